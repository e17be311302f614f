"""A user's own reward function from a Python file: ``reward.custom=path/to/file.py:function``.

The function replaces the registry for every sample (as verl's ``custom_reward_function``):
``function(data_source, response, ground_truth, extra_info)`` returning a ``RewardOutput`` or a
number (then ``correct`` is ``score >= 1``).
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path

from megareason.rewards.registry import RewardOutput

Scorer = Callable[[str, str, str, dict], RewardOutput]


def load_custom(spec: str) -> Scorer:
    """Import ``path.py:function`` and wrap it as a scorer; errors name the file and function."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise ValueError(f"reward.custom must look like path/to/file.py:function, got {spec!r}")
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"reward.custom: no file {path}")
    module_spec = importlib.util.spec_from_file_location(f"megareason_custom_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward.custom: {path} has no function {name!r}")
    if len(inspect.signature(fn).parameters) != 4:
        raise ValueError(f"reward.custom: {path}:{name} must take (data_source, response, ground_truth, extra_info)")

    def scorer(data_source: str, response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
        out = fn(data_source, response, ground_truth, extra_info)
        if isinstance(out, RewardOutput):
            return out
        if isinstance(out, bool) or not isinstance(out, int | float):
            raise TypeError(f"{path}:{name} returned {type(out).__name__}; expected a number or RewardOutput")
        return RewardOutput(score=float(out), correct=float(out) >= 1.0)

    return scorer
