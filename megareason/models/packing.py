"""Dynamic micro-batching by token count: sequences of any lengths packed into equal-width rows.

``plan_micro_batches`` assigns sequences to micro-batches of at most ``max_tokens`` tokens (first-fit
decreasing), ``pack`` lays each micro-batch out as one packed row (``schedule.TokenBatch`` with
``cu_seqlens``) padded to a common width, since a pipeline schedule sends fixed-size activations, and
``unpack_rows`` turns a packed [1, T] output back into one padded row per sequence, so per-sequence
losses (``algorithms.aggregate`` seq-mean modes) see one row per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megareason.models.schedule import TokenBatch


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


def pack(seqs: Sequence[torch.Tensor], plan: list[list[int]], pad_id: int = 0,
         width: int | None = None) -> list[PackedMicroBatch]:
    """One packed row per micro-batch of ``plan``, all padded to ``width`` (default: the longest)."""
    totals = [sum(len(seqs[i]) for i in b) for b in plan]
    width = width or max(totals)
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
