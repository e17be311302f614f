"""Running a megatron-core model over micro-batches with megatron-core's schedule (1F1B when PP > 1).

A *head* turns the model's output on the last pipeline stage into aligned [B, T] tensors
(``logprobs.logprob_head`` for the actor and reference, ``roles.value_head_outputs`` for the critic).
``forward_outputs`` returns them on every rank; ``forward_backward`` feeds them to a loss function that
returns (loss_sum, count, metrics), and megatron-core divides the gradients by the global count.

A run that is stopping gives a pass up between two *pieces* of its micro-batches (``stop``: every rank of the
role asks it at the same points and gets the same answer, ``agreed_stop``): at PP 1 megatron-core's schedule
without pipelining runs micro-batches one after the other, so a piece is one schedule call over an eighth of
them; at PP > 1 a piece is one whole 1F1B schedule (it drains the pipeline: PP - 1 more idle slots per piece),
and a pass is at most ``PIECES_PIPELINED`` of them. Gradients accumulate across the pieces of a training pass
and are finalised once, after the last (data-parallel reduction, the division by the global token count:
``finalize_model_grads``), exactly as one schedule call over all micro-batches does them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

# (model output on the last stage, micro-batch) -> aligned [B, T] tensors
Head = Callable[[torch.Tensor, Any], tuple[torch.Tensor, ...]]
# (*head outputs, micro_batch) -> (loss_sum, count, metrics)
LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]
# Asked before each piece of a pass, on every rank of the role: True gives the pass up (``PassStopped``).
StopCheck = Callable[[], bool]

PIECES = 8  # PP 1: the pieces of a pass (free: the schedule has no pipeline to drain)
PIECES_PIPELINED = 4  # PP > 1: each piece costs one pipeline drain, PP - 1 micro-batch slots


def pieces(n: int, pp: int) -> list[slice]:
    """The micro-batches ``0..n`` of a pass cut into the same number of contiguous pieces on every rank (the
    data-parallel replicas may hold different counts; a piece may be empty): a stop check runs before each."""
    k = PIECES if pp == 1 else PIECES_PIPELINED
    return [slice(n * i // k, n * (i + 1) // k) for i in range(k)]


def agreed_stop(local: Callable[[], bool]) -> StopCheck:
    """A ``StopCheck`` that every rank of the process group answers alike: True when ``local()`` is True on
    any rank (a MAX all-reduce of one integer over the default group, the role's ranks), so no rank goes on
    alone into a collective its peers left. vLLM agrees on its data-parallel engines' unfinished requests the
    same way (``ParallelConfig.has_unfinished_dp``, vllm/config/parallel.py)."""
    def check() -> bool:
        flag = torch.tensor([int(local())], dtype=torch.int32, device=device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    return check


class PassStopped(RuntimeError):
    """A pass given up between two pieces because ``stop`` said so; the optimizer was not stepped."""


def _check(stop: StopCheck | None, what: str, parts: list[slice], i: int, n: int) -> None:
    """Before piece ``i`` of ``parts`` (of ``n`` micro-batches): the piece is the same on every rank, the
    micro-batches done before it may differ (the data-parallel replicas' shares)."""
    if stop is not None and stop():
        done = parts[i].indices(n)[0]
        raise PassStopped(f"{what} stopped before piece {i + 1} of {len(parts)} ({done} of {n} micro-batches "
                          "done): the run is stopping")


@dataclass
class TokenBatch:
    """A micro-batch of tokens, padded or packed.

    Padded: ``tokens_BT`` holds one right-padded sequence per row and ``cu_seqlens`` is None.
    Packed: ``tokens_BT`` is [1, T], sequences laid end to end (then padding), and ``cu_seqlens``
    (int32 [n + 1]) holds their boundaries; each sequence attends only to itself and its positions
    restart at 0. Any object with these two fields (e.g. ``train.TrainBatch``) works the same.
    """

    tokens_BT: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    shared: Any = None  # packing.SharedPrefixes: run on the prefix-shared physical row instead
    # Positions whose output is needed (each scores the token after it); None: all. The LM head then
    # runs on these rows only and the head receives [B, len(keep_W), V] (see logprobs.logprob_head).
    keep_W: torch.Tensor | None = None


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (position within its sequence, sequence index) for a packed row of ``total`` tokens;
    the padding tail is sequence ``n`` of its own."""
    lengths = torch.diff(cu_seqlens.long(), append=torch.tensor([total]))
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    starts = torch.repeat_interleave(torch.cat([cu_seqlens.long(), torch.tensor([total])])[:-1], lengths)
    return torch.arange(total) - starts, seq


def device() -> torch.device:
    """Where this rank's model lives: its CUDA device on GPU machines, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def to_device(batch, where: torch.device):
    """A copy of a micro-batch (a dataclass) with its tensors, and the tensors of its dict fields, on
    ``where``. Micro-batches are built on the CPU (the driver's experience); each step moves one."""
    if where.type == "cpu":
        return batch

    def move(v):
        if isinstance(v, torch.Tensor):
            return v.to(where, non_blocking=True)
        if isinstance(v, dict):
            return {k: move(x) for k, x in v.items()}
        if dataclasses.is_dataclass(v):
            return to_device(v, where)
        return v

    return dataclasses.replace(batch, **{f.name: move(getattr(batch, f.name)) for f in dataclasses.fields(batch)})


def _uses_thd(model) -> bool:
    """TransformerEngine layers take packed sequences in the THD layout; megatron-core's local layers
    need an explicit block-diagonal mask instead (also on GPU when TE is not installed)."""
    from megareason.models.build import uses_transformer_engine

    return uses_transformer_engine(model)


@contextlib.contextmanager
def _rope_at(model, positions_P: torch.Tensor):
    """megatron-core's RoPE rotates token i of a row by position i (``position_ids`` only feed learned
    absolute embeddings); a prefix-shared row needs each token's own position."""
    while hasattr(model, "module"):  # DDP / Float16Module wrappers
        model = model.module
    rope = model.rotary_pos_emb
    table = rope.forward

    def at_positions(max_seq_len, *args, **kwargs):
        return table(int(positions_P.max()) + 1, *args, **kwargs).index_select(0, positions_P)

    rope.forward = at_positions
    try:
        yield
    finally:
        del rope.forward  # the class's method again


@contextlib.contextmanager
def _output_rows(model, rows: torch.Tensor | None):
    """Run the last stage's output layer (the LM head) on sequence positions ``rows`` only: over a
    49k vocabulary it is a fifth of a small model's FLOPs, and prompt positions are never scored."""
    while hasattr(model, "module"):
        model = model.module
    layer = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None
    if rows is None or layer is None:
        yield
        return
    head = layer.forward
    sequence_parallel = getattr(layer, "sequence_parallel", False)

    def selected(hidden_states, *args, **kwargs):  # hidden [S, B, H] ([S/TP, B, H] under sequence parallelism)
        if sequence_parallel:
            # Gather the sequence first, then run the head as a plain column-parallel layer on the rows
            # (it all-reduces its input gradient, so each rank keeps its own slice of it on the way back).
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
            layer.sequence_parallel = False
            try:
                return head(hidden_states.index_select(0, rows), *args, **kwargs)
            finally:
                layer.sequence_parallel = True
        return head(hidden_states.index_select(0, rows), *args, **kwargs)

    layer.forward = selected
    try:
        yield
    finally:
        del layer.forward


def _run_shared(batch, model):
    """Run on the physical row; the last stage gathers its output back to the virtual positions."""
    from megatron.core import parallel_state as ps

    if _uses_thd(model):
        raise NotImplementedError("prefix sharing needs an explicit attention mask (megatron-core's local "
                                  "layers); set trainer.share_prompt_prefix=false with TransformerEngine")
    s, keep = batch.shared, batch.keep_W
    rows = None if keep is None else s.gather_W.index_select(0, keep)
    with _rope_at(model, s.positions_1P[0]), _output_rows(model, rows):
        out = model(s.tokens_1P, s.positions_1P, attention_mask=s.attention_mask())
    if keep is not None or not ps.is_pipeline_last_stage():
        return out  # already at the kept positions, in their order (or hidden states for the next stage)
    return out.index_select(1, s.gather_W)


def _physical_width(micro_batches: Sequence[Any], model=None) -> int:
    """The sequence length the pipeline sends: the physical rows' when prefixes are shared (a multiple of
    TP under sequence parallelism, which splits it over the TP ranks)."""
    widths = {(m.shared.tokens_1P if getattr(m, "shared", None) is not None else m.tokens_BT).shape[1]
              for m in micro_batches}
    if len(widths) != 1:
        raise ValueError(f"micro-batches of one call must have one width, got {sorted(widths)}")
    width = widths.pop()
    config = getattr(model, "config", None)
    if config is not None and config.sequence_parallel and width % config.tensor_model_parallel_size:
        raise ValueError(f"sequence parallelism splits each row over TP={config.tensor_model_parallel_size} ranks: "
                         f"the row width {width} must be a multiple of it (pack(..., multiple=TP) pads it)")
    return width


def _run(batch, model):
    if getattr(batch, "shared", None) is not None:
        return _run_shared(batch, model)
    with _output_rows(model, getattr(batch, "keep_W", None)):
        return _run_plain(batch, model)


def _run_plain(batch, model):
    tokens = batch.tokens_BT
    if batch.cu_seqlens is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        return model(tokens, positions, attention_mask=None)
    assert tokens.shape[0] == 1, "a packed micro-batch is a single row"
    t = tokens.shape[1]
    pos, seq = packed_positions(batch.cu_seqlens.cpu(), t)
    if _uses_thd(model):
        # TransformerEngine attention and fused RoPE take the THD layout natively.
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.cat([batch.cu_seqlens.int(), torch.tensor([t], dtype=torch.int32)]).unique().to(tokens.device)
        longest = int(torch.diff(cu).max())
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                 max_seqlen_kv=longest)
        return model(tokens, pos.unsqueeze(0).to(tokens.device), attention_mask=None, packed_seq_params=params)
    # megatron-core's local attention takes an explicit mask instead (True = not attended):
    # causal within each sequence, nothing across sequences.
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    mask = ~(causal & (seq[:, None] == seq[None, :]))
    return model(tokens, pos.unsqueeze(0).to(tokens.device), attention_mask=mask[None, None].to(tokens.device))


def _forward_only_step(head: Head, data_iterator, model):
    batch = to_device(next(data_iterator), device())
    output = _run(batch, model)

    def collect(out):
        outputs = [t.detach() for t in head(out, batch)]
        return out.new_zeros(()), out.new_tensor(batch.tokens_BT.numel(), dtype=torch.int), {"outputs": outputs}

    return output, collect


def _pipeline_broadcast(t: torch.Tensor) -> None:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())


