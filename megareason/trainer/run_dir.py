"""A training run's folder, its checkpoints, and the resumable state of the driver.

```
<trainer.output_dir>/
  config.json            the resolved config of the latest (re)start; a resume must agree with it
  metrics.jsonl          one JSON object per step (and per validation)
  tensorboard/           event files
  rollouts/step_N.jsonl  rollout samples every trainer.dump_rollouts_every steps
  rollouts/val_step_N.jsonl  greedy validation samples (with the prompt text and token ids)
  checkpoints/step_N/    actor/ (+ critic/) megatron-core checkpoints, trainer_state.json
  plots/                 `megareason report` output
```

A run writes only into a folder of its own: ``hold_run_lock`` refuses a folder that is neither empty nor
a run folder (``check_run_folder``), so a user's files named config.json or metrics.jsonl are never
overwritten. One process writes a run folder at a time: ``hold_run_lock`` takes an exclusive ``flock`` on its
``.lock`` file for the rest of the process's life (the kernel drops it when the process dies, however it
dies), or where the file system has no ``flock`` an exclusive-create ``.lock.held`` file, taken over once its
holder is provably gone (``run_lock.py``); a second ``train`` / ``sft`` on the folder stops at once naming
the holder.

A checkpoint is built in ``checkpoints/.step_N.tmp`` and renamed to ``step_N`` once the model
checkpoints and ``trainer_state.json`` are all written, so a ``step_N`` folder is always complete; a
process killed mid-save leaves a ``.tmp`` folder (up to a whole checkpoint's bytes), which the next start
removes once it holds the run lock (``RunDir.remove_partial_checkpoints``). Only the last ``keep_last`` are kept.

A rerun resumes from the latest checkpoint only with the config of the run (``check_resume``): the fields
of ``RESUMABLE_CHANGES`` may differ (more steps, a copied run folder, save and log settings), any other
difference is refused before anything is loaded, unless ``trainer.resume_mode=force``.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megareason.config import Config, ConfigError, saved_config
from megareason.trainer import run_lock
from megareason.trainer.run_lock import RunFolderBusy  # noqa: F401 (callers catch it from here)
from megareason.utils import OccupiedFolder, OutputKind, RunError, atomic_write, replace_directory

_STEP = re.compile(r"^step_(\d+)$")
_PARTIAL = re.compile(r"^\.step_\d+\.tmp$")  # a checkpoint being written (``begin_checkpoint``)
# A checkpoints/step_N folder: trainer_state.json, a folder per trained role (trainer/handles.py names
# them), the batch in flight of a one-step off-policy run (trainer/offpolicy.py's INFLIGHT).
STEP_CHECKPOINT = OutputKind("step checkpoint", marks=("trainer_state.json",),
                             entries=("trainer_state.json", "actor", "critic", "rollout_inflight.pt"))
_LOCKS: dict[Path, int] = {}  # run folder -> the descriptor holding its lock, for the process's life


def first_line(error: BaseException) -> str:
    """An error's first non-empty line (Ray's reports and re-raised worker errors run to many lines)."""
    return next((x.strip() for x in str(error).splitlines() if x.strip()), type(error).__name__)


class CheckpointError(RunError):
    """A checkpoint could not be written (e.g. the disk is full); the previous complete one is intact."""


def check_run_folder(root: str | Path, key: str = "trainer.output_dir") -> None:
    """A run may write into ``root`` (the config's ``key``): it does not exist, is an empty folder, or is a
    run folder (its ``.lock``, its ``metrics.jsonl``, a complete checkpoint, or the ``ray_logs`` and the
    code snapshot ``code/`` its Slurm job keeps). ``OccupiedFolder`` otherwise, naming a few of the entries."""
    root = Path(root)
    if root.is_symlink() and not root.exists() or root.exists() and not root.is_dir():
        raise OccupiedFolder(f"{key} {root} is not a folder; name a new or empty folder")
    if not root.exists():
        return
    names = sorted(p.name for p in root.iterdir())
    if not names or {".lock", "metrics.jsonl", "ray_logs"} & set(names) or RunDir(root).steps() \
            or any(root.glob("code/*/.megareason-code")):
        return
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise OccupiedFolder(f"{key} {root} is neither empty nor a run folder (it holds {shown}); a run writes "
                         "config.json, metrics.jsonl, checkpoints/ and more there, so it takes only a new or empty "
                         "folder, or an earlier run's to resume it: name another trainer.output_dir")


def hold_run_lock(root: str | Path) -> None:
    """Lock ``root`` for this process until it exits (``run_lock.take``: ``flock`` on ``root/.lock``, or where
    the file system has none an exclusive-create ``root/.lock.held``) and write the holder's PID, host, Slurm
    job and start time into it. Taking it again in the same process is a no-op. Raises ``RunFolderBusy``
    naming the holder when another live process has it, ``OccupiedFolder`` when ``root`` is a folder of
    someone else's (``check_run_folder``). The descriptor is not inherited by programs this process execs
    (Python opens files non-inheritable); the reward pool spawns."""
    # fcntl.flock on a file of ours, not filelock: the holder's PID, host and job live in the locked file
    # itself, for a second run to name who holds it and to tell a stale holder (run_lock.stale).
    root = Path(root).resolve()
    if root in _LOCKS:
        return
    check_run_folder(root)
    root.mkdir(parents=True, exist_ok=True)
    _LOCKS[root] = run_lock.take(root)


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
    # The step's metrics when a SIGTERM stopped its validation: the next run validates first, then logs them.
    pending_metrics: dict | None = None

    @classmethod
    def from_json(cls, text: str) -> TrainerState:
        raw = json.loads(text)
        return cls(step=raw["step"], sampler=SamplerState(**raw["sampler"]), extra=raw.get("extra", {}),
                   pending_metrics=raw.get("pending_metrics"))


class RunDir:
    """``trainer.output_dir`` (module docstring): its complete checkpoints and their atomic commit."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.checkpoints = self.root / "checkpoints"
        # Created by the driver on SIGTERM; the rollout engines poll it and give up a generation in progress.
        self.stop_file = self.root / ".stopping"

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

    def remove_partial_checkpoints(self) -> list[Path]:
        """Delete the ``.step_N.tmp`` folders a killed save left (a hard kill during a save, or SIGKILL at the
        end of a pre-emption's grace time); returns them. Call it only while holding the run lock
        (``hold_run_lock``): a save in progress in another process writes such a folder."""
        if not self.checkpoints.is_dir():
            return []
        partial = sorted(p for p in self.checkpoints.iterdir() if _PARTIAL.match(p.name))
        for p in partial:
            shutil.rmtree(p, ignore_errors=True)
        return partial

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
        replace_directory(tmp, final, STEP_CHECKPOINT)  # the same step saved again after a restart: replaced
        for old in self.steps()[:-keep_last]:
            shutil.rmtree(self.checkpoint(old), ignore_errors=True)
        return final

    def read_state(self, checkpoint: Path) -> TrainerState:
        return TrainerState.from_json((checkpoint / "trainer_state.json").read_text())

    def check_resume(self, cfg: Config) -> list[str]:
        """When a run of ``cfg`` resumes here (trainer.resume_mode auto or force, a complete checkpoint), its
        differences from the run's ``config.json`` outside ``RESUMABLE_CHANGES``, one line each (``key: old
        -> new``); under auto any difference raises ``ConfigError`` listing them. Writes nothing."""
        saved = self.root / "config.json"
        if cfg.trainer.resume_mode == "disable" or self.latest() is None or not saved.is_file():
            return []
        try:
            old = saved_config(json.loads(saved.read_text()))
        except (ValueError, ConfigError) as e:  # not JSON, or a field of another type than this version's
            changed = [f"its config.json cannot be read as this version's config: {e}"]
        else:
            changed = [f"{key}: {_shown(a)} -> {_shown(b)}" for key, a, b in config_changes(asdict(old), asdict(cfg))]
        if changed and cfg.trainer.resume_mode != "force":
            raise ConfigError(f"{self.root} holds a run to resume (its latest checkpoint is {self.latest()}) whose "
                              "config differs from this one:\n  " + "\n  ".join(changed) + "\nSet "
                              "trainer.resume_mode=force to resume it with these changes, or another "
                              "trainer.output_dir for a new run.")
        return changed


# What a resumed run may change without trainer.resume_mode=force (a key, or a section and all under it):
# how long it runs, where and how often it saves, logs and validates, where its services are, and resources
# that leave the math alone (memory, speed, the parallel layout: checkpoints reshard when they load). Any
# other field is the experiment: the run folder's config.json must agree on it.
RESUMABLE_CHANGES = (
    "trainer.steps", "trainer.output_dir", "trainer.resume_mode", "trainer.save_every", "trainer.save_every_minutes",
    "trainer.must_save_by_minutes", "trainer.stop_margin_s", "trainer.keep_last", "trainer.async_save",
    "trainer.loggers", "trainer.wandb",
    "trainer.val_every", "trainer.val_before_train",
    "trainer.dump_rollouts_every", "trainer.ray_address", "trainer.weight_sync_bucket_mb",
    "trainer.micro_batch_tokens", "trainer.share_prompt_prefix", "trainer.recompute", "trainer.recompute_num_layers",
    "trainer.offload_optimizer",
    "parallel", "rollout.gpu_memory_utilization", "rollout.kv_cache_gib", "rollout.enforce_eager",
    "rollout.weight_transfer",
    "reward.workers", "reward.tinyv.base_url", "reward.tinyv.concurrency", "eval", "benchmark",
)
_UNSET = object()


def config_changes(old: Any, new: Any, key: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) of each difference between two ``asdict`` configs (or parts of
    them at ``key``), outside ``RESUMABLE_CHANGES``; list items are compared one by one (``data.sources[0].size``)
    when the lists have the same length. A key that only one side has is ``_UNSET`` on the other."""
    if any(key == k or key.startswith((f"{k}.", f"{k}[")) for k in RESUMABLE_CHANGES):
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        return [c for k in sorted(set(old) | set(new))
                for c in config_changes(old.get(k, _UNSET), new.get(k, _UNSET), f"{key}.{k}" if key else k)]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [c for i, (a, b) in enumerate(zip(old, new, strict=True)) for c in config_changes(a, b, f"{key}[{i}]")]
    return [] if old == new else [(key, old, new)]


def _shown(value: Any) -> str:
    text = "unset" if value is _UNSET else json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
