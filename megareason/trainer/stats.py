"""What one optimizer step reports back from the Megatron workers to the driver, as typed records.

A loss function (``trainer/losses.py``) returns its statistics as sums over tokens (``*_sum`` with
``tokens``), numerator/denominator pairs (``*_num``/``*_den``) and maxima (``*_max``); megatron-core's
schedule adds them over micro-batches and data-parallel ranks (``models.schedule.forward_backward``), so
they are exact under any split. The worker wraps them in the record of its loss (``from_step``: a loss
that reports a name the record lacks is a ``TypeError`` on the worker, not a silently missing metric),
and the driver turns a step's records into per-token means (``means``), averaged over the step's
optimizer steps (``mean_metrics``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import ClassVar


@dataclass(frozen=True)
class TrainStats:
    """One optimizer step: the aggregated loss, the gradient norm before clipping, the trained tokens."""

    loss: float
    grad_norm: float
    tokens: float
    NOT_MEANS: ClassVar[tuple[str, ...]] = ()  # sums reported elsewhere than in ``means``
    # MoE models: the routers' metrics (``models.moe.RouterWatch.metrics``), reported as they are
    moe: dict[str, float] | None = field(default=None, kw_only=True)

    @classmethod
    def from_step(cls, loss: float, grad_norm: float, sums: dict[str, float], moe: dict[str, float] | None = None):
        """From ``models.train.StepResult``'s fields; ``sums`` must name exactly this record's fields."""
        return cls(loss=loss, grad_norm=grad_norm, **sums, moe=moe)

    def means(self) -> dict[str, float]:
        """``loss``, ``grad_norm``, each ``X_num / X_den`` as ``X`` and each token sum ``X_sum`` as the
        per-token mean ``X``; ``None`` fields (statistics this run does not measure) are left out."""
        out = {"loss": self.loss, "grad_norm": self.grad_norm}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_num") and value is not None:
                out[f.name[:-4]] = value / max(getattr(self, f.name[:-4] + "_den"), 1)
            elif f.name.endswith("_sum") and value is not None and f.name not in self.NOT_MEANS:
                out[f.name[:-4]] = value / max(self.tokens, 1)
        out.update(self.moe or {})
        return out


@dataclass(frozen=True)
class PolicyStats(TrainStats):
    """The actor's clipped policy loss (``losses.policy_loss_fn``)."""

    pg_loss_num: float
    pg_loss_den: float
    clipfrac_sum: float
    ppo_kl_sum: float  # approximate KL(old || new) of the update
    entropy_sum: float
    kl_sum: float | None = None  # the KL loss term's KL to the reference (when it is a loss term)
    # On-policy only: the train/generation mismatch this very forward pass measured (``rollout.metrics``).
    mismatch_sum: float | None = None
    logp_diff_max: float | None = None
    # algorithm.rollout_tis_cap / rollout_mis_cap: the correction's ratios pi_train / pi_vllm (per token),
    # KL(pi_vllm || pi_train) (k3), tokens truncated by TIS, sequences MIS dropped (of all sequences).
    is_ratio_sum: float | None = None
    is_ratio_max: float | None = None
    is_kl_sum: float | None = None
    is_truncated_sum: float | None = None
    is_masked_num: float | None = None
    is_masked_den: float | None = None
    NOT_MEANS: ClassVar[tuple[str, ...]] = ("mismatch_sum",)  # rollout/* metrics (``trainer.metrics``)


@dataclass(frozen=True)
class CriticStats(TrainStats):
    """The critic's clipped value loss (``losses.value_loss_fn``)."""

    vf_loss_num: float
    vf_loss_den: float
    vf_clipfrac_sum: float
    vpred_sum: float


@dataclass(frozen=True)
class SftStats(TrainStats):
    """The supervised negative log-likelihood of the response tokens (``losses.sft_loss_fn``)."""

    nll_num: float
    nll_den: float


def mean_metrics(prefix: str, stats: Sequence[TrainStats]) -> dict[str, float]:
    """``prefix/name``: each of ``TrainStats.means`` averaged over a step's optimizer steps."""
    per_step = [s.means() for s in stats]
    return {f"{prefix}/{name}": sum(m[name] for m in per_step) / len(per_step) for name in per_step[0]}
