"""Metrics to the console, tensorboard and ``metrics.jsonl`` (which ``megareason report`` plots)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm import tqdm

# The console line shows these (when present), in this order, under these labels.
CONSOLE_KEYS = {"reward/mean": "reward", "accuracy": "acc", "response_length/mean": "len", "actor/loss": "loss",
                "actor/kl": "kl", "actor/entropy": "entropy", "actor/grad_norm": "gnorm", "critic/vf_loss": "vf_loss",
                "rollout/token_mult_prob_error": "mismatch", "sft/loss": "sft_loss", "val/loss": "val_loss",
                "val/accuracy": "val_acc", "time/step": "sec"}


class Tracker:
    """Appends one record per ``log`` call. On a resume from step ``start_step`` the records of later
    steps (written after that checkpoint by the interrupted run) are dropped first, so the file and the
    tensorboard curves hold each step once."""

    def __init__(self, root: Path, loggers: list[str], start_step: int):
        self.path = root / "metrics.jsonl"
        self.console = "console" in loggers
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip() and json.loads(line)["step"] <= start_step:
                    kept.append(line + "\n")
        self.path.write_text("".join(kept))
        self.writer = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(root / "tensorboard"), purge_step=start_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
            f.flush()
        if self.writer is not None:
            for k, v in clean.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        if self.console:
            shown = [f"{label}={clean[k]:.4g}" for k, label in CONSOLE_KEYS.items() if k in clean]
            tqdm.write(f"step {step}: " + " ".join(shown))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(root: str | Path) -> list[dict[str, float]]:
    path = Path(root) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {root}; is it a training run folder?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
