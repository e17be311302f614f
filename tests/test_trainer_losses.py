"""The trainer's actor and critic losses through megatron-core: with gradient accumulation (several
packed micro-batches, and two data-parallel ranks) the gradient equals the full-batch gradient, for
every loss aggregation mode; and the full-batch policy gradient equals one computed with plain
autograd on the transformers model for the same weights and batch."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from distributed import run_workers

from megareason.config.schema import AlgorithmConfig
from megareason.trainer.experience import Experience

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
NORM_LENGTH = 16  # seq-mean-token-sum-norm's constant (the trainer passes rollout.max_tokens)


def _experience(vocab: int) -> Experience:
    g = torch.Generator().manual_seed(0)
    lengths = [9, 6, 11, 7, 10, 5, 8, 12]
    width = max(lengths)
    tokens = torch.randint(1, vocab, (8, width), generator=g)
    mask = torch.zeros(8, width)
    for b, n in enumerate(lengths):
        tokens[b, n:] = 0
        mask[b, 3:n] = 1.0  # 3-token prompts
    noise = torch.randn(8, width, generator=g)
    return Experience(tokens_BT=tokens, lengths_B=torch.tensor(lengths), mask_BT=mask,
                      rollout_logp_BT=torch.zeros(8, width),
                      old_logp_BT=(-2.0 + 0.3 * noise) * mask,
                      ref_logp_BT=(-2.1 + 0.2 * noise.roll(1, 1)) * mask,
                      adv_BT=torch.randn(8, width, generator=g) * mask,
                      values_BT=0.1 * noise * mask, returns_BT=torch.randn(8, width, generator=g) * mask)


def _alg(mode: str) -> AlgorithmConfig:
    return AlgorithmConfig(loss_agg_mode=mode, kl_coef=0.1, entropy_coef=0.01, clip_ratio_low=0.2,
                           clip_ratio_high=0.3, dual_clip=3.0)


def _grads(ddp):
    return {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}


def _worker(model_dir: str, exp: Experience):
    import torch.distributed as dist

    from megareason.config.schema import Config, OptimConfig
    from megareason.models.build import HFCheckpoint
    from megareason.models.parallel import init_parallel
    from megareason.models.roles import Actor, Critic
    from megareason.models.schedule import forward_backward
    from megareason.settings import optimizer_settings
    from megareason.trainer.experience import pack_experience
    from megareason.trainer.losses import policy_loss_fn, value_loss_fn
    from megareason.trainer.workers import share

    rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"])
    out = {}
    init_parallel(1, 1)
    ckpt = HFCheckpoint(model_dir)
    optim = optimizer_settings(Config(), OptimConfig.lr)
    actor, critic = Actor(ckpt, optim), Critic(ckpt, optim)
    names = ["mask_BT", "old_logp_BT", "ref_logp_BT", "adv_BT"]
    mine = exp.select(share(len(exp), 2, rank))
    for mode in MODES:
        alg = _alg(mode)
        # The whole batch as one packed micro-batch on each rank (rank 1 computes it too, unused).
        loss_fn = policy_loss_fn(alg, on_policy=False, norm_length=NORM_LENGTH)
        forward_backward(actor.ddp, pack_experience(exp, 10_000, names)[:1], actor.head, loss_fn)
        full = _grads(actor.ddp)
        # This rank's half, in micro-batches of at most 24 tokens, gradients all-reduced over 2 ranks.
        dist.barrier()
        forward_backward(actor.ddp, pack_experience(mine, 24, names), actor.head, loss_fn)
        out[("actor", mode)] = (full, _grads(actor.ddp), len(pack_experience(mine, 24, names)))
        vnames = ["mask_BT", "values_BT", "returns_BT"]
        value_fn = value_loss_fn(alg, NORM_LENGTH)
        forward_backward(critic.ddp, pack_experience(exp, 10_000, vnames), critic.head, value_fn)
        vfull = _grads(critic.ddp)
        forward_backward(critic.ddp, pack_experience(mine, 24, vnames), critic.head, value_fn)
        out[("critic", mode)] = (vfull, _grads(critic.ddp), 0)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_accumulated_gradient_equals_full_batch_gradient(worker_results, mode):
    for role in ("actor", "critic"):
        for rank_out in worker_results:
            full, accumulated, _ = rank_out[(role, mode)]
            # The full-batch pass ran on both ranks: the all-reduce sums two copies of the gradient
            # sum and divides by twice the count, which is the full-batch gradient again.
            for name, g in full.items():
                err = (accumulated[name] - g).norm() / g.norm().clamp_min(1e-12)
                assert err < 1e-5, f"{role} {mode} {name}: relative error {err:.2e}"
    assert worker_results[0][("actor", mode)][2] > 1, "the half batch must span several micro-batches"


@pytest.fixture(scope="module")
def worker_results(tiny_qwen2):
    from megareason.models.build import HFCheckpoint

    exp = _experience(HFCheckpoint(tiny_qwen2).arch.vocab_size)
    return run_workers(2, _worker, str(tiny_qwen2), exp)


# (aggregation mode, KL in the reward): the loss term's coefficient is kl_coef, or kl_loss_coef beside the
# KL in the reward (verl's use_kl_in_reward + use_kl_loss; the reward's KL is already in the advantages here).
KL_SETTINGS = [("seq-mean-token-mean", {}), ("seq-mean-token-sum-norm", {"kl_in_reward": True, "kl_loss_coef": 0.05})]


@pytest.mark.parametrize(("mode", "kl"), KL_SETTINGS, ids=["kl-loss", "kl-reward-and-loss-drgrpo-norm"])
def test_policy_gradient_matches_autograd_on_transformers(tiny_qwen2, mode, kl):
    """Full batch: megatron's gradient of the trainer loss = autograd through the HF model."""
    from transformers import AutoModelForCausalLM

    from megareason.algorithms.kl import kl_penalty
    from megareason.algorithms.losses import aggregate, entropy_bonus, ppo_policy_loss
    from megareason.models import weight_map
    from megareason.models.build import HFCheckpoint

    arch = HFCheckpoint(tiny_qwen2).arch
    exp = _experience(arch.vocab_size)
    alg = replace(_alg(mode), **kl)
    kl_coef, agg = (0.05 if kl else alg.kl_coef), {"mode": mode, "norm_length": NORM_LENGTH}
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2, torch_dtype=torch.float32)
    logits = hf(exp.tokens_BT).logits.float()
    logp_all = torch.log_softmax(logits[:, :-1], -1)
    logp = torch.nn.functional.pad(logp_all.gather(-1, exp.tokens_BT[:, 1:, None])[..., 0], (1, 0))
    entropy = torch.nn.functional.pad(-(logp_all.exp() * logp_all).sum(-1), (1, 0))
    num, den, _ = ppo_policy_loss(logp, exp.old_logp_BT, exp.adv_BT, exp.mask_BT, clip_low=0.2, clip_high=0.3,
                                  dual_clip=3.0, **agg)
    num = num + entropy_bonus(entropy, exp.mask_BT, alg.entropy_coef, **agg)[0]
    num = num + aggregate(kl_coef * kl_penalty(logp, exp.ref_logp_BT, alg.kl_loss_kind), exp.mask_BT, **agg)[0]
    (num / den).backward()
    expected = {n: p.grad for n, p in hf.named_parameters()}
    got = run_workers(1, _single_worker, str(tiny_qwen2), exp, alg)[0]
    got_hf = weight_map.to_hf({(0, 0): got}, arch, 1, 1)
    for name, g in got_hf.items():
        err = (g - expected[name]).norm() / expected[name].norm().clamp_min(1e-12)
        assert err < 1e-4, f"{name}: relative error {err:.2e}"


