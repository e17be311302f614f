"""Train/generation mismatch correction (TIS, MIS, metrics) and the GSPO policy loss, against
hand-computed values (arithmetic in the comments) and slow per-row reference loops."""

import math

import pytest
import torch

from megareason.algorithms.gspo import gspo_policy_loss, sequence_log_ratio
from megareason.algorithms.losses import ppo_policy_loss
from megareason.algorithms.rollout_correction import (
    mis_weights,
    mismatch_metrics,
    rollout_correction,
    sequence_ratio,
    tis_weights,
    token_log_ratio,
)

T = torch.tensor
NAN, INF = float("nan"), float("inf")
LN = math.log
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual).double(), torch.as_tensor(expected).double(), atol=atol,
                               rtol=0)


# --- rollout correction --------------------------------------------------------
# Three sequences of 3, 2 and 3 tokens; token ratios rho = pi_train / pi_vllm:
#   row 0: [3, 0.5, 1]     row 1: [1.5, 4]     row 2: [0.25, 0.25, 1]
# Padding holds NaN and +-inf in both log-prob tensors.
MASK = T([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 0]])
ROLLOUT = T([[-1.0, -2.0, -0.5, NAN], [-0.3, -3.0, INF, -INF], [-2.0, -1.5, -1.0, NAN]])
RATIOS = [[3, 0.5, 1, 1], [1.5, 4, 1, 1], [0.25, 0.25, 1, 1]]
LOGP = torch.where(MASK.bool(), ROLLOUT + T(RATIOS).log(), T([[NAN, NAN, NAN, -INF], [0, 0, INF, NAN], [0, 0, 0, INF]]))


def test_token_log_ratio_is_zero_on_padding():
    lr = token_log_ratio(LOGP, ROLLOUT, MASK)
    close(lr, [[LN(3), LN(0.5), 0, 0], [LN(1.5), LN(4), 0, 0], [LN(0.25), LN(0.25), 0, 0]])


def test_tis_weights_cap_2():
    # min(rho, 2) on real tokens, 0 on padding: 3 -> 2 and 4 -> 2 are truncated (2 of 8 tokens)
    close(tis_weights(LOGP, ROLLOUT, MASK, cap=2.0), [[2, 0.5, 1, 0], [1.5, 2, 0, 0], [0.25, 0.25, 1, 0]])


def test_mis_geometric_means_and_masked_set():
    # row 0: (3 * 0.5 * 1)^(1/3) = 1.5^(1/3) = 1.144714
    # row 1: (1.5 * 4)^(1/2) = sqrt(6) = 2.449490          > 2   -> dropped
    # row 2: (0.25 * 0.25 * 1)^(1/3) = (1/16)^(1/3) = 0.396850 < 1/2 -> dropped
    close(sequence_ratio(LOGP, ROLLOUT, MASK), [1.144714, 2.449490, 0.396850])
    close(mis_weights(LOGP, ROLLOUT, MASK, cap=2.0), [1, 0, 0])
    # truncate: min(rho_i, 2); the low sequence keeps its small weight
    close(mis_weights(LOGP, ROLLOUT, MASK, cap=2.0, mode="truncate"), [1.144714, 2, 0.396850])
    # cap 3: [1/3, 3] keeps rows 0 and 1, row 2 (0.396850 >= 0.333333) too
    close(mis_weights(LOGP, ROLLOUT, MASK, cap=3.0), [1, 1, 1])


def test_mismatch_metrics_by_hand():
    # 8 tokens; mean rho = (3 + 0.5 + 1 + 1.5 + 4 + 0.25 + 0.25 + 1) / 8 = 11.5 / 8 = 1.4375; max 4
    # sum log rho = log(3 * 0.5 * 1.5 * 4 * 0.25 * 0.25) = log(9 / 16) = -0.575364
    # k1 = mean(rollout - logp) = 0.575364 / 8 = 0.071921
    # k3 = mean(rho - 1 - log rho) = 1.4375 - 1 + 0.071921 = 0.509421
    m = mismatch_metrics(LOGP, ROLLOUT, MASK)
    close(m["token_ratio_mean"], 1.4375)
    close(m["token_ratio_max"], 4.0)
    close(m["kl_k1"], 0.071921)
    close(m["kl_k3"], 0.509421)
    close(m["tokens"], 8)
    close(m["seqs"], 3)


