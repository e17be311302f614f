"""Dynamic micro-batching by token count: sequences of any lengths packed into equal-width rows.

``plan_micro_batches`` assigns sequences to micro-batches of at most ``max_tokens`` tokens (first-fit
decreasing), ``pack`` lays each micro-batch out as one packed row (``schedule.TokenBatch`` with
``cu_seqlens``) padded to a common width, since a pipeline schedule sends fixed-size activations, and
``unpack_rows`` turns a packed [1, T] output back into one padded row per sequence, so per-sequence
losses (``algorithms.aggregate`` seq-mean modes) see one row per sequence.

Prefix sharing (``plan_shared`` + ``pack_shared``): the samples of one GRPO group start with the same
prompt. The model then runs on a shorter *physical* row where each prompt appears once, followed by its
responses, each attending to that prompt and to itself (``SharedPrefixes.attention_mask``, positions
continuing after the prompt); its outputs are gathered back into the usual packed (*virtual*) row, so
heads, losses and unpacking see exactly what they would without sharing. A causal model's outputs at a
response token depend only on the prompt and the response so far, so this is exact, gradients included
(the shared prompt's activations sum the gradients of every response that reads them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megareason.models.schedule import TokenBatch


@dataclass
class SharedPrefixes:
    """The physical row of a prefix-shared micro-batch (see the module docstring)."""

    tokens_1P: torch.Tensor  # int64 [1, P]: each unit's prompt once, then its responses, then padding
    positions_1P: torch.Tensor  # int64 [1, P]: a response's positions continue after its prompt
    segment_P: torch.Tensor  # int64 [P]: one id per prompt, per response and per padding token
    reads_P: torch.Tensor  # int64 [P]: the segment a token may read besides its own (its prompt's)
    gather_W: torch.Tensor  # int64 [W]: the physical position behind each virtual position

    def attention_mask(self) -> torch.Tensor:
        """[1, 1, P, P], True = not attended: causal, within the own segment or the prompt read."""
        seg, reads = self.segment_P, self.reads_P
        p = seg.shape[0]
        causal = torch.ones(p, p, dtype=torch.bool, device=seg.device).tril()
        visible = (seg[None, :] == seg[:, None]) | (seg[None, :] == reads[:, None])
        return ~(causal & visible)[None, None]


@dataclass
class PackedMicroBatch(TokenBatch):
    """A packed row plus where its sequences came from: ``index[i]`` is the position, in the caller's
    list, of the sequence that starts at ``cu_seqlens[i]``."""

    index: list[int] | None = None


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Sequence indices per micro-batch; each micro-batch holds at most ``max_tokens`` tokens.

    First-fit decreasing: longest sequences first, each into the first micro-batch with room. Within a
    micro-batch, indices keep the caller's order.
    """
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sequence {i} has {n} tokens, more than the micro-batch budget of {max_tokens} "
                         f"({len(too_long)} such sequences); raise the budget or shorten the sequences")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def split_plan(plan: list[list], count: int, size) -> list[list]:
    """``plan`` cut into ``count`` micro-batches: the largest one that holds two or more items (``size(item)``
    tokens each) is halved until there are ``count``. A micro-batch of ``plan_shared`` whose single item is a
    unit of several sequences is cut inside that unit (its parts read the prefix once each).

    Every rank of an expert-parallel group must run the same number of micro-batches: each one's MoE layers
    exchange tokens with the other ranks (all-to-all), so a rank with fewer would leave the others waiting
    forever. verl's dynamic batching makes the same agreement (the maximum over the data-parallel group)."""
    plan = [list(b) for b in plan]
    shared = bool(plan) and isinstance(plan[0][0], list)
    while len(plan) < count:
        cuts = [k for k, b in enumerate(plan) if len(b) > 1 or (shared and len(b[0]) > 1)]
        if not cuts:
            raise ValueError(f"{sum(len(b) for b in plan)} sequences cannot fill the {count} micro-batches that "
                             f"another rank of the expert-parallel group runs; raise trainer.micro_batch_tokens")
        k = max(cuts, key=lambda k: (sum(size(x) for x in plan[k]), -k))
        b = plan.pop(k)
        if len(b) > 1:
            plan += [b[: len(b) // 2], b[len(b) // 2 :]]
        else:
            unit = b[0]
            plan += [[unit[: len(unit) // 2]], [unit[len(unit) // 2 :]]]
    return plan


def pack(seqs: Sequence[torch.Tensor], plan: list[list[int]], pad_id: int = 0,
         width: int | None = None, multiple: int = 1) -> list[PackedMicroBatch]:
    """One packed row per micro-batch of ``plan``, all padded to ``width`` (default: the longest),
    rounded up to a ``multiple`` (sequence parallelism splits the row over the TP ranks)."""
    totals = [sum(len(seqs[i]) for i in b) for b in plan]
    width = _round_up(width or max(totals), multiple)
    if max(totals) > width:
        raise ValueError(f"a micro-batch of {max(totals)} tokens does not fit in width {width}")
    out = []
    for b in plan:
        lengths = [len(seqs[i]) for i in b]
        row = torch.full((1, width), pad_id, dtype=torch.long)
        row[0, : sum(lengths)] = torch.cat([seqs[i] for i in b])
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        out.append(PackedMicroBatch(tokens_BT=row, cu_seqlens=cu, index=list(b)))
    return out


def plan_shared(lengths: Sequence[int], units: Sequence[Sequence[int]], max_tokens: int,
                prefix_lens: Sequence[int] | None = None) -> list[list[list[int]]]:
    """Micro-batches of units (lists of sequence indices that share a prefix), at most ``max_tokens``
    tokens each. First-fit decreasing over units; a unit too large for one micro-batch is cut, in order,
    into parts that fit (each part reads the prefix once).

    The tokens counted: without ``prefix_lens``, unshared ones, so the virtual row is as wide as without
    sharing (what a head that runs at every position needs). With ``prefix_lens`` (each sequence's
    shared prefix), the physical row's: a part's prefix once plus its sequences' remainders, what the
    model's layers run on; for heads that run only at response positions (``keep_W``) that bounds the
    micro-batch's memory as ``max_tokens`` does without sharing, and keeps a GRPO group or a critic's
    judgements of one prompt whole where the unshared count would cut them."""
    plan_micro_batches(lengths, max_tokens)  # the same error for a sequence that fits nowhere

    def cost(i: int, first: bool) -> int:
        return lengths[i] if first or prefix_lens is None else lengths[i] - prefix_lens[i]

    parts: list[list[int]] = []
    sizes: list[int] = []
    for unit in units:
        part, size = [], 0
        for i in unit:
            if part and size + cost(i, False) > max_tokens:
                parts.append(part)
                sizes.append(size)
                part, size = [], 0
            size += cost(i, not part)
            part.append(i)
        parts.append(part)
        sizes.append(size)
    bins: list[list[list[int]]] = []
    room: list[int] = []
    for k in sorted(range(len(parts)), key=lambda k: (-sizes[k], parts[k][0])):
        for b, free in enumerate(room):
            if sizes[k] <= free:
                bins[b].append(parts[k])
                room[b] -= sizes[k]
                break
        else:
            bins.append([parts[k]])
            room.append(max_tokens - sizes[k])
    return [sorted(b) for b in bins]


def pack_shared(seqs: Sequence[torch.Tensor], prefix_lens: Sequence[int], plan: list[list[list[int]]],
                pad_id: int = 0, multiple: int = 1) -> list[PackedMicroBatch]:
    """Like ``pack`` (the virtual rows, sequences in unit order) plus each micro-batch's physical row,
    whose width is rounded up to a ``multiple``. Every sequence of a unit must start with the same
    ``prefix_lens[i]`` tokens (checked)."""
    flat = [[i for unit in b for i in unit] for b in plan]
    virtual = pack(seqs, flat, pad_id)
    physical = [sum(prefix_lens[u[0]] + sum(len(seqs[i]) - prefix_lens[i] for i in u) for u in b) for b in plan]
    width = _round_up(max(physical), multiple)
    for mb, b, total in zip(virtual, plan, physical, strict=True):
        tokens = torch.full((width,), pad_id, dtype=torch.long)
        positions = torch.zeros(width, dtype=torch.long)
        segment = torch.zeros(width, dtype=torch.long)
        reads = torch.zeros(width, dtype=torch.long)
        gather = torch.full((mb.tokens_BT.shape[1],), width - 1, dtype=torch.long)
        at, seg, virtual_at = 0, 0, 0
        for unit in b:
            p = prefix_lens[unit[0]]
            prefix = seqs[unit[0]][:p]
            if any(prefix_lens[i] != p or not torch.equal(seqs[i][:p], prefix) for i in unit):
                raise ValueError(f"sequences {unit} do not share a prefix of {p} tokens")
            tokens[at : at + p], positions[at : at + p] = prefix, torch.arange(p)
            segment[at : at + p], reads[at : at + p] = seg, seg
            prompt_at, prompt_seg = at, seg
            at, seg = at + p, seg + 1
            for i in unit:
                r = len(seqs[i]) - p
                tokens[at : at + r], positions[at : at + r] = seqs[i][p:], torch.arange(p, p + r)
                segment[at : at + r], reads[at : at + r] = seg, prompt_seg
                gather[virtual_at : virtual_at + p] = torch.arange(prompt_at, prompt_at + p)
                gather[virtual_at + p : virtual_at + p + r] = torch.arange(at, at + r)
                at, seg, virtual_at = at + r, seg + 1, virtual_at + p + r
        pad = torch.arange(width - total)
        segment[total:], reads[total:] = seg + pad, seg + pad  # padding reads nothing else
        mb.shared = SharedPrefixes(tokens[None], positions[None], segment, reads, gather)
    return virtual


def unpack_rows(x_1T: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed row's per-token values [1, T] -> (values [n, L], mask [n, L]), one row per sequence,
    right-padded with zeros to the longest (L); differentiable."""
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    longest = max(lengths)
    rows = [torch.nn.functional.pad(x_1T[0, a:b], (0, longest - (b - a))) for a, b in zip(bounds[:-1], bounds[1:],
                                                                                          strict=True)]
    mask = (torch.arange(longest)[None] < torch.tensor(lengths)[:, None]).to(x_1T.device, x_1T.dtype)
    return torch.stack(rows), mask