def _single_worker(model_dir: str, exp: Experience, alg: AlgorithmConfig):
    from megareason.config.schema import Config, OptimConfig
    from megareason.models.build import HFCheckpoint
    from megareason.models.parallel import init_parallel
    from megareason.models.roles import Actor
    from megareason.models.schedule import forward_backward
    from megareason.settings import optimizer_settings
    from megareason.trainer.experience import pack_experience
    from megareason.trainer.losses import policy_loss_fn

    init_parallel(1, 1)
    actor = Actor(HFCheckpoint(model_dir), optimizer_settings(Config(), OptimConfig.lr))
    names = ["mask_BT", "old_logp_BT", "ref_logp_BT", "adv_BT"]
    loss_fn = policy_loss_fn(alg, on_policy=False, norm_length=NORM_LENGTH)
    forward_backward(actor.ddp, pack_experience(exp, 24, names), actor.head, loss_fn)
    return _grads(actor.ddp)


def _packed(rollout_logp, adv, mask):
    """Two packed sequences [p, r, r] and [p, r] (one row, cu_seqlens) with the fields the policy loss reads."""
    return type("B", (), {"cu_seqlens": torch.tensor([0, 3, 5]),
                          "fields": {"mask_BT": torch.tensor([mask]), "adv_BT": torch.tensor([adv]),
                                     "rollout_logp_BT": torch.tensor([rollout_logp])}})()


