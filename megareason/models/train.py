"""Training a megatron-core model: DDP, the megatron-core optimizer, and one step over micro-batches.

The optimizer is megatron-core's (``get_megatron_optimizer``: AdamW with grad clipping) on GPU and CPU
alike; on CPU it runs through ``cpu_compat``. ``use_distributed_optimizer`` shards its state over the DP
ranks (megatron-core's distributed optimizer; ``checkpoint`` saves and reshards it like the plain one's).

Loss normalisation is explicit: a loss function returns (sum of per-token or per-sequence losses,
count) for its micro-batch, and megatron-core divides the gradients by the count summed over all
micro-batches and data-parallel ranks (``calculate_per_token_loss``). A token-mean over the global
batch therefore gives the same gradient however the batch is split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megareason.models.schedule import Head, LossFn, StopCheck, forward_backward


@dataclass
class TrainBatch:
    """The minimal micro-batch: right-padded tokens and which of them the loss scores."""

    tokens_BT: torch.Tensor  # int64 [B, T]
    loss_mask_BT: torch.Tensor  # float32 [B, T], 0 on prompt and padding
    cu_seqlens: torch.Tensor | None = None  # packed rows only; see schedule.TokenBatch


@dataclass(frozen=True)
class OptimizerSettings:
    """megatron-core's AdamW as ``wrap_for_training`` builds it (the config's ``optim``): ``clip_grad`` is
    the maximum global gradient norm; ``use_distributed_optimizer`` shards the optimizer state over the
    data-parallel ranks (its checkpoints then resume only into a distributed optimizer)."""

    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    clip_grad: float
    use_distributed_optimizer: bool


@dataclass
class StepResult:
    """What one ``train_step`` returns, the same on every rank (reduced over data-parallel ranks and
    broadcast from the last pipeline stage)."""

    loss: float  # sum of loss_sum / sum of count, over the global batch
    grad_norm: float  # before clipping
    metrics: dict[str, float]  # each metric summed over micro-batches and DP ranks
    moe: dict[str, float] | None = None  # MoE models: the routers' load and loss (``moe.RouterWatch.metrics``)


def wrap_for_training(model, settings: OptimizerSettings):
    """Wrap ``model`` in megatron-core DDP and build its optimizer. Returns (ddp_model, optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model.config
    assert config.calculate_per_token_loss, "build the model with megareason.models.arch.transformer_config"
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.beta1,
        adam_beta2=settings.beta2,
        adam_eps=settings.eps,
        clip_grad=settings.clip_grad,
        params_dtype=config.params_dtype,
        bf16=config.bf16,
        fp16=config.fp16,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    return ddp, get_megatron_optimizer(opt_config, [ddp])


def train_step(ddp_model, optimizer, micro_batches: Sequence[Any], head: Head, loss_fn: LossFn,
               router_watch=None, stop: StopCheck | None = None) -> StepResult:
    """One optimizer step over ``micro_batches`` (this data-parallel rank's share of the global batch);
    ``router_watch`` (an MoE model's ``moe.RouterWatch``) counts the step's routing. ``stop``: the pass may
    give up between pieces of its micro-batches (``schedule.forward_backward``), before the optimizer step."""
    optimizer.zero_grad()
    if router_watch is not None:
        router_watch.start()
    sums = forward_backward(ddp_model, micro_batches, head, loss_fn, stop)
    moe = router_watch.metrics() if router_watch is not None else None
    ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise FloatingPointError("optimizer step skipped: non-finite gradients")
    loss_sum, count = sums.pop("loss_sum"), sums.pop("count")
    return StepResult(loss=loss_sum / max(count, 1.0), grad_norm=float(grad_norm), metrics=sums, moe=moe)
