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

# Every limit here is a bound on a hang, not a speed: each wait ends on an event (a log line, an exit, the
# processes gone), and each limit is 3x or more what a loaded machine took. Measured on 2 cores beside other
# tests (load average 11 falling to 3; 2026-11-28): 648 s in all; the uninterrupted run 245 s, each fault's
# start and resume 77-97 s, the stop after a SIGKILL 0.2-3.6 s, every process gone 0.2-3.7 s, the resumed run
# 120 s. pyproject's 900 s for a test was overrun under a heavy load. Each phase's time is printed (a failure
# shows them).
TEST_LIMIT_S = 2000  # the whole test
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_LIMIT_S)]
RUN_LIMIT_S = 900  # one `megareason train` of the test, or a start up to the resume
STOP_LIMIT_S = 300  # the run stopping by itself after a victim's SIGKILL
GONE_LIMIT_S = 60  # then every process it started gone
PHASES: dict[str, float] = {}


class _Phase:
    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.start = time.monotonic()

    def __exit__(self, *exc):
        PHASES[self.name] = round(time.monotonic() - self.start, 1)
        print(f"test_faults phase {self.name}: {PHASES[self.name]} s", flush=True)


def _wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = RUN_LIMIT_S) -> None:
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.2)


def _named(proc: subprocess.Popen, prefix: str) -> list[int]:
    table = process_table()
    return sorted(p for p in descendants({proc.pid}, table)
                  if Path(f"/proc/{p}/comm").exists() and Path(f"/proc/{p}/comm").read_text().startswith(prefix))


def _fault(args: list[str], ready, what: str, victim: str, engines: bool = True) -> tuple[subprocess.Popen, str, int]:
    """Start the run, wait for ``ready()``, SIGKILL its first process named ``victim`` (the driver itself
    when ``victim`` is empty); the run's exit, its stderr and the victim's pid. Nothing the run started may
    be left ``GONE_LIMIT_S`` after it exits (for the driver: launch/reaper.py's watcher cleans up after it);
    ``engines``: the vLLM engines are up when the victim dies."""
    proc = subprocess.Popen(args, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        with _Phase(f"{victim or 'driver'}: start and resume"):
            _wait_for(proc, lambda: ready() and (not victim or _named(proc, victim)), what)
        started = _started_by(proc, engines)
        pid = _named(proc, victim)[0] if victim else proc.pid
        os.kill(pid, signal.SIGKILL)
        with _Phase(f"{victim or 'driver'}: stop after the SIGKILL"):
            _, stderr = proc.communicate(timeout=STOP_LIMIT_S)  # the run must stop by itself, not hang
        with _Phase(f"{victim or 'driver'}: every process gone"):
            _expect_gone(started, f"the {victim or 'driver'} SIGKILL", within=GONE_LIMIT_S)
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
    with _Phase("the uninterrupted run"):
        _run(_args(tiny_qwen3_moe, tmp_path, straight, *at_scale), timeout=RUN_LIMIT_S)
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

    # 1. A Megatron rank (a policy worker) killed as soon as it exists: the run's start-up stops at once.
    proc, stderr, _ = _fault(args, lambda: True, "a policy worker", "ray::PolicyWork", engines=False)
    assert proc.returncode == 1, stderr[-3000:]
    assert "error: actor rank" in stderr and "died during" in stderr, stderr[-3000:]
    assert json.loads(step2.read_text())["step"] == 2

    # 2. A vLLM engine core killed while the run resumes.
    proc, stderr, engine = _fault(args, resuming(1), "resume", "VLLM::EngineCor")
    assert proc.returncode == 1, stderr[-3000:]
    assert f"the vLLM engine core process (pid {engine})" in stderr, stderr[-3000:]
    assert "error: actor rank" in stderr and "died during" in stderr, stderr[-3000:]
    assert json.loads(step2.read_text())["step"] == 2

    # 3. The driver itself SIGKILLed while the run resumes: Ray's processes and agents, the policy workers,
    # their vLLM engine cores, the reward workers are all gone within seconds.
    proc, _, _ = _fault(args, resuming(2), "resume", "")
    assert proc.returncode == -signal.SIGKILL
    assert json.loads(step2.read_text())["step"] == 2

    # 4. Resumed from the step-2 checkpoint: each step once (the interrupted runs' partial rows dropped) and
    # the uninterrupted run's metrics, every one of every step.
    with _Phase("the resumed run"):
        done = _run(args, timeout=RUN_LIMIT_S)
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
