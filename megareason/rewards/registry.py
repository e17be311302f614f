"""Reward-function registry keyed by ``data_source``.

Every reward function has the signature
``fn(response_text, ground_truth, extra_info) -> RewardOutput`` and is
registered under one canonical name plus optional aliases.  A lookup tries the
exact name, then the name with case and surrounding blanks ignored (``Grade`` ->
``grade``), then the names other projects use for the same families
(``source_names``: verl's ``openai/gsm8k`` -> ``gsm8k``, ``aime2024`` -> ``math``, ...).
Unknown names raise ``ValueError`` naming the nearest known names and the config
keys that plug in a function of one's own.  A name ``<source>_tinyv`` looks up
``<source>``: its rule reward runs first, then the TinyV verifier
(``megareason.rewards.tinyv``) rescores the batch.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from megareason.rewards.source_names import SOURCE_NAMES, SOURCE_PREFIXES, UNSUPPORTED_SOURCES


@dataclass(frozen=True)
class RewardOutput:
    """Result of scoring one response.

    ``score`` is the scalar used as the training reward; ``correct`` says
    whether the final answer is right (used for accuracy and pass@k), which
    is independent of any format credit folded into ``score``. ``parts``: (name, score) of each function
    a weighted sum of several (``reward.funcs``) added up, logged as ``reward/<name>``.
    """

    score: float
    correct: bool
    parts: tuple[tuple[str, float], ...] = ()


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
        taken = [n for n in names if n.strip().lower() in _folded_names()]
        if taken:
            raise ValueError(f"reward data_source already registered: {', '.join(taken)}")
        for n in names:
            _REGISTRY[n] = fn
        return fn

    return decorator


def registered_sources() -> list[str]:
    """All registered names (canonical and aliases), sorted."""
    return sorted(_REGISTRY)


def _folded_names() -> dict[str, tuple[str, dict]]:
    """Every known name, lower-cased and stripped -> (registered family, settings): registered names
    first, then ``SOURCE_NAMES``."""
    folded = {k.strip().lower(): v for k, v in SOURCE_NAMES.items()}
    folded.update({n.strip().lower(): (n, {}) for n in _REGISTRY})
    return folded


def _with_settings(fn: RewardFn, settings: dict, response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
    """``fn`` with ``settings`` under the row's own ``extra_info`` (the row's values win)."""
    return fn(response, ground_truth, {**settings, **extra_info})


def resolve_source(data_source: str) -> tuple[str, dict] | None:
    """(registered family, extra_info settings) scoring ``data_source``, or None when no name matches."""
    name = base_source(data_source)
    if name in _REGISTRY:
        return name, {}
    key = name.strip().lower()
    found = _folded_names().get(key)
    if found is None:
        found = next((v for prefix, v in SOURCE_PREFIXES.items() if key.startswith(prefix)), None)
    return found


def unknown_source_message(data_source: str) -> str:
    """Why ``data_source`` has no reward: what it needs (for a name verl scores with something
    megareason lacks), the nearest known names, and the config keys for a function of one's own."""
    name = base_source(data_source)
    why = {k.lower(): v for k, v in UNSUPPORTED_SOURCES.items()}.get(name.strip().lower())
    known = {n.lower(): n for n in [*SOURCE_NAMES, *_REGISTRY]}
    nearest = [known[k] for k in difflib.get_close_matches(name.strip().lower(), list(known), n=3, cutoff=0.6)]
    return (f"unknown data_source {data_source!r}" + (f": it {why}" if why else "")
            + (f"; nearest: {', '.join(nearest)}" if nearest else "")
            + f"; to score it with a function of your own, map it in reward.by_source ({name}: "
            "path/to/file.py:compute_score) or set reward.custom=path/to/file.py:compute_score for every "
            f"sample; registered: {', '.join(registered_sources())}")


def get_reward_fn(data_source: str) -> RewardFn:
    """Return the (rule) reward function for ``data_source`` or, for ``<source>_tinyv``, that of
    ``<source>`` (see the module docstring for the names tried); unknown -> ``ValueError``."""
    found = resolve_source(data_source)
    if found is None:
        raise ValueError(unknown_source_message(data_source))
    family, settings = found
    fn = _REGISTRY[family]
    return partial(_with_settings, fn, settings) if settings else fn


def compute_score(
    data_source: str, response: str, ground_truth: str, extra_info: dict | None = None,
    prompt: list[dict] | None = None,
) -> RewardOutput:
    """Score ``response`` against ``ground_truth`` with the ``data_source`` reward. ``prompt`` (the
    chat messages) is accepted so every scorer takes the same arguments; the built-in rewards do not
    read it."""
    return get_reward_fn(data_source)(response, ground_truth, extra_info if extra_info is not None else {})
