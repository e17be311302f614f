"""Rollout metrics as pure tensor functions."""

from __future__ import annotations

import torch


def logprob_mismatch(trainer_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor,
                     mask_BT: torch.Tensor) -> dict[str, float]:
    """How far the trainer's log-probs of the sampled tokens are from the generator's.

    ``token_mult_prob_error`` is the mean over masked tokens of exp(|Δlogp|) (NeMo-RL's convention:
    1.0 is a perfect match); ``max_abs_logp_diff`` the largest |Δlogp|. All inputs are [B, T].
    """
    mask = mask_BT.bool()
    if not mask.any():
        raise ValueError("logprob_mismatch needs at least one masked-in token")
    diff = abs_logp_diff(trainer_logp_BT, rollout_logp_BT, mask_BT)[mask]
    return {"token_mult_prob_error": diff.exp().mean().item(), "max_abs_logp_diff": diff.max().item()}


def mismatch_sums(trainer_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor,
                  mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """``logprob_mismatch`` as sums that add over micro-batches and ranks (the on-policy update measures
    it in its own forward pass): ``mismatch_sum`` of exp(|Δlogp|) over masked tokens, ``logp_diff_max``."""
    diff_BT = abs_logp_diff(trainer_logp_BT, rollout_logp_BT, mask_BT)
    return {"mismatch_sum": (diff_BT.exp() * mask_BT).sum(), "logp_diff_max": diff_BT.max()}


def abs_logp_diff(trainer_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor,
                  mask_BT: torch.Tensor) -> torch.Tensor:
    """|trainer - rollout| log-prob of each sampled token [B, T], 0 outside ``mask_BT``."""
    diff_BT = (trainer_logp_BT.detach().float() - rollout_logp_BT.float()).abs()
    return torch.where(mask_BT.bool(), diff_BT, 0.0)
