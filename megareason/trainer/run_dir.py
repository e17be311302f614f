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

A checkpoint is built in ``checkpoints/.step_N.tmp`` and renamed to ``step_N`` once the model
checkpoints and ``trainer_state.json`` are all written, so a ``step_N`` folder is always complete; a
crash mid-save leaves a ``.tmp`` folder that the next save removes. Only the last ``keep_last`` are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megareason.utils import atomic_write

_STEP = re.compile(r"^step_(\d+)$")


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
