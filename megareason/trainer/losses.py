"""The actor's and the critic's loss over one packed micro-batch, built from ``megareason.algorithms``.

A micro-batch is an ``experience.MicroBatch``: packed tokens plus per-token fields of the same layout.
Each sequence is unpacked to its own row first, so the sequence-mean aggregation modes see one row
per sequence. Both return (numerator, denominator, metrics) in the form ``models.schedule`` expects:
megatron-core divides the accumulated gradients by the denominators summed over micro-batches and
data-parallel ranks, which makes every aggregation mode exact under any split. Metrics are sums
(``*_sum`` over tokens, with ``tokens``; ``*_max``), so they combine across micro-batches and ranks.
"""

from __future__ import annotations

from functools import partial

import torch

from megareason.algorithms.gspo import gspo_policy_loss
from megareason.algorithms.kl import kl_penalty
from megareason.algorithms.losses import aggregate, entropy_bonus, ppo_policy_loss, value_loss
from megareason.algorithms.rollout_correction import rollout_correction
from megareason.config.schema import AlgorithmConfig
from megareason.models.packing import unpack_rows
from megareason.rollout.metrics import mismatch_sums


def _rows(x_1W: torch.Tensor, batch) -> torch.Tensor:
    if batch.cu_seqlens is None:
        return x_1W
    return unpack_rows(x_1W, batch.cu_seqlens)[0]


def policy_loss_fn(alg: AlgorithmConfig, on_policy: bool, norm_length: int | None = None):
    """The policy loss (``algorithm.policy_loss``: PPO's clipped token ratio or GSPO's sequence ratio, for
    GRPO, PPO, RARO and REINFORCE++ alike) + entropy bonus + KL loss term, one aggregation mode.
    ``on_policy`` (one update per rollout): the old policy is the current one, so the micro-batches carry
    no ``old_logp_BT`` and this forward pass measures the train/generation mismatch (``rollout_logp_BT``).
    With ``algorithm.rollout_tis_cap``/``rollout_mis_cap`` the advantages are weighted (and MIS-dropped
    sequences masked) by ``algorithms.rollout_correction`` on the old vs vLLM's log-probs.
    ``norm_length``: the constant of ``seq-mean-token-sum-norm`` (the trainer's rollout.max_tokens)."""
    # The KL loss term (estimator: kl_loss_kind): kl_coef's, or kl_loss_coef's beside the KL in the reward
    # (kl_in_reward, whose estimator is kl_reward_kind: algorithms/estimate.compute_advantages).
    kl_loss_coef = alg.kl_loss_coef if alg.kl_in_reward else alg.kl_coef
    corrected = alg.rollout_tis_cap > 0 or alg.rollout_mis_cap > 0

    def loss(logp_1W, entropy_1W, batch):
        f = batch.fields
        logp_BT, entropy_BT = _rows(logp_1W, batch), _rows(entropy_1W, batch)
        mask_BT, adv_BT = _rows(f["mask_BT"], batch), _rows(f["adv_BT"], batch)
        old_logp_BT = logp_BT.detach() if on_policy else _rows(f["old_logp_BT"], batch)
        tokens, loss_mask_BT, metrics = mask_BT.sum(), mask_BT, {}
        if corrected:
            c = rollout_correction(old_logp_BT, _rows(f["rollout_logp_BT"], batch), mask_BT,
                                   tis_cap=alg.rollout_tis_cap or None, mis_cap=alg.rollout_mis_cap or None,
                                   mis_mode=alg.rollout_mis_mode)
            adv_BT, loss_mask_BT = adv_BT * c.weight_BT, c.mask_BT.float()
            cm = c.metrics
            metrics = {"is_ratio_sum": cm["token_ratio_mean"] * tokens, "is_ratio_max": cm["token_ratio_max"],
                       "is_kl_sum": cm["kl_k3"] * tokens, "is_truncated_sum": cm["token_truncated_frac"] * tokens,
                       "is_masked_num": cm["seq_masked_frac"] * cm["seqs"], "is_masked_den": cm["seqs"]}
        surrogate = gspo_policy_loss if alg.policy_loss == "gspo" else partial(ppo_policy_loss,
                                                                               dual_clip=alg.dual_clip or None)
        num, den, m = surrogate(logp_BT, old_logp_BT, adv_BT, loss_mask_BT, clip_low=alg.clip_ratio_low,
                                clip_high=alg.clip_ratio_high, mode=alg.loss_agg_mode, norm_length=norm_length)
        kept = loss_mask_BT.sum()
        metrics |= {"tokens": tokens, "pg_loss_num": num.detach(), "pg_loss_den": den.float(),
                    "clipfrac_sum": m["clipfrac"] * kept, "ppo_kl_sum": m["approx_kl"] * kept,
                    "entropy_sum": (entropy_BT.detach() * mask_BT).sum()}
        if on_policy:
            metrics.update(mismatch_sums(logp_BT, _rows(f["rollout_logp_BT"], batch), mask_BT))
        if alg.entropy_coef:
            num = num + entropy_bonus(entropy_BT, loss_mask_BT, alg.entropy_coef, alg.loss_agg_mode, norm_length)[0]
        if kl_loss_coef > 0:
            kl_BT = kl_penalty(logp_BT, _rows(f["ref_logp_BT"], batch), alg.kl_loss_kind)
            num = num + aggregate(kl_loss_coef * kl_BT, loss_mask_BT, alg.loss_agg_mode, norm_length=norm_length)[0]
            metrics["kl_sum"] = (kl_BT.detach() * mask_BT).sum()
        return num, den, metrics

    return loss


def sft_loss_fn(mode: str, norm_length: int | None = None):
    """Negative log-likelihood of the response tokens (``mask_BT``), aggregated by ``mode``."""

    def loss(logp_1W, entropy_1W, batch):
        logp_BT, mask_BT = _rows(logp_1W, batch), _rows(batch.fields["mask_BT"], batch)
        num, den = aggregate(-logp_BT, mask_BT, mode, norm_length=norm_length)
        tokens = mask_BT.sum()
        return num, den, {"tokens": tokens, "nll_num": (-logp_BT.detach() * mask_BT).sum(), "nll_den": tokens}

    return loss


def value_loss_fn(alg: AlgorithmConfig, norm_length: int | None = None):
    """Clipped value loss on the critic's values (aligned: column t is the value before token t)."""

    def loss(values_1W, batch):
        f = batch.fields
        values_BT = _rows(shift_values(values_1W), batch)
        mask_BT = _rows(f["mask_BT"], batch)
        num, den, m = value_loss(values_BT, _rows(f["values_BT"], batch), _rows(f["returns_BT"], batch), mask_BT,
                                 clip=alg.value_clip or None, mode=alg.loss_agg_mode, norm_length=norm_length)
        tokens = mask_BT.sum()
        return num, den, {"tokens": tokens, "vf_loss_num": num.detach(), "vf_loss_den": den.float(),
                          "vf_clipfrac_sum": m["vf_clipfrac"] * tokens,
                          "vpred_sum": (values_BT.detach() * mask_BT).sum()}

    return loss


def shift_values(values_BT: torch.Tensor) -> torch.Tensor:
    """The value head's column t reads token t; the value of the state *before* token t is column t-1.
    (Column 0 and each packed sequence's first column are prompt tokens, never scored.)"""
    return torch.nn.functional.pad(values_BT[:, :-1], (1, 0))
