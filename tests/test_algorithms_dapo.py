"""REINFORCE++-baseline, Dr. GRPO's constant normaliser and DAPO's pieces against hand-computed values
(arithmetic in the comments)."""

import math

import pytest
import torch

from megareason.algorithms.advantages import gae_reference, reinforce_pp_baseline_advantages, whiten
from megareason.algorithms.dapo import dynamic_sampling, mask_truncated, overlong_penalty, select_informative
from megareason.algorithms.losses import aggregate
from megareason.algorithms.raro import role_advantage_scale

T = torch.tensor
NAN, INF = float("nan"), float("inf")
NORM = "seq-mean-token-sum-norm"


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual).double(), torch.as_tensor(expected).double(), atol=atol,
                               rtol=1e-6)


# --- REINFORCE++-baseline ------------------------------------------------------------------------------


def test_reinforce_pp_baseline_by_hand():
    # Groups 0 = rows 0, 1 (rewards 1, 0: mean 0.5) and 1 = rows 2, 3 (rewards 1, 1: mean 1).
    # Centred: +0.5, -0.5, 0, 0. KL-in-reward -0.5 * kl per response token (k1 may be negative: row 2);
    # NaN/inf sit on mask-0 entries and must not leak.
    reward_B, group_B = T([1.0, 0, 1, 1]), T([0, 0, 1, 1])
    mask_BT = T([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    kl_BT = T([[0.2, 0.4, NAN], [0.0, 0, 0], [-0.4, INF, NAN], [0.0, 0, 0]])
    adv_BT = reinforce_pp_baseline_advantages(reward_B, group_B, mask_BT, kl_BT=kl_BT, kl_coef=0.5)
    # Token rewards: row 0 [-0.1, -0.2], row 1 [0, 0, 0], row 2 [+0.2], row 3 [0, 0];
    # reward-to-go (gamma 1) + centred outcome:
    #   row 0: 0.5 + (-0.1 - 0.2) = 0.2, 0.5 - 0.2 = 0.3;  row 1: -0.5 x 3;  row 2: 0 + 0.2 = 0.2;  row 3: 0, 0.
    # Whitening over the 8 tokens: sum 0.2 + 0.3 - 1.5 + 0.2 + 0 = -0.8, mean -0.1;
    #   centred 0.3, 0.4, -0.4 x 3, 0.3, 0.1, 0.1; squares sum 0.09 + 0.16 + 0.48 + 0.09 + 0.02 = 0.84;
    #   unbiased var 0.84 / 7 = 0.12: 0.3 / sqrt(0.12) = sqrt(3) / 2, 0.4 / sqrt(0.12) = 2 / sqrt(3),
    #   0.1 / sqrt(0.12) = 1 / sqrt(12).
    a, b, c = math.sqrt(3) / 2, 2 / math.sqrt(3), 1 / math.sqrt(12)
    close(adv_BT, [[a, b, 0], [-b, -b, -b], [a, 0, 0], [c, c, 0]], atol=1e-5)


def test_reinforce_pp_baseline_without_kl_is_whitened_group_centring():
    # No KL: rewards 3, 1 (mean 2) and 5 alone (a group of one: 0). Centred +1, -1, 0 on 2 + 1 + 2 tokens:
    # values 1, 1, -1, 0, 0; mean 0.2; centred 0.8, 0.8, -1.2, -0.2, -0.2; squares sum 0.64 * 2 + 1.44 + 0.08
    # = 2.8; var 2.8 / 4 = 0.7.
    mask_BT = T([[1, 1, 0], [0, 1, 0], [1, 0, 1]])
    adv_BT = reinforce_pp_baseline_advantages(T([3.0, 1, 5]), T([4, 4, 9]), mask_BT)
    s = math.sqrt(0.7)
    close(adv_BT, [[0.8 / s, 0.8 / s, 0], [0, -1.2 / s, 0], [-0.2 / s, 0, -0.2 / s]], atol=1e-5)
    kl_ignored = reinforce_pp_baseline_advantages(T([3.0, 1, 5]), T([4, 4, 9]), mask_BT, kl_BT=torch.ones(3, 3))
    close(kl_ignored, adv_BT)  # kl_coef 0: no penalty


def test_reinforce_pp_baseline_matches_gae_reference():
    # The reward-to-go with gamma 1 is GAE with V = 0, gamma = lambda = 1 (holes in the mask skipped),
    # the centred outcome on each row's last response token.
    g = torch.Generator().manual_seed(0)
    B, L = 6, 7
    mask_BT = (torch.rand(B, L, generator=g) > 0.3).float()
    mask_BT[4] = 0  # a row without response tokens
    reward_B, group_B = torch.randn(B, generator=g), T([0, 1, 0, 1, 2, 2])
    kl_BT = torch.randn(B, L, generator=g)
    adv_BT = reinforce_pp_baseline_advantages(reward_B, group_B, mask_BT, kl_BT=kl_BT, kl_coef=0.3)

    reward_BT = torch.where(mask_BT.bool(), -0.3 * kl_BT, torch.zeros(()))
    for b in range(B):
        same = [i for i in range(B) if group_B[i] == group_B[b]]
        centred = float(reward_B[b]) - sum(float(reward_B[i]) for i in same) / len(same)
        steps = [t for t in range(L) if mask_BT[b, t]]
        if steps:
            reward_BT[b, steps[-1]] += centred
    ref_BT, _ = gae_reference(reward_BT, torch.zeros(B, L), mask_BT, gamma=1.0, lam=1.0)
    close(adv_BT, whiten(ref_BT, mask_BT), atol=1e-5)


# --- Dr. GRPO's constant normaliser: aggregate "seq-mean-token-sum-norm" ---------------------------------
LOSS = T([[1.0, 2, NAN, 0], [4, 5, 6, INF], [7, 8, 9, 10]])
MASK = T([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])


def test_seq_mean_token_sum_norm_by_hand_and_split():
    # Row sums 1 + 2 = 3 and 4 + 5 + 6 = 15, norm_length 4: numerator (3 + 15) / 4 = 4.5 over 2 non-empty
    # rows (row 2 is empty) = 2.25; seq-mean-token-sum would be 18 / 2 = 9 = 4 * 2.25.
    num, den = aggregate(LOSS, MASK, NORM, norm_length=4)
    close(num, 4.5)
    assert den.dtype == torch.int64 and int(den) == 2
    # Micro-batches [row 0] and [rows 1, 2]: (3 / 4, 1) and (15 / 4, 1); summed: 4.5 / 2, the full batch.
    parts = [aggregate(LOSS[s], MASK[s], NORM, norm_length=4) for s in (slice(0, 1), slice(1, 3))]
    close([float(n) for n, _ in parts], [0.75, 3.75])
    assert [int(d) for _, d in parts] == [1, 1]
    close(sum(n for n, _ in parts) / sum(d for _, d in parts), 2.25)
    # The constant, not the padded width, divides: the same rows padded to 4 or cut to 3 columns agree.
    close(aggregate(LOSS[:, :3], MASK[:, :3], NORM, norm_length=4)[0], 4.5)


def test_seq_mean_token_sum_norm_needs_a_length():
    for bad in (None, 0, -3):
        with pytest.raises(ValueError, match="needs norm_length > 0"):
            aggregate(LOSS, MASK, NORM, norm_length=bad)
    # The other modes ignore it: token-mean is (3 + 15) over 5 tokens still.
    num, den = aggregate(LOSS, MASK, "token-mean", norm_length=4)
    assert (float(num), int(den)) == (18.0, 5)


def test_seq_mean_token_sum_norm_gradient_matches_loop():
    # Autograd through two uneven micro-batches (numerators backward, then / summed denominators, as
    # megatron-core does) vs the hand-derived loop: J = sum_b sum_t m x^2 w_t / (L R), so
    # dJ/dx_bt = m * 2 x w_t / (L R), with R the non-empty rows.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, generator=g, requires_grad=True)
    w_T = T([1.0, -2, 0.5, 3])
    mask = T([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 1], [0, 1, 0, 0], [1, 1, 1, 1]])
    length = 6
    parts = [aggregate(x[s].square() * w_T, mask[s], NORM, norm_length=length) for s in (slice(0, 2), slice(2, 5))]
    for n, _ in parts:
        n.backward()
    den = int(sum(d for _, d in parts))
    value = float(sum(n.detach() for n, _ in parts)) / den

    rows = sum(1 for b in range(5) if any(mask[b].tolist()))
    ref_value, ref_grad = 0.0, torch.zeros(5, 4)
    for b in range(5):
        for t in range(4):
            if mask[b, t]:
                xv = float(x.detach()[b, t])
                ref_value += xv * xv * float(w_T[t]) / (length * rows)
                ref_grad[b, t] = 2 * xv * float(w_T[t]) / (length * rows)
    assert den == rows == 4
    close(value, ref_value)
    close(x.grad / den, ref_grad)


def test_raro_role_weights_with_the_constant_normaliser():
    # Policy row 0 (loss 2 + 2), critic rows 1 (3) and 2 (1 + 1 + 1); norm_length 3.
    # J_pol = 4 / 3 / 1 = 4/3, J_crit = (3 + 3) / 3 / 2 = 1; lambdas 1/4, 3/4: target 1/3 + 3/4 = 13/12.
    # Weights (3 scored rows): w_pol = 1/4 * 3 / 1 = 0.75, w_crit = 3/4 * 3 / 2 = 1.125; aggregated:
    # (0.75 * 4 + 1.125 * 3 + 1.125 * 3) / 3 = 3.25 over 3 rows = 13/12.
    loss_BT, mask_BT = T([[2.0, 2, 9], [3, 9, 9], [1, 1, 1]]), T([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    w_B = role_advantage_scale(T([False, True, True]), mask_BT, NORM, lambda_pol=0.25, lambda_crit=0.75)
    close(w_B, [0.75, 1.125, 1.125])
    num, den = aggregate(loss_BT * w_B[:, None], mask_BT, NORM, norm_length=3)
    close(num, 3.25)
    close(num / den, 13 / 12)


# --- DAPO ----------------------------------------------------------------------------------------------


def test_overlong_penalty_at_the_buffer_edges():
    # max_tokens 10, buffer 4: free up to 6 tokens, then -(L - 6) / 4: 7 -> -0.25, 8 (middle) -> -0.5,
    # 10 (the edge) -> -1, 12 (past it) -> -1.
    lengths = T([0, 6, 7, 8, 10, 12])
    close(overlong_penalty(lengths, max_tokens=10, buffer=4), [0, 0, -0.25, -0.5, -1, -1])
    close(overlong_penalty(lengths, max_tokens=10, buffer=4, penalty_factor=0.5),
          [0, 0, -0.125, -0.25, -0.5, -0.5])
    # The whole budget as buffer: -L / 10.
    close(overlong_penalty(T([0, 5, 10]), max_tokens=10, buffer=10), [0, -0.5, -1])
    for buffer in (0, 11):
        with pytest.raises(ValueError, match="0 < buffer <= max_tokens"):
            overlong_penalty(lengths, max_tokens=10, buffer=buffer)
    with pytest.raises(ValueError, match="penalty_factor"):
        overlong_penalty(lengths, max_tokens=10, buffer=4, penalty_factor=-1)


def test_select_informative_drops_all_equal_groups():
    # Group 7: 1, 1 (all equal: dropped); 3: 0, 1 (kept, rows not contiguous); 5: 0, 0, 0 (dropped);
    # 2: seven rewards of 0.7 (dropped: exactly equal); 9: one sample (dropped); 4: 0.2, 0.3 (kept).
    group_B = T([7, 3, 7, 5, 5, 3, 5, 2, 2, 2, 2, 2, 2, 2, 9, 4, 4])
    reward_B = T([1.0, 0, 1, 0, 0, 1, 0, *[0.7] * 7, 0.5, 0.2, 0.3])
    keep_groups, keep_B = select_informative(reward_B, group_B)
    assert keep_groups.tolist() == [3, 4]
    assert keep_B.tolist() == [False, True, False, False, False, True, False, *[False] * 7, False, True, True]
    with pytest.raises(ValueError, match="integer group ids"):
        select_informative(reward_B, group_B.float())


def _draws(*batches):
    it = iter(batches)
    return lambda: next(it)


DRAWS = (
    ("d1", T([0.0, 0, 1, 1]), T([0, 0, 1, 1])),  # nothing informative
    ("d2", T([0.0, 1, 1, 1]), T([0, 0, 1, 1])),  # group 0
    ("d3", T([1.0, 0, 0, 1, 1, 1, 0.5, 0]), T([0, 0, 1, 1, 2, 2, 3, 3])),  # groups 0, 1, 3
)


def test_dynamic_sampling_refills_until_enough_groups():
    # want 3: d1 gives 0, d2 gives 1, d3 gives 3 of which the 2 smallest ids (0, 1) are needed; group 3 dropped.
    out = dynamic_sampling(_draws(*DRAWS), want=3, max_tries=5)
    assert (out.groups, out.drawn_groups, out.tries, out.enough) == (3, 2 + 2 + 4, 3, True)
    assert [name for name, _ in out.batches] == ["d1", "d2", "d3"]
    assert [keep.tolist() for _, keep in out.batches] == [
        [False] * 4, [True, True, False, False], [True, True, True, True, False, False, False, False]]
    # Stops as soon as it has enough: want 1 is met by d2.
    out = dynamic_sampling(_draws(*DRAWS), want=1, max_tries=5)
    assert (out.groups, out.tries, out.enough) == (1, 2, True)


def test_dynamic_sampling_gives_up_after_max_tries():
    out = dynamic_sampling(_draws(*DRAWS), want=3, max_tries=2)
    assert (out.groups, out.drawn_groups, out.tries, out.enough) == (1, 4, 2, False)
    with pytest.raises(ValueError, match="want >= 1 and max_tries >= 1"):
        dynamic_sampling(_draws(*DRAWS), want=3, max_tries=0)


def test_mask_truncated_zeroes_truncated_rows():
    mask_BT = T([[1.0, 1, 0], [0, 1, 1], [1, 0, 1]])
    out = mask_truncated(mask_BT, T([False, True, False]))
    assert out.dtype == mask_BT.dtype
    close(out, [[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    assert mask_truncated(mask_BT.bool(), T([True, False, False])).tolist() == [
        [False, False, False], [False, True, True], [True, False, True]]
    with pytest.raises(ValueError, match="bool truncated_B"):
        mask_truncated(mask_BT, T([0, 1, 0]))
