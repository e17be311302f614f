"""LoRA adapters on megatron-core's tensor-parallel linear layers, split the way their base layer is.

``y = base(x) + scale * B(A(dropout(x)))`` with ``scale = alpha / rank``; the base weight is frozen.

* Column-parallel base (``linear_qkv``, ``linear_fc1``: the weight is split on the output dimension):
  A ``[r, in]`` is whole on every TP rank, B ``[out / tp, r]`` is split like the base weight. The
  rank-r activation passes ``copy_to_tensor_model_parallel_region`` before B (identity forward,
  all-reduce backward), so every rank's A gets the full gradient.
* Row-parallel base (``linear_proj``, ``linear_fc2``: split on the input dimension, the input arrives
  split): A ``[r, in / tp]`` is split like the base weight, B ``[out, r]`` is whole; the partial ``A x``
  passes ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward) before B.

A is drawn from the full-size tensor with a generator seeded by (seed, layer name) and then sliced, so
every TP layout starts from the same adapter. ``merged_weight`` is this rank's shard of ``W + scale·BA``.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

TARGETS = {"linear_qkv": "column", "linear_fc1": "column", "linear_proj": "row", "linear_fc2": "row"}


@dataclass(frozen=True)
class LoRASettings:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora rank must be >= 1, got {self.rank}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRALinear(torch.nn.Module):
    """Wraps one megatron-core ``ColumnParallelLinear`` / ``RowParallelLinear`` (same call signature)."""

    def __init__(self, base: torch.nn.Module, kind: str, name: str, settings: LoRASettings, tp_rank: int,
                 tp_size: int):
        super().__init__()
        if kind not in ("column", "row"):
            raise ValueError(f"kind must be column or row, got {kind!r}")
        self.base, self.kind, self.settings = base, kind, settings
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
        self.dropout = torch.nn.Dropout(settings.dropout)

    def forward(self, x, *args, **kwargs):
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        out, bias = self.base(x, *args, **kwargs)
        h = torch.nn.functional.linear(self.dropout(x), self.lora_A)
        h = (copy_to_tensor_model_parallel_region if self.kind == "column"
             else reduce_from_tensor_model_parallel_region)(h)
        return out + self.settings.scale * torch.nn.functional.linear(h, self.lora_B), bias

    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of ``W + scale * B @ A`` (the same split as the base weight)."""
        with torch.no_grad():
            return self.base.weight + self.settings.scale * (self.lora_B @ self.lora_A)
