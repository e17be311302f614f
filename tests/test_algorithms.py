"""Advantages, KL estimators and PPO losses against hand-computed values (arithmetic in the comments)."""

import math

import pytest
import torch

from megareason.algorithms import (
    AGG_MODES,
    KL_KINDS,
    aggregate,
    broadcast_to_tokens,
    entropy_bonus,
    explained_variance,
    gae,
    gae_reference,
    grpo_advantages,
    kl_in_reward,
    kl_penalty,
    ppo_policy_loss,
    value_loss,
    whiten,
)

T = torch.tensor
NAN, INF = float("nan"), float("inf")


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual).double(), torch.as_tensor(expected).double(), atol=atol,
                               rtol=0)


# --- GRPO -------------------------------------------------------------------
def test_grpo_std_uses_unbiased_std_and_zeroes_flat_groups():
    # group 0: r = [1, 0], mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.70711 -> +-0.5 / 0.70711 = +-0.70711
    # group 1: r = [1, 1], std 0 -> centred 0 -> 0
    close(grpo_advantages(T([1.0, 0, 1, 1]), T([0, 0, 1, 1])), [0.70711, -0.70711, 0, 0])


def test_grpo_std_non_contiguous_groups_and_singleton():
    # group 0 (idx 0, 2, 4): r = [1, 0, 0], mean 1/3, centred [2/3, -1/3, -1/3],
    #   unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3, std 0.57735 -> [1.15470, -0.57735, -0.57735]
    #   (the biased std 0.47140 would give 1.41421 for idx 0)
    # group 5 (idx 1, 3): r = [2, 4], mean 3, std sqrt(2) -> [-0.70711, 0.70711]
    # group 9 (idx 5): a singleton -> 0
    adv = grpo_advantages(T([1.0, 2, 0, 4, 0, 5]), T([0, 5, 0, 5, 0, 9]), mode="std")
    close(adv, [1.15470, -0.70711, -0.57735, 0.70711, -0.57735, 0])


def test_grpo_no_std():
    # same data: group 0 centred [2/3, -1/3, -1/3]; group 5 [2 - 3, 4 - 3]; singleton 0
    adv = grpo_advantages(T([1.0, 2, 0, 4, 0, 5]), T([0, 5, 0, 5, 0, 9]), mode="no_std")
    close(adv, [2 / 3, -1.0, -1 / 3, 1.0, -1 / 3, 0])


def test_grpo_leave_one_out():
    # group 0: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 (twice); group 5: 2 - 4 = -2, 4 - 2 = 2; singleton 0
    adv = grpo_advantages(T([1.0, 2, 0, 4, 0, 5]), T([0, 5, 0, 5, 0, 9]), mode="loo")
    close(adv, [1.0, -2.0, -0.5, 2.0, -0.5, 0])


@pytest.mark.parametrize("mode", ["std", "no_std", "loo"])
def test_grpo_flat_groups_are_exactly_zero(mode):
    # Seven rewards of 0.7: the float32 mean is off by ~1e-8, which (r - mean) / (0 + 1e-6) would blow up
    # to ~0.05. Every member of a flat group gets exactly 0; group 1 ([0, 1]) still gets +-advantages.
    adv = grpo_advantages(T([0.7] * 7 + [0.0, 1.0]), T([0] * 7 + [1, 1]), mode=mode)
    assert torch.equal(adv[:7], torch.zeros(7))
    assert adv[7] < 0 < adv[8]


def test_grpo_bad_input():
    with pytest.raises(ValueError, match="unknown GRPO mode 'rloo'; expected one of std, no_std, loo"):
        grpo_advantages(T([1.0, 0]), T([0, 0]), mode="rloo")
    with pytest.raises(ValueError, match="shape mismatch"):
        grpo_advantages(T([1.0, 0]), T([0, 0, 1]))
    with pytest.raises(ValueError, match="integer group ids"):
        grpo_advantages(T([1.0, 0]), T([0.0, 0.0]))


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(T([2.0, -1.0]), T([[0, 1, 1], [1, 1, 0]]))
    assert torch.equal(out, T([[0.0, 2, 2], [-1, -1, 0]]))


