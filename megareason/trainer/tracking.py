"""Metrics to ``metrics.jsonl`` (which ``megareason report`` plots) and to the loggers of
``trainer.loggers``: the console, tensorboard, wandb and MLflow, under the same metric names everywhere.

* **wandb**: project, entity, run name, group and tags from ``trainer.wandb``. Online when wandb finds
  credentials the way its own tools do (``wandb login``'s entry in ``~/.netrc`` or ``$NETRC``,
  ``WANDB_API_KEY``, the api_key of wandb's settings file), else offline (a run folder under
  ``<run>/wandb/``, uploaded later with ``wandb sync``); ``trainer.wandb.mode`` or ``$WANDB_MODE`` choose
  instead. One log line says which and why.
* **MLflow**: ``$MLFLOW_TRACKING_URI`` if set, else a local file store in ``<run>/mlruns`` (MLflow 3 keeps
  that backend in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``, which is set for it); experiment
  ``$MLFLOW_EXPERIMENT_NAME`` (default "megareason"), one batch of metrics per step.

Credentials are read by the libraries from the environment only; nothing here writes them anywhere. A
resumed run continues the same wandb and MLflow runs (their ids are kept in the run folder).
"""

from __future__ import annotations

import configparser
import json
import logging
import math
import netrc
import os
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from tqdm import tqdm

from megareason.config.schema import WandbConfig
from megareason.utils import atomic_write

log = logging.getLogger(__name__)

LOGGERS = ("console", "tensorboard", "wandb", "mlflow")

# The console line shows these (when present), in this order, under these labels.
CONSOLE_KEYS = {"reward/mean": "reward", "accuracy": "acc", "response_length/mean": "len", "actor/loss": "loss",
                "actor/kl": "kl", "actor/entropy": "entropy", "actor/grad_norm": "gnorm", "critic/vf_loss": "vf_loss",
                "rollout/token_mult_prob_error": "mismatch", "sft/loss": "sft_loss", "val/loss": "val_loss",
                "val/accuracy": "val_acc", "time/step": "sec"}
# ... and these only when not 0: samples a reward failed on, and those past reward.timeout.
CONSOLE_IF_NONZERO = {"reward/errors": "reward_errors", "reward/timeouts": "reward_timeouts"}


def _need(module: str, logger: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"trainer.loggers has {logger!r} but {module} is not installed: "
                          "pip install 'megareason[trackers]'") from e


def _saved_id(path: Path) -> str | None:
    return path.read_text().strip() or None if path.is_file() else None


def wandb_credentials() -> str | None:
    """Where wandb would find an API key for its server ($WANDB_BASE_URL, default api.wandb.ai), read the
    way ``wandb login`` stores it; None when nowhere. The key itself is never read into this process."""
    if os.environ.get("WANDB_API_KEY"):
        return "WANDB_API_KEY"
    if os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "WANDB_IDENTITY_TOKEN_FILE"
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc").expanduser()
    try:
        if path.is_file() and netrc.netrc(str(path)).authenticators(host):
            return f"{path} (wandb login)"
    except (netrc.NetrcParseError, OSError):
        pass
    settings = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb") / "settings"
    parser = configparser.ConfigParser()
    try:
        parser.read(settings)
    except configparser.Error:
        return None
    return str(settings) if parser.get("default", "api_key", fallback="") else None


def wandb_mode(mode: str) -> tuple[str, str]:
    """(wandb's mode, the reason) for ``trainer.wandb.mode``: auto follows $WANDB_MODE when set, else goes
    online with credentials and offline without."""
    if mode != "auto":
        return mode, f"trainer.wandb.mode={mode}"
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], f"WANDB_MODE={os.environ['WANDB_MODE']}"
    found = wandb_credentials()
    if found:
        return "online", f"credentials from {found}"
    return "offline", "no credentials (run `wandb login` or set WANDB_API_KEY to log online)"


