"""A training setup that cannot run is refused before any worker starts, with the field it names: the
checks ``megareason train`` runs (config, preflight, data, model, the Ray cluster's size), in this process.
The command line's side of it (exit code 2, the message on stderr, no worker started) is
test_train_e2e.py's ``test_a_bad_setup_exits_2_before_any_worker_starts``."""

from __future__ import annotations

import contextlib
import os

import pytest
from test_train_e2e import _args

from megareason.config import ConfigError, load_config, validate_training
from megareason.data import DataError
from megareason.launch.preflight import PreflightError, check_run
from megareason.models.arch import ArchError
from megareason.trainer import handles, loop

REFUSED = (ConfigError, DataError, ArchError, PreflightError, FileNotFoundError)  # the CLI's exit code 2


def _no_workers(*args, **kwargs):
    raise AssertionError("a worker group was started")


@pytest.mark.parametrize("override, message", [
    ("parallel.data_parallel_size=6", "ranks but the Ray cluster has"),
    ("parallel.tensor_model_parallel_size=3", "not divisible by TP=3"),
    ("model.path=/nonexistent/model", "/nonexistent/model"),
    ("trainer.prompts_per_step=3", "trainer.prompts_per_step"),
    ("parallel.expert_model_parallel_size=2", "must divide parallel.data_parallel_size = 1"),
    ("parallel.data_parallel_size=2 parallel.expert_model_parallel_size=2",
     "expert_model_parallel_size=2 needs a mixture-of-experts model"),
])
def test_bad_setups_are_refused_before_any_worker_starts(tiny_qwen2, tmp_path, monkeypatch, override, message):
    # `megareason train`'s order (cli._train, then loop.train); Ray itself is not started: the cluster is
    # this machine's CPUs, as the local cluster's would be, and starting a worker group fails the test.
    monkeypatch.setattr(loop, "ray_session", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(handles, "cluster_size", lambda: (os.cpu_count(), 0))
    monkeypatch.setattr(handles, "WorkerGroup", _no_workers)
    monkeypatch.setattr(handles, "RolloutPool", _no_workers)
    overrides = _args(tiny_qwen2, tmp_path, tmp_path / "bad", "rollout.n=3", "algorithm.mini_batches=2")[4:]
    with pytest.raises(REFUSED) as refused:
        cfg = load_config("grpo_smollm2_cpu", overrides + override.split())
        validate_training(cfg)
        check_run(cfg, "train")
        loop.train(cfg)
    assert message in str(refused.value)
