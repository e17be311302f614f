"""Megatron shards -> HF-named tensors in buckets -> the running vLLM engine, in place.

``stream_hf_tensors`` runs on every rank of one model-parallel group. For each HF tensor in layer order:
the pipeline stage that owns it gathers the tensor-parallel pieces onto its TP rank 0, converts them to
the HF layout with the same rules as the conversion tools (``weight_map``), and broadcasts the result
over the TP-rank-0 pipeline group; the group's first rank (TP 0, PP 0), which owns the vLLM engine,
receives the tensors one by one and ``VLLMEngine.update_weights`` packs them into a shared-memory bucket
of a fixed size. Peak extra memory on that rank is that bucket plus the tensor being assembled; no rank
ever holds the whole model twice.

``gather_hf_naive`` is the obvious reference (every shard to one rank, then ``weight_map.to_hf``).
Each data-parallel replica runs its own stream into its own engine: generation replicas are fed by DP
ranks, and the engine's TP is independent of training's (it always receives whole HF tensors).
A LoRA model is read through ``lora.merged_state``: each adapted layer's shard is merged
(``W + scale·BA``) on its own rank just before it is gathered, so vLLM receives plain merged weights.

A failure on one rank (a load vLLM refuses, memory that runs out) must not leave its peers waiting in the
next gather or broadcast, which they would until NCCL's watchdog ends the process: ``SyncGuard`` has every
rank agree, before each tensor's collectives and once after the last load, whether any rank failed (one
all-reduce of a flag over the world group), and then every rank raises the same ``WeightSyncError`` naming
the failed rank and its error (``guarded_sync``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from megareason.models import weight_map
from megareason.models.arch import ModelArch
from megareason.models.lora import merged_state
from megareason.models.parallel import current_layout
from megareason.utils import RunError

T = TypeVar("T")


class WeightSyncError(RunError):
    """A weight sync failed on some rank; every rank of the sync raises it, with the same message."""


@dataclass
class SyncGuard:
    """Whether this rank failed during a weight sync, and the agreement of all ranks about it. Every rank of
    the world group must make the same ``check`` calls: ``stream_hf_tensors`` makes one before each
    tensor's collectives (two with pipeline parallelism), ``guarded_sync`` one after the loads."""

    error: str | None = None  # this rank's first failure, as the other ranks will read it
    exc: BaseException | None = None
    streams: list[Iterator] = field(default_factory=list)  # the streams this rank reads (``guarded_sync``)

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error, self.exc = f"{type(error).__name__}: {error}", error

    def attempt(self, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None after recording its failure (reported at the next ``check``)."""
        try:
            return fn()
        except Exception as e:
            self.fail(e)
            return None

    def check(self) -> None:
        """One all-reduce of a failure flag over the world; raises ``WeightSyncError`` on every rank when
        any rank failed, naming the lowest failed rank and its error."""
        if not dist.is_initialized():  # one process: nothing to agree with
            errors: list[str | None] = [self.error]
        else:
            on_gpu = "nccl" in dist.get_backend()
            device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
            flag = torch.tensor([0 if self.error is None else 1], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if not flag.item():
                return
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, self.error)
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if not failed:
            return
        rank, error = failed[0]
        others = f" (and on rank{'s' if len(failed) > 2 else ''} {', '.join(str(r) for r, _ in failed[1:])})" \
            if len(failed) > 1 else ""
        raise WeightSyncError(f"weight sync failed on rank {rank}{others}: {error}") from self.exc


def guarded_sync(guard: SyncGuard, sync: Callable[[], T]) -> T:
    """``sync()`` (a rank's part of a weight sync: iterate ``stream_hf_tensors(..., guard=guard)`` and load
    what it yields), such that a failure on any rank raises ``WeightSyncError`` on every rank instead of
    leaving its peers in a collective. After a failure here (a load, waking the engine) the rest of the
    stream is read without loading: its next ``check`` stops every rank at the same point."""
    try:
        result = sync()
    except WeightSyncError:
        raise
    except Exception as e:
        guard.fail(e)
        for stream in guard.streams:
            for _ in stream:
                pass
        result = None
    guard.check()  # the loads after the stream's last tensor
    return result


@dataclass
class _Item:
    rule: weight_map.Rule
    layer: int | None  # global layer index
    stage: int  # owning pipeline stage
    local: int | None  # layer index on that stage
    expert: int = 0  # a per-expert rule's global expert number


def _items(arch: ModelArch, pp: int) -> list[_Item]:
    per_stage = arch.num_layers // pp
    items = []
    rules = weight_map.rules_for(arch, pp)
    for r in rules:
        if r.where == "first":
            items.append(_Item(r, None, 0, None))
    for i in range(arch.num_layers):
        items += [_Item(r, i, i // per_stage, i % per_stage, e) for r in rules if r.where == "layer"
                  for e in (range(arch.num_experts) if r.per_expert else [0])]
    for r in rules:
        if r.where == "last" and r is not weight_map.TIED_OUTPUT:
            items.append(_Item(r, None, pp - 1, None))
    return items


def is_consumer() -> bool:
    """Whether this rank receives the buckets (TP rank 0 of the first pipeline stage)."""
    layout = current_layout()
    return layout.tp_rank == 0 and layout.pp_rank == 0


def stream_hf_tensors(model, arch: ModelArch, every_rank: bool = False, dtype: torch.dtype | None = None,
                      guard: SyncGuard | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) pairs on the consumer rank, in layer order; every other rank of the
    group must also iterate this generator to the end (it takes part in the collectives and yields
    nothing). At TP=1 a tensor that needs no re-layout is a view of the parameter, not a copy.

    ``every_rank``: every rank of the group yields every tensor (the TP pieces are all-gathered and each
    stage broadcasts to every rank of its pipeline group): what colocated engines need, whose vLLM
    ranks each take their own slice of the whole tensor (``rollout.colocated``). ``dtype``: each shard is
    cast before it is gathered (the rollout's dtype: bf16 halves an fp32 trainer's traffic).
    ``guard``: every rank of the world iterates the stream; each tensor's local work is done before a
    ``SyncGuard.check``, so a rank that failed (here or in its load) stops all ranks there (a fresh guard
    when None)."""
    from megatron.core import parallel_state as ps

    guard = guard or SyncGuard()
    layout = current_layout()
    shapes = weight_map.hf_shapes(arch)
    params = merged_state(model)
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    tp_src = ps.get_tensor_model_parallel_src_rank()
    ep_group = ps.get_expert_model_parallel_group() if layout.ep > 1 else None
    receives = every_rank or layout.tp_rank == 0  # holds each whole tensor of its stage
    consumer = every_rank or is_consumer()
    for item in _items(arch, layout.pp):
        names = [n.format(i=item.layer, e=item.expert) for n in item.rule.hf]
        tensors: list[torch.Tensor] | None = None
        stage = layout.pp_rank == item.stage
        whole = item.rule.split == "replicated" or layout.tp == 1
        buffers = not whole and (every_rank or layout.tp_rank == 0)  # receives the TP pieces
        # This rank's shard and the gather's buffers before the check: nothing that can fail locally runs
        # between it and the collectives.
        prepared = guard.attempt(lambda item=item, buffers=buffers: _prepare(params, item, arch, layout, dtype,
                                                                             buffers)) if stage else None
        guard.check()
        if stage:
            local, parts = prepared
            if item.rule.per_expert and layout.ep > 1:
                owner, _ = weight_map.expert_owner(arch, item.expert, layout.ep)
                dist.broadcast(local, src=dist.get_global_rank(ep_group, owner), group=ep_group)
            if whole:
                parts = [local] * layout.tp
            elif every_rank:
                dist.all_gather(parts, local, group=tp_group)
            else:
                dist.gather(local, parts, dst=tp_src, group=tp_group)
            if receives:
                tensors = guard.attempt(lambda parts=parts, item=item: weight_map.unshard(item.rule.split, parts, arch))
            del parts
        if layout.pp > 1:
            src = dist.get_global_rank(pp_group, item.stage)
            if receives and not stage:
                some = next(iter(params.values()))  # NCCL receives into device memory
                tensors = guard.attempt(lambda names=names, some=some: [
                    torch.empty(shapes[n], dtype=dtype or some.dtype, device=some.device) for n in names])
            elif receives and tensors is not None:
                tensors = guard.attempt(lambda tensors=tensors: [t.contiguous() for t in tensors])
            guard.check()  # every rank, also those outside the broadcast: the checks stay in step
            if receives:
                for t in tensors:
                    dist.broadcast(t, src=src, group=pp_group)
        if consumer and tensors is not None:
            yield from zip(names, tensors, strict=True)
    guard.check()  # the last tensor's re-layout


def _prepare(params: dict[str, torch.Tensor], item: _Item, arch: ModelArch, layout, dtype: torch.dtype | None,
             buffers: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """This rank's contiguous shard of ``item`` in ``dtype`` (under expert parallelism: its own expert's, or
    an empty buffer the expert's owner broadcasts into) and, if ``buffers``, the TP gather's receive
    buffers."""
    if item.rule.per_expert:
        owner, local_expert = weight_map.expert_owner(arch, item.expert, layout.ep)
        if layout.ep == 1 or layout.ep_rank == owner:
            local = params[item.rule.megatron.format(i=item.local, e=local_expert)].detach()
        else:  # every expert has the same shape
            mine = params[item.rule.megatron.format(i=item.local, e=0)].detach()
            local = torch.empty_like(mine, dtype=dtype or mine.dtype)
    else:
        local = params[item.rule.megatron.format(i=item.local)].detach()
    if dtype is not None:
        local = local.to(dtype)
    local = local.contiguous()
    return local, [torch.empty_like(local) for _ in range(layout.tp)] if buffers else None


def gather_hf_naive(model, arch: ModelArch) -> dict[str, torch.Tensor] | None:
    """Reference: every rank's whole shard to the consumer rank, merged with ``weight_map.to_hf`` (under
    expert parallelism from every rank: the experts live on other data-parallel ranks)."""
    from megatron.core import parallel_state as ps

    layout = current_layout()
    state = dict(merged_state(model))
    group = ps.get_model_parallel_group() if layout.ep == 1 else None
    shards = [None] * dist.get_world_size(group)
    key = (layout.tp_rank, layout.pp_rank) + ((layout.ep_rank,) if layout.ep > 1 else ())
    dist.all_gather_object(shards, (key, state), group=group)
    if not is_consumer():
        return None
    merged: dict = {}
    for k, v in shards:
        merged.setdefault(k, v)
    return weight_map.to_hf(merged, arch, layout.tp, layout.pp, ep=layout.ep)
