"""Faults injected into a running ``megareason train`` (issue 24), on the tiny model at scale settings (bf16,
distributed optimizer, DP 2, full recompute: the golden "grpo" run): each stops the run at once with an
error naming what died, leaves the last complete checkpoint loadable and no process behind, and the run
resumed after both faults reproduces the uninterrupted run's every metric (tests/golden/grpo.jsonl).

Other faults are tested where their code is: a reward worker killed mid-batch (test_reward_pool.py), the
driver SIGKILLed mid-run (test_train_e2e.py's sigkill test), SIGTERM (test_sft.py), a full disk while a
checkpoint is written (test_trainer_units.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from golden_curves import check_golden
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
    """Start the run, wait for ``ready()``, SIGKILL its first process named ``victim``; the run's exit,
    its stderr and the victim's pid. Nothing the run started may be left 20 s after it exits."""
    proc = subprocess.Popen(args, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _wait_for(proc, lambda: ready() and _named(proc, victim), what)
        started = _started_by(proc)
        pid = _named(proc, victim)[0]
        os.kill(pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)  # the run must stop by itself, not hang
        _expect_gone(started, f"the run stopped on the {victim} fault")
    finally:
        _kill_group(proc)
    return proc, stderr, pid


def test_a_dead_engine_and_a_dead_megatron_rank_stop_the_run_clearly_and_it_resumes_to_the_golden_curve(
        tiny_qwen2, tmp_path):
    out = tmp_path / "run"
    args = _args(tiny_qwen2, tmp_path, out, *AT_SCALE)
    step2 = out / "checkpoints" / "step_00000002" / "trainer_state.json"

    # 1. A vLLM engine core killed after the step-2 checkpoint (mid step 3).
    proc, stderr, engine = _fault(args, step2.exists, "step-2 checkpoint", "VLLM::EngineCor")
    assert proc.returncode == 1, stderr[-3000:]
    assert f"the vLLM engine core process (pid {engine})" in stderr, stderr[-3000:]
    assert "error: actor rank" in stderr and "died during" in stderr, stderr[-3000:]
    assert json.loads(step2.read_text())["step"] == 2 and max(_metrics(out)) < 4

    # 2. A Megatron rank (a policy worker) killed while the resumed run starts up or trains.
    driver_log = out / "logs" / "driver.log"
    proc, stderr, _ = _fault(args, lambda: driver_log.exists() and driver_log.read_text().count("resuming from") == 1,
                             "resume", "ray::PolicyWork")
    assert proc.returncode == 1, stderr[-3000:]
    assert "error: actor rank" in stderr and "died during" in stderr, stderr[-3000:]
    assert json.loads(step2.read_text())["step"] == 2

    # 3. Resumed from the step-2 checkpoint: the uninterrupted run's metrics, every one of every step.
    done = _run(args)
    assert "resuming from" in done.stderr and "step_00000002" in done.stderr
    check_golden("grpo", _metrics(out))
