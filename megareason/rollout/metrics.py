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
    diff = (trainer_logp_BT.float() - rollout_logp_BT.float()).abs()[mask]
    return {"token_mult_prob_error": diff.exp().mean().item(), "max_abs_logp_diff": diff.max().item()}
