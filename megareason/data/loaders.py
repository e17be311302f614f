"""Prompt sources: local JSON / JSONL files (read directly; a UTF-8 byte-order mark is skipped), Parquet
files (through ``datasets``), reasoning-gym, MuSiQue and the synthetic multi-hop set; ``LOADERS`` maps
each ``data.sources[].kind`` to its loader.

Two row formats are accepted from files (rows are numbered from 1 in error messages):

* verl:  ``{"prompt": [{"role": "user", "content": ...}], "data_source": ...,
           "reward_model": {"ground_truth": ...}, "extra_info": {...}}``
* seed:  ``{"question": ..., "answer": ..., "solution": ... (optional), "data_source": ... (optional)}``

A row's ``data_source`` may be omitted when the source config sets one for the whole file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megareason.config.schema import DataConfig, DataSourceConfig
from megareason.data import arithmetic
from megareason.data.musique import load_musique
from megareason.data.records import DataError, PromptRecord
from megareason.data.rows import check, field, json_object, shown
from megareason.data.synthetic_multihop import synthetic_multihop

log = logging.getLogger(__name__)

_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_ROLES = ("system", "user", "assistant", "tool")


def load_records(cfg: DataConfig) -> list[PromptRecord]:
    """All records of all sources in ``cfg``, in order; each gets ``extra_info["index"]``."""
    records: list[PromptRecord] = []
    for source in cfg.sources:
        rows = LOADERS[source.kind](source)
        for rec in rows:
            rec.extra_info = {**source.extra_info, **rec.extra_info}
        records.extend(rows[: source.size] if source.size else rows)
    for i, rec in enumerate(records):
        rec.extra_info.setdefault("index", i)
        if cfg.system_prompt and rec.prompt[0]["role"] != "system":
            rec.prompt.insert(0, {"role": "system", "content": cfg.system_prompt})
    return records


def _load_file_source(source: DataSourceConfig) -> list[PromptRecord]:
    return load_file(source.path, source.data_source)


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


def load_file(path: str | Path, data_source: str = "") -> list[PromptRecord]:
    """Read one local file and validate every row."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(f"{path}: unsupported extension '{path.suffix}'; expected one of {sorted(_FORMATS)}")
    rows = _read_rows(path, fmt)
    if not rows:
        raise DataError(f"{path}: no rows")
    return [parse_row(row, f"{path} row {i}", data_source) for i, row in enumerate(rows, start=1)]


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


def parse_row(row: dict[str, Any], where: str, data_source: str = "") -> PromptRecord:
    """Validate one row (either format) into a record; ``where`` prefixes every error."""
    row = {k: v for k, v in row.items() if v is not None}  # datasets fills the fields a row lacks with None
    if not data_source and "data_source" not in row:
        raise DataError(f"{where}: missing field 'data_source' (set it in the row, or "
                        f"data.sources[].data_source for the whole file)")
    source = data_source or field(row, "data_source", where, "non-empty text")
    extra = check(row.get("extra_info") or {}, "extra_info", where, "an object")
    extra = {k: v for k, v in extra.items() if v is not None}
    if "prompt" in row:
        messages = _messages(row["prompt"], where)
        truth = _text(row, "reward_model.ground_truth", where)
        return PromptRecord(prompt=messages, data_source=source, ground_truth=truth, extra_info=extra)
    if "question" in row:
        question = _text(row, "question", where)
        truth = _text(row, "answer", where)
        extra.setdefault("question", question)
        if "solution" in row:
            extra.setdefault("solution", _text(row, "solution", where))
        return PromptRecord(prompt=[{"role": "user", "content": question}], data_source=source,
                            ground_truth=truth, extra_info=extra)
    fields = ", ".join(sorted(row)) or "none"
    raise DataError(f"{where}: expected a 'prompt' (chat messages) or a 'question' field; found: {fields}")


def _text(row: dict[str, Any], name: str, where: str) -> str:
    """Field ``name`` as text (a number is its decimal text)."""
    return str(field(row, name, where, "text or a number"))


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
LOADERS: dict[str, Callable[[DataSourceConfig], list[PromptRecord]]] = {
    "file": _load_file_source,
    "reasoning_gym": load_reasoning_gym,
    "musique": _load_musique_source,
    "synthetic_multihop": _load_synthetic_multihop_source,
}
