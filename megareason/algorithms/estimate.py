"""Which advantage estimator a run uses (``algorithm.name``), on a step's rows.

The estimators themselves are in ``advantages`` (GRPO family, REINFORCE++-baseline, GAE, whitening), RARO's
per-role scaling in ``raro`` and the KL-in-reward estimators in ``kl``; this module picks and combines them
as the configured algorithm does. Pure tensor code: ``exp`` is any record with the fields of ``Rows``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from megareason.algorithms.advantages import (
    broadcast_to_tokens,
    gae,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    whiten,
)
from megareason.algorithms.kl import kl_in_reward, kl_penalty
from megareason.algorithms.raro import role_advantage_scale
from megareason.config.schema import AlgorithmConfig, RaroConfig


class Rows(Protocol):
    """The fields of a step's rows the estimators read (the trainer's ``Experience``): ``mask_BT`` (response
    tokens), ``lengths_B``, and the old policy's and reference's log-probs and the critic's values where the
    algorithm needs them."""

    mask_BT: torch.Tensor
    lengths_B: torch.Tensor
    old_logp_BT: torch.Tensor | None
    ref_logp_BT: torch.Tensor | None
    values_BT: torch.Tensor | None

    def __len__(self) -> int: ...


def compute_advantages(alg: AlgorithmConfig, raro: RaroConfig, exp: Rows, reward_B: torch.Tensor,
                       group_B: torch.Tensor, is_critic_B: torch.Tensor | None = None,
                       parts: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """GRPO: the group-relative outcome advantage on every response token. RARO: the same within the
    policy groups and within the critic groups, scaled so that the loss of each mini-batch (``parts``, row
    indices; None: one) is lambda_pol * J_pol + lambda_crit * J_crit. REINFORCE++-baseline:
    ``algorithms.advantages.reinforce_pp_baseline_advantages``. PPO: the outcome reward on the last
    response token (minus the per-token KL when kl_in_reward), GAE with the critic's values, whitened
    advantages; also the critic's targets (``returns_BT``). The KL in the reward (PPO and REINFORCE++-baseline)
    is ``algorithm.kl_reward_kind``'s estimate on the old policy's log-probs."""
    mask_BT = exp.mask_BT
    if alg.name == "reinforce_pp_baseline":
        kl_BT = (kl_penalty(exp.old_logp_BT, exp.ref_logp_BT, alg.kl_reward_kind)
                 if alg.kl_in_reward and alg.kl_coef > 0 else None)
        return {"adv_BT": reinforce_pp_baseline_advantages(reward_B, group_B, mask_BT, kl_BT=kl_BT,
                                                           kl_coef=alg.kl_coef)}
    if alg.name in ("grpo", "raro"):
        adv_B = grpo_advantages(reward_B, group_B, mode=alg.grpo_mode)
        if alg.name == "raro":
            scale_B = torch.empty_like(adv_B)
            for rows in parts or [torch.arange(len(adv_B))]:
                scale_B[rows] = role_advantage_scale(is_critic_B[rows], mask_BT[rows], alg.loss_agg_mode,
                                                     lambda_pol=raro.lambda_pol, lambda_crit=raro.lambda_crit)
            adv_B = adv_B * scale_B
        return {"adv_BT": broadcast_to_tokens(adv_B, mask_BT)}
    last_B = exp.lengths_B - 1
    token_reward_BT = torch.zeros_like(mask_BT)
    token_reward_BT[torch.arange(len(exp)), last_B] = reward_B
    if alg.kl_in_reward and alg.kl_coef > 0:
        kl_BT = kl_penalty(exp.old_logp_BT, exp.ref_logp_BT, alg.kl_reward_kind) * mask_BT
        token_reward_BT = kl_in_reward(token_reward_BT, kl_BT, mask_BT, alg.kl_coef)
    adv_BT, returns_BT = gae(token_reward_BT, exp.values_BT, mask_BT, gamma=alg.gamma, lam=alg.lam)
    if alg.whiten_advantages:
        adv_BT = whiten(adv_BT, mask_BT)
    return {"adv_BT": adv_BT, "returns_BT": returns_BT}