def test_rollout_correction_tis_and_mis_mask():
    c = rollout_correction(LOGP, ROLLOUT, MASK, tis_cap=2.0, mis_cap=2.0)
    # MIS drops rows 1 and 2 (above); row 0 keeps its TIS weights [min(3, 2), 0.5, 1]
    close(c.weight_BT, [[2, 0.5, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    assert c.mask_BT.tolist() == [[True, True, True, False], [False] * 4, [False] * 4]
    close(c.metrics["token_truncated_frac"], 2 / 8)
    close(c.metrics["seq_masked_frac"], 2 / 3)
    close(c.metrics["seq_truncated_frac"], 0.0)
    close(c.metrics["token_ratio_mean"], 1.4375)  # measured before correction, over the input mask
    assert all(torch.isfinite(v) and not v.requires_grad for v in c.metrics.values())


def test_rollout_correction_mis_truncate_and_off():
    # truncate: weight_BT = TIS weight * min(rho_i, 2) per row; nothing dropped; 1 of 3 rows over the cap
    c = rollout_correction(LOGP, ROLLOUT, MASK, tis_cap=2.0, mis_cap=2.0, mis_mode="truncate")
    close(c.weight_BT, [[2 * 1.144714, 0.5 * 1.144714, 1.144714, 0], [3, 4, 0, 0],
                        [0.25 * 0.396850, 0.25 * 0.396850, 0.396850, 0]])
    assert c.mask_BT.tolist() == MASK.bool().tolist()
    close(c.metrics["seq_truncated_frac"], 1 / 3)
    close(c.metrics["seq_masked_frac"], 0.0)
    # both off: weight 1 on the mask, nothing truncated, the mismatch still measured
    off = rollout_correction(LOGP, ROLLOUT, MASK, tis_cap=None, mis_cap=None)
    close(off.weight_BT, MASK)
    close(off.metrics["token_truncated_frac"], 0.0)
    close(off.metrics["kl_k3"], 0.509421)


def test_rollout_correction_perfect_match_and_empty_mask():
    c = rollout_correction(ROLLOUT, ROLLOUT, MASK, tis_cap=2.0, mis_cap=1.001)
    close(c.weight_BT, MASK)
    close(c.metrics["kl_k3"], 0.0)
    close(c.metrics["kl_k1"], 0.0)
    close(c.metrics["token_ratio_max"], 1.0)
    empty = rollout_correction(LOGP, ROLLOUT, torch.zeros_like(MASK), tis_cap=2.0, mis_cap=2.0)
    close(empty.weight_BT, torch.zeros(3, 4))
    assert all(float(v) == 0 for v in empty.metrics.values())


def test_rollout_correction_huge_mismatch_stays_finite():
    # log rho = 100 on a real token: clamped to 20 before exp (exp(100) overflows float32)
    c = rollout_correction(T([[0.0, -1.0]]), T([[-100.0, -1.0]]), T([[1, 1]]), tis_cap=2.0, mis_cap=2.0)
    close(c.weight_BT, [[0, 0]])  # row ratio exp((20 + 0) / 2) = exp(10) > 2 -> dropped
    close(c.metrics["token_ratio_max"] / 1e8, math.exp(20) / 1e8)
    assert all(torch.isfinite(v) for v in c.metrics.values())


def test_rollout_correction_bad_arguments():
    with pytest.raises(ValueError, match="tis_cap must be >= 1"):
        rollout_correction(LOGP, ROLLOUT, MASK, tis_cap=0.5, mis_cap=None)
    with pytest.raises(ValueError, match="unknown MIS mode 'clip'; expected one of mask, truncate"):
        rollout_correction(LOGP, ROLLOUT, MASK, tis_cap=None, mis_cap=2.0, mis_mode="clip")
    with pytest.raises(ValueError, match="expected .B, T. tensors of one shape"):
        tis_weights(LOGP, ROLLOUT[:2], MASK, cap=2.0)


# --- TIS/MIS applied to the PPO loss -------------------------------------------
def test_ppo_on_policy_gradient_is_tis_weighted():
    # The weight goes into the advantages (w >= 0: w * max(-A r, -A clip r) = max(-wA r, -wA clip r)).
    # On-policy (old = sg[logp]): ratio 1, so d/dlogp_t of token-mean(-A * w * ratio) = -A * w_t / N.
    # A = 1 on all 8 tokens, TIS weights above -> grad = -w / 8; the weight itself carries no gradient
    # although it is computed from logp.
    logp = LOGP.clone().requires_grad_()
    c = rollout_correction(logp, ROLLOUT, MASK, tis_cap=2.0, mis_cap=None)
    adv = torch.where(MASK.bool(), 1.0, NAN)
    num, den, _ = ppo_policy_loss(logp, logp.detach(), adv * c.weight_BT, MASK)
    (grad,) = torch.autograd.grad(num / den, logp)
    close(grad, -T([[2, 0.5, 1, 0], [1.5, 2, 0, 0], [0.25, 0.25, 1, 0]]) / 8)
    # With MIS (cap 2) and its mask, only row 0 remains: N = 3, grad = -[2, 0.5, 1] / 3
    c = rollout_correction(logp, ROLLOUT, MASK, tis_cap=2.0, mis_cap=2.0)
    num, den, _ = ppo_policy_loss(logp, logp.detach(), adv * c.weight_BT, c.mask_BT)
    (grad,) = torch.autograd.grad(num / den, logp)
    close(grad, -T([[2, 0.5, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]) / 3)


def _random_batch(seed, B=5, L=7):
    g = torch.Generator().manual_seed(seed)
    lengths = [L, 1, 4, 0, 3][:B]
    mask = T([[1.0] * n + [0.0] * (L - n) for n in lengths])
    old = -torch.rand(B, L, generator=g) * 3
    logp = old + 0.3 * torch.randn(B, L, generator=g)
    rollout = old + 0.5 * torch.randn(B, L, generator=g)
    adv_B = torch.randn(B, generator=g)
    pad = ~mask.bool()
    poison = [NAN, INF, -INF]
    for k, x in enumerate((old, logp, rollout)):
        x[pad] = poison[k]
    return logp, old, rollout, adv_B, mask, lengths


def _mode_weights(lengths, mode):
    """Each row's weight in the aggregated loss (rows without tokens: 0)."""
    rows, tokens = sum(n > 0 for n in lengths), sum(lengths)
    return [0.0 if n == 0 else {"token-mean": n / tokens, "seq-mean-token-sum": n / rows,
                                "seq-mean-token-mean": 1 / rows}[mode] for n in lengths]


@pytest.mark.parametrize("mode", MODES)
def test_ppo_with_correction_matches_reference_loop(mode):
    logp, old, rollout, adv_B, mask, lengths = _random_batch(1)
    logp.requires_grad_()
    c = rollout_correction(old, rollout, mask, tis_cap=1.5, mis_cap=1.5)
    adv = adv_B.unsqueeze(1) * c.weight_BT  # the weighted per-token loss, see Correction
    num, den, _ = ppo_policy_loss(logp, old, adv, c.mask_BT, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                                  mode=mode)
    (grad,) = torch.autograd.grad(num / den, logp)

    # slow reference: token by token, plain floats for the weights (constants)
    kept = [n if (c.mask_BT[i, :n].all() and n) else 0 for i, n in enumerate(lengths)]
    row_w = _mode_weights(kept, mode)
    ref = torch.zeros(())
    for i, n in enumerate(kept):
        for t in range(n):
            r_old = math.exp(float(old[i, t] - rollout[i, t]))
            w_tis = min(r_old, 1.5)
            rho_i = math.exp(sum(float(old[i, k] - rollout[i, k]) for k in range(n)) / n)
            assert 1 / 1.5 <= rho_i <= 1.5
            ratio = torch.exp(logp[i, t] - old[i, t])
            a = float(adv_B[i])
            loss_t = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.28))
            if a < 0:
                loss_t = torch.minimum(loss_t, torch.tensor(-a * 3.0))
            loss_t = w_tis * loss_t
            ref = ref + loss_t * row_w[i] / n  # the row's weight, shared by its tokens
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert 0 < sum(kept) < sum(lengths)  # MIS dropped some rows, kept others
    close(num / den, ref)
    torch.testing.assert_close(grad, ref_grad)


# --- GSPO ----------------------------------------------------------------------
def _gspo(log_ratios, adv, mode="seq-mean-token-mean", **kw):
    """Rows of different lengths, padded to 4 with NaN in logp, old_logp and adv."""
    L = 4
    mask = T([[1.0] * len(r) + [0.0] * (L - len(r)) for r in log_ratios])
    old = torch.where(mask.bool(), -1.5, NAN)
    logp = torch.where(mask.bool(), old + T([r + [0.0] * (L - len(r)) for r in log_ratios]), NAN).requires_grad_()
    adv_BT = torch.where(mask.bool(), T(adv).unsqueeze(1), NAN)
    num, den, m = gspo_policy_loss(logp, old, adv_BT, mask, mode=mode, **kw)
    (grad,) = torch.autograd.grad(num / den, logp)
    return num / den, grad, m


EXAMPLE = ([[0.2, 0.4], [0.1, -0.4, 0.0]], [1.0, -2.0])


def test_gspo_two_sequences_by_hand():
    # row 0: 2 tokens, mean log-ratio 0.3 -> s_0 = exp(0.3) = 1.349859, A = +1
    #        max(-1.349859, -clip(1.349859, 0.8, 1.28) = -1.28) = -1.28        clipped: no gradient
    # row 1: 3 tokens, mean log-ratio -0.1 -> s_1 = exp(-0.1) = 0.904837, A = -2
    #        max(2 * 0.904837, 2 * 0.904837) = 1.809675                       not clipped
    # seq-mean-token-mean: (-1.28 + 1.809675) / 2 = 0.264837
    # gradient on row 1's tokens: d/dlogp_t (1/2)(1/3) sum_t' 2 s_1t' = 2 * s_1 / 6 = 0.301612
    # (token-level PPO would clip row 0's first token differently: exp(0.2) = 1.221 < 1.28 is inside)
    loss, grad, m = _gspo(*EXAMPLE, clip_low=0.2, clip_high=0.28)
    close(loss, 0.264837)
    close(grad, [[0, 0, 0, 0], [0.301612, 0.301612, 0.301612, 0]])
    close(m["clipfrac"], 0.5)
    close(m["ratio_mean"], (1.349859 + 0.904837) / 2)
    close(m["ratio_max"], 1.349859)
    close(m["approx_kl"], 0.037)  # 0.5 * (0.04 + 0.16 + 0.01 + 0.16 + 0) / 5
    assert all(torch.isfinite(v) and not v.requires_grad for v in m.values())
    # token-mean: (2 * -1.28 + 3 * 1.809675) / 5 = 0.573805; row 1's gradient 2 * s_1 / 5 = 0.361935
    loss, grad, _ = _gspo(*EXAMPLE, mode="token-mean", clip_low=0.2, clip_high=0.28)
    close(loss, 0.573805)
    close(grad, [[0, 0, 0, 0], [0.361935, 0.361935, 0.361935, 0]])


def test_gspo_sequence_log_ratio_is_length_normalised():
    # (0.2 + 0.4) / 2 = 0.3 and (0.1 - 0.4 + 0) / 3 = -0.1; padding (inf, NaN) ignored
    old = T([[-1.0, -1.0, NAN], [-1.0, -1.0, -1.0]])
    logp = T([[-0.8, -0.6, INF], [-0.9, -1.4, -1.0]])
    close(sequence_log_ratio(logp, old, T([[1, 1, 0], [1, 1, 1]])), [0.3, -0.1])


def test_gspo_single_token_sequences_equal_ppo():
    # With one token per sequence the sequence ratio is the token ratio: GSPO == PPO (no dual clip).
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 1, generator=g)
    logp = (old + 0.4 * torch.randn(6, 1, generator=g)).requires_grad_()
    adv, mask = torch.randn(6, 1, generator=g), torch.ones(6, 1)
    for mode in MODES:
        gn, gd, gm = gspo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, mode=mode)
        pn, pd, pm = ppo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=None, mode=mode)
        close(gn / gd, pn / pd)
        torch.testing.assert_close(torch.autograd.grad(gn, logp)[0], torch.autograd.grad(pn, logp)[0])
        close(gm["clipfrac"], pm["clipfrac"])


