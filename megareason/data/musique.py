"""MuSiQue's official JSONL format -> prompt records for the retrieval QA environment.

One row per question (https://github.com/StonyBrookNLP/musique, ``musique_ans_v1.0_*.jsonl``)::

    {"id": "2hop__...", "question": ..., "answer": ..., "answer_aliases": [...], "answerable": true,
     "paragraphs": [{"idx": 0, "title": ..., "paragraph_text": ..., "is_supporting": false}, ...],
     "question_decomposition": [{"id": ..., "question": ..., "answer": ..., "paragraph_support_idx": 5}, ...]}

The record's ``extra_info`` carries what the environment and the ``multihop_qa`` reward read:
``documents`` (the question's paragraphs), ``supporting_ids``, ``hops`` (the decomposition's length),
``answer_aliases`` and the ``decomposition``. Rows marked unanswerable (MuSiQue-Full) are skipped
unless ``answerable_only=False``. Every error names the file, the row (from 1) and the field.
``documents_of`` turns a record's ``extra_info["documents"]`` back into retriever ``Document``s (the
synthetic set, ``data.synthetic_multihop``, writes the same format).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megareason.data.loaders import DataError
from megareason.data.records import PromptRecord
from megareason.envs.retrieval import Document

DATA_SOURCE = "musique"


def load_musique(path: str | Path, answerable_only: bool = True) -> list[PromptRecord]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} row {n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            answerable = row.get("answerable", True)
            if not isinstance(answerable, bool):
                raise DataError(f"{where}: field 'answerable' must be true or false, got {json.dumps(answerable)[:80]}")
            if answerable_only and not answerable:
                continue
            records.append(parse_musique_row(row, where))
    if not records:
        raise DataError(f"{path}: no answerable rows")
    return records


def _field(row: dict, name: str, types: type, where: str, what: str) -> Any:
    if name not in row:
        raise DataError(f"{where}: missing field '{name}' ({what})")
    value = row[name]
    if not isinstance(value, types) or (types is int and isinstance(value, bool)):  # JSON true is not an idx
        raise DataError(f"{where}: field '{name}' must be {what}, got {json.dumps(value)[:80]}")
    return value


def parse_musique_row(row: dict, where: str) -> PromptRecord:
    row_id = _field(row, "id", str, where, "a string")
    question = _field(row, "question", str, where, "a string")
    answer = _field(row, "answer", str, where, "a string")
    aliases = row.get("answer_aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise DataError(f"{where}: field 'answer_aliases' must be a list of strings")
    paragraphs = _field(row, "paragraphs", list, where, "a non-empty list of paragraphs")
    if not paragraphs:
        raise DataError(f"{where}: field 'paragraphs' must be a non-empty list of paragraphs")
    documents, seen = [], set()
    for i, p in enumerate(paragraphs):
        pw = f"{where} paragraphs[{i}]"
        if not isinstance(p, dict):
            raise DataError(f"{pw}: expected an object with idx, title, paragraph_text, is_supporting")
        idx = _field(p, "idx", int, pw, "an integer")
        if idx in seen:
            raise DataError(f"{pw}: duplicate paragraph idx {idx}")
        seen.add(idx)
        is_supporting = p.get("is_supporting", False)
        if not isinstance(is_supporting, bool):
            raise DataError(f"{pw}: field 'is_supporting' must be true or false, got {json.dumps(is_supporting)[:80]}")
        documents.append({"id": str(idx), "title": _field(p, "title", str, pw, "a string"),
                          "text": _field(p, "paragraph_text", str, pw, "a string"),
                          "supporting": is_supporting})
    steps = _field(row, "question_decomposition", list, where, "a non-empty list of steps")
    if not steps:
        raise DataError(f"{where}: field 'question_decomposition' must be a non-empty list of steps")
    decomposition = []
    for i, s in enumerate(steps):
        sw = f"{where} question_decomposition[{i}]"
        if not isinstance(s, dict):
            raise DataError(f"{sw}: expected an object with question, answer, paragraph_support_idx")
        support = s.get("paragraph_support_idx")
        if support is not None and (not isinstance(support, int) or isinstance(support, bool) or support not in seen):
            raise DataError(f"{sw}: paragraph_support_idx {json.dumps(support)} is not the idx of one of the "
                            f"row's paragraphs ({sorted(seen)})")
        decomposition.append({"question": _field(s, "question", str, sw, "a string"),
                              "answer": _field(s, "answer", str, sw, "a string"), "paragraph_support_idx": support})
    supporting = [d["id"] for d in documents if d["supporting"]]
    return PromptRecord(
        prompt=[{"role": "user", "content": question}], data_source=DATA_SOURCE, ground_truth=answer,
        extra_info={"id": row_id, "question": question, "answer_aliases": aliases,
                    "hops": len(decomposition), "supporting_ids": supporting, "documents": documents,
                    "decomposition": decomposition})


def documents_of(record: PromptRecord, where: str = "record") -> list[Document]:
    """The record's documents (``extra_info["documents"]``, as ``load_musique`` writes them), in corpus order."""
    docs = record.extra_info.get("documents")
    if not isinstance(docs, list) or not docs:
        raise DataError(f"{where}: extra_info['documents'] must be a non-empty list of documents "
                        "(a MuSiQue-format record; see megareason.data.musique)")
    out = []
    for i, d in enumerate(docs):
        if not isinstance(d, dict) or "id" not in d or not isinstance(d.get("text"), str):
            raise DataError(f"{where}: extra_info['documents'][{i}] must be an object with 'id' and 'text' (a string)")
        out.append(Document(id=str(d["id"]), title=str(d.get("title", "")), text=d["text"],
                            supporting=bool(d.get("supporting", False))))
    return out
