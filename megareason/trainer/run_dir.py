"""A training run's folder, its checkpoints, and the resumable state of the driver.

```
<trainer.output_dir>/
  config.json            the resolved config of the latest (re)start
  metrics.jsonl          one JSON object per step (and per validation)
  tensorboard/           event files
  rollouts/step_N.jsonl  rollout samples every trainer.dump_rollouts_every steps
  rollouts/val_step_N.jsonl  greedy validation samples (with the prompt text and token ids)
  checkpoints/step_N/    actor/ (+ critic/) megatron-core checkpoints, trainer_state.json
  plots/                 `megareason report` output
```

One process writes a run folder at a time: ``hold_run_lock`` takes an exclusive ``flock`` on its
``.lock`` file for the rest of the process's life (the kernel drops it when the process dies, however it
dies, so a stale lock never blocks), and a second ``train`` / ``sft`` on the folder stops at once naming
the holder.

A checkpoint is built in ``checkpoints/.step_N.tmp`` and renamed to ``step_N`` once the model
checkpoints and ``trainer_state.json`` are all written, so a ``step_N`` folder is always complete; a
crash mid-save leaves a ``.tmp`` folder that the next save removes. Only the last ``keep_last`` are kept.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megareason.config import ConfigError
from megareason.utils import atomic_write

_STEP = re.compile(r"^step_(\d+)$")
_LOCKS: dict[Path, int] = {}  # run folder -> the descriptor holding its lock, for the process's life


class RunError(RuntimeError):
    """A run stopped by a failure under it (a worker died, a checkpoint could not be written); its last
    complete checkpoint is intact and the same command resumes from it."""


def first_line(error: BaseException) -> str:
    """An error's first non-empty line (Ray's reports and re-raised worker errors run to many lines)."""
    return next((x.strip() for x in str(error).splitlines() if x.strip()), type(error).__name__)


class CheckpointError(RunError):
    """A checkpoint could not be written (e.g. the disk is full); the previous complete one is intact."""


class RunFolderBusy(ConfigError):
    """Another live process holds the run folder's lock (``hold_run_lock``)."""


def hold_run_lock(root: str | Path) -> None:
    """Take ``root/.lock`` (exclusive, non-blocking ``flock``) and keep it until this process exits; write
    the holder's PID, host and start time into it. Taking it again in the same process is a no-op. Raises
    ``RunFolderBusy`` naming the holder when another live process has it. The descriptor is not inherited
    by programs this process execs (Python opens files non-inheritable); the reward pool spawns."""
    root = Path(root).resolve()
    if root in _LOCKS:
        return
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 512).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunFolderBusy(f"{root} is in use by another run ({holder}); wait for it to end or set another "
                            "trainer.output_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
             .encode())
    _LOCKS[root] = fd


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0


@dataclass
class TrainerState:
    """Everything the driver needs to continue exactly. No global random generator is used by the
    loop: the prompt order is a function of (seed, epoch) and vLLM's sampling seeds of (seed, step),
    so this plus the model/optimizer checkpoints is the whole state."""

    step: int = 0
    sampler: SamplerState = field(default_factory=SamplerState)
    extra: dict = field(default_factory=dict)  # algorithm state (e.g. a replay buffer's file name)

    @classmethod
    def from_json(cls, text: str) -> TrainerState:
        raw = json.loads(text)
        return cls(step=raw["step"], sampler=SamplerState(**raw["sampler"]), extra=raw.get("extra", {}))


class RunDir:
    """``trainer.output_dir`` (module docstring): its complete checkpoints and their atomic commit."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.checkpoints = self.root / "checkpoints"

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        if not self.checkpoints.is_dir():
            return []
        found = []
        for p in self.checkpoints.iterdir():
            m = _STEP.match(p.name)
            if m and (p / "trainer_state.json").is_file():
                found.append(int(m.group(1)))
        return sorted(found)

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:08d}"

    def latest(self) -> Path | None:
        """The newest complete checkpoint (None: none yet); half-written ``.tmp`` folders never count."""
        steps = self.steps()
        return self.checkpoint(steps[-1]) if steps else None

    def begin_checkpoint(self, step: int) -> Path:
        """A fresh temporary folder for step ``step``'s checkpoint (model workers write into it)."""
        tmp = self.checkpoints / f".step_{step:08d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def commit_checkpoint(self, tmp: Path, state: TrainerState, keep_last: int) -> Path:
        """Write ``trainer_state.json`` into ``tmp`` (last: its presence marks a complete checkpoint), rename
        ``tmp`` to ``step_N`` (replacing a ``step_N`` saved before a resume) and delete all but the last
        ``keep_last`` checkpoints. Returns the ``step_N`` folder."""
        atomic_write(tmp / "trainer_state.json", json.dumps(asdict(state), indent=2) + "\n")
        final = self.checkpoint(state.step)
        if final.exists():  # the same step saved again after a resume
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in self.steps()[:-keep_last]:
            shutil.rmtree(self.checkpoint(old), ignore_errors=True)
        return final

    def read_state(self, checkpoint: Path) -> TrainerState:
        return TrainerState.from_json((checkpoint / "trainer_state.json").read_text())
