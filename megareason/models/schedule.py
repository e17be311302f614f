"""Running a megatron-core model over micro-batches with megatron-core's schedule (1F1B when PP > 1).

A *head* turns the model's output on the last pipeline stage into aligned [B, T] tensors
(``logprobs.logprob_head`` for the actor and reference, ``roles.value_head_outputs`` for the critic).
``forward_outputs`` returns them on every rank; ``forward_backward`` feeds them to a loss function that
returns (loss_sum, count, metrics), and megatron-core divides the gradients by the global count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

Head = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
# (*head outputs, micro_batch) -> (loss_sum, count, metrics)
LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def _run(tokens: torch.Tensor, model):
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return model(tokens, positions, attention_mask=None)


def _forward_only_step(head: Head, data_iterator, model):
    tokens = next(data_iterator)
    output = _run(tokens, model)

    def collect(out):
        return out.new_zeros(()), torch.tensor(tokens.numel()), {"outputs": [t.detach() for t in head(out, tokens)]}

    return output, collect


def _pipeline_broadcast(t: torch.Tensor) -> None:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())


@torch.no_grad()
def forward_outputs(model, tokens_BT: torch.Tensor, head: Head, num_outputs: int,
                    micro_batch_size: int = 1) -> list[torch.Tensor]:
    """``head``'s ``num_outputs`` float32 [B, T] tensors for ``tokens_BT``, identical on every rank.

    Every rank of the model-parallel group passes the same ``tokens_BT``. Right padding is harmless:
    a causal model never attends to later (pad) positions; mask pad columns out of any loss.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, t = tokens_BT.shape
    if b % micro_batch_size:
        raise ValueError(f"batch size {b} is not a multiple of micro_batch_size {micro_batch_size}")
    micro = list(tokens_BT.split(micro_batch_size))
    was_training = model.training
    model.eval()
    store = get_forward_backward_func()(
        forward_step_func=partial(_forward_only_step, head), data_iterator=iter(micro), model=[model],
        num_microbatches=len(micro), seq_length=t, micro_batch_size=micro_batch_size, forward_only=True,
    )
    model.train(was_training)
    out = torch.zeros(num_outputs, b, t, dtype=torch.float32)
    if ps.is_pipeline_last_stage():
        for i in range(num_outputs):
            out[i] = torch.cat([s["outputs"][i].float() for s in store])
    _pipeline_broadcast(out)
    return list(out)


def _train_step(head: Head, loss_fn: LossFn, data_iterator, model):
    batch = next(data_iterator)
    output = _run(batch.tokens_BT, model)

    def loss(out):
        loss_sum, count, metrics = loss_fn(*head(out, batch.tokens_BT), batch)
        reported = {k: v.detach().float() for k, v in metrics.items()}
        reported["loss_sum"], reported["count"] = loss_sum.detach().float(), count.detach().float()
        return loss_sum, count.to(torch.int), reported

    return output, loss


def forward_backward(ddp_model, micro_batches: Sequence[Any], head: Head, loss_fn: LossFn) -> dict[str, float]:
    """Accumulate gradients of ``loss_fn`` over ``micro_batches`` (objects with ``tokens_BT``, all the
    same shape). Returns each metric summed over micro-batches and data-parallel ranks, on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, t = micro_batches[0].tokens_BT.shape
    ddp_model.zero_grad_buffer()
    store = get_forward_backward_func()(
        forward_step_func=partial(_train_step, head, loss_fn), data_iterator=iter(micro_batches),
        model=[ddp_model], num_microbatches=len(micro_batches), seq_length=t, micro_batch_size=b,
        forward_only=False,
    )
    keys = sorted(store[0]) if store else []
    if ps.get_pipeline_model_parallel_world_size() > 1:  # only the last stage holds the metrics
        box = [keys]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        keys = box[0]
    sums = torch.stack([sum(s[k] for s in store) for k in keys]) if store else torch.zeros(len(keys))
    _pipeline_broadcast(sums)
    dist.all_reduce(sums, group=ps.get_data_parallel_group())
    return dict(zip(keys, sums.tolist(), strict=True))
