"""A user's own reward functions from Python files, beside or instead of the built-in rewards.

Config: ``reward.custom=path/to/file.py[:function]`` scores every sample (as verl's
``custom_reward_function``); ``reward.by_source`` maps a data_source to ``path/to/file.py[:function]``
and scores only that source's samples, the others keeping their built-in reward. The function name
defaults to ``compute_score`` (verl's default). Two signatures are accepted, told apart by the
function's parameters:

* verl's per-sample ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)``
  (any parameter names; a fourth positional parameter, or else ``extra_info`` by keyword). It returns a
  number, a dict with ``"score"`` (and optionally ``"acc"`` or ``"correct"``), or a ``RewardOutput``.
* TRL's batch ``fn(prompts, completions, **kwargs) -> list[float]`` (a parameter named ``completions``;
  TRL's ``GRPOTrainer`` reward functions). The keyword arguments are the rows' other columns by name:
  ``ground_truth``, ``data_source`` and every ``extra_info`` key, each a list in batch order (None for
  a row without that key); ``solution`` and ``answer`` are a row's ground truth where it has no
  ``extra_info`` key of that name. Prompts and completions are strings (standard: the prompt's last user
  message, the response) or message lists (conversational: the prompt's messages, ``[{"role":
  "assistant", "content": response}]``), as TRL passes them for standard and conversational datasets;
  ``reward.trl_format=auto`` decides per row as TRL does, from how the row gave its prompt (as text or as
  chat messages: ``PromptRecord.chat``), so a batch of both kinds is two calls.

``reward.funcs`` (TRL's ``reward_funcs``) lists several functions, each scoring every sample; the reward
is their sum weighted by ``reward.weights`` (TRL's ``reward_weights``), and each function's own score is
logged (``WeightedRewards``).

The prompt reaches a function that asks for it: verl's as ``prompt=`` (the chat messages), TRL's as
``prompts``; only when the function names that parameter or takes ``**kwargs``. ``correct`` (accuracy,
pass@k) is ``score >= 1`` unless the function says otherwise.

``CustomScorer`` pickles as its file path, function name and format, and imports the file lazily in
whichever process calls it, so it can be sent to reward worker processes (``megareason.rewards.pool``),
which a closure over the imported function could not. ``CustomRewards`` routes each sample to its
function or to the built-in rewards, and pickles the same way.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from pathlib import Path
from typing import Literal, Protocol

from megareason.config.load import ConfigError
from megareason.rewards.registry import RewardOutput, base_source, compute_score

DEFAULT_FUNCTION = "compute_score"  # verl's default custom_reward_function name
TrlFormat = Literal["auto", "standard", "conversational"]
_SIGNATURES = ("verl's (data_source, solution_str, ground_truth, extra_info=None, **kwargs) or TRL's "
               "(prompts, completions, **kwargs) -> list[float]")


class Scorer(Protocol):
    """Scores one sample. ``prompt``: the chat messages, for scorers that read them."""

    def __call__(self, data_source: str, response: str, ground_truth: str, extra_info: dict,
                 prompt: list[dict] | None = None) -> RewardOutput: ...


def parse_spec(spec: str, key: str) -> tuple[Path, str]:
    """``path/to/file.py[:function]`` -> (absolute path, function name); ``key`` names the config key."""
    path_text, name = (spec, DEFAULT_FUNCTION) if spec.endswith(".py") else spec.rpartition(":")[::2]
    if not path_text or not name.isidentifier():
        raise ConfigError(f"{key} must look like path/to/file.py or path/to/file.py:function, got {spec!r}")
    return Path(path_text).expanduser().resolve(), name


def _import_function(path: Path, name: str, key: str) -> Callable:
    """Import ``path`` and return its function ``name``; errors name the config key, file and function."""
    if not path.is_file():
        raise FileNotFoundError(f"{key}: no file {path}")
    module_spec = importlib.util.spec_from_file_location(f"megareason_custom_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: a syntax error, a missing import, its own code failing
        line = f" line {e.lineno}" if isinstance(e, SyntaxError) else ""
        raise ConfigError(f"{key}: importing {path}{line} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise ConfigError(f"{key}: {path} has no function {name!r}; its functions: {', '.join(found) or 'none'}")
    return fn


class _Function:
    """An imported reward function and how to call it, read from its signature."""

    def __init__(self, fn: Callable, where: str, key: str):
        self.fn, self.where = fn, where
        sig = inspect.signature(fn)
        params = sig.parameters
        self.var_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.names = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        self.required = {n for n, p in params.items()
                         if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty}
        self.batch = "completions" in self.names
        self.extra_info_positional = False
        if not self.batch:
            if _binds(sig, "ds", "response", "gt", {}):
                self.extra_info_positional = True
            elif not _binds(sig, "ds", "response", "gt", extra_info={}):
                shown = ", ".join(str(p) for p in params.values())
                raise ConfigError(f"{key}: {where} takes ({shown}); a reward function must take {_SIGNATURES}")

    def accepts(self, name: str) -> bool:
        return self.var_keyword or name in self.names


def _binds(sig: inspect.Signature, *args, **kwargs) -> bool:
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


class CustomScorer:
    """A ``Scorer`` calling ``name`` from the Python file ``path``, imported on first use per process.

    Picklable: only ``path``, ``name``, ``trl_format`` and ``key`` travel; the imported function is
    dropped and re-imported on the other side. ``key`` is the config key named in errors.
    """

    def __init__(self, path: Path, name: str, trl_format: TrlFormat = "auto", key: str = "reward.custom"):
        self.path, self.name, self.trl_format, self.key = path, name, trl_format, key
        self._fn: _Function | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fn": None}

    def __repr__(self) -> str:
        return f"CustomScorer({str(self.path)!r}, {self.name!r})"

    @property
    def label(self) -> str:
        """``file.py:function``, as the start-up table and the errors name it."""
        return f"{self.path.name}:{self.name}"

    def conversational(self, chat: bool) -> bool:
        """Whether a row whose prompt was chat messages (``chat``) reaches a TRL function in TRL's
        conversational format: ``reward.trl_format``, or with ``auto`` the row's own format."""
        return chat if self.trl_format == "auto" else self.trl_format == "conversational"

    def mode(self, chat: bool) -> str:
        """How the function is called, for the start-up table."""
        if not self.function.batch:
            return "verl signature, per sample"
        return f"TRL signature, {'conversational' if self.conversational(chat) else 'standard'}"

    @property
    def function(self) -> _Function:
        if self._fn is None:
            where = f"{self.path}:{self.name}"
            self._fn = _Function(_import_function(self.path, self.name, self.key), where, self.key)
        return self._fn

    @property
    def batch(self) -> bool:
        """True for a TRL batch function (``score_batch`` scores many samples in one call)."""
        return self.function.batch

    def __call__(self, data_source: str, response: str, ground_truth: str, extra_info: dict,
                 prompt: list[dict] | None = None) -> RewardOutput:
        f = self.function
        if f.batch:
            (score,) = self.score_batch([(data_source, response, ground_truth, extra_info, prompt)])
            if score is None:
                raise ValueError(f"{f.where} returned None for the sample; expected a number")
            return RewardOutput(score=score, correct=score >= 1.0)
        kwargs = {"prompt": prompt} if prompt is not None and f.accepts("prompt") else {}
        if f.extra_info_positional:
            out = f.fn(data_source, response, ground_truth, extra_info, **kwargs)
        else:
            out = f.fn(data_source, response, ground_truth, extra_info=extra_info, **kwargs)
        return _reward_output(out, f.where)

    def score_batch(self, rows: Sequence[tuple[str, str, str, dict, list[dict] | None]],
                    conversational: bool | None = None) -> list[float | None]:
        """A TRL batch function on ``rows`` of (data_source, response, ground_truth, extra_info, prompt),
        given in TRL's conversational format or its standard one (None: as ``reward.trl_format`` says for
        rows of text): one score per row, in order (None where the function returned None for that row)."""
        f = self.function
        assert f.batch, f"{f.where} is not a batch function"
        if conversational is None:
            conversational = self.conversational(False)
        completions = [[{"role": "assistant", "content": r[1]}] if conversational else r[1] for r in rows]
        columns = _columns(rows)
        missing = sorted(n for n in f.required - {"prompts", "completions"} if n not in columns)
        if missing:
            raise ValueError(f"{f.where} asks for {', '.join(missing)}, which the rows do not have; they give "
                             f"{', '.join(sorted(columns))} (TRL passes a dataset's other columns by name)")
        kwargs = {k: v for k, v in columns.items() if f.accepts(k)}
        if f.accepts("prompts"):
            kwargs["prompts"] = [_prompt(r[4], conversational) for r in rows]
        out = f.fn(completions=completions, **kwargs)
        if not isinstance(out, Sequence) or isinstance(out, str) or len(out) != len(rows):
            got = f"{len(out)} items" if isinstance(out, Sequence) else type(out).__name__
            raise TypeError(f"{f.where} returned {got} for {len(rows)} completions; expected a list of "
                            f"{len(rows)} numbers")
        bad = [v for v in out if v is not None and (isinstance(v, bool) or not isinstance(v, Real))]
        if bad:
            raise TypeError(f"{f.where} returned {bad[0]!r} in its list; expected numbers (or None)")
        return [None if v is None else float(v) for v in out]


