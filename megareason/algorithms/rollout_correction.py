"""Train/generation mismatch correction: importance weights from the trainer's and the generator's
log-probabilities of the sampled tokens, and the metrics that watch the mismatch.

vLLM samples from pi_vllm; the trainer's forward pass computes pi_train, which differs from it (bf16
kernels, batch composition, reduction order). The samples are off-policy for pi_train by the ratio
``rho_t = pi_train(y_t) / pi_vllm(y_t) = exp(logp - rollout_logp)``. Two corrections, as verl's rollout
correction (``docs/algo/rollout_corr.md``; Liu, Li et al. 2025, "When Speed Kills Stability") and slime's
``--use-tis`` (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training")
define them:

- TIS, token-level truncated importance sampling: each token's loss is weighted by ``min(rho_t, C)``.
- MIS, sequence-level masked importance sampling on the geometric mean ``rho_i = exp(mean_t log rho_t)``
  of a sequence's token ratios (verl's "geometric" rejection sampling): sequences with ``rho_i`` outside
  ``[1/C, C]`` are dropped; the ``"truncate"`` variant weights every sequence by ``min(rho_i, C)`` instead.

Weights are constants in the loss (detached), computed in float32. Inputs are [B, T]: ``logp_BT`` the
trainer's log-probs of the sampled tokens (pi_old's when updates are off-policy, as verl's decoupled
mode), ``rollout_logp_BT`` the engine's, ``mask_BT`` nonzero on scored response tokens. Masked-out
entries are replaced with ``torch.where`` before use, so NaN/inf on padding never reaches any output;
per-token log-ratios are clamped to +-20 (exp(20) ~ 5e8, verl's safety bound). Rows are never split, so
every per-row quantity is exact in any micro-batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MIS_MODES = ("mask", "truncate")
_LOG_RATIO_LIMIT = 20.0


class Correction(NamedTuple):
    """What ``rollout_correction`` returns.

    ``weight_BT``: float32 [B, T], detached, >= 0; 0 outside the returned mask. It weights each token's
    policy loss, as verl and slime do; since it is >= 0, multiplying the advantages by it does exactly
    that in ``ppo_policy_loss`` and ``gspo_policy_loss``: ``w * max(-A r, -A clip(r)) =
    max(-(wA) r, -(wA) clip(r))``, and the dual clip ``min(., -A c)`` scales the same way.
    ``mask_BT``: bool [B, T]: the input mask less the sequences MIS dropped. Aggregate with it so dropped
    sequences leave the denominators too (as verl does); the input mask keeps them counted at weight 0.
    ``metrics``: detached float32 scalars (see ``rollout_correction``).
    """

    weight_BT: torch.Tensor
    mask_BT: torch.Tensor
    metrics: dict[str, torch.Tensor]


def _check(logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> None:
    shapes = {"logp_BT": tuple(logp_BT.shape), "rollout_logp_BT": tuple(rollout_logp_BT.shape),
              "mask_BT": tuple(mask_BT.shape)}
    if len(set(shapes.values())) != 1 or len(shapes["logp_BT"]) != 2:
        raise ValueError(f"expected [B, T] tensors of one shape, got {shapes}")


def _check_mode(mode: str) -> None:
    if mode not in MIS_MODES:
        raise ValueError(f"unknown MIS mode {mode!r}; expected one of {', '.join(MIS_MODES)}")


def _check_cap(name: str, cap: float) -> None:
    if not cap >= 1:
        raise ValueError(f"{name} must be >= 1 (the weights are truncated at it), got {cap}")


def token_log_ratio(logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """``log rho_t = logp - rollout_logp`` [B, T], float32, detached, clamped to +-20, 0 outside the mask."""
    _check(logp_BT, rollout_logp_BT, mask_BT)
    m_BT = mask_BT.bool()
    diff_BT = logp_BT.detach().float() - rollout_logp_BT.detach().float()
    return torch.where(m_BT, diff_BT, 0.0).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)


def tis_weights(logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor, *,
                cap: float) -> torch.Tensor:
    """TIS: ``min(exp(logp - rollout_logp), cap)`` per masked token, 0 elsewhere; [B, T] float32, detached.
    No lower bound (slime's ``--tis-clip-low`` defaults to 0; verl truncates only above)."""
    _check_cap("cap", cap)
    return _tis(token_log_ratio(logp_BT, rollout_logp_BT, mask_BT), mask_BT.bool(), cap)


def sequence_ratio(logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """The geometric-mean ratio ``rho_i = exp(mean over row i's masked tokens of log rho_t)`` [B], float32,
    detached (token log-ratios clamped to +-20 first); 1 for a row without masked tokens."""
    return _sequence_ratio(token_log_ratio(logp_BT, rollout_logp_BT, mask_BT), mask_BT.bool())


def mis_weights(logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor, *, cap: float,
                mode: str = "mask") -> torch.Tensor:
    """MIS per-sequence weight [B], float32, detached, from ``rho_i = sequence_ratio(...)``:
    ``"mask"``: 1 if ``1/cap <= rho_i <= cap`` else 0 (the sequence is dropped);
    ``"truncate"``: ``min(rho_i, cap)`` (too-likely sequences are down-weighted, none dropped)."""
    _check_cap("cap", cap)
    _check_mode(mode)
    return _mis(sequence_ratio(logp_BT, rollout_logp_BT, mask_BT), cap, mode)


def mismatch_metrics(logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor,
                     mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """The mismatch itself, over masked tokens (detached float32 scalars; 0 when nothing is masked in):

    ``token_ratio_mean``, ``token_ratio_max``: mean and max of ``rho_t`` (1.0 is a perfect match);
    ``kl_k3``: KL(pi_vllm || pi_train) by Schulman's k3 estimator on tokens sampled from pi_vllm,
    ``mean(rho - 1 - log rho)`` (unbiased, never negative, low variance; verl's ``k3_kl``);
    ``kl_k1``: the same KL by k1, ``mean(rollout_logp - logp)`` (unbiased, can be negative; verl's ``kl``);
    ``tokens``, ``seqs``: the counts behind the means (masked tokens; rows with >= 1 of them), so means
    from several micro-batches combine exactly.
    """
    return _metrics(token_log_ratio(logp_BT, rollout_logp_BT, mask_BT), mask_BT.bool())


def rollout_correction(logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor, *,
                       tis_cap: float | None, mis_cap: float | None, mis_mode: str = "mask") -> Correction:
    """TIS and/or MIS together, with their metrics. ``tis_cap`` / ``mis_cap`` None turns that one off
    (both None: weight 1 on masked tokens, the mask unchanged, the metrics still measured).

    ``weight_BT = tis_weights(cap=tis_cap) * mis_weights(cap=mis_cap, mode=mis_mode)`` (the sequence
    weight broadcast over its tokens) on the kept tokens; see ``Correction`` for the returned mask.
    Metrics: those of ``mismatch_metrics``, plus ``token_truncated_frac``: fraction of masked tokens with
    ``rho_t > tis_cap``; ``seq_masked_frac``: fraction of sequences MIS dropped (``"mask"``);
    ``seq_truncated_frac``: fraction with ``rho_i > mis_cap`` (``"truncate"``); each 0 when not in use.
    Sequences are the rows with >= 1 masked token; every weight and fraction is exact per row.
    """
    for name, cap in (("tis_cap", tis_cap), ("mis_cap", mis_cap)):
        if cap is not None:
            _check_cap(name, cap)
    _check_mode(mis_mode)
    log_ratio_BT = token_log_ratio(logp_BT, rollout_logp_BT, mask_BT)
    m_BT = mask_BT.bool()
    rows_B = m_BT.any(dim=1)
    metrics = _metrics(log_ratio_BT, m_BT)
    tokens, seqs = metrics["tokens"].clamp(min=1), metrics["seqs"].clamp(min=1)
    weight_BT = torch.where(m_BT, 1.0, 0.0)
    zero = weight_BT.new_zeros(())
    metrics |= {"token_truncated_frac": zero, "seq_masked_frac": zero, "seq_truncated_frac": zero}
    if tis_cap is not None:
        weight_BT = _tis(log_ratio_BT, m_BT, tis_cap)
        metrics["token_truncated_frac"] = (m_BT & (log_ratio_BT.exp() > tis_cap)).sum() / tokens
    if mis_cap is not None:
        ratio_B = _sequence_ratio(log_ratio_BT, m_BT)
        seq_weight_B = _mis(ratio_B, mis_cap, mis_mode)
        if mis_mode == "mask":
            m_BT = m_BT & (seq_weight_B > 0).unsqueeze(1)
            metrics["seq_masked_frac"] = (rows_B & (seq_weight_B == 0)).sum() / seqs
        else:
            metrics["seq_truncated_frac"] = (rows_B & (ratio_B > mis_cap)).sum() / seqs
        weight_BT = torch.where(m_BT, weight_BT * seq_weight_B.unsqueeze(1), 0.0)
    return Correction(weight_BT=weight_BT, mask_BT=m_BT, metrics=metrics)


# Below: on log_ratio_BT = token_log_ratio(...) (0 outside the mask) and the bool mask m_BT.
def _tis(log_ratio_BT: torch.Tensor, m_BT: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.where(m_BT, log_ratio_BT.exp().clamp(max=cap), 0.0)


def _sequence_ratio(log_ratio_BT: torch.Tensor, m_BT: torch.Tensor) -> torch.Tensor:
    return (log_ratio_BT.sum(dim=1) / m_BT.sum(dim=1).clamp(min=1)).exp()


def _mis(ratio_B: torch.Tensor, cap: float, mode: str) -> torch.Tensor:
    if mode == "truncate":
        return ratio_B.clamp(max=cap)
    return ((ratio_B >= 1 / cap) & (ratio_B <= cap)).float()


def _metrics(log_ratio_BT: torch.Tensor, m_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    ratio_BT = torch.where(m_BT, log_ratio_BT.exp(), 0.0)
    tokens = m_BT.sum()
    n = tokens.clamp(min=1)
    return {
        "token_ratio_mean": ratio_BT.sum() / n,
        "token_ratio_max": ratio_BT.max(),
        "kl_k3": torch.where(m_BT, ratio_BT - 1 - log_ratio_BT, 0.0).sum() / n,
        "kl_k1": -log_ratio_BT.sum() / n,
        "tokens": tokens.float(),
        "seqs": m_BT.any(dim=1).sum().float(),
    }
