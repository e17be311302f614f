"""Rule-based reward functions, looked up by dataset ``data_source``.

Importing this package registers every family (math, gsm8k, countdown,
arithmetic, reasoning_format, multihop_qa, rubric).  Use
``compute_score(data_source, response, ground_truth, extra_info)`` or
``get_reward_fn(data_source)``.
"""

from megareason.rewards import (  # noqa: F401  (registration side effects)
    arithmetic,
    countdown,
    gsm8k,
    math,
    multihop_qa,
    reasoning_format,
    rubric,
)
from megareason.rewards.registry import (
    RewardOutput,
    compute_score,
    get_reward_fn,
    register,
    registered_sources,
)

__all__ = ["RewardOutput", "compute_score", "get_reward_fn", "register", "registered_sources"]
