"""PPO-family losses as (numerator, denominator) pairs for one micro-batch.

A loss function given to ``models.schedule.forward_backward`` returns (loss_sum, count, metrics) for
one micro-batch, and megatron-core divides the accumulated gradients by ``count`` summed over all
micro-batches and data-parallel ranks. So every loss here returns ``(numerator, denominator)`` from
``aggregate``: the loss over a global batch is ``sum(numerators) / sum(denominators)``, exactly, in every
aggregation mode and however the batch is split into micro-batches, as long as no row (sequence) is
split across micro-batches. Losses of one mode share the denominator, so their numerators add.

Pure tensor functions. ``mask_BT`` is 1 (or True) on scored response tokens; anything nonzero counts.
Masked-out entries of every input are replaced with ``torch.where`` (not multiplied by 0) before use,
so NaN or inf on padding never reaches the loss, its gradient or the metrics. Metrics are detached
per-micro-batch values.
"""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# exp(20) ~ 5e8: far past any clip range; keeps exp finite, as verl does (tokens beyond it get no gradient).
_LOG_RATIO_LIMIT = 20.0


def _same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"expected [B, T] tensors of one shape, got {shapes}")


def _zero_unmasked(m_BT: torch.Tensor, *xs_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(torch.where(m_BT, x_BT, x_BT.new_zeros(())) for x_BT in xs_BT)


def _masked_mean(x_BT: torch.Tensor, m_BT: torch.Tensor) -> torch.Tensor:
    return torch.where(m_BT, x_BT, x_BT.new_zeros(())).sum() / m_BT.sum().clamp(min=1)


def aggregate(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, *,
              norm_length: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses [B, T] -> (numerator, denominator) for one micro-batch; the loss is their ratio.

    - ``"token-mean"``: sum over masked tokens / number of masked tokens.
    - ``"seq-mean-token-sum"``: sum over rows of each row's masked sum / number of rows with >= 1 masked
      token.
    - ``"seq-mean-token-mean"``: sum over rows of each row's masked mean / rows with >= 1 masked token.
    - ``"seq-mean-token-sum-norm"`` (Dr. GRPO's constant normaliser, Liu et al. 2025, arXiv 2503.20783;
      verl's mode of that name with ``loss_scale_factor``): sum over rows of each row's masked sum /
      ``norm_length`` / rows with >= 1 masked token. ``norm_length`` is a constant (the maximum response
      length), never the batch's padded width, so every token of every row and step weighs the same.
      Required by this mode, ignored by the others.

    Rows without masked tokens add 0 to both. The numerator keeps ``loss_BT``'s dtype and gradient; the
    denominator is an int64 count. Summing numerators over micro-batches and dividing by the summed
    denominators gives the full-batch value in every mode, because each row's contribution depends on
    that row alone (and the constant ``norm_length``) and each denominator is a count.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {', '.join(AGG_MODES)}")
    if mode == "seq-mean-token-sum-norm" and not (norm_length is not None and norm_length > 0):
        raise ValueError(f"loss aggregation mode {mode!r} needs norm_length > 0 (a fixed length such as the "
                         f"maximum response length), got {norm_length}")
    _same_shape(loss_BT=loss_BT, mask_BT=mask_BT)
    m_BT = mask_BT.bool()
    masked_BT = torch.where(m_BT, loss_BT, loss_BT.new_zeros(()))
    if mode == "token-mean":
        return masked_BT.sum(), m_BT.sum()
    tokens_B = m_BT.sum(dim=1)
    rows = (tokens_B > 0).sum()
    if mode == "seq-mean-token-sum":
        return masked_BT.sum(), rows
    if mode == "seq-mean-token-sum-norm":
        return masked_BT.sum() / norm_length, rows
    return (masked_BT.sum(dim=1) / tokens_B.clamp(min=1)).sum(), rows


def ppo_policy_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_BT: torch.Tensor, mask_BT: torch.Tensor,
                    *, clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                    mode: str = "token-mean", norm_length: float | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (with optional dual clip). Returns (numerator, denominator, metrics),
    aggregated by ``mode`` (``norm_length``: see ``aggregate``).

    ``ratio = exp(logp - old_logp)`` (log-ratio clamped to +-20 for finiteness);
    per token ``max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``; with ``dual_clip = c``
    (c > 1, Ye et al. 2020 "Mastering Complex Control in MOBA Games", as verl) tokens with A < 0 take
    ``min(that, -A * c)``, bounding the loss when the ratio explodes on a negative advantage.
    Only ``logp_BT`` should carry gradient.

    Metrics (detached scalars, masked means over this micro-batch):
    ``clipfrac``: fraction of tokens where the clipped term was strictly larger, so taken;
    ``dual_clipfrac``: fraction where the dual-clip bound was taken (0 without dual clip);
    ``approx_kl``: mean of ``0.5 * (logp - old_logp)^2`` (the k2 estimator: never negative);
    ``ratio_max``: largest ratio over masked tokens (0 if there are none).
    """
    _same_shape(logp_BT=logp_BT, old_logp_BT=old_logp_BT, adv_BT=adv_BT, mask_BT=mask_BT)
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low} and {clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    m_BT = mask_BT.bool()
    logp_BT, old_logp_BT, adv_BT = _zero_unmasked(m_BT, logp_BT, old_logp_BT, adv_BT)
    log_ratio_BT = logp_BT - old_logp_BT
    ratio_BT = torch.exp(log_ratio_BT.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_taken_BT = torch.zeros_like(m_BT)
    if dual_clip is not None:
        bound_BT = -adv_BT * dual_clip
        dual_taken_BT = (adv_BT < 0) & (loss_BT > bound_BT)
        loss_BT = torch.where(dual_taken_BT, bound_BT, loss_BT)
    numerator, denominator = aggregate(loss_BT, m_BT, mode, norm_length=norm_length)
    with torch.no_grad():
        metrics = {
            "clipfrac": _masked_mean((clipped_BT > unclipped_BT).to(logp_BT.dtype), m_BT),
            "dual_clipfrac": _masked_mean(dual_taken_BT.to(logp_BT.dtype), m_BT),
            "approx_kl": _masked_mean(0.5 * log_ratio_BT.square(), m_BT),
            "ratio_max": torch.where(m_BT, ratio_BT, ratio_BT.new_zeros(())).max(),
        }
    return numerator, denominator, metrics


def value_loss(value_BT: torch.Tensor, old_value_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor,
               *, clip: float | None = 0.2,
               mode: str = "token-mean", norm_length: float | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss. Returns (numerator, denominator, metrics), aggregated as ``aggregate``.

    Per token ``0.5 * max((v - R)^2, (old + clip(v - old, -clip, clip) - R)^2)``; ``clip=None`` gives
    plain ``0.5 * (v - R)^2``. Only ``value_BT`` should carry gradient. Metrics (detached, masked means):
    ``vf_clipfrac``: fraction of tokens where the clipped term was strictly larger (0 without clipping).
    """
    _same_shape(value_BT=value_BT, old_value_BT=old_value_BT, returns_BT=returns_BT, mask_BT=mask_BT)
    if clip is not None and clip < 0:
        raise ValueError(f"clip must be >= 0 or None, got {clip}")
    m_BT = mask_BT.bool()
    value_BT, old_value_BT, returns_BT = _zero_unmasked(m_BT, value_BT, old_value_BT, returns_BT)
    unclipped_BT = (value_BT - returns_BT).square()
    if clip is None:
        loss_BT, taken_BT = 0.5 * unclipped_BT, torch.zeros_like(m_BT)
    else:
        clipped_value_BT = old_value_BT + (value_BT - old_value_BT).clamp(-clip, clip)
        clipped_BT = (clipped_value_BT - returns_BT).square()
        loss_BT, taken_BT = 0.5 * torch.maximum(unclipped_BT, clipped_BT), clipped_BT > unclipped_BT
    numerator, denominator = aggregate(loss_BT, m_BT, mode, norm_length=norm_length)
    return numerator, denominator, {"vf_clipfrac": _masked_mean(taken_BT.to(value_BT.dtype), m_BT).detach()}


def entropy_bonus(entropy_BT: torch.Tensor, mask_BT: torch.Tensor, coef: float,
                  mode: str, norm_length: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy bonus as a loss to minimise: ``-coef * entropy`` aggregated by ``mode``.
    Returns (numerator, denominator); with the policy loss's ``mode`` the numerators simply add."""
    return aggregate(-coef * entropy_BT, mask_BT, mode, norm_length=norm_length)
