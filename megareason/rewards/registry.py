"""Reward-function registry keyed by ``data_source``.

Every reward function has the signature
``fn(response_text, ground_truth, extra_info) -> RewardOutput`` and is
registered under one canonical name plus optional aliases.  Lookups are by
exact string; unknown names raise ``ValueError`` listing what is available.
A name ``<source>_tinyv`` looks up ``<source>``: its rule reward runs first, then
the TinyV verifier (``megareason.rewards.tinyv``) rescores the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RewardOutput:
    """Result of scoring one response.

    ``score`` is the scalar used as the training reward; ``correct`` says
    whether the final answer is right (used for accuracy and pass@k), which
    is independent of any format credit folded into ``score``.
    """

    score: float
    correct: bool


RewardFn = Callable[[str, str, dict], RewardOutput]

_REGISTRY: dict[str, RewardFn] = {}

# data_source suffix routing a sample through the TinyV LLM verifier after its rule reward.
TINYV_SUFFIX = "_tinyv"


def base_source(data_source: str) -> str:
    """The registered name whose rule reward scores ``data_source``: ``math_tinyv`` -> ``math``."""
    return data_source.removesuffix(TINYV_SUFFIX)


def register(name: str, *aliases: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering ``fn`` under ``name`` and each alias.

    Raises ``ValueError`` if any of the names is already taken, so two
    families can never silently shadow each other.  Nothing is registered
    when a collision is detected.
    """
    names = (name, *aliases)

    def decorator(fn: RewardFn) -> RewardFn:
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate names in registration of {fn.__name__}: {names}")
        suffixed = [n for n in names if n.endswith(TINYV_SUFFIX)]
        if suffixed:  # such a name would be read as "<base> + TinyV"
            raise ValueError(f"reward names must not end in {TINYV_SUFFIX!r}: {', '.join(suffixed)}")
        taken = [n for n in names if n in _REGISTRY]
        if taken:
            raise ValueError(f"reward data_source already registered: {', '.join(taken)}")
        for n in names:
            _REGISTRY[n] = fn
        return fn

    return decorator


def registered_sources() -> list[str]:
    """All registered names (canonical and aliases), sorted."""
    return sorted(_REGISTRY)


def get_reward_fn(data_source: str) -> RewardFn:
    """Return the (rule) reward function for ``data_source`` or, for ``<source>_tinyv``, that of
    ``<source>``; unknown -> ``ValueError``."""
    try:
        return _REGISTRY[base_source(data_source)]
    except KeyError:
        raise ValueError(
            f"unknown data_source {data_source!r}; registered: {', '.join(registered_sources())}"
        ) from None


def compute_score(
    data_source: str, response: str, ground_truth: str, extra_info: dict | None = None
) -> RewardOutput:
    """Score ``response`` against ``ground_truth`` with the ``data_source`` reward."""
    return get_reward_fn(data_source)(response, ground_truth, extra_info if extra_info is not None else {})
