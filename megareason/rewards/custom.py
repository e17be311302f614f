"""A user's own reward function from a Python file: ``reward.custom=path/to/file.py:function``.

The function replaces the registry for every sample (as verl's ``custom_reward_function``):
``function(data_source, response, ground_truth, extra_info)`` returning a ``RewardOutput`` or a
number (then ``correct`` is ``score >= 1``).

``load_custom`` returns a ``CustomScorer``: it pickles as just the file path and function name and
imports the file lazily in whichever process calls it, so it can be sent to reward worker processes
(``megareason.rewards.pool``), which a closure over the imported function could not.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path

from megareason.rewards.registry import RewardOutput

Scorer = Callable[[str, str, str, dict], RewardOutput]


def _import_function(path: Path, name: str) -> Callable:
    """Import ``path`` and return its 4-argument function ``name``; errors name the file and function."""
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
    return fn


class CustomScorer:
    """A ``Scorer`` calling ``name`` from the Python file ``path``, imported on first use per process.

    Picklable: only ``path`` and ``name`` travel; the imported function is dropped and re-imported
    on the other side.
    """

    def __init__(self, path: Path, name: str):
        self.path = path
        self.name = name
        self._fn: Callable | None = None

    def __getstate__(self) -> dict:
        return {"path": self.path, "name": self.name, "_fn": None}

    def __repr__(self) -> str:
        return f"CustomScorer({str(self.path)!r}, {self.name!r})"

    def __call__(self, data_source: str, response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
        if self._fn is None:
            self._fn = _import_function(self.path, self.name)
        out = self._fn(data_source, response, ground_truth, extra_info)
        if isinstance(out, RewardOutput):
            return out
        if isinstance(out, bool) or not isinstance(out, int | float):
            raise TypeError(f"{self.path}:{self.name} returned {type(out).__name__}; expected a number or RewardOutput")
        return RewardOutput(score=float(out), correct=float(out) >= 1.0)


def load_custom(spec: str) -> CustomScorer:
    """Import ``path.py:function`` now (so a bad spec fails at start-up) and return it as a scorer."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise ValueError(f"reward.custom must look like path/to/file.py:function, got {spec!r}")
    scorer = CustomScorer(Path(path_text).expanduser().resolve(), name)
    scorer._fn = _import_function(scorer.path, name)
    return scorer
