"""Stopping at any moment: the leftovers of a killed save, the agreement of an SPMD engine's ranks on the
engine step at which they give up a generation, the stop between micro-batches of the log-prob and training
passes (before the step's first optimizer step), and the pre-emption lead these bound."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megareason.trainer.run_dir import RunDir, RunFolderBusy, TrainerState

_HOLD = ("import sys, time\nfrom megareason.trainer.run_dir import hold_run_lock\n"
         "hold_run_lock(sys.argv[1])\nprint('held', flush=True)\ntime.sleep(600)\n")


class _Role:
    """A trained role that writes and reads a checkpoint like a model does."""

    name, loaded = "actor", ""

    def save(self, path: str, meta: dict) -> None:
        from pathlib import Path

        Path(path).mkdir(parents=True)
        (Path(path) / "model.pt").write_text(f"weights of step {meta['step']}")

    def load(self, path: str) -> None:
        from pathlib import Path

        self.loaded = (Path(path) / "model.pt").read_text()

    def sync_weights(self) -> None:
        pass

    def stop_generating_on(self, path: str) -> None:
        pass


def test_a_killed_saves_leftovers_are_removed_at_the_next_start_once_the_lock_is_held(tmp_path):
    """A save killed mid-write leaves ``.step_N.tmp`` (here with a file in it). While another process holds
    the run lock (it may be writing that folder) a second run is refused and removes nothing; the next run
    that holds the lock removes every leftover before it resumes from the last complete checkpoint."""
    from megareason.config import load_config
    from megareason.trainer.driver import Driver
    from megareason.trainer.loop import train

    run = RunDir(tmp_path / "run")
    tmp = run.begin_checkpoint(2)
    _Role().save(str(tmp / "actor"), {"step": 2})
    run.commit_checkpoint(tmp, TrainerState(step=2), keep_last=2)
    for step in (3, 4):  # two killed saves, one with a half-written file
        killed = run.begin_checkpoint(step)
    (killed / "actor").mkdir()
    (killed / "actor" / "shard_0.distcp").write_bytes(b"\0" * 4096)
    leftovers = sorted(p.name for p in run.checkpoints.iterdir() if p.name.startswith("."))
    assert leftovers == [".step_00000003.tmp", ".step_00000004.tmp"]

    cfg = load_config("grpo_smollm2_cpu", [f"trainer.output_dir={run.root}", "trainer.steps=4",
                                           "trainer.val_before_train=false"])
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(run.root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusy):
            train(cfg)
        assert sorted(p.name for p in run.checkpoints.iterdir() if p.name.startswith(".")) == leftovers
    finally:
        holder.kill()
        holder.wait()

    role = _Role()
    driver = Driver(cfg, run, [role], 16, "training", None)
    assert driver.start().step == 2 and role.loaded == "weights of step 2"
    assert [p.name for p in run.checkpoints.iterdir()] == ["step_00000002"]


def _fake_scontrol(tmp_path, state: str) -> dict[str, str]:
    """A stand-in ``scontrol`` on PATH: ``show job`` reports ``state``; every call is logged in tmp/calls."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(f"""#!/bin/bash
echo "scontrol $*" >> {tmp_path}/calls
[[ $1 == show ]] && echo "JobId=41 JobName=x JobState={state} Reason=None"
exit 0
""")
    (bin_dir / "scontrol").chmod(0o755)
    (tmp_path / "calls").write_text("")
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "41"}


def _job_script(body: str, env: dict[str, str], tmp_path) -> str:
    """``body`` after sourcing slurm/ray_cluster.sh, with one stand-in Ray step and the script's TERM and EXIT
    traps; its exit code and its log lines, with the stand-in scontrol's calls interleaved in order."""
    import os
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    jobdir = tmp_path / "job"
    jobdir.mkdir(exist_ok=True)
    script = (f'source "{repo}/slurm/ray_cluster.sh" || exit 99\n'
              f'MR_JOBDIR={jobdir} MR_REQUEUED=0 MR_SIGNALS=0 MR_DRIVER= MR_DRIVER_PIDFILE={jobdir}/driver.pid\n'
              # a Ray step ends once it sees the stop file, as megareason/launch/ray_node.py does
              f"(while [[ ! -e {jobdir}/ray.stop ]]; do sleep 0.1; done) >/dev/null 2>&1 & MR_RAY_STEPS=($!)\n"
              "_mr_log() { echo \"megareason-slurm: $*\" >> " + str(tmp_path / "calls") + "; }\n"
              "trap '_mr_on_signal TERM' TERM\ntrap '_mr_teardown; _mr_clean_jobdir' EXIT\n" + body)
    proc = subprocess.run(["bash", "-c", script], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    return f"exit {proc.returncode}\n" + (tmp_path / "calls").read_text()


def test_the_job_requeues_before_it_tears_ray_down(tmp_path):
    """Exit code 75 from the driver: ``scontrol requeue`` comes first, Ray's teardown after it (a pre-emption's
    SIGKILL may end the teardown; the requeue is made by then), and the job folder keeps the code record."""
    out = _job_script("_mr_driver_exited 75", _fake_scontrol(tmp_path, "RUNNING"), tmp_path)
    lines = out.splitlines()
    assert lines[0] == f"exit {75}", out
    requeue = lines.index("scontrol requeue 41")
    assert lines[requeue - 1].startswith("megareason-slurm: requeueing job 41 (the driver stopped after a checkpoint)")
    assert lines[1] == "megareason-slurm: driver exited with 75"
    assert lines[requeue + 1:] == ["megareason-slurm: Ray stopped"], out
    out = _job_script("_mr_driver_exited 1", _fake_scontrol(tmp_path, "RUNNING"), tmp_path)
    assert out.splitlines() == ["exit 1", "megareason-slurm: driver exited with 1", "megareason-slurm: Ray stopped"]


@pytest.mark.parametrize(("state", "requeued"), [("TIMEOUT", True), ("CANCELLED", False), ("RUNNING", False)])
def test_sigterm_to_the_job_script_requeues_at_the_time_limit_and_not_after_scancel(tmp_path, state, requeued):
    """A missed deadline: Slurm marks the job TIMEOUT, then sends SIGTERM to the script (SIGKILL follows after
    KillWait): the trap requeues at once, once, before anything else. After scancel (CANCELLED) it never
    requeues; in a pre-emption's grace time (RUNNING) the driver's checkpoint and exit code 75 do."""
    out = _job_script("kill -TERM $$\nkill -TERM $$\nexit 1", _fake_scontrol(tmp_path, state), tmp_path)
    assert out.count("scontrol requeue 41") == (1 if requeued else 0), out
    if requeued:
        assert "requeueing job 41 (SIGTERM at the time limit (JobState=TIMEOUT))" in out
        assert out.index("scontrol requeue 41") < out.index("Ray stopped")
    if state == "CANCELLED":
        assert "the job was cancelled (JobState=CANCELLED): not requeued" in out