class _Wandb:
    def __init__(self, root: Path, config: dict | None, settings: WandbConfig):
        wandb = _need("wandb", "wandb")
        mode, why = wandb_mode(settings.mode)
        id_file = root / "wandb_run_id"
        run_id = _saved_id(id_file) or uuid.uuid4().hex[:8]  # wandb ids: 8 lowercase alphanumerics
        project = settings.project or os.environ.get("WANDB_PROJECT") or "megareason"
        self.run = wandb.init(project=project, entity=settings.entity or None,
                              name=settings.name or root.resolve().name, group=settings.group or None,
                              tags=list(settings.tags) or None, id=run_id, resume="allow", dir=str(root), mode=mode,
                              config=config, settings=wandb.Settings(console="off", save_code=False, silent=True))
        atomic_write(id_file, run_id + "\n")
        later = f" into {root / 'wandb'} (`wandb sync {root / 'wandb'}` uploads it)" if mode == "offline" else ""
        log.info("wandb: run %s of project %s logs %s%s: %s", run_id, project, mode, later, why)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, root: Path, config: dict | None):
        _need("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"file:{root.resolve() / 'mlruns'}"
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        id_file = root / "mlflow_run_id"
        self.run_id = _saved_id(id_file)
        if self.run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "megareason")
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            self.run_id = self.client.create_run(exp_id, run_name=root.resolve().name).info.run_id
            atomic_write(id_file, self.run_id + "\n")
            if config:
                from mlflow.entities import Param

                flat = _flatten(config)
                for i in range(0, len(flat), 100):  # MLflow's batch limit
                    self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in flat[i:i + 100]])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        self._check_names(metrics)
        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def _check_names(self, metrics: dict[str, float]) -> None:
        """The file store keeps metric ``a/b`` in the file ``metrics/a/b``: ``a`` and ``a/b`` cannot coexist.
        Fail with both names rather than mid-write (megareason's own names never collide)."""
        if not self.client.tracking_uri.startswith("file:"):
            return
        self.names = getattr(self, "names", set()) | set(metrics)
        for name in metrics:
            parts = name.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in self.names:
                    raise ValueError(f"MLflow file store: metric {name!r} needs {'/'.join(parts[:i])!r} to be a "
                                     "folder, but it is also a metric; rename one of them")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        out += _flatten(v, key + ".") if isinstance(v, dict) else [(key, v)]
    return out


class Tracker:
    """Appends one record per ``log`` call. On a resume from step ``start_step`` the records of later
    steps (written after that checkpoint by the interrupted run) are dropped first, so the file and the
    tensorboard curves hold each step once. ``config`` (the run's resolved config) goes to wandb and
    MLflow as the run's parameters; ``wandb`` names the wandb run (default: ``WandbConfig()``)."""

    def __init__(self, root: Path, loggers: list[str], start_step: int, config: dict | None = None,
                 wandb: WandbConfig | None = None):
        unknown = sorted(set(loggers) - set(LOGGERS))
        if unknown:
            raise ValueError(f"trainer.loggers: unknown {unknown}; expected some of {list(LOGGERS)}")
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
        self.remote: list[_Wandb | _Mlflow] = []
        if "wandb" in loggers:
            self.remote.append(_Wandb(root, config, wandb or WandbConfig()))
        if "mlflow" in loggers:
            self.remote.append(_Mlflow(root, config))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One row of ``metrics.jsonl`` (non-finite values dropped) and the same values to every logger."""
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
            f.flush()
        if self.writer is not None:
            for k, v in clean.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        for logger in self.remote:
            logger.log(step, clean)
        if self.console:
            shown = [f"{label}={clean[k]:.4g}" for k, label in CONSOLE_KEYS.items() if k in clean]
            shown += [f"{label}={clean[k]:.4g}" for k, label in CONSOLE_IF_NONZERO.items() if clean.get(k)]
            tqdm.write(f"step {step}: " + " ".join(shown))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        for logger in self.remote:
            logger.close()


def read_metrics(root: str | Path) -> list[dict[str, float]]:
    """The rows of ``<root>/metrics.jsonl`` in file order (``FileNotFoundError`` naming a non-run folder)."""
    path = Path(root) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {root}; is it a training run folder?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
