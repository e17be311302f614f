"""The metrics of one RL step (``step_metrics``), as written to ``metrics.jsonl`` and the loggers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megareason.algorithms.advantages import explained_variance
from megareason.config import Config
from megareason.rewards.tinyv import FALLBACK_ERROR, TIMEOUT_ERROR, is_tinyv
from megareason.rollout.metrics import logprob_mismatch
from megareason.rollout.records import WeightUpdate
from megareason.trainer.driver import learning_rate
from megareason.trainer.experience import Experience
from megareason.trainer.stats import CriticStats, PolicyStats, mean_metrics
from megareason.trainer.steps import StepRows

_ENV_KEYS = ("turns", "searches", "tool_errors", "em", "f1", "retrieval_recall", "citation_precision")


@dataclass
class UpdateStats:
    """What a step's update reported: one record per optimizer step of each role, one per engine synced
    (all empty when the update was skipped)."""

    actor: list[PolicyStats] = field(default_factory=list)
    critic: list[CriticStats] = field(default_factory=list)
    sync: list[WeightUpdate] = field(default_factory=list)


def step_metrics(cfg: Config, step: int, exp: Experience, rows: StepRows, update: UpdateStats,
                 timer: dict[str, float]) -> dict[str, float]:
    """The step's metrics, all floats:

    * samples (``rows.scored``, the policy's): ``reward/mean``, ``reward/std``, ``accuracy``,
      ``reward/errors`` (scorer exceptions), ``reward/timeouts``, ``response_length/{mean,max,clip_ratio}``
      (clip: cut by rollout.max_tokens), ``by_source/<data_source>/{reward,accuracy}``, and with
      ``reward.funcs`` each function's mean score ``rewards/<function>/mean`` (TRL's names);
    * ``rollout/token_mult_prob_error`` (mean exp|Δlogp| between trainer and vLLM, 1 = equal) and
      ``rollout/max_abs_logp_diff``: from the old log-probs, or measured by the on-policy update itself;
    * ``actor/{loss,pg_loss,grad_norm,clipfrac,ppo_kl,entropy,kl}`` (``kl``: the KL loss term's) averaged
      over the step's optimizer steps, and ``actor/lr``; with rollout correction (algorithm.rollout_tis_cap
      / rollout_mis_cap) ``actor/is_ratio`` (mean pi_train / pi_vllm per token), ``actor/is_ratio_max``,
      ``actor/is_kl`` (k3 estimate of KL(pi_vllm || pi_train)), ``actor/is_truncated`` (tokens over the
      TIS cap) and ``actor/is_masked`` (sequences MIS dropped);
    * PPO: ``critic/{loss,vf_loss,grad_norm,vf_clipfrac,vpred}``, ``critic/explained_variance`` and
      ``critic/returns_var`` of the values the advantages used (before this step's critic update);
    * environments: ``env/{turns,searches,tool_errors,em,f1,retrieval_recall,citation_precision}``;
    * ``sync/{bytes,seconds}`` of the weight sync, ``time/<phase>`` (seconds; ``time/step`` their sum),
      ``throughput/tokens_per_s``; and the variant's own (RARO: ``raro/*``, ``raro.critic``; one step
      off-policy: ``rollout/policy_version`` and ``rollout/staleness`` of the batch, ``time/generate_wait``
      in the sum, ``time/engine_generate``, the engines' own seconds on it, not in the sum).
    """
    scored = rows.scored
    m = {**_sample_metrics(scored), **rows.metrics}
    if exp.old_logp_BT is not None:
        m.update({f"rollout/{k}": v for k, v in logprob_mismatch(exp.old_logp_BT, exp.rollout_logp_BT,
                                                                 exp.mask_BT).items()})
    elif update.actor:  # measured in the (single) update's forward pass
        first = update.actor[0]
        m["rollout/token_mult_prob_error"] = first.mismatch_sum / max(first.tokens, 1)
        m["rollout/max_abs_logp_diff"] = first.logp_diff_max
    if update.actor:
        m.update(mean_metrics("actor", update.actor))
        if update.actor[0].is_ratio_max is not None:
            m["actor/is_ratio_max"] = max(s.is_ratio_max for s in update.actor)
    m["actor/lr"] = learning_rate(cfg.optim.lr, cfg, step)
    if update.critic:
        m.update(mean_metrics("critic", update.critic))
        m["critic/explained_variance"] = explained_variance(exp.values_BT, exp.returns_BT, exp.mask_BT)
        ret = exp.returns_BT[exp.mask_BT.bool()]
        m["critic/returns_var"] = ret.var(unbiased=False) if ret.numel() else 0.0
    episodes = [s.env for s in scored if s.env]
    for key in _ENV_KEYS:
        if episodes and key in episodes[0]:
            m[f"env/{key}"] = sum(float(e[key]) for e in episodes) / len(episodes)
    if update.sync:
        m["sync/bytes"] = sum(u.bytes for u in update.sync)
        m["sync/seconds"] = max(u.seconds for u in update.sync)
    m.update({f"time/{k}": v for k, v in timer.items()})
    m["throughput/tokens_per_s"] = int(exp.lengths_B.sum()) / max(timer["step"], 1e-9)
    return {k: float(v) for k, v in m.items()}


def _sample_metrics(scored) -> dict[str, float]:
    """Rewards over the rows that have one (RARO's masked rows have None: ``reward/masked_rate``, set by
    the variant, says how many; no ``reward/mean`` when none has); accuracy and lengths over every sample."""
    rewards = torch.tensor([s.reward for s in scored if s.reward is not None])
    lengths = torch.tensor([float(s.response_tokens) for s in scored])
    m = {"accuracy": sum(s.correct for s in scored) / len(scored),
         "response_length/mean": lengths.mean(), "response_length/max": lengths.max(),
         "response_length/clip_ratio": sum(s.truncated for s in scored) / len(scored),
         "reward/errors": sum(bool(s.score_error) and not s.timed_out for s in scored),
         "reward/timeouts": sum(s.timed_out for s in scored)}
    if len(rewards):
        m |= {"reward/mean": rewards.mean(), "reward/std": rewards.std() if len(rewards) > 1 else 0.0}
    for name in sorted({k for s in scored for k in s.parts}):  # reward.funcs: each function's own score (TRL's)
        values = [s.parts[name] for s in scored if name in s.parts]
        m[f"rewards/{name}/mean"] = sum(values) / len(values)
    if any(is_tinyv(s.data_source) for s in scored):  # LLM-verified samples given no verdict, and timeouts
        m["reward/verifier_fallbacks"] = sum(FALLBACK_ERROR in s.score_error for s in scored)
        m["reward/verifier_timeouts"] = sum(TIMEOUT_ERROR in s.score_error for s in scored)
    for source in sorted({s.data_source for s in scored}):
        mine = [s for s in scored if s.data_source == source]
        # by_source/...: no metric name may be a path prefix of another (MLflow's file store: one file each)
        rewarded = [s.reward for s in mine if s.reward is not None]
        if rewarded:
            m[f"by_source/{source}/reward"] = sum(rewarded) / len(rewarded)
        m[f"by_source/{source}/accuracy"] = sum(s.correct for s in mine) / len(mine)
    return m