# --- GAE --------------------------------------------------------------------
def test_gae_hand_three_tokens_with_prompt_and_padding():
    # Row: [prompt, resp, resp, resp, pad]; rewards/values on prompt and pad are junk and must be ignored.
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72), values [0.5, 0.6, 0.7], reward 1 on the last token:
    #   t2: delta = 1 + 0.9 * 0   - 0.7 = 0.3    A = 0.3
    #   t1: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03   A = 0.03 + 0.72 * 0.3   = 0.246
    #   t0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04   A = 0.04 + 0.72 * 0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    reward, value, mask = T([[5.0, 0, 0, 1, 7]]), T([[3.0, 0.5, 0.6, 0.7, 4]]), T([[0, 1, 1, 1, 0]])
    adv, ret = gae(reward, value, mask, gamma=0.9, lam=0.8)
    close(adv, [[0, 0.21712, 0.246, 0.3, 0]])
    close(ret, [[0, 0.71712, 0.846, 1.0, 0]])


def test_gae_gamma_lam_one_is_monte_carlo():
    # gamma = lam = 1: A_t = (sum of future rewards) - V_t = 1 - V_t; returns are all 1
    adv, ret = gae(T([[0.0, 0, 1]]), T([[0.5, 0.6, 0.7]]), T([[1, 1, 1]]), gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_skips_masked_holes():
    # mask [1, 0, 1]: the hole's reward 9 and value 9 are skipped; t0's next value is t2's 0.7.
    #   t2: A = 1 - 0.7 = 0.3;  t0: delta = 0 + 0.9 * 0.7 - 0.5 = 0.13, A = 0.13 + 0.72 * 0.3 = 0.346
    adv, _ = gae(T([[0.0, 9, 1]]), T([[0.5, 9, 0.7]]), T([[1, 0, 1]]), gamma=0.9, lam=0.8)
    close(adv, [[0.346, 0, 0.3]])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.5), (0.7, 1.0)])
def test_gae_matches_reference_loop(gamma, lam):
    g = torch.Generator().manual_seed(int(gamma * 100 + lam * 10))
    b, t = 6, 13
    reward, value = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) < 0.8).long()  # holes anywhere
    mask[:, :2] = 0  # prompt
    mask[1, 9:] = 0  # padding
    mask[3] = 0  # a row with no response tokens
    adv, ret = gae(reward, value, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_reference(reward, value, mask, gamma=gamma, lam=lam)
    assert ref_adv.abs().sum() > 1  # the reference is not trivially zero
    close(adv, ref_adv, atol=1e-5)
    close(ret, ref_ret, atol=1e-5)


def test_whiten_is_global_over_masked_tokens():
    # masked entries 1, 2 (row 0) and 3 (row 1): mean 2, unbiased var (1 + 0 + 1) / 2 = 1 -> [-1, 0, 1]
    # (per-row whitening would give row 1 a 0); masked-out entries come back 0.
    x, mask = T([[1.0, 2, 50], [3, 60, 70]]), T([[1, 1, 0], [1, 0, 0]])
    close(whiten(x, mask), [[-1.0, 0, 0], [1, 0, 0]])
    close(whiten(x, torch.zeros_like(mask)), torch.zeros(2, 3))  # nothing to whiten
    close(whiten(x, T([[0, 1, 0], [0, 0, 0]])), torch.zeros(2, 3))  # a single token centres to 0



def test_explained_variance_by_hand():
    # masked returns 0, 1, 1, 0 (padding 9s ignored): mean 0.5, population variance 0.25.
    ret, mask = T([[0.0, 1, 9], [1, 0, 9]]), T([[1, 1, 0], [1, 1, 0]])
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)  # perfect critic
    assert explained_variance(torch.full_like(ret, 0.3), ret, mask) == pytest.approx(0.0)  # any constant
    # values 0.5, 0.5, 1, 0 -> errors -0.5, 0.5, 0, 0: variance 0.125 -> 1 - 0.125 / 0.25 = 0.5
    assert explained_variance(T([[0.5, 0.5, -7], [1, 0, -7]]), ret, mask) == pytest.approx(0.5)
    # values 1, 0, 0, 1 -> errors -1, 1, 1, -1: variance 1 -> 1 - 1 / 0.25 = -3 (worse than a constant)
    assert explained_variance(T([[1.0, 0, 0], [0, 1, 0]]), ret, mask) == pytest.approx(-3.0)
    assert math.isnan(explained_variance(ret, torch.ones_like(ret), mask))  # returns do not vary

