"""Checkpoint conversion: HF safetensors <-> megareason (megatron-core dist_checkpointing) checkpoints.

Both directions run in one process (TP=1, PP=1, gloo): a dist checkpoint is resharded to any TP/PP
when it is loaded, so there is no need to convert "for" a layout. HF output is written to a temporary
directory and renamed into place; transformers and vLLM load it directly. An existing output folder is
replaced only when it is empty or an earlier export of the same kind (``HF_MODEL``, ``PEFT_ADAPTER``,
``checkpoint.CHECKPOINT``): a folder holding anything else is refused and left as it is.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from megareason.models.checkpoint import HF_FILES
from megareason.utils import OutputKind, atomic_directory

MAX_SHARD_BYTES = 5 * 1024**3
# What an export writes: a second export to the same folder replaces the first, and nothing else. An HF
# folder as transformers' save_pretrained writes it (``hub.fetch``'s too), weights in one file or shards.
HF_MODEL = OutputKind("HF model folder", marks=("config.json", "model*.safetensors*"),
                      entries=(*HF_FILES, "added_tokens.json", "model.safetensors", "model-*-of-*.safetensors",
                               "model.safetensors.index.json"))
PEFT_ADAPTER = OutputKind("PEFT adapter folder", marks=("adapter_config.json", "adapter_model.safetensors"),
                          entries=("adapter_config.json", "adapter_model.safetensors"))


def _ensure_single_process_group() -> None:
    import torch.distributed as dist

    from megareason.models.parallel import init_parallel

    store = None
    if not dist.is_initialized() and "MASTER_PORT" not in os.environ:
        # One process: an in-memory store, no port (under torchrun, its env:// rendezvous).
        store = dist.HashStore()
        os.environ.update(RANK="0", WORLD_SIZE="1")
    init_parallel(1, 1, store=store)


def hf_to_megatron(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert an HF checkpoint directory into a megareason checkpoint at ``out_dir``."""
    from megareason.models.build import HFCheckpoint, build_gpt, load_hf_weights
    from megareason.models.checkpoint import save_checkpoint

    ckpt = HFCheckpoint(hf_dir)
    ckpt.check_complete()  # before any process group or model is built
    _ensure_single_process_group()
    model = build_gpt(ckpt.arch)
    load_hf_weights(model, ckpt)
    return save_checkpoint(out_dir, model, ckpt.arch, hf_dir, metadata={"converted_from": str(hf_dir)})


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def source_dtype(ckpt_dir: str | Path) -> str:
    """The dtype of the HF model a checkpoint was trained from (its config.json), float32 if unstated."""
    config = Path(ckpt_dir) / "hf" / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() else {}
    name = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    return name if name in DTYPES else "float32"


def megatron_to_hf(ckpt_dir: str | Path, out_dir: str | Path, peft: bool = False, dtype: str = "auto") -> Path:
    """Convert a megareason checkpoint (saved at any TP/PP) into an HF directory at ``out_dir``.

    A LoRA checkpoint is written with the adapters merged into the weights, or with ``peft`` as a PEFT
    adapter (``adapter_config.json`` + ``adapter_model.safetensors``) for the HF base model it was
    trained from (``PeftModel.from_pretrained(base, out_dir)`` or transformers' ``load_adapter``).

    ``dtype``: of the written tensors (float32, bfloat16, float16; auto: the source model's). A bf16
    run's checkpoint holds bf16 model weights and, with its optimizer state, the fp32 main weights:
    exporting it in float32 reads the main weights (the optimizer state is loaded too: 16 bytes per
    parameter in this one process), in bf16 the model weights, which are those rounded."""
    dtype = source_dtype(ckpt_dir) if dtype == "auto" else dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected auto or one of {', '.join(DTYPES)}")
    from dataclasses import fields

    from megareason.models import lora, weight_map
    from megareason.models.checkpoint import checkpoint_arch, read_metadata

    meta = read_metadata(ckpt_dir)
    settings = None
    if meta.get("lora"):
        known = {f.name for f in fields(lora.LoRASettings)}
        kw = {k: v for k, v in meta["lora"].items() if k in known}
        settings = lora.LoRASettings(**{**kw, "targets": tuple(kw["targets"])})
    if peft and settings is None:
        raise ValueError(f"{ckpt_dir}: --peft needs a checkpoint trained with LoRA (lora.enabled=true); this one "
                         "has no adapters")
    arch = checkpoint_arch(ckpt_dir)
    _ensure_single_process_group()
    main_weights = meta.get("precision", "fp32") != "fp32" and DTYPES[dtype] == torch.float32 and meta["has_optimizer"]
    model = _load_for_export(ckpt_dir, arch, settings, meta, main_weights)
    if peft:
        adapters = {k: (a.cpu(), b.cpu()) for k, (a, b) in lora.adapter_state(model).items()}
        base = str(meta.get("base_model", ""))
        return write_peft(lora.peft_adapter(adapters, arch), lora.peft_config(settings, base), out_dir)
    state = {k: v.cpu() for k, v in lora.merged_state(model).items()}
    tensors = weight_map.to_hf({(0, 0): state}, arch, tp=1, pp=1)
    return write_hf({k: v.to(DTYPES[dtype]) for k, v in tensors.items()}, Path(ckpt_dir) / "hf", out_dir)


