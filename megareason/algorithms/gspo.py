"""GSPO, Group Sequence Policy Optimization (Zheng et al. 2025, "Group Sequence Policy Optimization",
arXiv 2507.18071): PPO's clipped surrogate on a length-normalised sequence-level importance ratio.

Pure tensor functions on [B, T] tensors, one row per sequence, in the contract of
``losses.ppo_policy_loss``: (numerator, denominator, metrics) from ``losses.aggregate``, exact under any
split of the rows into micro-batches (every quantity here is per row, and rows are never split).
Masked-out entries are replaced with ``torch.where`` before use, so NaN/inf on padding never reach the
loss, its gradient or the metrics.
"""

from __future__ import annotations

import torch

from megareason.algorithms.losses import _LOG_RATIO_LIMIT, _same_shape, _zero_unmasked, aggregate


def sequence_log_ratio(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-row mean of ``logp - old_logp`` over the row's masked tokens, [B] (0 for a row without any):
    the log of the length-normalised sequence ratio ``(pi(y|x) / pi_old(y|x)) ** (1 / |y|)``, which is the
    geometric mean of the token ratios. Keeps the inputs' gradient; NaN/inf on padding never reach it."""
    _same_shape(logp_BT=logp_BT, old_logp_BT=old_logp_BT, mask_BT=mask_BT)
    m_BT = mask_BT.bool()
    logp_BT, old_logp_BT = _zero_unmasked(m_BT, logp_BT, old_logp_BT)
    return (logp_BT - old_logp_BT).sum(dim=1) / m_BT.sum(dim=1).clamp(min=1)


def gspo_policy_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_BT: torch.Tensor, mask_BT: torch.Tensor,
                     *, clip_low: float, clip_high: float, mode: str = "seq-mean-token-mean",
                     norm_length: float | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071), in its GSPO-token
    form. Returns (numerator, denominator, metrics), the contract of ``ppo_policy_loss``.

    The importance ratio is the sequence's, length-normalised: ``s_i = exp(mean_t (logp - old_logp))``
    over row i's masked tokens (``sequence_log_ratio``; log clamped to +-20, no gradient past the clamp).
    Per token ``s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]``: its value is ``s_i`` on every token of the row,
    its gradient ``s_i * grad logp_t``; the loss is ``max(-A_t * s_it, -A_t * clip(s_it, 1 - clip_low,
    1 + clip_high))``, so clipping is decided per sequence. With one advantage per sequence (GRPO's,
    broadcast) and the paper's ``mode="seq-mean-token-mean"`` this has exactly GSPO's value and gradient
    (the paper's eq. for GSPO-token); per-token advantages pass through unchanged. Other modes weight each
    row's GSPO loss by its token count (``token-mean``: |y_i| / total tokens). The paper's clip range is
    far narrower than PPO's (3e-4 / 4e-4 in its experiments), so there is no default here. Only
    ``logp_BT`` should carry gradient. A per-token weight w >= 0 (``rollout_correction``) goes into the
    advantages: ``w * max(-A s, -A clip(s)) = max(-(wA) s, -(wA) clip(s))``.

    Metrics (detached, this micro-batch): ``clipfrac``: fraction of sequences (rows with >= 1 masked
    token) whose clipped term was taken (a row counts by its share of clipped tokens when advantages vary
    within it); ``ratio_mean``, ``ratio_max``: mean and max of ``s_i`` over those rows (0 if none);
    ``approx_kl``: token mean of ``0.5 * (logp - old_logp)^2`` (k2, as ``ppo_policy_loss``).
    """
    _same_shape(logp_BT=logp_BT, old_logp_BT=old_logp_BT, adv_BT=adv_BT, mask_BT=mask_BT)
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low} and {clip_high}")
    m_BT = mask_BT.bool()
    logp_BT, old_logp_BT, adv_BT = _zero_unmasked(m_BT, logp_BT, old_logp_BT, adv_BT)
    log_seq_ratio_B = sequence_log_ratio(logp_BT, old_logp_BT, m_BT).detach()
    # value log s_i on every token, gradient that of logp_t (logp - sg[logp] is 0 with gradient 1)
    log_ratio_BT = log_seq_ratio_B.unsqueeze(1) + (logp_BT - logp_BT.detach())
    ratio_BT = torch.exp(log_ratio_BT.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    numerator, denominator = aggregate(loss_BT, m_BT, mode, norm_length=norm_length)
    with torch.no_grad():
        rows_B = m_BT.any(dim=1)
        seq_ratio_B = torch.where(rows_B, torch.exp(log_seq_ratio_B.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)), 0.0)
        clip_num, clip_den = aggregate((clipped_BT > unclipped_BT).to(logp_BT.dtype), m_BT, "seq-mean-token-mean")
        metrics = {
            "clipfrac": clip_num / clip_den.clamp(min=1),
            "ratio_mean": seq_ratio_B.sum() / rows_B.sum().clamp(min=1),
            "ratio_max": seq_ratio_B.max(),
            "approx_kl": (0.5 * (logp_BT - old_logp_BT).square()).sum() / m_BT.sum().clamp(min=1),
        }
    return numerator, denominator, metrics
