"""Per-token KL estimators between the policy and a reference policy (Schulman, "Approximating KL
divergence", http://joschu.net/blog/kl-approx.html), and folding a KL penalty into the reward.

Pure tensor functions on [B, T] log-probabilities of the sampled tokens. Each estimator, averaged over
tokens sampled from the policy, estimates KL(policy || reference).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# kind -> fn(log_ratio = logp - ref_logp, clamp) -> kl
_ESTIMATORS: dict[str, Callable[[torch.Tensor, float | None], torch.Tensor]] = {}


def _estimator(*kinds: str):
    def register(fn):
        for kind in kinds:
            _ESTIMATORS[kind] = fn
        return fn

    return register


@_estimator("k1")
def _k1(log_ratio: torch.Tensor, clamp: float | None) -> torch.Tensor:
    return log_ratio


@_estimator("k2")
def _k2(log_ratio: torch.Tensor, clamp: float | None) -> torch.Tensor:
    return 0.5 * log_ratio.square()


@_estimator("k3", "low_var_kl")
def _k3(log_ratio: torch.Tensor, clamp: float | None) -> torch.Tensor:
    # exp(x) - x - 1 with x = ref - logp: unbiased and never negative, but exp overflows on large x,
    # hence verl's clamps on x and on the result.
    x = -log_ratio
    if clamp is not None:
        x = x.clamp(-clamp, clamp)
    kl = torch.exp(x) - x - 1
    return kl if clamp is None else kl.clamp(-clamp, clamp)


KL_KINDS = tuple(_ESTIMATORS)


def kl_penalty(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, kind: str = "k1",
               clamp: float | None = 10.0) -> torch.Tensor:
    """Per-token KL estimate [B, T] from the sampled tokens' log-probabilities under policy and reference.

    - ``"k1"``: ``logp - ref`` (unbiased, high variance, can be negative).
    - ``"k2"``: ``0.5 * (logp - ref)^2`` (biased, never negative; its gradient is that of the true KL).
    - ``"k3"`` / ``"low_var_kl"`` (verl's name): ``exp(ref - logp) - (ref - logp) - 1``, with the
      log-ratio clamped to [-clamp, clamp] before the exp and the result clamped to [-clamp, clamp].

    ``clamp`` applies to k3 only; None disables it. Values on padding are whatever the inputs give:
    mask them in the caller.
    """
    if kind not in _ESTIMATORS:
        raise ValueError(f"unknown KL kind {kind!r}; expected one of {', '.join(KL_KINDS)}")
    if logp_BT.shape != ref_logp_BT.shape:
        raise ValueError(f"shape mismatch: logp {tuple(logp_BT.shape)} vs ref_logp {tuple(ref_logp_BT.shape)}")
    return _ESTIMATORS[kind](logp_BT - ref_logp_BT, clamp)


def kl_in_reward(reward_BT: torch.Tensor, kl_BT: torch.Tensor, mask_BT: torch.Tensor, beta: float) -> torch.Tensor:
    """Token-level reward with the KL penalty folded in: ``reward - beta * kl`` on response tokens
    (mask 1), ``reward`` unchanged elsewhere. The penalty is a reward, not a loss: pass a detached kl."""
    if not reward_BT.shape == kl_BT.shape == mask_BT.shape:
        raise ValueError(f"shape mismatch: reward {tuple(reward_BT.shape)}, kl {tuple(kl_BT.shape)}, "
                         f"mask {tuple(mask_BT.shape)}")
    return torch.where(mask_BT.bool(), reward_BT - beta * kl_BT, reward_BT)