def _columns(rows: Sequence[tuple[str, str, str, dict, list[dict] | None]]) -> dict[str, list]:
    """TRL's keyword arguments: each column of the rows as a list (None where a row lacks it; ``solution``
    and ``answer``: the row's ground truth)."""
    keys = dict.fromkeys(k for r in rows for k in r[3])
    columns = {k: [r[3].get(k) for r in rows] for k in keys}
    columns["ground_truth"] = [r[2] for r in rows]
    columns["data_source"] = [r[0] for r in rows]
    for alias in ("solution", "answer"):  # TRL datasets name the reference so; ours is ground_truth
        columns[alias] = [r[3].get(alias, r[2]) for r in rows]
    return columns


def _prompt(messages: list[dict] | None, conversational: bool) -> list[dict] | str | None:
    if messages is None or conversational:
        return messages
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return users[-1] if users else ""


def _reward_output(out: object, where: str) -> RewardOutput:
    """A verl-style return value as a ``RewardOutput``: a number, a dict with "score", or itself."""
    if isinstance(out, RewardOutput):
        return out
    if isinstance(out, Mapping):
        if "score" not in out:
            raise TypeError(f"{where} returned a dict without 'score' (keys: {', '.join(map(str, out))})")
        score = _number(out["score"], where)
        correct = out.get("correct", out.get("acc"))
        return RewardOutput(score=score, correct=score >= 1.0 if correct is None else bool(correct))
    score = _number(out, where)
    return RewardOutput(score=score, correct=score >= 1.0)


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{where} returned {type(value).__name__}; expected a number, a dict with 'score' "
                        "or RewardOutput")
    return float(value)


