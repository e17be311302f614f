"""Training a megatron-core model: DDP, the megatron-core optimizer, and one step over micro-batches.

The optimizer is megatron-core's (``get_megatron_optimizer``: AdamW with grad clipping) on GPU and CPU
alike; on CPU it runs through ``cpu_compat`` (the distributed optimizer also steps on CPU, but its state
does not round-trip through dist_checkpointing there, so the CPU path defaults to the plain one).

Loss normalisation is explicit: a loss function returns (sum of per-token or per-sequence losses,
count) for its micro-batch, and megatron-core divides the gradients by the count summed over all
micro-batches and data-parallel ranks (``calculate_per_token_loss``). A token-mean over the global
batch therefore gives the same gradient however the batch is split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megareason.models.logprobs import vocab_parallel_logprobs

# (logp_BT, entropy_BT, micro_batch) -> (loss_sum, count, metrics): logp/entropy are aligned with
# micro_batch.tokens_BT (column t scores token t; column 0 is 0).
LossFn = Callable[[torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class TrainBatch:
    """The minimal micro-batch: right-padded tokens and which of them the loss scores."""

    tokens_BT: torch.Tensor  # int64 [B, T]
    loss_mask_BT: torch.Tensor  # float32 [B, T], 0 on prompt and padding


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float = 1e-6
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False


@dataclass
class StepResult:
    loss: float  # sum of loss_sum / sum of count, over the global batch
    grad_norm: float  # before clipping
    metrics: dict[str, float]  # each metric summed over micro-batches and DP ranks


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


def _forward_step(loss_fn: LossFn, true_vocab: int, data_iterator, model):
    batch = next(data_iterator)
    tokens = batch.tokens_BT
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    logits = model(tokens, positions, attention_mask=None)

    def loss(output):
        logp, entropy = vocab_parallel_logprobs(output[:, :-1], tokens[:, 1:], true_vocab)
        pad = logp.new_zeros(logp.shape[0], 1)
        loss_sum, count, metrics = loss_fn(torch.cat([pad, logp], 1), torch.cat([pad, entropy], 1), batch)
        reported = {k: v.detach().float() for k, v in metrics.items()}
        reported["loss_sum"], reported["count"] = loss_sum.detach().float(), count.detach().float()
        return loss_sum, count.to(torch.int), reported

    return logits, loss


def forward_backward(ddp_model, micro_batches: Sequence[Any], loss_fn: LossFn, true_vocab: int) -> dict:
    """Accumulate gradients of ``loss_fn`` over ``micro_batches`` (all the same shape) with megatron-core's
    schedule (1F1B when PP > 1). Returns the summed metrics (on every rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, t = micro_batches[0].tokens_BT.shape
    ddp_model.zero_grad_buffer()
    store = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, loss_fn, true_vocab),
        data_iterator=iter(micro_batches),
        model=[ddp_model],
        num_microbatches=len(micro_batches),
        seq_length=t,
        micro_batch_size=b,
        forward_only=False,
    )
    keys = sorted(store[0]) if store else []
    if ps.get_pipeline_model_parallel_world_size() > 1:  # only the last stage holds the metrics
        src = ps.get_pipeline_model_parallel_last_rank()
        names = [keys]
        dist.broadcast_object_list(names, src=src, group=ps.get_pipeline_model_parallel_group())
        keys = names[0]
    sums = torch.stack([sum(s[k] for s in store) for k in keys]) if store else torch.zeros(len(keys))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(sums, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    dist.all_reduce(sums, group=ps.get_data_parallel_group())
    return dict(zip(keys, sums.tolist(), strict=True))


def train_step(ddp_model, optimizer, micro_batches: Sequence[Any], loss_fn: LossFn, true_vocab: int) -> StepResult:
    """One optimizer step over ``micro_batches`` (this data-parallel rank's share of the global batch)."""
    optimizer.zero_grad()
    sums = forward_backward(ddp_model, micro_batches, loss_fn, true_vocab)
    ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise FloatingPointError("optimizer step skipped: non-finite gradients")
    loss_sum, count = sums.pop("loss_sum"), sums.pop("count")
    return StepResult(loss=loss_sum / max(count, 1.0), grad_norm=float(grad_norm), metrics=sums)
