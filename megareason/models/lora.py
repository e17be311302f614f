"""LoRA adapters on megatron-core's tensor-parallel linear layers, split the way their base layer is.

``y = base(x) + scale * B(A(dropout(x)))`` with ``scale = alpha / rank``; the base weight is frozen.

* Column-parallel base (``linear_qkv``, ``linear_fc1``: the weight is split on the output dimension):
  A ``[r, in]`` is whole on every TP rank, B ``[out / tp, r]`` is split like the base weight. The
  rank-r activation passes ``copy_to_tensor_model_parallel_region`` before B (identity forward,
  all-reduce backward), so every rank's A gets the full gradient.
* Row-parallel base (``linear_proj``, ``linear_fc2``: split on the input dimension, the input arrives
  split): A ``[r, in / tp]`` is split like the base weight, B ``[out, r]`` is whole; the partial ``A x``
  passes ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward) before B.

A is drawn from the full-size tensor with a generator seeded by (seed, global layer name) and then sliced,
so every TP/PP layout starts from the same adapter. ``merged_weight`` is this rank's shard of
``W + scale·BA``.

Around the layer: ``apply_lora`` freezes a model and wraps its target linears (after the HF weights are
loaded), so DDP and the optimizer see only the adapters; ``merged_state`` shows a LoRA model under the
base model's names with merged weights (what the weight sync and the HF export read); checkpoints hold
the base weight under its usual key plus ``lora_A`` / ``lora_B`` split over TP like the layer (any TP/PP
on load); ``peft_adapter`` turns a TP=1 adapter state into PEFT's format (``adapter_model.safetensors``
names and ``adapter_config.json``), which transformers + PEFT load onto the HF base model.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

TARGETS = {"linear_qkv": "column", "linear_fc1": "column", "linear_proj": "row", "linear_fc2": "row"}
# megatron-core target -> the HF modules it holds (QKV and fc1 are fused in megatron-core)
HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


@dataclass(frozen=True)
class LoRASettings:
    """The adapters of ``apply_lora``: ``rank`` r, ``alpha`` (the update is scaled by ``alpha / rank``),
    ``dropout`` on the adapter's input, ``seed`` of A's initialisation, ``targets`` among ``TARGETS``
    (megatron-core names). Raises ``ValueError`` on construction for a value out of range."""

    rank: int
    alpha: float
    dropout: float
    seed: int
    targets: tuple[str, ...]

    def __post_init__(self):
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"lora targets must be a non-empty subset of {sorted(TARGETS)}, got {list(self.targets)}")
        if self.rank < 1:
            raise ValueError(f"lora rank must be >= 1, got {self.rank}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout}")

    @property
    def scale(self) -> float:
        """``alpha / rank``: the factor on ``B A``."""
        return self.alpha / self.rank


class LoRALinear(torch.nn.Module):
    """Wraps one megatron-core ``ColumnParallelLinear`` / ``RowParallelLinear`` (same call signature)."""

    def __init__(self, base: torch.nn.Module, kind: str, name: str, settings: LoRASettings, tp_rank: int,
                 tp_size: int, gated: bool = False):
        """``gated``: the base is a SwiGLU ``linear_fc1`` whose shard is [gate_r; up_r] (checkpointed as two
        TP-split halves, as megatron-core's MLP does)."""
        super().__init__()
        if kind not in ("column", "row"):
            raise ValueError(f"kind must be column or row, got {kind!r}")
        self.base, self.kind, self.settings, self.gated = base, kind, settings, gated
        base.weight.requires_grad_(False)
        if getattr(base, "bias", None) is not None:
            base.bias.requires_grad_(False)
        out_local, in_local = base.weight.shape
        full_in = in_local * tp_size if kind == "row" else in_local
        g = torch.Generator().manual_seed(settings.seed * 1_000_003 + zlib.crc32(name.encode()))
        a_full = torch.empty(settings.rank, full_in)
        bound = 1 / math.sqrt(full_in)  # kaiming-uniform(a=sqrt(5)) as nn.Linear and PEFT initialise A
        a_full.uniform_(-bound, bound, generator=g)
        a = a_full[:, tp_rank * in_local:(tp_rank + 1) * in_local] if kind == "row" else a_full
        kw = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_A = torch.nn.Parameter(a.to(**kw).contiguous())
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, settings.rank, **kw))  # column: out/tp; row: out
        # megatron-core's bookkeeping: which parameters are split over TP, and on which dimension
        split, dim = (self.lora_B, 0) if kind == "column" else (self.lora_A, 1)
        split.tensor_model_parallel, split.partition_dim, split.partition_stride = True, dim, 1
        other = self.lora_A if kind == "column" else self.lora_B
        other.tensor_model_parallel = False
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout > 0 else torch.nn.Identity()
        self.enabled = True  # False: the base layer alone (``adapters_off``)
        # Sequence parallelism: a column layer's input is this rank's slice of the sequence (the base
        # gathers it inside), a row layer's output is reduce-scattered to one. The row adapter's B then
        # sees only this rank's tokens, so its gradient is summed over TP like the norms'.
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False))
        if self.sequence_parallel and kind == "row":
            self.lora_B.sequence_parallel = True

    def forward(self, x, *args, **kwargs):
        """The base layer's ``(out, bias)`` with ``scale * B(A(dropout(x)))`` added to ``out`` (nothing
        added while ``enabled`` is False). A TP collective, as the base layer's: every TP rank calls it."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        out, bias = self.base(x, *args, **kwargs)
        if not self.enabled:
            return out, bias
        if self.sequence_parallel and self.kind == "column":
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # The copy-to region below all-reduces the gradient, so the gather keeps each rank's slice of it.
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        h = torch.nn.functional.linear(self.dropout(x), self.lora_A)
        if self.kind == "column":
            h = copy_to_tensor_model_parallel_region(h)
        elif self.sequence_parallel:
            from megatron.core.tensor_parallel import reduce_scatter_to_sequence_parallel_region

            h = reduce_scatter_to_sequence_parallel_region(h)
        else:
            h = reduce_from_tensor_model_parallel_region(h)
        return out + self.settings.scale * torch.nn.functional.linear(h, self.lora_B), bias

    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of ``W + scale * B @ A`` (the same split as the base weight)."""
        with torch.no_grad():
            return self.base.weight + self.settings.scale * (self.lora_B @ self.lora_A)

    def sharded_state_dict(self, prefix: str, sharded_offsets, metadata: dict) -> dict:
        """The base layer's entries under its own checkpoint keys (``<layer>.weight``: a LoRA checkpoint's
        base loads into a plain model and back), stored in this module's state dict as ``base.*``; the
        adapters split over TP on the dimension their layer splits."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = {prefix + "base." + key[len(prefix):]: sh
               for key, sh in self.base.sharded_state_dict(prefix, sharded_offsets, metadata).items()}
        axis = {"lora_B": 0} if self.kind == "column" else {"lora_A": 1}
        adapters = {"lora_A": self.lora_A, "lora_B": self.lora_B}
        groups = {"tp_group": self.base.tp_group, "dp_cp_group": metadata["dp_cp_group"]}
        out.update(make_sharded_tensors_for_checkpoint(adapters, prefix, axis, sharded_offsets, **groups))
        if self.gated:  # the MLP applies this to "<prefix>weight" only; ours are named otherwise
            singleton = metadata.get("singleton_local_shards", False)
            for key in (prefix + "base.weight", prefix + "base.bias", prefix + "lora_B"):
                if key in out:
                    out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
        return out


def apply_lora(model, settings: LoRASettings) -> list[str]:
    """Freeze ``model`` (this rank's GPTModel stage, HF weights already loaded) and wrap every target
    linear in a ``LoRALinear``; returns the wrapped modules' names. megatron-core's local layers only:
    TransformerEngine fuses the pre-norm into ``linear_qkv`` / ``linear_fc1``, whose input is then not
    the normalised activation the adapter must read."""
    from megareason.models.build import uses_transformer_engine
    from megareason.models.parallel import current_layout

    if uses_transformer_engine(model):
        raise ValueError("LoRA wraps megatron-core's local linear layers; build the model with the local spec")
    layout = current_layout()
    model.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        if leaf not in settings.targets or isinstance(module, LoRALinear) or ".base" in name:
            continue
        parent = model.get_submodule(parent_name)
        gated = leaf == "linear_fc1" and model.config.gated_linear_unit
        setattr(parent, leaf, LoRALinear(module, TARGETS[leaf], _global_name(model, name), settings,
                                         layout.tp_rank, layout.tp, gated))
        wrapped.append(name)
    if not wrapped:
        raise ValueError(f"no LoRA target {list(settings.targets)} found in the model")
    if model.config.recompute_granularity == "full" and getattr(model, "embedding", None) is not None:
        # megatron-core's full recomputation is a reentrant autograd.Function: its backward runs only if
        # its input requires grad, and the frozen embedding's output does not, so the adapters inside
        # would get no gradient at all (measured: grad norm 0). Later pipeline stages receive inputs that
        # require grad already.
        model.embedding.register_forward_hook(_input_requires_grad)
    return wrapped


def _input_requires_grad(module, args, output):
    return output.requires_grad_(True) if torch.is_grad_enabled() and not output.requires_grad else output


def _global_name(model, name: str) -> str:
    """``decoder.layers.<global index>...``: pipeline stages number their layers from 0."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def lora_modules(model) -> dict[str, LoRALinear]:
    """This rank's ``LoRALinear`` wrappers by module name (the base layer's name); empty without LoRA."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextmanager
def adapters_off(model):
    """The frozen base model for the duration: the reference policy of a LoRA actor, with no second copy
    of the weights (every rank of the model-parallel group must do the same)."""
    modules = lora_modules(model).values()
    for m in modules:
        m.enabled = False
    try:
        yield model
    finally:
        for m in modules:
            m.enabled = True


class MergedState(Mapping):
    """``weight_map.model_state(model)`` as the base model would show it: a LoRA layer's ``weight`` is
    its merged shard, computed when read (one layer at a time, never the whole model twice); its
    ``bias`` is the base's; the adapters themselves are not listed. A model without LoRA reads through."""

    def __init__(self, model):
        from megareason.models.weight_map import model_state

        self._state = model_state(model)
        self._lora = lora_modules(model)
        self._keys = [k.replace(".base.", ".") for k in self._state
                      if not k.endswith((".lora_A", ".lora_B"))]

    def __getitem__(self, key: str) -> torch.Tensor:
        module, _, leaf = key.rpartition(".")
        if module in self._lora:
            return self._lora[module].merged_weight() if leaf == "weight" else self._state[f"{module}.base.{leaf}"]
        return self._state[key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def merged_state(model) -> Mapping[str, torch.Tensor]:
    """This rank's state under the base model's names with merged LoRA weights (``MergedState``: each
    merged shard is computed when read); what the weight sync and the HF export read, with or without LoRA."""
    return MergedState(model)


def adapter_state(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (A, B) of every LoRA layer, keyed by the base layer's ``weight`` name."""
    return {f"{n}.weight": (m.lora_A.detach(), m.lora_B.detach()) for n, m in lora_modules(model).items()}


def peft_adapter(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], arch) -> dict[str, torch.Tensor]:
    """PEFT tensors (``base_model.model.<hf module>.lora_A.weight`` [r, in], ``lora_B.weight`` [out, r])
    from a whole-model (TP=1, PP=1) ``adapter_state``. A fused layer's A is shared by its HF modules and
    its B is split like its weight (QKV per query group, fc1 into gate/up), so each HF module's
    ``scale·B_m A`` is exactly its rows of the fused update."""
    from megareason.models import weight_map

    out = {}
    for rule in weight_map.rules_for(arch):
        if rule.where != "layer":
            continue
        for i in range(arch.num_layers):
            name = rule.megatron.format(i=i)
            if name not in adapters:
                continue
            a, b = adapters[name]
            bs = weight_map.unshard(rule.split, [b], arch) if rule.split in ("qkv", "gate_up") else [b]
            for hf, b_m in zip(rule.hf, bs, strict=True):
                module = "base_model.model." + hf.format(i=i).removesuffix(".weight")
                out[f"{module}.lora_A.weight"] = a.clone()
                out[f"{module}.lora_B.weight"] = b_m.contiguous().clone()
    return out


def peft_config(settings: LoRASettings, base_model: str) -> dict:
    """``adapter_config.json`` for ``peft_adapter``'s tensors."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout, "bias": "none",
            "target_modules": sorted(m for t in settings.targets for m in HF_MODULES[t]),
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True}