def test_policy_loss_with_rollout_correction_weights_tokens_and_drops_sequences():
    from dataclasses import replace

    from megareason.trainer.losses import policy_loss_fn

    # Trainer log-probs (on-policy: also the old ones) vs vLLM's: token ratios exp(logp - rollout_logp) =
    # e^1, e^-0.5 (sequence 1) and e^0.1 (sequence 2); advantages +1, +1 | -2.
    logp = torch.tensor([[-9.0, -1.0, -2.0, -9.0, -0.5]], requires_grad=True)
    batch = _packed([0.0, -2.0, -1.5, 0.0, -0.6], [0.0, 1, 1, 0, -2], [0.0, 1, 1, 0, 1])
    alg = AlgorithmConfig(dual_clip=0.0, rollout_tis_cap=2.0)
    num, den, m = policy_loss_fn(alg, on_policy=True)(logp, torch.zeros_like(logp), batch)
    # On-policy the ratio is 1, so the loss is -sum(w * A) / 3 tokens: w = min(e^1, 2) = 2, e^-0.5, e^0.1.
    w = [2.0, torch.exp(torch.tensor(-0.5)).item(), torch.exp(torch.tensor(0.1)).item()]
    assert float((num / den).detach()) == pytest.approx(-(w[0] + w[1] - 2 * w[2]) / 3, rel=1e-6)
    (num / den).backward()
    assert logp.grad[0, [1, 2, 4]].tolist() == pytest.approx([-w[0] / 3, -w[1] / 3, 2 * w[2] / 3], rel=1e-6)
    ratios = [torch.e, w[1], w[2]]
    assert float(m["is_ratio_sum"]) == pytest.approx(sum(ratios), rel=1e-6)
    assert float(m["is_ratio_max"]) == pytest.approx(torch.e, rel=1e-6)
    assert float(m["is_truncated_sum"]) == pytest.approx(1.0)  # e^1 > 2: one token of three
    assert float(m["is_kl_sum"]) == pytest.approx(sum(r - 1 - torch.log(torch.tensor(r)).item() for r in ratios),
                                                  rel=1e-5)

    # MIS (mask, cap 1.2): sequence 1's geometric mean e^0.25 = 1.284 leaves [1/1.2, 1.2], sequence 2's
    # e^0.1 = 1.105 stays: only sequence 2 is trained, and the token-mean denominator is its 1 token.
    logp.grad = None
    alg = AlgorithmConfig(dual_clip=0.0, rollout_mis_cap=1.2)
    num, den, m = policy_loss_fn(alg, on_policy=True)(logp, torch.zeros_like(logp), batch)
    assert int(den) == 1 and float(num.detach()) == pytest.approx(2.0)  # -(1 * -2)
    assert (float(m["is_masked_num"]), float(m["is_masked_den"])) == (1.0, 2.0)
    (num / den).backward()
    assert logp.grad[0].tolist() == pytest.approx([0, 0, 0, 0, 2.0])

    # GSPO: on-policy the sequence ratio is 1 (no clipping); seq-mean-token-mean over the 2 sequences:
    # (-(1 + 1) / 2 + 2) / 2 = 0.5 — the same value as PPO's in this mode, through gspo_policy_loss.
    gspo = replace(AlgorithmConfig(), policy_loss="gspo", loss_agg_mode="seq-mean-token-mean")
    num, den, m = policy_loss_fn(gspo, on_policy=True)(logp, torch.zeros_like(logp), batch)
    assert float((num / den).detach()) == pytest.approx(0.5) and float(m["clipfrac_sum"]) == 0.0


