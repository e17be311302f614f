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
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megareason.models import weight_map
from megareason.models.arch import ModelArch
from megareason.models.lora import merged_state
from megareason.models.parallel import current_layout


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


def stream_hf_tensors(model, arch: ModelArch, every_rank: bool = False,
                      dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) pairs on the consumer rank, in layer order; every other rank of the
    group must also iterate this generator to the end (it takes part in the collectives and yields
    nothing). At TP=1 a tensor that needs no re-layout is a view of the parameter, not a copy.

    ``every_rank``: every rank of the group yields every tensor (the TP pieces are all-gathered and each
    stage broadcasts to every rank of its pipeline group): what colocated engines need, whose vLLM
    ranks each take their own slice of the whole tensor (``rollout.colocated``). ``dtype``: each shard is
    cast before it is gathered (the rollout's dtype: bf16 halves an fp32 trainer's traffic)."""
    from megatron.core import parallel_state as ps

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
        if layout.pp_rank == item.stage:
            if item.rule.per_expert:
                local = _expert_shard(params, item, arch, layout, ep_group)
            else:
                local = params[item.rule.megatron.format(i=item.local)].detach()
            if dtype is not None:
                local = local.to(dtype)
            if item.rule.split == "replicated" or layout.tp == 1:
                parts = [local] * layout.tp
            elif every_rank:
                parts = [torch.empty_like(local) for _ in range(layout.tp)]
                dist.all_gather(parts, local.contiguous(), group=tp_group)
            else:
                parts = [torch.empty_like(local) for _ in range(layout.tp)] if layout.tp_rank == 0 else None
                dist.gather(local.contiguous(), parts, dst=tp_src, group=tp_group)
            if receives:
                tensors = weight_map.unshard(item.rule.split, parts, arch)
            del parts
        if not receives:
            continue
        if layout.pp > 1:
            src = dist.get_global_rank(pp_group, item.stage)
            if tensors is None:
                some = next(iter(params.values()))  # NCCL receives into device memory
                tensors = [torch.empty(shapes[n], dtype=dtype or some.dtype, device=some.device) for n in names]
            tensors = [t.contiguous() for t in tensors]
            for t in tensors:
                dist.broadcast(t, src=src, group=pp_group)
        if consumer:
            yield from zip(names, tensors, strict=True)


def _expert_shard(params: dict[str, torch.Tensor], item: _Item, arch: ModelArch, layout, ep_group) -> torch.Tensor:
    """This rank's TP shard of one expert's tensor: its own, or under expert parallelism broadcast over the
    expert-parallel group from the rank that holds that expert (every rank of the group takes part)."""
    owner, local_expert = weight_map.expert_owner(arch, item.expert, layout.ep)
    if layout.ep == 1:
        return params[item.rule.megatron.format(i=item.local, e=local_expert)].detach()
    mine = params[item.rule.megatron.format(i=item.local, e=0)].detach()  # every expert has the same shape
    shard = params[item.rule.megatron.format(i=item.local, e=local_expert)].detach().contiguous() \
        if layout.ep_rank == owner else torch.empty_like(mine)
    dist.broadcast(shard, src=dist.get_global_rank(ep_group, owner), group=ep_group)
    return shard


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
