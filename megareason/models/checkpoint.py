"""Megatron checkpoints with ``megatron.core.dist_checkpointing``: atomic, reshardable on load.

Layout of a checkpoint directory::

    <dir>/            dist_checkpointing files (model, optionally optimizer), any TP/PP on load
    <dir>/hf/         config.json, generation config and tokenizer of the HF model it came from
    <dir>/megareason.json   what wrote it: the architecture, the TP/PP it was saved from, user metadata

Every rank writes into ``<dir>.tmp-<id>`` and rank 0 renames it to ``<dir>`` once all ranks are done,
so a crash mid-save leaves the previous checkpoint (if any) intact and never a half-written one.

Optimizer state: megatron-core's non-distributed optimizer state is saved and resharded like the
model. The distributed optimizer's state does not round-trip through dist_checkpointing on CPU
(``flattened_range is not supported``); ``save_checkpoint`` refuses it there rather than write a
checkpoint that cannot be resumed.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from megareason.models.arch import ModelArch
from megareason.models.parallel import current_layout
from megareason.utils import replace_directory

HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")
META = "megareason.json"


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(path: str | Path, model, arch: ModelArch, hf_dir: str | Path, optimizer=None,
                    metadata: dict | None = None) -> Path:
    """Save ``model`` (and ``optimizer``) to ``path`` from every rank; returns the final path."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if optimizer is not None and not torch.cuda.is_available() and _is_distributed_optimizer(optimizer):
        raise NotImplementedError("the distributed optimizer's state cannot be checkpointed on CPU with "
                                  "megatron-core 0.16.1; use optimizer use_distributed_optimizer=false on CPU")
    tmp = Path(_broadcast(f"{path}.tmp-{uuid.uuid4().hex[:8]}" if dist.get_rank() == 0 else None))
    if dist.get_rank() == 0:
        tmp.mkdir(parents=True)
    dist.barrier()
    try:
        state = {"model": model.sharded_state_dict()}
        if optimizer is not None:
            state["optimizer"] = optimizer.sharded_state_dict(state["model"])
        dist_checkpointing.save(state, str(tmp))
        dist.barrier()
        if dist.get_rank() == 0:
            (tmp / "hf").mkdir()
            for name in HF_FILES:
                if (Path(hf_dir) / name).is_file():
                    shutil.copy2(Path(hf_dir) / name, tmp / "hf" / name)
            layout = current_layout()
            meta = {"arch": asdict(arch), "saved_tp": layout.tp, "saved_pp": layout.pp,
                    "has_optimizer": optimizer is not None, **(metadata or {})}
            (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
            replace_directory(tmp, path)
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _stop_writer_manager()
    dist.barrier()
    return path


def _stop_writer_manager() -> None:
    """dist_checkpointing's file writer keeps a spawned multiprocessing Manager (~360 MB) alive for the
    life of the process, and it outlives a SIGKILLed trainer. Shut it down after every save; the next
    save starts a new one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = getattr(filesystem_async, "_results_queue", None)
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        manager.shutdown()
    filesystem_async._results_queue = None


def _is_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in chained)


def read_metadata(path: str | Path) -> dict:
    meta = Path(path) / META
    if not meta.is_file():
        raise FileNotFoundError(f"{path}: not a megareason checkpoint (no {META})")
    return json.loads(meta.read_text())


def checkpoint_arch(path: str | Path) -> ModelArch:
    return ModelArch(**read_metadata(path)["arch"])


def load_checkpoint(path: str | Path, model, optimizer=None) -> dict:
    """Load ``path`` into this rank's ``model`` (any TP/PP layout) and ``optimizer``; returns the metadata."""
    from megatron.core import dist_checkpointing

    from megareason.models.lora import lora_modules

    meta = read_metadata(path)
    if optimizer is not None and not meta["has_optimizer"]:
        raise ValueError(f"{path}: checkpoint has no optimizer state")
    if bool(meta.get("lora")) != bool(lora_modules(model)):
        has = "has LoRA adapters" if meta.get("lora") else "has no LoRA adapters"
        raise ValueError(f"{path}: the checkpoint {has} and the model {'does not' if meta.get('lora') else 'does'}; "
                         "build the model with the checkpoint's lora settings (megareason.json: lora)")
    state = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=True)
    loaded = dist_checkpointing.load(state, str(path))
    model.load_state_dict(loaded["model"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    return meta