def load_custom(spec: str, trl_format: TrlFormat = "auto", key: str = "reward.custom") -> CustomScorer:
    """Import ``path.py[:function]`` now (so a bad file or signature fails at start-up) as a scorer."""
    path, name = parse_spec(spec, key)
    scorer = CustomScorer(path, name, trl_format, key)
    _ = scorer.function
    return scorer


class WeightedRewards:
    """Several functions scoring every sample, TRL's ``reward_funcs`` with ``reward_weights``: the reward
    is ``sum(weight * score)``; ``correct`` is ``reward >= 1``. Scored by ``rewards.scoring`` one function
    at a time (a TRL function on the whole batch), each function's score logged under its ``names`` entry.
    Picklable as its scorers are."""

    batch = True  # scored in the driver, a function at a time (rewards.scoring._score_batch)

    def __init__(self, parts: Sequence[CustomScorer], weights: Sequence[float]):
        self.parts, self.weights = list(parts), [float(w) for w in weights]
        names = [p.name for p in self.parts]
        self.names = [p.label if names.count(p.name) > 1 else p.name for p in self.parts]

    def __repr__(self) -> str:
        return f"WeightedRewards({self.parts!r}, {self.weights!r})"

    @property
    def label(self) -> str:
        return " + ".join(f"{w:g} x {p.label}" for p, w in zip(self.parts, self.weights, strict=True))

    def mode(self, chat: bool) -> str:
        return "weighted sum; " + "; ".join(dict.fromkeys(p.mode(chat) for p in self.parts))

    def __call__(self, data_source: str, response: str, ground_truth: str, extra_info: dict,
                 prompt: list[dict] | None = None) -> RewardOutput:
        scores = [p(data_source, response, ground_truth, extra_info, prompt=prompt).score for p in self.parts]
        total = sum(w * v for w, v in zip(self.weights, scores, strict=True))
        return RewardOutput(score=total, correct=total >= 1.0,
                            parts=tuple(zip(self.names, scores, strict=True)))


Custom = CustomScorer | WeightedRewards


class CustomRewards:
    """A ``Scorer`` routing each sample: ``by_source[data_source]`` (the exact name, else the name without
    its ``_tinyv`` suffix), else ``custom`` (``reward.custom`` or ``reward.funcs``), else the built-in
    reward of its data_source."""

    def __init__(self, custom: Custom | None, by_source: Mapping[str, CustomScorer]):
        self.custom, self.by_source = custom, dict(by_source)

    def route(self, data_source: str) -> Custom | None:
        """The custom scorer of ``data_source``; None: its built-in reward."""
        found = self.by_source.get(data_source) or self.by_source.get(base_source(data_source))
        return found or self.custom

    def __call__(self, data_source: str, response: str, ground_truth: str, extra_info: dict,
                 prompt: list[dict] | None = None) -> RewardOutput:
        scorer = self.route(data_source)
        if scorer is None:
            return compute_score(data_source, response, ground_truth, extra_info)
        return scorer(data_source, response, ground_truth, extra_info, prompt=prompt)


def load_rewards(custom: str, by_source: Mapping[str, str], trl_format: TrlFormat,
                 funcs: Sequence[str] = (), weights: Sequence[float] = ()) -> CustomRewards:
    """``reward.custom`` (or ``reward.funcs`` with ``reward.weights``) and ``reward.by_source`` imported
    now (bad files fail at start-up)."""
    if funcs:
        if custom:
            raise ConfigError("reward.custom and reward.funcs both set: name one function in reward.custom, or "
                              "several in reward.funcs (summed with reward.weights)")
        if weights and len(weights) != len(funcs):
            raise ConfigError(f"reward.weights has {len(weights)} entries for {len(funcs)} reward.funcs; give one "
                              "weight per function (or none: 1 each)")
        scorers = [load_custom(spec, trl_format, f"reward.funcs[{i}]") for i, spec in enumerate(funcs)]
        main: Custom | None = WeightedRewards(scorers, weights or [1.0] * len(funcs))
    else:
        if weights:
            raise ConfigError("reward.weights weighs reward.funcs, which is empty")
        main = load_custom(custom, trl_format) if custom else None
    return CustomRewards(
        main,
        {source: load_custom(spec, trl_format, f"reward.by_source[{source!r}]") for source, spec in by_source.items()},
    )
