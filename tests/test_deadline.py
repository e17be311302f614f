"""The deadline (trainer.must_save_by_minutes, a Slurm job's end time) with checkpoints written in the background
(trainer.async_save): on a clock the test drives, hand-computed."""

from __future__ import annotations

import pytest

from megareason.config import load_config
from megareason.trainer.driver import Driver
from megareason.trainer.run_dir import RunDir

STEP_S, SAVE_S, COPY_S = 100.0, 30.0, 5.0  # a step; a checkpoint written at once; a background save's copy


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


class TimedRole:
    """A trained role whose checkpoint takes SAVE_S written at once; in the background the step waits COPY_S,
    and the write is done by the end of the next step (``finish_saves`` commits it then)."""

    name = "actor"

    def __init__(self, clock: Clock):
        self.clock, self.pending, self.saves = clock, None, []

    def save(self, path: str, meta: dict, asynchronous: bool = False) -> None:
        from pathlib import Path

        self.saves.append((meta["step"], "background" if asynchronous else "at once"))
        self.clock.t += COPY_S if asynchronous else SAVE_S
        if asynchronous:
            self.pending = path
        else:
            Path(path).mkdir(parents=True)

    def finish_saves(self, blocking: bool) -> bool:
        from pathlib import Path

        if self.pending is not None:
            Path(self.pending).mkdir(parents=True)
            self.pending = None
        return True

    def load(self, path: str) -> None:
        pass

    def sync_weights(self) -> None:
        pass

    def stop_generating_on(self, path: str) -> None:
        pass


def test_the_deadline_with_background_saves_counts_a_checkpoints_time_not_the_step_beside_it(tmp_path, monkeypatch):
    """Deadline 600 s after the start, 100 s steps, a checkpoint after each, 10 s margin. The first checkpoint
    is written at once (130 s: it measures 30 s), the next ones in the background (5 s each). After step 4
    (t = 440 s) 160 s are left, enough for a step, a 30 s checkpoint and the margin (140 s): step 5 runs, and
    after it (t = 545 s, 55 s left) the run stops with a checkpoint written at once, done at 575 s, before the
    deadline. Counting a background checkpoint's time to its commit (105 s: the step beside it) would need
    215 s after step 4 and stop there, a step early."""
    clock = Clock()
    monkeypatch.setattr("megareason.trainer.driver.time.monotonic", clock)
    monkeypatch.delenv("MEGAREASON_JOB_END_TIME", raising=False)
    cfg = load_config("grpo_smollm2_cpu", [f"trainer.output_dir={tmp_path}", "trainer.steps=20", "trainer.save_every=1",
                                           "trainer.async_save=true", "trainer.must_save_by_minutes=10",
                                           "trainer.stop_margin_s=10", "trainer.val_before_train=false",
                                           "trainer.keep_last=20"])
    role = TimedRole(clock)
    driver = Driver(cfg, RunDir(tmp_path), [role], 16, "training", None)
    driver.start()
    with pytest.raises(SystemExit) as stopped:
        for step, _ in driver.steps():
            clock.t += STEP_S
            driver.end_step(step, {"loss": float(step)})
    assert stopped.value.code == 75
    assert role.saves == [(1, "at once"), (2, "background"), (3, "background"), (4, "background"), (5, "at once")]
    assert clock.t == 575.0 < 600.0 and RunDir(tmp_path).steps() == [1, 2, 3, 4, 5]
    assert driver.stop_reason == ("the deadline is 55 s away, less than a step (100 s), a checkpoint (30 s) and "
                                  "trainer.stop_margin_s (10 s)")


def test_a_background_write_still_going_on_counts_what_is_left_of_it():
    from megareason.trainer.driver import BackgroundSave, deadline_near

    write = BackgroundSave(step=3, tmp=None, state=None, previous=None, started=1000.0)
    assert write.left_s(1010.0, 30.0) == 20.0 and write.left_s(1040.0, 30.0) == 0.0
    # 150 s left: a 100 s step + a 30 s checkpoint + 10 s margin fit (140), not with 20 s of the write first
    assert not deadline_near(150.0, 100.0, 30.0, 10.0) and deadline_near(150.0, 100.0, 30.0, 10.0, writing_s=20.0)
