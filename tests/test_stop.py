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