@pytest.mark.parametrize("mode", MODES)
def test_gspo_gradient_matches_sequence_level_reference(mode):
    # The paper's GSPO, one row at a time: s_i = exp(mean(logp - old)) with autograd through s_i,
    # loss_i = max(-A_i s_i, -A_i clip(s_i)); each row weighted as the mode weights it. The fast GSPO-token
    # form must give the same value and gradient. An MIS truncate weight per row rides along.
    logp, old, rollout, adv_B, mask, lengths = _random_batch(2)
    logp.requires_grad_()
    seq_w = mis_weights(old, rollout, mask, cap=1.2, mode="truncate")
    adv = adv_B.unsqueeze(1) * seq_w.unsqueeze(1)  # the per-row weight goes into the advantages
    adv = torch.where(mask.bool(), adv, NAN)
    num, den, m = gspo_policy_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.15, mode=mode)
    (grad,) = torch.autograd.grad(num / den, logp)

    ref, clipped = torch.zeros(()), []
    for i, (n, w) in enumerate(zip(lengths, _mode_weights(lengths, mode), strict=True)):
        if n == 0:
            continue
        s = torch.exp(sum(logp[i, t] - old[i, t] for t in range(n)) / n)
        a = float(adv_B[i])
        loss_i = torch.maximum(-a * s, -a * s.clamp(0.9, 1.15))
        clipped.append(bool(-a * s.detach().clamp(0.9, 1.15) > -a * s.detach()))
        ref = ref + w * float(seq_w[i]) * loss_i
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert 0 < sum(clipped) < len(clipped)  # both branches exercised
    close(num / den, ref)
    torch.testing.assert_close(grad, ref_grad)
    close(m["clipfrac"], sum(clipped) / len(clipped))