# --- KL -----------------------------------------------------------------------
LOGP, REF = T([[-1.0, -2.0]]), T([[-1.5, -1.0]])  # logp - ref = [0.5, -1.0]


def test_kl_k1_k2():
    close(kl_penalty(LOGP, REF, "k1"), [[0.5, -1.0]])
    close(kl_penalty(LOGP, REF, "k2"), [[0.125, 0.5]])  # 0.5 * 0.25, 0.5 * 1


@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
def test_kl_k3(kind):
    # x = ref - logp = [-0.5, 1.0]: exp(-0.5) + 0.5 - 1 = 0.106531, exp(1) - 1 - 1 = 0.718282
    close(kl_penalty(LOGP, REF, kind), [[0.106531, 0.718282]])


def test_kl_k3_clamps():
    # x = ref - logp = -30 -> clamped to -10: exp(-10) + 10 - 1 = 9.0000454 (unclamped: 29)
    # x = +30 -> clamped to 10: exp(10) - 11 = 22015.5 -> result clamped to 10
    out = kl_penalty(T([[0.0, -30.0]]), T([[-30.0, 0.0]]), "k3", clamp=10.0)
    close(out, [[9.0000454, 10.0]])
    close(kl_penalty(T([[0.0]]), T([[-30.0]]), "k3", clamp=None), [[29.0]])


def test_kl_unknown_kind_lists_kinds():
    assert KL_KINDS == ("k1", "k2", "k3", "low_var_kl")
    with pytest.raises(ValueError, match="unknown KL kind 'k4'; expected one of k1, k2, k3, low_var_kl"):
        kl_penalty(LOGP, REF, "k4")


def test_kl_in_reward():
    # beta 0.5 on response tokens only: 0 - 0.5 * 0.2 = -0.1, 1 - 0.5 * 0.3 = 0.85
    out = kl_in_reward(T([[0.0, 0, 1, 0]]), T([[0.1, 0.2, 0.3, 0.4]]), T([[0, 1, 1, 0]]), beta=0.5)
    close(out, [[0.0, -0.1, 0.85, 0]])


# Which estimator where, on a 3-token categorical, every expectation summed exactly over the tokens:
# policy pi = softmax(z) at z = (log 2, 0, 0) = (1/2, 1/4, 1/4), reference q = (1/4, 1/2, 1/4).
# log(pi/q) = (log 2, -log 2, 0), KL(pi||q) = (1/2 - 1/4) log 2 = log(2)/4, and its gradient in the logits,
# dKL/dz_j = pi_j (log(pi_j/q_j) - KL) = log 2 * (3/8, -5/16, -1/16) = (0.259930, -0.216608, -0.043322).
Z_CAT, Q_CAT = [math.log(2), 0.0, 0.0], [0.25, 0.5, 0.25]
GRAD_KL = [math.log(2) * g for g in (3 / 8, -5 / 16, -1 / 16)]


def _categorical():
    z = T(Z_CAT, dtype=torch.float64, requires_grad=True)
    return z, torch.log_softmax(z, -1), T(Q_CAT, dtype=torch.float64).log()


