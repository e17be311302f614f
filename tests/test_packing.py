"""Dynamic micro-batching by token count, checked by hand."""

from __future__ import annotations

import pytest
import torch

from megareason.algorithms import aggregate
from megareason.models.packing import pack, plan_micro_batches, plan_shared, split_plan, unpack_rows


def test_first_fit_decreasing_by_hand():
    # lengths 5, 3, 7, 2, 4 with a budget of 10: 7 -> A, 5 -> B, 4 -> B (9), 3 -> A (10), 2 -> C
    assert plan_micro_batches([5, 3, 7, 2, 4], 10) == [[1, 2], [0, 4], [3]]


def test_every_sequence_once_and_within_budget():
    lengths = [int(x) for x in torch.randint(1, 50, (40,), generator=torch.Generator().manual_seed(0))]
    plan = plan_micro_batches(lengths, 64)
    assert sorted(i for b in plan for i in b) == list(range(40))
    assert all(sum(lengths[i] for i in b) <= 64 for b in plan)
    assert len(plan) <= -(-sum(lengths) // 64) * 2  # far from one micro-batch per sequence


def test_split_plan_halves_the_largest_micro_batch_until_the_expert_parallel_groups_count():
    # Ranks of an expert-parallel group must run as many micro-batches as the rank with the most. Budget 10:
    # first-fit decreasing gives [[0, 3], [1, 2]] (9 + 1, 6 + 3); asked for 3, the larger one (10 tokens)
    # is halved; asked for 4, then [1, 2], the only one left with two sequences.
    lengths = [9, 6, 3, 1]
    plan = plan_micro_batches(lengths, 10)
    assert plan == [[0, 3], [1, 2]]
    assert split_plan(plan, 2, lambda b: lengths[b]) == plan  # already there: unchanged
    assert split_plan(plan, 3, lambda b: lengths[b]) == [[1, 2], [0], [3]]
    assert split_plan(plan, 4, lambda b: lengths[b]) == [[0], [3], [1], [2]]
    with pytest.raises(ValueError, match="4 sequences cannot fill the 5 micro-batches.*trainer.micro_batch_tokens"):
        split_plan(plan, 5, lambda b: lengths[b])
    # Units that share a prompt (plan_shared): a micro-batch holding one unit is cut inside it.
    shared = plan_shared([4, 4, 4, 2], [[0, 1, 2], [3]], 16)
    assert shared == [[[0, 1, 2], [3]]]
    two = split_plan(shared, 2, lambda unit: sum([4, 4, 4, 2][b] for b in unit))
    assert two == [[[0, 1, 2]], [[3]]]
    assert split_plan(two, 3, lambda unit: sum([4, 4, 4, 2][b] for b in unit)) == [[[3]], [[0]], [[1, 2]]]


def test_too_long_sequence_is_named():
    with pytest.raises(ValueError, match="sequence 1 has 12 tokens, more than the micro-batch budget of 10"):
        plan_micro_batches([3, 12, 4], 10)


def test_pack_layout_and_unpack_round_trip():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6, 7, 8, 9])]
    batches = pack(seqs, [[0, 1], [2]], pad_id=0)
    assert [b.tokens_BT.tolist() for b in batches] == [[[1, 2, 3, 4, 5]], [[6, 7, 8, 9, 0]]]
    assert [b.cu_seqlens.tolist() for b in batches] == [[0, 3, 5], [0, 4]]
    assert [b.index for b in batches] == [[0, 1], [2]]
    rows, mask = unpack_rows(batches[0].tokens_BT.float(), batches[0].cu_seqlens)
    assert rows.tolist() == [[1, 2, 3], [4, 5, 0]] and mask.tolist() == [[1, 1, 1], [1, 1, 0]]


def test_seq_mean_loss_on_packed_equals_padded():
    """Per-sequence aggregation after unpack_rows equals the same loss on ordinary padded rows."""
    loss_1T = torch.tensor([[1.0, 2.0, 3.0, 10.0, 20.0, 0.0]], requires_grad=True)
    rows, mask = unpack_rows(loss_1T, torch.tensor([0, 3, 5]))
    num, den = aggregate(rows, mask, "seq-mean-token-mean")
    assert (num / den).item() == pytest.approx(((1 + 2 + 3) / 3 + (10 + 20) / 2) / 2)
    (num / den).backward()
    assert loss_1T.grad[0].tolist() == pytest.approx([1 / 6, 1 / 6, 1 / 6, 0.25, 0.25, 0.0])