def test_gspo_token_advantages_gradient_matches_hand_loop():
    # GSPO-token with per-token advantages: d/dlogp_it = c_i * (-A_it * s_i) where the token's clipped term
    # is not taken, else 0 (seq-mean-token-mean: c_i = 1 / (rows * n_i)).
    logp, old, _, _, mask, lengths = _random_batch(4)
    logp.requires_grad_()
    adv = torch.randn(logp.shape, generator=torch.Generator().manual_seed(5))
    adv[~mask.bool()] = INF
    num, den, _ = gspo_policy_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.1)
    (grad,) = torch.autograd.grad(num / den, logp)
    rows = sum(n > 0 for n in lengths)
    expected = torch.zeros_like(grad)
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        s = math.exp(sum(float(logp[i, t].detach() - old[i, t]) for t in range(n)) / n)
        for t in range(n):
            a = float(adv[i, t])
            if not -a * min(max(s, 0.9), 1.1) > -a * s:
                expected[i, t] = -a * s / (rows * n)
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("mode", MODES)
def test_gspo_micro_batches_match_full_batch(mode):
    logp, old, _, adv_B, mask, _ = _random_batch(6)
    logp.requires_grad_()
    adv = adv_B.unsqueeze(1).expand_as(logp)
    kw = {"clip_low": 0.1, "clip_high": 0.15, "mode": mode}
    num, den, _ = gspo_policy_loss(logp, old, adv, mask, **kw)
    (full_grad,) = torch.autograd.grad(num / den, logp)
    parts = [gspo_policy_loss(logp[s], old[s], adv[s], mask[s], **kw) for s in (slice(0, 2), slice(2, 5))]
    total_den = sum(d for _, d, _ in parts)
    (split_grad,) = torch.autograd.grad(sum(n for n, _, _ in parts) / total_den, logp)
    close(sum(n for n, _, _ in parts) / total_den, num / den)
    torch.testing.assert_close(split_grad, full_grad)


