"""Faults injected into a running ``megareason train``, on the tiny mixture-of-experts model as large MoE
models train (bf16, the distributed optimizer, full recompute, DP 2 x EP 2: each replica holds two of the
four experts and feeds its own vLLM engine all four): each fault stops the run at once (with an error naming
what died, or, for the driver's own SIGKILL, leaving no process behind) and keeps the last complete
checkpoint loadable, and the run resumed after all three faults reproduces every metric of the
uninterrupted run, the routers' included.

Other faults are tested where their code is: a reward worker killed mid-batch (test_reward_pool.py),
SIGTERM (test_sft.py, and Slurm's pre-emption in test_nemo_run.py), a full disk while a checkpoint is
written (test_trainer_units.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from golden_curves import check_same
from test_train_e2e import AT_SCALE, _args, _env, _expect_gone, _kill_group, _metrics, _run, _started_by

from megareason.launch.reaper import descendants, process_table

pytestmark = pytest.mark.slow


def _wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.2)


def _named(proc: subprocess.Popen, prefix: str) -> list[int]:
    table = process_table()
    return sorted(p for p in descendants({proc.pid}, table)
                  if Path(f"/proc/{p}/comm").exists() and Path(f"/proc/{p}/comm").read_text().startswith(prefix))


def _fault(args: list[str], ready, what: str, victim: str) -> tuple[subprocess.Popen, str, int]:
    """Start the run, wait for ``ready()``, SIGKILL its first process named ``victim`` (the driver itself
    when ``victim`` is empty); the run's exit, its stderr and the victim's pid. Nothing the run started may
    be left 20 s after it exits (for the driver: launch/reaper.py's watcher cleans up after it)."""
    proc = subprocess.Popen(args, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _wait_for(proc, lambda: ready() and (not victim or _named(proc, victim)), what)
        started = _started_by(proc)
        pid = _named(proc, victim)[0] if victim else proc.pid
        os.kill(pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)  # the run must stop by itself, not hang
        _expect_gone(started, f"the {victim or 'driver'} SIGKILL")
    finally:
        _kill_group(proc)
    return proc, stderr, pid


def test_moe_at_scale_logs_its_routers_and_dead_engine_driver_and_rank_stop_it_cleanly_and_it_resumes_exactly(
        tiny_qwen3_moe, tmp_path):
    # The uninterrupted run (3 steps, checkpoints after steps 2 and 3), and the same run as a crash after its
    # step-2 checkpoint leaves it: the folder with the step-3 checkpoint removed (its metrics, rollouts and
    # logs are what an interrupted run leaves behind). bf16 sums differ in the last bits between CPU kinds
    # (another kernel, another order), so the reference is this machine's own run, not a recorded curve.
    straight = tmp_path / "straight"
    at_scale = (*AT_SCALE, "parallel.expert_model_parallel_size=2", "trainer.steps=3")
    _run(_args(tiny_qwen3_moe, tmp_path, straight, *at_scale))
    reference = _metrics(straight)
    assert sorted(reference) == [1, 2, 3]
    for m in reference.values():  # the routers' metrics (the aux loss's value: against transformers, test_moe.py)
        assert m["actor/grad_norm"] > 0 and 0 < m["actor/moe/min_max_ratio"] <= 1 and m["actor/moe/aux_loss"] > 0
        for layer in (0, 1):
            assert 0 < m[f"actor/moe/layer_{layer}/tokens_min"] <= m[f"actor/moe/layer_{layer}/tokens_max"]
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    shutil.rmtree(out / "checkpoints" / "step_00000003")
    args = _args(tiny_qwen3_moe, tmp_path, out, *at_scale)
    step2 = out / "checkpoints" / "step_00000002" / "trainer_state.json"
    driver_log = out / "logs" / "driver.log"

    def resuming(times: int):
        return lambda: driver_log.exists() and driver_log.read_text().count("resuming from") == times

    # 1. A vLLM engine core killed while the run resumes.
    proc, stderr, engine = _fault(args, resuming(1), "resume", "VLLM::EngineCor")
    assert proc.returncode == 1, stderr[-3000:]
    assert f"the vLLM engine core process (pid {engine})" in stderr, stderr[-3000:]
    assert "error: actor rank" in stderr and "died during" in stderr, stderr[-3000:]
    assert json.loads(step2.read_text())["step"] == 2

    # 2. The driver itself SIGKILLed while the run resumes: Ray's processes and agents, the policy workers,
    # their vLLM engine cores and workers, the reward workers are all gone within seconds.
    proc, _, _ = _fault(args, resuming(2), "resume", "")
    assert proc.returncode == -signal.SIGKILL
    assert json.loads(step2.read_text())["step"] == 2

    # 3. A Megatron rank (a policy worker) killed while the run resumes.
    proc, stderr, _ = _fault(args, resuming(3), "resume", "ray::PolicyWork")
    assert proc.returncode == 1, stderr[-3000:]
    assert "error: actor rank" in stderr and "died during" in stderr, stderr[-3000:]
    assert json.loads(step2.read_text())["step"] == 2

    # 4. Resumed from the step-2 checkpoint: each step once (the interrupted runs' partial rows dropped) and
    # the uninterrupted run's metrics, every one of every step.
    done = _run(args)
    assert "resuming from" in done.stderr and "step_00000002" in done.stderr
    m = _metrics(out)
    assert sorted(m) == sorted(reference) == [1, 2, 3]
    # On-policy, equal-length responses make the loss value ~0; its gradient is what must be nonzero.
    assert m[3]["actor/grad_norm"] > 1e-3, "gradients must be nonzero to compare"
    # bf16 training against fp32 generation (vLLM serves the synced experts): the mismatch is reported, > 1
    # and still small.
    assert all(1.0 < m[s]["rollout/token_mult_prob_error"] < 1.5 for s in m)
    assert "val/accuracy" in m[3]
    check_same(m, reference, "the resumed run against the uninterrupted one")
