"""The frame every run shares, ``megareason train`` and ``megareason sft`` alike.

``Driver`` owns what is not an algorithm: resuming from the run folder's latest checkpoint (trainer
state, every role's model checkpoint, then the rollout engines take the restored weights) when the
config agrees with the run's (``RunDir.check_resume``), the run folder's ``config.json``, the metrics
tracker, the seeded resumable prompt order, the validation schedule, checkpoints (every
``trainer.save_every`` steps, every ``trainer.save_every_minutes``, the last step) with the algorithm's
own state inside ``trainer_state.json``, and the stop signals: SIGUSR1/SIGTERM finish the step in
progress, save a checkpoint and exit with ``EXIT_STOPPED`` (Slurm pre-emption and
``slurm/ray_cluster.sh``'s requeue), and so does a deadline that another step and a checkpoint would not
meet (``trainer.must_save_by_minutes``, a Slurm job's end time: ``deadline_near``). The loops
(``loop.py``, ``sft.py``) read::

    driver.start()
    for step, rows in driver.steps():
        ...                                           # the algorithm's step
        if driver.validation_due(step):
            driver.validate_step(step, metrics, state)  # validation (a stopped one: saved, pending)
        driver.finish_step(step, metrics, state)      # metrics, checkpoint when due, stop when asked
    driver.close()

(``end_step`` is those two, for a loop with nothing to do between them.)
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from megareason.config import Config
from megareason.data.sampler import PromptSampler
from megareason.rollout.records import GenerationStopped, Sampling
from megareason.trainer.handles import PolicyHandle, RoleHandle
from megareason.trainer.run_dir import CheckpointError, RunDir, RunError, SamplerState, TrainerState, first_line
from megareason.trainer.tracking import Tracker
from megareason.utils import atomic_write

log = logging.getLogger(__name__)

# The exit code of a run that SIGUSR1 or SIGTERM stopped after a step and a checkpoint: run it again to
# resume (EX_TEMPFAIL). slurm/ray_cluster.sh requeues the job on it.
EXIT_STOPPED = 75


class StopRequest:
    """Signal handler: records the first SIGUSR1/SIGTERM (``signal``); the loop then saves a checkpoint and
    exits with ``EXIT_STOPPED``. SIGUSR1 (a time limit ahead, with a lead that covers a step) lets the step
    in progress finish; SIGTERM (a pre-emption, whose grace time may not) also calls ``on_term``, which makes
    a generation in progress give up (``Driver.start``): the step is dropped and the state before it saved.
    A second SIGTERM kills as usual (a SIGUSR1 first, then a pre-emption's SIGTERM: still the checkpoint)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.at: float | None = None  # time.monotonic() of the first signal
        self.on_term: Callable[[], None] | None = None

    def __call__(self, signum: int, frame) -> None:
        # Nothing else here: a handler runs between two bytecodes of the main thread (no logging locks).
        if self.signal is None:
            self.signal, self.at = signum, time.monotonic()
        if signum == signal.SIGTERM:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if self.on_term is not None:
                self.on_term()


@contextmanager
def stop_signals() -> Iterator[StopRequest]:
    """SIGUSR1 and SIGTERM set a ``StopRequest`` instead of ending the process, for the block."""
    stop = StopRequest()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


JOB_END_ENV = "MEGAREASON_JOB_END_TIME"  # a Slurm job's end time, seconds since the epoch (slurm/ray_cluster.sh)


def deadline_near(left_s: float, step_s: float, save_s: float, margin_s: float, writing_s: float = 0.0) -> bool:
    """Whether to save and stop now, ``left_s`` seconds before the deadline: another step (as long as the
    last, ``step_s``), a checkpoint written at once (``save_s``: a stop's is never written in the background)
    and the margin would not fit; ``writing_s``: what is left of a background write still going on, which that
    checkpoint waits for first."""
    return left_s < step_s + writing_s + save_s + margin_s


def job_end_time(env=None) -> float | None:
    """The Slurm job's end time (``MEGAREASON_JOB_END_TIME``, seconds since the epoch), if the job has one."""
    import os

    text = (os.environ if env is None else env).get(JOB_END_ENV, "")
    try:
        return float(text) if text else None
    except ValueError:
        log.warning("%s=%r is not a time in seconds since the epoch: ignored", JOB_END_ENV, text)
        return None


def checkpoint_due(cfg: Config, step: int, since_save_s: float) -> bool:
    """Save after ``step``: the last step, every ``trainer.save_every`` steps, or when
    ``trainer.save_every_minutes`` have passed since the last checkpoint (``since_save_s`` seconds)."""
    t = cfg.trainer
    return (step == t.steps or (t.save_every > 0 and step % t.save_every == 0)
            or (t.save_every_minutes > 0 and since_save_s >= 60 * t.save_every_minutes))


@dataclass
class BackgroundSave:
    """A checkpoint whose roles write it in the background (trainer.async_save): committed as ``step``'s
    from ``tmp`` with ``state`` once they are done; ``previous``: the latest complete one when it started.

    Its time from ``started`` to the commit holds the steps that ran beside the write, so it is not a
    checkpoint's time: the deadline counts ``Driver.save_s``, measured on a checkpoint written at once (with
    a deadline, a run's first checkpoint is), and what is left of this write (``left_s``)."""

    step: int
    tmp: Path
    state: TrainerState
    previous: Path | None
    started: float

    def left_s(self, now: float, save_s: float) -> float:
        """The seconds this write may still take at ``now``: a checkpoint's time, less what has passed."""
        return max(0.0, save_s - (now - self.started))


class Driver:
    """One run's frame (module docstring). ``roles``: the policy handle first (its engines take the
    weights on resume), then any other trained role; each saves to ``<checkpoint>/<role name>/``.
    ``validate(step)`` returns validation metrics (None: no validation set)."""

    def __init__(self, cfg: Config, run: RunDir, roles: list[PolicyHandle | RoleHandle], num_prompts: int, desc: str,
                 validate: Callable[[int], dict[str, float]] | None, stop: StopRequest | None = None):
        self.cfg, self.run, self.roles, self.num_prompts, self.desc = cfg, run, roles, num_prompts, desc
        self.validate, self.stop = validate, stop
        self.resumed_from: Path | None = None  # the checkpoint ``start`` resumed from
        self.resume_syncs: list = []  # the weight pushes of the resume (``start``)
        self.stop_reason = ""  # why a run stops without a signal (a deadline)
        self.background: BackgroundSave | None = None  # trainer.async_save: the checkpoint being written

    def start(self) -> TrainerState:
        """Resume or start; returns the state of the checkpoint resumed from (step 0: a fresh run)."""
        t = self.cfg.trainer
        self.state = TrainerState()
        changed = self.run.check_resume(self.cfg)  # before anything is loaded or config.json is written
        for partial in self.run.remove_partial_checkpoints():  # the run lock is held (loop.train, sft)
            log.warning("removed %s: a checkpoint whose save was killed before it was committed", partial)
        latest = self.run.latest() if t.resume_mode != "disable" else None
        if changed:
            log.warning("resuming with a config that differs from the run's (trainer.resume_mode=force):\n  %s",
                        "\n  ".join(changed))
        if latest is not None:
            self.state, self.resumed_from = self.run.read_state(latest), latest
            log.info("resuming from %s (step %d)", latest, self.state.step)
            for role in self.roles:
                role.load(str(latest / role.name))
            # the policy's engines start from the checkpoint's weights; one step off-policy reports this push in
            # the first step, where the uninterrupted run pushed the same weights (``OneStepOff``)
            self.resume_syncs = list(self.roles[0].sync_weights() or [])
        self.run.root.mkdir(parents=True, exist_ok=True)
        atomic_write(self.run.root / "config.json", json.dumps(asdict(self.cfg), indent=2) + "\n")
        self.sampler = PromptSampler(self.num_prompts, t.seed, self.state.sampler.epoch, self.state.sampler.position)
        self.tracker = Tracker(self.run.root, t.loggers, self.state.step, config=asdict(self.cfg), wandb=t.wandb)
        self.run.stop_file.unlink(missing_ok=True)  # an earlier run's
        self._stop_generation_on_sigterm()
        due, pending = None, self.state.pending_metrics
        if pending is not None:  # the checkpoint's step, saved when a SIGTERM stopped its validation
            due = self.state.step
        elif t.val_before_train and self.state.step == 0 and self.validate is not None:
            due = 0
        if due is not None:
            try:
                validated = self.validate(due) if self.validate is not None else {}
            except GenerationStopped as e:  # the checkpoint holds the step: nothing to save
                self._exit(f" during step {due}'s validation: stopped; the next run validates it first ({e})")
            self.tracker.log(due, {**(pending or {}), **validated})
        self.last_save = time.monotonic()  # trainer.save_every_minutes counts from here
        self.save_s = 0.0  # the last checkpoint's seconds (deadline_near)
        self.deadline = self._deadline()
        # What a step dropped by a SIGTERM (``drop_step``) returns to: the last step done and its state.
        self.saved_step, self.done_extra = self.state.step, json.loads(json.dumps(self.state.extra))
        return self.state

    def steps(self) -> Iterator[tuple[int, list[int]]]:
        """(step, the indices of its trainer.prompts_per_step prompts) for each step left, with a progress
        bar; a stop requested before the first of them (nothing done since the checkpoint) exits here."""
        t = self.cfg.trainer
        for step in tqdm(range(self.state.step + 1, t.steps + 1), desc=self.desc, unit="step",
                         initial=self.state.step, total=t.steps):
            if self._stopping() and step == self.state.step + 1:
                self._exit(f" before step {step}: stopped")
            self.step_started = time.monotonic()
            self.before_step = SamplerState(self.sampler.epoch, self.sampler.position)
            yield step, self.sampler.next(t.prompts_per_step)

    def end_step(self, step: int, metrics: dict[str, float], algorithm_state: dict | None = None) -> None:
        """``validate_step`` when due, then ``finish_step``."""
        if self.validation_due(step):
            self.validate_step(step, metrics, algorithm_state)
        self.finish_step(step, metrics, algorithm_state)

    def validation_due(self, step: int) -> bool:
        """Validate after ``step``: the last one, and every ``trainer.val_every`` (with a validation set)."""
        t = self.cfg.trainer
        return self.validate is not None and (step == t.steps or bool(t.val_every and step % t.val_every == 0))

    def validate_step(self, step: int, metrics: dict[str, float], algorithm_state: dict | None = None) -> None:
        """Validation's metrics into ``metrics``. A SIGTERM that stops its generation: the step is saved with
        its metrics pending in ``trainer_state.json`` (the next run validates it first), and the run exits."""
        try:
            metrics.update(self.validate(step))
        except GenerationStopped as e:  # the update is done: saved, its row waits for the next run's validation
            self._save(step, algorithm_state or {}, pending_metrics=metrics)
            self._exit(f" during step {step}'s validation: saved; the next run validates it first ({e})")

    def finish_step(self, step: int, metrics: dict[str, float], algorithm_state: dict | None = None,
                    save_files: Callable[[Path], None] | None = None) -> None:
        """The step's metrics, a checkpoint when due or stopping (``algorithm_state`` in
        ``trainer_state.json``: ``extra``; ``save_files(folder)`` writes the files of a state that is not the
        roles' models, into the checkpoint's folder before it is committed), then the exit of a stopped run."""
        t = self.cfg.trainer
        self._commit_background(blocking=False)
        self.tracker.log(step, metrics)
        self.done_extra = json.loads(json.dumps(algorithm_state or {}))  # as a resume would read it
        now = time.monotonic()
        writing = self.background.left_s(now, self.save_s) if self.background is not None else 0.0
        near = (self.deadline is not None and step < t.steps
                and deadline_near(self.deadline - now, now - self.step_started, self.save_s, t.stop_margin_s, writing))
        if near and not self._stopping():
            self.stop_reason = (f"the deadline is {self.deadline - now:.0f} s away, less than a step "
                                f"({now - self.step_started:.0f} s), a checkpoint ({self.save_s:.0f} s) and "
                                f"trainer.stop_margin_s ({t.stop_margin_s:g} s)")
        stopping = self._stopping() or near  # read once: save and exit agree
        if checkpoint_due(self.cfg, step, time.monotonic() - self.last_save) or stopping:
            # The last one and a stop's: at once; with a deadline, also the first, which measures save_s.
            background = (t.async_save and not stopping and step < t.steps
                          and (self.deadline is None or self.save_s > 0))
            self._save(step, algorithm_state or {}, save_files=save_files, background=background)
        if stopping and step < t.steps:
            self._exit(f": stopped after step {step} with a checkpoint")

    def drop_step(self, step: int, phase: str = "generation", cause: str = "") -> None:
        """A SIGTERM stopped ``step``'s generation (``GenerationStopped``), or a log-prob pass or its first
        training pass before any optimizer step (``UpdateStopped``): nothing of the step is kept. The state
        after step - 1 is saved unless a checkpoint holds it already, then the run exits with
        ``EXIT_STOPPED``; the next run does ``step`` again, as the uninterrupted run did it. ``cause``: the
        stop's own words (where the pass or generation gave up), for the log."""
        if step - 1 > self.saved_step:
            self._save(step - 1, self.done_extra, self.before_step)
        self._exit(f" during step {step}'s {phase}: the step was dropped, the run resumes at step {step}"
                   f"{f' ({cause})' if cause else ''}")

    def close(self) -> None:
        self._commit_background(blocking=True)
        self.tracker.close()

    def _stop_generation_on_sigterm(self) -> None:
        """A SIGTERM makes the engines give up a generation in progress, and the workers a log-prob pass or the
        step's first training pass (``models.schedule``): the handler creates the run's stop file, which every
        engine polls while it generates and every worker between pieces of its passes. Not with
        trainer.max_staleness (the batch in flight belongs to the next step's checkpoint); not without a
        handler (tests, library use)."""
        if self.stop is None or self.cfg.trainer.max_staleness:
            return
        stop_file = self.run.stop_file.resolve()
        for role in self.roles:  # the policy's engines and passes, the critic's passes
            role.stop_generating_on(str(stop_file))
        self.stop.on_term = stop_file.touch
        if self.stop.signal == signal.SIGTERM:
            stop_file.touch()

    def _save(self, step: int, algorithm_state: dict, sampler: SamplerState | None = None,
              pending_metrics: dict | None = None, save_files: Callable[[Path], None] | None = None,
              background: bool = False) -> None:
        """Every role's checkpoint and the driver's files into a fresh folder, committed as ``step_N`` at once,
        or with ``background`` (trainer.async_save) once every role's write has finished
        (``_commit_background``, after each step). A checkpoint still being written is committed first."""
        self._commit_background(blocking=True)
        saving = time.monotonic()
        sampler = sampler or SamplerState(self.sampler.epoch, self.sampler.position)
        state = TrainerState(step=step, sampler=sampler, extra=algorithm_state, pending_metrics=pending_metrics)
        previous = self.run.latest()
        try:
            tmp = self.run.begin_checkpoint(step)
            for role in self.roles:
                if background:
                    role.save(str(tmp / role.name), {"step": step}, asynchronous=True)
                else:
                    role.save(str(tmp / role.name), {"step": step})
            if save_files is not None:
                save_files(tmp)
            if background:
                self.background = BackgroundSave(step, tmp, state, previous, saving)
            else:
                self.run.commit_checkpoint(tmp, state, self.cfg.trainer.keep_last)
        except RunError:
            raise
        except Exception as e:  # e.g. OSError ENOSPC, here or raised by a worker (Ray re-raises its type)
            raise self._save_error(step, previous, e) from e
        if background:
            log.info("checkpoint of step %d: copied to host memory in %.1f s, written in the background", step,
                     time.monotonic() - saving)
        else:
            self.save_s = time.monotonic() - saving
            log.info("checkpoint of step %d saved in %.1f s", step, self.save_s)
        self.saved_step = step
        self.last_save = time.monotonic()

    def _commit_background(self, blocking: bool) -> None:
        """The checkpoint written in the background becomes ``step_N`` once every role's write has finished
        on every rank (``blocking``: waits for that)."""
        b = self.background
        if b is None:
            return
        try:
            done = [role.finish_saves(blocking) for role in self.roles]  # every role, each its own collective
            if not all(done):
                return
            self.run.commit_checkpoint(b.tmp, b.state, self.cfg.trainer.keep_last)
        except RunError:
            raise
        except Exception as e:
            self.background = None
            raise self._save_error(b.step, b.previous, e) from e
        self.background = None
        log.info("checkpoint of step %d saved in the background in %.1f s", b.step, time.monotonic() - b.started)

    def _save_error(self, step: int, previous: Path | None, e: Exception) -> CheckpointError:
        last = previous or "none (no earlier checkpoint)"
        return CheckpointError(f"the checkpoint of step {step} could not be written in {self.run.checkpoints}: "
                               f"{first_line(e)}; the last complete one is {last}")

    def _deadline(self) -> float | None:
        """The deadline on the ``time.monotonic`` clock: ``trainer.must_save_by_minutes`` from now, or the
        Slurm job's end time, whichever comes first (None: neither)."""
        t, now = self.cfg.trainer, time.monotonic()
        deadlines = []
        if t.must_save_by_minutes > 0:
            deadlines.append(now + 60 * t.must_save_by_minutes)
            log.info("trainer.must_save_by_minutes: a checkpoint and a stop before %.0f min from now",
                     t.must_save_by_minutes)
        end = job_end_time()
        if end is not None:
            deadlines.append(now + end - time.time())
            log.info("the Slurm job ends in %.0f s (%s): a checkpoint and a stop before then", end - time.time(),
                     JOB_END_ENV)
        return min(deadlines) if deadlines else None

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.signal is not None

    def _exit(self, what: str) -> None:
        self._commit_background(blocking=True)
        why = signal.Signals(self.stop.signal).name if self._stopping() else self.stop_reason
        # From the signal to here: what a site's grace time must cover (``megareason plan`` prints its bound).
        after = f"; {time.monotonic() - self.stop.at:.1f} s after the signal" if self._stopping() else ""
        log.warning("%s%s%s; run again to resume (exit code %d)", why, what, after, EXIT_STOPPED)
        self.tracker.close()
        raise SystemExit(EXIT_STOPPED)


def learning_rate(base: float, cfg: Config, step: int) -> float:
    """``base`` after the linear warm-up of ``optim.warmup_steps`` steps."""
    warmup = cfg.optim.warmup_steps
    return base * min(1.0, step / warmup) if warmup else base


def greedy(cfg: Config) -> Sampling:
    """Validation's sampling: one greedy answer per prompt."""
    return Sampling(n=1, temperature=0.0, max_tokens=cfg.rollout.max_tokens, stop=tuple(cfg.rollout.stop))


@contextmanager
def timed(timer: dict[str, float], name: str):
    """Adds the block's wall time in seconds to ``timer[name]``."""
    start = time.perf_counter()
    yield
    timer[name] = timer.get(name, 0.0) + time.perf_counter() - start


def dump_validation(root: Path, step: int, prompts, results, completions=None) -> None:
    """One row per greedy sample: the scored result plus the prompt exactly as the model read it (and the
    response's token ids, single-turn), in ``rollouts/val_step_N.jsonl``."""
    folder = root / "rollouts"
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": p.text, "prompt_token_ids": p.token_ids, **asdict(r)}
            for p, r in zip(prompts, results, strict=True)]
    for row, group in zip(rows, completions or [], strict=False):
        row["response_token_ids"] = list(group[0].token_ids)
    atomic_write(folder / f"val_step_{step:08d}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