@pytest.mark.parametrize("kind, expected", [
    ("k1", GRAD_KL),
    # + q - pi = (-1/4, 1/4, 0): (0.009930, 0.033392, -0.043322)
    ("low_var_kl", [GRAD_KL[0] - 0.25, GRAD_KL[1] + 0.25, GRAD_KL[2]]),
])
def test_kl_as_a_reward_has_the_kl_gradient_with_k1_only(kind, expected):
    # In the reward the KL is a detached reward: its policy gradient is E_pi[kl(a) grad log pi(a)] (score
    # function). k1 = log pi - log q: E[(log pi - log q) grad log pi] = grad KL, as E[grad log pi] = 0.
    # k3 = q/pi - log(q/pi) - 1 adds sum_a pi_a (q_a/pi_a) grad log pi_a = sum_a q_a (e_a - pi) = q - pi.
    z, logp, ref = _categorical()
    kl = kl_penalty(logp.detach()[None], ref[None], kind)[0]
    (logp.exp().detach() * kl * logp).sum().backward()
    close(z.grad, expected)


@pytest.mark.parametrize("kind, expected", [
    ("k1", [0.0, 0.0, 0.0]),
    ("k2", GRAD_KL),
    ("low_var_kl", [0.25, -0.25, 0.0]),
])
def test_kl_as_a_loss_term_gradients_by_hand(kind, expected):
    # As a loss term the KL is differentiated through log pi on tokens sampled from the policy (on-policy:
    # pi itself), E_pi[d kl/d log pi(a) * grad log pi(a)] with grad log pi(a) = e_a - pi.
    # k1: d/d log pi = 1 -> E[grad log pi] = 0. k2: (log pi - log q) -> grad KL(pi||q).
    # k3: 1 - q/pi -> sum_a (pi_a - q_a)(e_a - pi) = pi - q = (1/4, -1/4, 0), the gradient of KL(q||pi).
    z, logp, ref = _categorical()
    kl = kl_penalty(logp[None], ref[None], kind)[0]
    (logp.exp().detach() * kl).sum().backward()
    close(z.grad, expected)