# Which estimator each KL reads, on test_algorithms.py's 3-token categorical: policy pi = softmax(log 2, 0, 0)
# = (1/2, 1/4, 1/4), reference q = (1/4, 1/2, 1/4); four one-token responses, tokens 0, 0, 1, 2, make every
# mean over them pi's expectation exactly. By hand (grad KL(pi||q) = log 2 * (3/8, -5/16, -1/16)): the policy
# gradient of the mean return -beta * kl is -beta * grad KL with k1 in the reward, -beta * (grad KL + q - pi)
# with k3; the KL loss term's gradient (on-policy) is beta * (pi - q) = beta * (1/4, -1/4, 0) with k3, 0 with k1.
TOKENS = torch.tensor([0, 0, 1, 2])
GRAD_KL = torch.tensor([3 / 8, -5 / 16, -1 / 16]) * math.log(2)
Q_MINUS_PI = torch.tensor([-0.25, 0.25, 0.0])


def pad(x_B: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 2]: a prompt column of 0, then the response token's column."""
    return torch.nn.functional.pad(x_B[:, None], (1, 0))


def _policy():
    z = torch.tensor([math.log(2), 0.0, 0.0], requires_grad=True)
    return z, torch.log_softmax(z, -1)[TOKENS], torch.tensor([0.25, 0.5, 0.25]).log()[TOKENS]


@pytest.mark.parametrize("kinds, reward_k3, loss_k3", [({}, False, True),
                                                        ({"kl_reward_kind": "k3", "kl_loss_kind": "k1"}, True, False)],
                         ids=["defaults-k1-reward-k3-loss", "swapped"])
def test_the_reward_and_the_loss_term_read_their_own_kl_kind(kinds, reward_k3, loss_k3):
    from megareason.algorithms.estimate import compute_advantages
    from megareason.config.schema import Config
    from megareason.trainer.losses import policy_loss_fn

    beta = 0.1
    alg = AlgorithmConfig(name="ppo", kl_in_reward=True, kl_coef=beta, kl_loss_coef=beta, whiten_advantages=False,
                          dual_clip=0.0, **kinds)
    # The reward: PPO, a one-token prompt then a one-token response per row, outcome 0, values 0, gamma = lam
    # = 1: each row's advantage is -beta * kl(token).
    z, logp_B, ref_B = _policy()
    exp = Experience(tokens_BT=pad(TOKENS + 1), lengths_B=torch.full((4,), 2), mask_BT=pad(torch.ones(4)),
                     rollout_logp_BT=torch.zeros(4, 2), old_logp_BT=pad(logp_B.detach()), ref_logp_BT=pad(ref_B),
                     values_BT=torch.zeros(4, 2))
    adv_B = compute_advantages(alg, Config().raro, exp, torch.zeros(4), torch.arange(4))["adv_BT"][:, 1]
    (logp_B * adv_B).mean().backward()
    expected = -beta * (GRAD_KL + Q_MINUS_PI if reward_k3 else GRAD_KL)
    assert z.grad.tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    # The loss term: the four tokens as one row, advantages 0 (no policy-gradient term), token-mean.
    z, logp_B, ref_B = _policy()
    batch = type("B", (), {"cu_seqlens": None, "fields": {"mask_BT": torch.ones(1, 4), "adv_BT": torch.zeros(1, 4),
                                                          "ref_logp_BT": ref_B[None],
                                                          "rollout_logp_BT": logp_B.detach()[None]}})()
    num, den, _ = policy_loss_fn(alg, on_policy=True)(logp_B[None], torch.zeros(1, 4), batch)
    (num / den).backward()
    expected = -beta * Q_MINUS_PI if loss_k3 else torch.zeros(3)
    assert z.grad.tolist() == pytest.approx(expected.tolist(), abs=1e-6)
