"""Prompt sources: local JSON / JSONL / Parquet files (through ``datasets``) and reasoning-gym.

Two row formats are accepted from files (rows are numbered from 1 in error messages):

* verl:  ``{"prompt": [{"role": "user", "content": ...}], "data_source": ...,
           "reward_model": {"ground_truth": ...}, "extra_info": {...}}``
* seed:  ``{"question": ..., "answer": ..., "solution": ... (optional), "data_source": ... (optional)}``

A row's ``data_source`` may be omitted when the source config sets one for the whole file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from megareason.config.schema import DataConfig, DataSourceConfig
from megareason.data.records import PromptRecord

log = logging.getLogger(__name__)

_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """Bad input data; the message names the file, the row and the field."""


def load_records(cfg: DataConfig) -> list[PromptRecord]:
    """All records of all sources in ``cfg``, in order; each gets ``extra_info["index"]``."""
    records: list[PromptRecord] = []
    for source in cfg.sources:
        if source.kind == "file":
            rows = load_file(source.path, source.data_source)
        elif source.kind == "musique":
            from megareason.data.musique import load_musique

            rows = load_musique(source.path)
        elif source.kind == "synthetic_multihop":
            from megareason.data.synthetic_multihop import synthetic_multihop

            rows = synthetic_multihop(source.size, source.seed, **_multihop_options(source))
        else:
            rows = load_reasoning_gym(source)
        records.extend(rows[: source.size] if source.size else rows)
    for i, rec in enumerate(records):
        rec.extra_info.setdefault("index", i)
        if cfg.system_prompt and rec.prompt[0]["role"] != "system":
            rec.prompt.insert(0, {"role": "system", "content": cfg.system_prompt})
    return records


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
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as e:  # datasets/pyarrow raise many types; find the row ourselves when we can
        if fmt == "json":
            _raise_json_row_error(path)
        raise DataError(f"{path}: cannot be read as {fmt}: {e}") from e
    return ds.to_list()


def _raise_json_row_error(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of objects (or JSONL), got {type(data).__name__}")
        bad = [i for i, row in enumerate(data, 1) if not isinstance(row, dict)]
        if bad:
            raise DataError(f"{path} row {bad[0]}: expected a JSON object")
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {lineno}: invalid JSON: {e.msg}") from e
            if not isinstance(row, dict):
                raise DataError(f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}")
    raise DataError(f"{path}: rows have inconsistent field types (a field is a string in one row "
                    f"and a number or object in another)")


def parse_row(row: dict[str, Any], where: str, data_source: str = "") -> PromptRecord:
    """Validate one row (either format) into a record; ``where`` prefixes every error."""
    source = data_source or row.get("data_source")
    if not isinstance(source, str) or not source:
        raise DataError(f"{where}: missing field 'data_source' (set it in the row, or "
                        f"data.sources[].data_source for the whole file)")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise DataError(f"{where}: field 'extra_info' must be an object, got {type(extra).__name__}")
    extra = {k: v for k, v in extra.items() if v is not None}
    if row.get("prompt") is not None:
        messages = _messages(row["prompt"], where)
        reward_model = row.get("reward_model")
        truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        truth = _text(truth, where, "reward_model.ground_truth")
        return PromptRecord(prompt=messages, data_source=source, ground_truth=truth, extra_info=extra)
    if row.get("question") is not None:
        question = _text(row["question"], where, "question")
        truth = _text(row.get("answer"), where, "answer")
        extra.setdefault("question", question)
        if row.get("solution") is not None:
            extra.setdefault("solution", _text(row["solution"], where, "solution"))
        return PromptRecord(prompt=[{"role": "user", "content": question}], data_source=source,
                            ground_truth=truth, extra_info=extra)
    fields = ", ".join(sorted(k for k, v in row.items() if v is not None)) or "none"
    raise DataError(f"{where}: expected a 'prompt' (chat messages) or a 'question' field; found: {fields}")


def _text(value: Any, where: str, name: str) -> str:
    if isinstance(value, bool) or value is None:
        raise DataError(f"{where}: missing field '{name}'" if value is None
                        else f"{where}: field '{name}' must be text or a number, got a bool")
    if isinstance(value, int | float):
        return str(value)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: field '{name}' must be non-empty text, got {value!r}")
    return value


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field 'prompt' must be a non-empty list of chat messages")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: prompt[{j}] must be {{'role': one of {list(_ROLES)}, "
                            f"'content': text}}, got {m!r}")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] == "assistant":
        raise DataError(f"{where}: prompt must not end with an assistant message (that is the answer)")
    return out


def load_reasoning_gym(source: DataSourceConfig) -> list[PromptRecord]:
    """``source.size`` items of a reasoning-gym generator, built offline from ``source.seed``."""
    import reasoning_gym

    try:
        ds = reasoning_gym.create_dataset(source.name, size=source.size, seed=source.seed, **source.options)
    except (KeyError, ValueError, TypeError, AssertionError) as e:
        raise DataError(f"reasoning_gym source '{source.name}' with options {source.options}: {e}") from e
    records = []
    for i, item in enumerate(ds):
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
        records.append(PromptRecord(
            prompt=[{"role": "user", "content": item["question"]}],
            data_source=source.data_source or source.name,
            ground_truth=truth,
            extra_info=extra,
        ))
    return records
