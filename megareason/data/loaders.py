"""Prompt sources: local JSON / JSONL files (read directly; a UTF-8 byte-order mark is skipped), Parquet
files (through ``datasets``), data sets ``datasets.load_dataset`` reads (``kind: hf``: a Hugging Face Hub
id or a local folder), reasoning-gym, MuSiQue and the synthetic multi-hop set; ``LOADERS`` maps each
``data.sources[].kind`` to its loader.

These row formats are accepted from files and ``hf`` sources as they are (rows are numbered from 1 in
error messages):

* verl (what verl's ``examples/data_preprocess`` scripts write): ``{"prompt": [{"role": "user",
  "content": ...}], "data_source": ..., "ability": ..., "reward_model": {"style": "rule", "ground_truth":
  ...}, "extra_info": {...}}``; ``ability`` and ``reward_model.style`` are not used.
* TRL prompt-only, standard (``"prompt": "text"``, given to the chat template as one user message) or
  conversational (``"prompt": [messages]``), with the reference answer in an ``answer``, ``solution`` or
  ``ground_truth`` column (``answer`` wins; a ``solution`` beside it is kept as ``extra_info["solution"]``).
* question/answer: ``{"question": ..., "answer": ..., "solution": ... (optional), "data_source": ...}``.

A row's ``data_source`` may be omitted when the source config sets one for the whole file; an ``hf``
source read from the Hub gives its rows without one the data set's id (verl's convention), and with
``reward.custom`` (a function of one's own scores every row) a file's rows without one take the file's
stem. Rows go in as written: a system message is added only where the config names one
(``data.system_prompt``, ``data.sources[].system_prompt``) or the kind brings its own (reasoning-gym's
instruction to box the final answer); ``source_system_prompt`` says which. A source's
``columns`` renames the data's columns to these fields first.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megareason.config.schema import DataConfig, DataSourceConfig
from megareason.data import arithmetic
from megareason.data.musique import load_musique
from megareason.data.records import DataError, PromptRecord
from megareason.data.rows import check, field, json_object, shown
from megareason.data.synthetic_multihop import synthetic_multihop
from megareason.utils import is_hub_id

log = logging.getLogger(__name__)

_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_ROLES = ("system", "user", "assistant", "tool")


# The instruction reasoning-gym's items come with (their questions say nothing of the answer's form; the
# built-in math and arithmetic rewards read a \boxed{} answer).
REASONING_GYM_SYSTEM_PROMPT = ("You are a helpful assistant. Think step by step, then give the final answer "
                               "inside \\boxed{}.")


@dataclass
class LoadedSource:
    """One configured source as loaded: ``where`` (``data.sources[0]``), ``origin`` (what it reads),
    ``system_prompt`` (the system message added to its rows that had none; "" none) and its records."""

    where: str
    origin: str
    system_prompt: str
    records: list[PromptRecord]


@dataclass
class LoadedData:
    """The training and validation records and how validation was chosen (``val_note``)."""

    sources: list[LoadedSource]
    val_sources: list[LoadedSource]
    train: list[PromptRecord]
    val: list[PromptRecord]
    val_note: str


def source_system_prompt(source: DataSourceConfig, cfg: DataConfig) -> str:
    """The system message for ``source``'s rows without one: its own ``system_prompt``, else
    ``data.system_prompt``, else the kind's own (reasoning-gym's instruction; none for the others)."""
    if source.system_prompt is not None:
        return source.system_prompt
    if cfg.system_prompt:
        return cfg.system_prompt
    return REASONING_GYM_SYSTEM_PROMPT if source.kind == "reasoning_gym" else ""


def origin(source: DataSourceConfig) -> str:
    """What ``source`` reads, as the start-up table shows it."""
    if source.kind in ("file", "musique"):
        return f"{source.kind} {source.path}"
    if source.kind == "hf":
        return f"hf {source.name}" + (f" ({source.config_name})" if source.config_name else "") + f" {source.split}"
    if source.kind == "reasoning_gym":
        return f"reasoning_gym {source.name} (seed {source.seed})"
    return f"{source.kind} (seed {source.seed})"


def load_sources(cfg: DataConfig, field_name: str = "sources", any_source: bool = False) -> list[LoadedSource]:
    """Every source of ``cfg.<field_name>`` loaded (``size`` rows kept), its rows given its ``extra_info``
    and its system prompt. ``any_source`` (a function of one's own scores every row): a row without a
    ``data_source`` takes its source's name (the file's stem, the data set's name) instead of an error."""
    out = []
    for i, source in enumerate(getattr(cfg, field_name)):
        if any_source and not source.data_source and source.kind in ("file", "hf"):
            default = Path(source.path).stem if source.kind == "file" else source.name
            rows = _LOADERS_WITH_DEFAULT[source.kind](source, default)
        else:
            rows = LOADERS[source.kind](source)
        for rec in rows:
            rec.extra_info = {**source.extra_info, **rec.extra_info}
        rows = rows[: source.size] if source.size else rows
        system = source_system_prompt(source, cfg)
        if system:
            for rec in rows:
                if rec.prompt[0]["role"] != "system":
                    rec.prompt.insert(0, {"role": "system", "content": system})
        out.append(LoadedSource(f"data.{field_name}[{i}]", origin(source), system, rows))
    return out


def _numbered(sources: list[LoadedSource], start: int = 0) -> list[PromptRecord]:
    records = [rec for s in sources for rec in s.records]
    for i, rec in enumerate(records, start=start):
        rec.extra_info.setdefault("index", i)
    return records


def load_records(cfg: DataConfig, any_source: bool = False) -> list[PromptRecord]:
    """All records of all sources in ``cfg``, in order; each gets ``extra_info["index"]``."""
    return _numbered(load_sources(cfg, any_source=any_source))


VAL_SEED = 0  # the draw of data.val_size held-out rows


def load_data(cfg: DataConfig, any_source: bool = False) -> LoadedData:
    """The training records and the validation records: ``data.val_sources``, else ``data.val_size`` rows
    of the training data held out (drawn with ``VAL_SEED``, not trained on), else none."""
    sources = load_sources(cfg, any_source=any_source)
    train = _numbered(sources)
    val_sources: list[LoadedSource] = []
    if cfg.val_sources:
        val_sources = load_sources(cfg, "val_sources", any_source)
        val = _numbered(val_sources)
        note = f"{len(val)} rows of data.val_sources"
    elif cfg.val_size:
        if cfg.val_size >= len(train):
            raise DataError(f"data.val_size={cfg.val_size} holds out every row of the training data ({len(train)} "
                            "rows); it must be smaller")
        held = set(random.Random(VAL_SEED).sample(range(len(train)), cfg.val_size))
        val = [r for i, r in enumerate(train) if i in held]
        train = [r for i, r in enumerate(train) if i not in held]
        note = f"{len(val)} of the {len(train) + len(val)} rows of data.sources held out (data.val_size)"
    else:
        val, note = [], ("none: data.val_sources is empty (a recipe's are dropped when data.sources replaces its "
                         "data) and data.val_size is 0 (data.val_size=N holds out N of these rows)")
    return LoadedData(sources, val_sources, train, val, note)


def _load_file_source(source: DataSourceConfig, default_source: str = "") -> list[PromptRecord]:
    return load_file(source.path, source.data_source, source.columns, default_source)


def load_hf_source(source: DataSourceConfig, default_source: str = "") -> list[PromptRecord]:
    """The rows of ``source.name`` (config ``source.config_name``, split ``source.split``) as
    ``datasets.load_dataset`` reads them, each validated as a file's rows are. Offline
    (``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1``) a Hub data set comes from the datasets cache, or
    from a copy in the Hugging Face Hub cache (``hf download --repo-type dataset NAME``)."""
    where = f"data set '{source.name}'" + (f" config '{source.config_name}'" if source.config_name else "")
    where += f" split '{source.split}'"
    rows = _renamed(_read_hf_rows(source, where), source.columns, where)
    if not rows:
        raise DataError(f"{where}: no rows")
    default = source.name if is_hub_id(source.name) else default_source
    return [parse_row(row, f"{where} row {i}", source.data_source, default) for i, row in enumerate(rows, start=1)]


def _read_hf_rows(source: DataSourceConfig, where: str) -> list[dict[str, Any]]:
    import datasets

    datasets.disable_progress_bars()
    config = source.config_name or None
    try:
        with _quiet("datasets"):  # its own ERROR lines would precede ours on the console
            try:
                ds = datasets.load_dataset(source.name, config, split=source.split)
            except ConnectionError:  # offline or unreachable, and not in the datasets cache
                folder = _hub_cache_copy(source.name)
                if folder is None:
                    raise DataError(
                        f"{where}: not in the datasets cache ({datasets.config.HF_DATASETS_CACHE}) and the Hub "
                        f"cannot be reached (HF_DATASETS_OFFLINE=1, HF_HUB_OFFLINE=1 or no network); fetch it "
                        f"with: hf download --repo-type dataset {source.name}") from None
                ds = datasets.load_dataset(folder, config, split=source.split)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types: unknown split or config, no data files, bad files
        raise DataError(f"{where}: cannot be loaded: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    return ds.to_list()


def _hub_cache_copy(name: str) -> str | None:
    """The snapshot folder of Hub data set ``name`` in the Hugging Face Hub cache, or None."""
    if not is_hub_id(name):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(name, repo_type="dataset", local_files_only=True)
    except LocalEntryNotFoundError:
        return None


def _renamed(rows: list[dict[str, Any]], columns: dict[str, str], where: str) -> list[dict[str, Any]]:
    """``rows`` with their columns renamed by ``columns`` ({column: field}); a renamed column replaces a
    column already called by its new name."""
    if not columns:
        return rows
    present = set().union(*rows) if rows else set()
    missing = sorted(set(columns) - present)
    if missing:
        raise DataError(f"{where}: data.sources[].columns renames {missing}, which the data does not have; its "
                        f"columns: {sorted(present)}")
    targets = set(columns.values())
    return [{columns.get(k, k): v for k, v in row.items() if k in columns or k not in targets} for row in rows]


def _load_musique_source(source: DataSourceConfig) -> list[PromptRecord]:
    return load_musique(source.path)


def _load_synthetic_multihop_source(source: DataSourceConfig) -> list[PromptRecord]:
    return synthetic_multihop(source.size, source.seed, **_multihop_options(source))


def _multihop_options(source: DataSourceConfig) -> dict[str, Any]:
    opts = dict(source.options)
    unknown = set(opts) - {"hops", "distractors"}
    if unknown:
        raise DataError(f"synthetic_multihop: unknown options {sorted(unknown)}; expected hops, distractors")
    if "hops" in opts:
        hops = opts["hops"]
        opts["hops"] = tuple(hops) if isinstance(hops, list) else (hops,)
    return opts


def load_file(path: str | Path, data_source: str = "", columns: dict[str, str] | None = None,
              default_source: str = "") -> list[PromptRecord]:
    """Read one local file and validate every row (``columns``: renamed first, {column: field});
    ``default_source``: the data_source of rows without one (empty: such a row is an error)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(f"{path}: unsupported extension '{path.suffix}'; expected one of {sorted(_FORMATS)}")
    rows = _renamed(_read_rows(path, fmt), columns or {}, str(path))
    if not rows:
        raise DataError(f"{path}: no rows")
    return [parse_row(row, f"{path} row {i}", data_source, default_source) for i, row in enumerate(rows, start=1)]


def _read_rows(path: Path, fmt: str) -> list[dict[str, Any]]:
    if fmt == "json":
        return _read_json_rows(path)
    import datasets

    datasets.disable_progress_bars()
    try:
        with _quiet("datasets"):  # its own ERROR lines would precede ours on the console
            ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as e:  # datasets/pyarrow raise many types
        raise DataError(f"{path}: cannot be read as {fmt}: {e}") from e
    return ds.to_list()


def _read_json_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON list of objects or of JSON lines (either extension; a .json file of JSON lines
    too), read as they are (no type unification across rows). A UTF-8 byte-order mark is skipped."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":  # several values: JSON lines, read below
                raise DataError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
        else:
            if isinstance(data, dict):  # one object: one row, as one line of JSONL
                data = [data]
            if not isinstance(data, list):
                raise DataError(f"{path}: expected a JSON list of objects (or JSONL), got {type(data).__name__}")
            return [json_object(row, f"{path} row {i}") for i, row in enumerate(data, start=1)]
    rows = []
    for lineno, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028 may sit in a string
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {lineno}: invalid JSON: {e.msg}") from None
        rows.append(json_object(row, f"{path} line {lineno}"))
    return rows


@contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """``logger``'s records (and its children's) dropped for the block."""
    lg = logging.getLogger(logger)
    level = lg.level
    lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        lg.setLevel(level)


def parse_row(row: dict[str, Any], where: str, data_source: str = "", default_source: str = "") -> PromptRecord:
    """Validate one row (any format of the module docstring) into a record; ``where`` prefixes every
    error. ``data_source`` replaces the row's; ``default_source`` is used when the row has none."""
    row = {k: v for k, v in row.items() if v is not None}  # datasets fills the fields a row lacks with None
    if not data_source and not default_source and "data_source" not in row:
        raise DataError(f"{where}: missing field 'data_source' (set it in the row, data.sources[].data_source for "
                        f"the whole file, or reward.custom to score every row with a function of your own)")
    source = data_source or (field(row, "data_source", where, "non-empty text") if "data_source" in row
                             else default_source)
    extra = check(row.get("extra_info") or {}, "extra_info", where, "an object")
    extra = {k: v for k, v in extra.items() if v is not None}
    if "prompt" in row:
        messages = _prompt(row["prompt"], where)
        truth = _reference_answer(row, where, extra)
        return PromptRecord(prompt=messages, data_source=source, ground_truth=truth, extra_info=extra,
                            chat=isinstance(row["prompt"], list))
    if "question" in row:
        question = _text(row, "question", where)
        truth = _text(row, "answer", where)
        extra.setdefault("question", question)
        if "solution" in row:
            extra.setdefault("solution", _text(row, "solution", where))
        return PromptRecord(prompt=[{"role": "user", "content": question}], data_source=source,
                            ground_truth=truth, extra_info=extra)
    fields = ", ".join(sorted(row)) or "none"
    raise DataError(f"{where}: expected a 'prompt' (chat messages or text) or a 'question' field; found: {fields}")


def _reference_answer(row: dict[str, Any], where: str, extra: dict[str, Any]) -> str:
    """The reference answer of a row with a ``prompt``: verl's ``reward_model.ground_truth``, else TRL's
    ``answer`` (a ``solution`` beside it goes to ``extra["solution"]``), else TRL's ``solution``."""
    if isinstance(row.get("reward_model"), dict) and row["reward_model"].get("ground_truth") is not None:
        return _text(row, "reward_model.ground_truth", where)
    if "answer" in row:
        if "solution" in row:
            extra.setdefault("solution", _text(row, "solution", where))
        return _text(row, "answer", where)
    if "solution" in row:
        return _text(row, "solution", where)
    if "ground_truth" in row:  # TRL's reward-function docs name the reference column so
        return _text(row, "ground_truth", where)
    fields = ", ".join(sorted(row))
    raise DataError(f"{where}: missing the reference answer: expected 'reward_model.ground_truth' (verl's "
                    f"format) or an 'answer', 'solution' or 'ground_truth' field (TRL's prompt-only format); "
                    f"found: {fields}")


def _text(row: dict[str, Any], name: str, where: str) -> str:
    """Field ``name`` as text (a number is its decimal text)."""
    return str(field(row, name, where, "text or a number"))


def _prompt(value: Any, where: str) -> list[dict[str, str]]:
    """A ``prompt`` field as chat messages: a list of messages, or text (TRL's standard format) as the one
    user message."""
    if isinstance(value, str):
        check(value, "prompt", where, "non-empty text")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise DataError(f"{where}: field 'prompt' must be a non-empty list of chat messages or text, got "
                        f"{shown(value)}")
    return _messages(value, where)


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    check(value, "prompt", where, "a non-empty list")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: prompt[{j}] must be {{'role': one of {list(_ROLES)}, "
                            f"'content': text}}, got {shown(m)}")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] == "assistant":
        raise DataError(f"{where}: prompt must not end with an assistant message (that is the answer)")
    return out


def load_reasoning_gym(source: DataSourceConfig) -> list[PromptRecord]:
    """``source.size`` items of a reasoning-gym generator, built offline from ``source.seed``.

    ``basic_arithmetic`` items whose answer is not their question's value (reasoning-gym's ``/`` bug, see
    :mod:`megareason.data.arithmetic`) are skipped and later items drawn instead, so ``size`` items are
    kept, the same ones for the same seed; each gets a worked solution as its demonstration."""
    import reasoning_gym

    checked = source.name == "basic_arithmetic"
    # Items depend on seed + index only, so a longer dataset starts with the same items.
    size = 4 * source.size + 64 if checked else source.size
    try:
        ds = reasoning_gym.create_dataset(source.name, size=size, seed=source.seed, **source.options)
    except (KeyError, ValueError, TypeError, AssertionError) as e:
        raise DataError(f"reasoning_gym source '{source.name}' with options {source.options}: {e}") from e
    records, skipped = [], 0
    for i in range(size):
        if len(records) == source.size:
            break
        item = ds[i]
        meta = item.get("metadata") or {}
        extra: dict[str, Any] = {"question": item["question"], "generator": source.name, "generator_index": i}
        if "answer_cot" in meta:
            extra["solution"] = meta["answer_cot"]
        if "numbers" in meta:
            extra["numbers"] = [int(x) for x in meta["numbers"]]
        truth = str(item["answer"])
        if source.name == "countdown":  # scored against the target; the expression is the expert's answer
            truth = str(meta["target"])
            extra["expert_answer"] = item["answer"]
            extra.setdefault("solution", f"{item['answer']} = {truth}")
        if checked:
            if not arithmetic.answer_matches(meta["expression"], truth):
                skipped += 1
                continue
            extra.setdefault("solution", arithmetic.worked_solution(meta["expression"], truth))
        records.append(PromptRecord(
            prompt=[{"role": "user", "content": item["question"]}],
            data_source=source.data_source or source.name,
            ground_truth=truth,
            extra_info=extra,
        ))
    if len(records) < source.size:
        raise DataError(f"reasoning_gym source '{source.name}' (seed {source.seed}, options {source.options}): "
                        f"only {len(records)} of the first {size} items have the answer their question asks "
                        f"for, {source.size} wanted (division questions are answered wrongly by reasoning-gym; "
                        f"options.operators without '/' avoids them)")
    if skipped:
        log.warning("reasoning_gym '%s' (seed %d): skipped %d items whose answer is not their question's value "
                    "(reasoning-gym writes '/' questions with one divisor and answers them with another); "
                    "%d kept", source.name, source.seed, skipped, len(records))
    return records


# data.sources[].kind -> the loader of one source.
_LOADERS_WITH_DEFAULT = {"file": _load_file_source, "hf": load_hf_source}
LOADERS: dict[str, Callable[[DataSourceConfig], list[PromptRecord]]] = {
    "file": _load_file_source,
    "hf": load_hf_source,
    "reasoning_gym": load_reasoning_gym,
    "musique": _load_musique_source,
    "synthetic_multihop": _load_synthetic_multihop_source,
}