@torch.no_grad()
def forward_outputs(model, micro_batches: Sequence[Any], head: Head, num_outputs: int,
                    stop: StopCheck | None = None) -> list[list[torch.Tensor]]:
    """For each micro-batch, ``head``'s ``num_outputs`` float32 [B, T] tensors, identical on every rank.

    Every rank of the model-parallel group passes the same micro-batches, all of one shape (the
    pipeline sends fixed-size activations). Right padding is harmless: a causal model never attends
    to later (pad) positions; mask pad columns out of any loss. ``stop``: asked before each piece
    (module docstring); True raises ``PassStopped``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, t = micro_batches[0].tokens_BT.shape
    if any(m.tokens_BT.shape != (b, t) for m in micro_batches):
        raise ValueError("all micro-batches of one call must have the same shape")
    was_training = model.training
    model.eval()
    parts = pieces(len(micro_batches), ps.get_pipeline_model_parallel_world_size()) if stop else [slice(None)]
    store = []
    try:
        for i, part in enumerate(parts):
            _check(stop, "a log-prob pass", parts, i, len(micro_batches))
            if not micro_batches[part]:
                continue
            store += get_forward_backward_func()(
                forward_step_func=partial(_forward_only_step, head), data_iterator=iter(micro_batches[part]),
                model=[model], num_microbatches=len(micro_batches[part]),
                seq_length=_physical_width(micro_batches, model), micro_batch_size=b, forward_only=True,
            )
    finally:
        model.train(was_training)
    out = torch.zeros(len(micro_batches), num_outputs, b, t, dtype=torch.float32, device=device())
    if ps.is_pipeline_last_stage():
        for j, s in enumerate(store):
            out[j] = torch.stack([o.float() for o in s["outputs"]])
    _pipeline_broadcast(out)
    return [list(o) for o in out.cpu()]


def padded_micro_batches(tokens_BT: torch.Tensor, micro_batch_size: int) -> list[TokenBatch]:
    """``tokens_BT`` (right-padded rows) cut into padded ``TokenBatch``es of ``micro_batch_size`` rows
    each (views, no copy); ``ValueError`` unless B is a multiple of it."""
    if tokens_BT.shape[0] % micro_batch_size:
        raise ValueError(f"batch size {tokens_BT.shape[0]} is not a multiple of micro_batch_size {micro_batch_size}")
    return [TokenBatch(t) for t in tokens_BT.split(micro_batch_size)]


def _train_step(head: Head, loss_fn: LossFn, counts: list[torch.Tensor], data_iterator, model):
    batch = to_device(next(data_iterator), device())
    output = _run(batch, model)

    def loss(out):
        loss_sum, count, metrics = loss_fn(*head(out, batch), batch)
        reported = {k: v.detach().float() for k, v in metrics.items()}
        reported["loss_sum"], reported["count"] = loss_sum.detach().float(), count.detach().float()
        counts.append(count.detach().to(torch.int))  # the schedule's num_tokens, summed over the pieces
        return loss_sum, count.to(torch.int), reported

    return output, loss


def forward_backward(ddp_model, micro_batches: Sequence[Any], head: Head, loss_fn: LossFn,
                     stop: StopCheck | None = None) -> dict[str, float]:
    """Accumulate gradients of ``loss_fn`` over ``micro_batches`` (objects with ``tokens_BT``, all the
    same shape). Returns each metric summed over micro-batches and data-parallel ranks (the max for
    names ending in ``_max``), on every rank. ``stop``: asked before each piece (module docstring); True
    raises ``PassStopped`` with the gradients unfinished (the next pass zeroes them), the optimizer untouched."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    b = micro_batches[0].tokens_BT.shape[0]
    ddp_model.zero_grad_buffer()
    config = get_model_config(ddp_model)
    parts = pieces(len(micro_batches), ps.get_pipeline_model_parallel_world_size()) if stop else [slice(None)]
    # Each schedule call would finalise its own piece's gradients: once, after the last piece, instead
    # (one piece: the schedule does it).
    finalize = config.finalize_model_grads_func
    if len(parts) > 1:
        config.finalize_model_grads_func = None
    store, counts = [], []
    try:
        for i, part in enumerate(parts):
            _check(stop, "a training pass", parts, i, len(micro_batches))
            if not micro_batches[part]:
                continue
            store += get_forward_backward_func()(
                forward_step_func=partial(_train_step, head, loss_fn, counts),
                data_iterator=iter(micro_batches[part]), model=[ddp_model],
                num_microbatches=len(micro_batches[part]),
                seq_length=_physical_width(micro_batches, ddp_model), micro_batch_size=b, forward_only=False,
            )
    finally:
        config.finalize_model_grads_func = finalize
    if finalize is not None and len(parts) > 1:  # as the schedule does after its last micro-batch (schedules.py)
        tokens = torch.stack(counts).sum().to(torch.int) if counts else torch.zeros((), dtype=torch.int)
        finalize([ddp_model], tokens.to(device()) if config.calculate_per_token_loss else None)
    keys = sorted(store[0]) if store else []
    if ps.get_pipeline_model_parallel_world_size() > 1:  # only the last stage holds the metrics
        box = [keys]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        keys = box[0]
    # Metrics add over micro-batches and data-parallel ranks, except "*_max" ones, which take the max.
    maxes = [k for k in keys if k.endswith("_max")]
    keys = [k for k in keys if not k.endswith("_max")]
    dev = device()
    sums = torch.stack([sum(s[k] for s in store) for k in keys]) if store and keys else torch.zeros(len(keys))
    top = torch.stack([max(s[k] for s in store) for k in maxes]) if store and maxes else torch.zeros(len(maxes))
    sums, top = sums.to(dev), top.to(dev)  # NCCL reduces device tensors only
    out = {}
    for values, op in ((sums, dist.ReduceOp.SUM), (top, dist.ReduceOp.MAX)):
        if values.numel():
            _pipeline_broadcast(values)
            dist.all_reduce(values, op=op, group=ps.get_data_parallel_group())
    out.update(zip(keys, sums.tolist(), strict=True))
    out.update(zip(maxes, top.tolist(), strict=True))
    return out