def _load_for_export(ckpt_dir, arch, settings, meta: dict, main_weights: bool):
    """This process's (TP=1, PP=1) model with the checkpoint's weights, in float32: the model tensors
    as saved, or (``main_weights``) the fp32 main weights of its mixed-precision optimizer."""
    from megareason.models import lora
    from megareason.models.build import FP32, build_gpt
    from megareason.models.checkpoint import SHARDING_KEY, load_checkpoint

    if not main_weights:
        model = build_gpt(arch, FP32, local_spec=settings is not None)
        if settings is not None:
            lora.apply_lora(model, settings)
        load_checkpoint(ckpt_dir, model)
        return model
    from dataclasses import replace

    from megareason.models.memory import main_parameters
    from megareason.models.train import OptimizerSettings, wrap_for_training

    model = build_gpt(arch, replace(FP32, precision=meta["precision"]), local_spec=settings is not None)
    if settings is not None:
        lora.apply_lora(model, settings)
    # Only the optimizer's layout matters: its state and hyperparameters come from the checkpoint.
    ddp, optimizer = wrap_for_training(model, OptimizerSettings(
        lr=1e-6, weight_decay=0.0, beta1=0.9, beta2=0.999, eps=1e-8, clip_grad=1.0,
        use_distributed_optimizer=meta.get(SHARDING_KEY) is not None))
    load_checkpoint(ckpt_dir, model, optimizer)
    main = main_parameters(optimizer)
    with torch.no_grad():
        for p in model.parameters():
            p.data = main.get(p, p).detach().float().reshape(p.shape)
    return model


def write_peft(tensors: dict[str, torch.Tensor], config: dict, out_dir: str | Path) -> Path:
    """A PEFT adapter directory, atomically; an existing ``out_dir`` must be empty or an earlier adapter
    (``utils.OccupiedFolder``). The shards and index are transformers' layout, written here rather than by
    huggingface_hub's ``save_torch_state_dict``, which refuses tensors that view part of a larger storage (the
    weight map's gate and up halves of fc1) unless each is copied first: twice the export's host memory."""
    from safetensors.torch import save_file

    with atomic_directory(out_dir, PEFT_ADAPTER) as tmp:
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
    return Path(out_dir)


def write_hf(tensors: dict[str, torch.Tensor], config_dir: Path, out_dir: str | Path) -> Path:
    """Write ``tensors`` as HF safetensors (sharded above 5 GiB) plus the config/tokenizer files of
    ``config_dir``, atomically; an existing ``out_dir`` must be empty or an earlier HF model folder
    (``utils.OccupiedFolder``)."""
    from safetensors.torch import save_file

    with atomic_directory(out_dir, HF_MODEL) as tmp:
        shards, current, size = [], {}, 0
        for name in sorted(tensors):
            t = tensors[name].contiguous()
            if current and size + t.numel() * t.element_size() > MAX_SHARD_BYTES:
                shards.append(current)
                current, size = {}, 0
            current[name] = t
            size += t.numel() * t.element_size()
        shards.append(current)
        if len(shards) == 1:
            save_file(shards[0], tmp / "model.safetensors", metadata={"format": "pt"})
        else:
            index, total = {}, 0
            for i, shard in enumerate(shards, 1):
                fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, tmp / fname, metadata={"format": "pt"})
                index.update(dict.fromkeys(shard, fname))
                total += sum(t.numel() * t.element_size() for t in shard.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2))
        for name in HF_FILES:
            if (config_dir / name).is_file():
                shutil.copy2(config_dir / name, tmp / name)
        for f in tmp.iterdir():
            f.chmod(0o644)
    return Path(out_dir)