def test_gspo_padding_never_reaches_outputs():
    # NaN / inf everywhere on padding (logp, old, adv): loss, gradient and metrics stay those of the
    # real tokens: 1 row of 2 tokens with log-ratios [0.1, 0.1] -> s = exp(0.1) = 1.105171, A = 1, unclipped
    # at clip 0.2; loss -1.105171; gradient -s / 2 per token.
    logp = T([[-0.9, -0.9, NAN, INF], [NAN, -INF, INF, NAN]], requires_grad=True)
    old = T([[-1.0, -1.0, INF, NAN], [INF, NAN, -INF, 0.0]])
    adv = T([[1.0, 1.0, NAN, -INF], [INF, NAN, NAN, 1.0]])
    mask = T([[1, 1, 0, 0], [0, 0, 0, 0]])
    for mode in MODES:
        num, den, m = gspo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, mode=mode)
        (grad,) = torch.autograd.grad(num / den, logp)
        close(num / den, -1.105171 * (2 if mode == "seq-mean-token-sum" else 1))
        scale = 2.0 if mode == "seq-mean-token-sum" else 1.0  # row sum / 1 row instead of row mean
        close(grad, T([[-0.552585, -0.552585, 0, 0], [0, 0, 0, 0]]) * scale)
        close(m["ratio_max"], 1.105171)
        close(m["ratio_mean"], 1.105171)
        assert all(torch.isfinite(v) for v in m.values())


def test_gspo_bad_arguments():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="need 0 <= clip_low < 1"):
        gspo_policy_loss(x, x, x, x + 1, clip_low=1.0, clip_high=0.1)
    with pytest.raises(ValueError, match="expected .B, T. tensors of one shape"):
        gspo_policy_loss(x, x, x[:, :1], x, clip_low=0.1, clip_high=0.1)
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        gspo_policy_loss(x, x, x, x + 1, clip_low=0.1, clip_high=0.1, mode="seq-mean")
