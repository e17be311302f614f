"""RL algorithms as pure tensor functions: advantage estimators, KL estimators, PPO-family losses.

No Ray, Megatron or config objects here; tensors are named by shape (``logp_BT``, ``adv_B``). Losses
return (numerator, denominator) pairs for one micro-batch, which is what ``models.schedule`` consumes.
"""

from megareason.algorithms.advantages import (
    GRPO_MODES,
    broadcast_to_tokens,
    explained_variance,
    gae,
    gae_reference,
    grpo_advantages,
    whiten,
)
from megareason.algorithms.kl import KL_KINDS, kl_in_reward, kl_penalty
from megareason.algorithms.losses import AGG_MODES, aggregate, entropy_bonus, ppo_policy_loss, value_loss

__all__ = [
    "AGG_MODES",
    "GRPO_MODES",
    "KL_KINDS",
    "aggregate",
    "broadcast_to_tokens",
    "entropy_bonus",
    "explained_variance",
    "gae",
    "gae_reference",
    "grpo_advantages",
    "kl_in_reward",
    "kl_penalty",
    "ppo_policy_loss",
    "value_loss",
    "whiten",
]