# --- aggregation ------------------------------------------------------------
# NaN and inf sit on masked-out entries: they must not reach the result.
LOSS = T([[1.0, 2, NAN], [4, 5, 6], [7, INF, 9]])
MASK = T([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize("mode,num,den", [
    ("token-mean", 7.0, 3),  # (1 + 2 + 4) / 3 tokens
    ("seq-mean-token-sum", 7.0, 2),  # ((1 + 2) + 4) / 2 non-empty rows (row 2 is empty)
    ("seq-mean-token-mean", 5.5, 2),  # (1.5 + 4) / 2 non-empty rows
])
def test_aggregate_by_hand(mode, num, den):
    n, d = aggregate(LOSS, MASK, mode)
    close(n, num)
    assert d.dtype == torch.int64 and int(d) == den


def _loss_of(x_BT):
    return x_BT.square() * T([1.0, -2, 3, 0.5, 1.5, 1])  # any per-token function of the inputs


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_gradient_accumulation_matches_full_batch(mode):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, generator=g, requires_grad=True)
    mask = T([[1, 1, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 0]])
    kw = {"norm_length": 8} if mode == "seq-mean-token-sum-norm" else {}
    num, den = aggregate(_loss_of(x), mask, mode, **kw)
    full = num / den
    (full_grad,) = torch.autograd.grad(full, x)

    # As megatron-core does: backward each micro-batch's numerator, then divide by the summed denominators.
    parts = [aggregate(_loss_of(x[s]), mask[s], mode, **kw) for s in (slice(0, 1), slice(1, 5))]
    for n, _ in parts:
        n.backward()
    total_den = sum(d for _, d in parts)
    close(sum(n for n, _ in parts) / total_den, full)
    close(x.grad / total_den, full_grad)
    # The split is uneven, so averaging per-micro-batch means would not be the full-batch value.
    assert abs(sum(n / d for n, d in parts) / 2 - full) > 1e-3


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'seq-mean'; expected one of token-mean, "):
        aggregate(LOSS, MASK, "seq-mean")
    with pytest.raises(ValueError, match="expected .B, T. tensors of one shape"):
        aggregate(LOSS, MASK[:2], "token-mean")


# --- PPO policy loss ----------------------------------------------------------
def _policy(log_ratio, adv, mask=None, **kw):
    old = torch.full((1, len(log_ratio)), -2.0)
    logp = (old + T([log_ratio])).requires_grad_()
    mask = torch.ones_like(old) if mask is None else T([mask])
    num, den, metrics = ppo_policy_loss(logp, old, T([adv]), mask, **kw)
    (grad,) = torch.autograd.grad(num / den, logp)
    return num / den, grad[0], metrics


def test_ppo_unclipped_is_minus_adv_times_ratio():
    # ratios exp(0.05) = 1.051271, exp(-0.05) = 0.951229, both inside [0.8, 1.2]
    # loss = mean(-2 * 1.051271, +1 * 0.951229) = (-2.102542 + 0.951229) / 2 = -0.575656
    # d/dlogp of -A * exp(logp - old) / 2 = -A * ratio / 2 = [-1.051271, 0.475615]
    loss, grad, m = _policy([0.05, -0.05], [2.0, -1.0])
    close(loss, -0.575656)
    close(grad, [-1.051271, 0.475615])
    close(m["clipfrac"], 0.0)
    close(m["approx_kl"], 0.00125)  # 0.5 * 0.05^2 on both tokens
    close(m["ratio_max"], 1.051271)


def test_ppo_clipped_and_clipfrac():
    # log-ratios [0.5, -0.5, 0.5, -0.5]: ratios [1.648721, 0.606531, 1.648721, 0.606531]; A [1, 1, -1, -1]
    # clip_high 0.28 -> upper 1.28, clip_low 0.2 -> lower 0.8; per token max(-A r, -A clip(r)):
    #   t0 A>0 r high: max(-1.648721, -1.28) = -1.28     clipped (no gradient)
    #   t1 A>0 r low:  max(-0.606531, -0.8)  = -0.606531 unclipped
    #   t2 A<0 r high: max(1.648721, 1.28)   = 1.648721  unclipped
    #   t3 A<0 r low:  max(0.606531, 0.8)    = 0.8       clipped (no gradient)
    # mean = (-1.28 - 0.606531 + 1.648721 + 0.8) / 4 = 0.140548; clipfrac 2/4
    # grads -A r / 4 on unclipped tokens: t1 -0.606531 / 4 = -0.151633, t2 1.648721 / 4 = 0.412180
    loss, grad, m = _policy([0.5, -0.5, 0.5, -0.5], [1.0, 1, -1, -1], clip_low=0.2, clip_high=0.28)
    close(loss, 0.140548)
    close(grad, [0, -0.151633, 0.412180, 0])
    close(m["clipfrac"], 0.5)
    close(m["dual_clipfrac"], 0.0)
    close(m["approx_kl"], 0.125)  # 0.5 * 0.25
    close(m["ratio_max"], 1.648721)


def test_ppo_dual_clip():
    # dual_clip 3, clip 0.2; ratios [5, 2, 5], A [-1, -1, +1]:
    #   t0 A<0: max(5, 1.2) = 5 -> min(5, 3) = 3 (dual bound, no gradient)
    #   t1 A<0: max(2, 1.2) = 2 -> min(2, 3) = 2 (d/dlogp = 2 / 3 = 0.666667)
    #   t2 A>0: max(-5, -1.2) = -1.2; no dual clip for A > 0 (min with -3 would give -3)
    # mean (3 + 2 - 1.2) / 3 = 1.266667; clipfrac 1/3 (t2); dual_clipfrac 1/3 (t0)
    loss, grad, m = _policy([math.log(5), math.log(2), math.log(5)], [-1.0, -1, 1], dual_clip=3.0)
    close(loss, 1.266667)
    close(grad, [0, 0.666667, 0])
    close(m["clipfrac"], 1 / 3)
    close(m["dual_clipfrac"], 1 / 3)
    loss_without, _, _ = _policy([math.log(5), math.log(2), math.log(5)], [-1.0, -1, 1])
    close(loss_without, 1.933333)  # (5 + 2 - 1.2) / 3


def test_ppo_padding_is_ignored():
    # Pad tokens carry a log-ratio of 100 (exp overflows float32), a NaN advantage and a NaN logp:
    # loss, gradients and metrics must be those of the single real token, ratio exp(0.1) = 1.105171, A = 1.
    logp = T([[-1.9, 98.0, -1.0, NAN]], requires_grad=True)
    old, adv, mask = T([[-2.0, -2.0, -2.0, -2.0]]), T([[1.0, 50.0, NAN, 0.0]]), T([[1, 0, 0, 0]])
    num, den, m = ppo_policy_loss(logp, old, adv, mask)
    loss = num / den
    (grad,) = torch.autograd.grad(loss, logp)
    close(loss, -1.105171)
    close(grad, [[-1.105171, 0, 0, 0]])
    close(m["ratio_max"], 1.105171)
    close(m["approx_kl"], 0.005)  # 0.5 * 0.1^2
    assert all(not v.requires_grad for v in m.values())


def test_ppo_log_ratio_is_clamped_at_20():
    # A real token with log-ratio 30 and A = -1 (no dual clip): loss -A * exp(min(30, 20)) = exp(20) = 4.851652e8,
    # finite, and no gradient past the clamp (exp(30) unclamped; its gradient would be 1.07e13).
    loss, grad, m = _policy([30.0], [-1.0])
    close(loss / 1e8, 4.851652)
    close(grad, [0.0])
    close(m["ratio_max"] / 1e8, 4.851652)


def test_ppo_bad_arguments():
    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'"):
        ppo_policy_loss(*args, mode="mean")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_policy_loss(*args, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_low"):
        ppo_policy_loss(*args, clip_low=1.0)


# --- value loss and entropy -------------------------------------------------
def _value(clip):
    # v = [1, 2], old = [0.9, 1], R = [1.5, 3]; the third token is masked out and holds inf / NaN
    v = T([[1.0, 2.0, INF]], requires_grad=True)
    num, den, m = value_loss(v, T([[0.9, 1.0, NAN]]), T([[1.5, 3.0, NAN]]), T([[1, 1, 0]]), clip=clip)
    (grad,) = torch.autograd.grad(num / den, v)
    return num / den, grad, m


def test_value_loss_clipped():
    # t0: (1 - 1.5)^2 = 0.25; v - old = 0.1 inside +-0.2, same value -> 0.5 * 0.25 = 0.125, grad (v - R) / 2 = -0.25
    # t1: (2 - 3)^2 = 1; v - old = 1 -> clipped to 0.2, v' = 1.2, (1.2 - 3)^2 = 3.24 > 1 -> 0.5 * 3.24 = 1.62, grad 0
    # mean (0.125 + 1.62) / 2 = 0.8725; vf_clipfrac 1/2
    loss, grad, m = _value(0.2)
    close(loss, 0.8725)
    close(grad, [[-0.25, 0, 0]])
    close(m["vf_clipfrac"], 0.5)


def test_value_loss_unclipped():
    # 0.5 * [0.25, 1] -> mean 0.3125; grads (v - R) / 2 = [-0.25, -0.5]
    loss, grad, m = _value(None)
    close(loss, 0.3125)
    close(grad, [[-0.25, -0.5, 0]])
    close(m["vf_clipfrac"], 0.0)


def test_entropy_bonus():
    # -0.01 * (1 + 2 + 3) over 3 tokens; seq-mean-token-mean: -0.01 * (1.5 + 3) over 2 rows
    num, den = entropy_bonus(T([[1.0, 2], [3, NAN]]), T([[1, 1], [1, 0]]), 0.01, "token-mean")
    close(num, -0.06)
    assert int(den) == 3
    num, den = entropy_bonus(T([[1.0, 2], [3, 4]]), T([[1, 1], [1, 0]]), 0.01, "seq-mean-token-mean")
    close(num, -0.045)
    assert int(den) == 2
