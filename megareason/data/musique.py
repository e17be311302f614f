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

from megareason.data.records import DataError, Document, PromptRecord
from megareason.data.rows import field, json_object

DATA_SOURCE = "musique"


def load_musique(path: str | Path, answerable_only: bool = True) -> list[PromptRecord]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records = []
    with path.open(encoding="utf-8-sig") as f:  # a byte-order mark (Windows editors) is skipped
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} row {n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            row = json_object(row, where)
            if answerable_only and not field(row, "answerable", where, "true or false", default=True):
                continue
            records.append(parse_musique_row(row, where))
    if not records:
        raise DataError(f"{path}: no answerable rows")
    return records


def parse_musique_row(row: dict, where: str) -> PromptRecord:
    row_id = field(row, "id", where, "a string")
    question = field(row, "question", where, "a string")
    answer = field(row, "answer", where, "a string")
    aliases = field(row, "answer_aliases", where, "a list of strings", default=[])
    paragraphs = field(row, "paragraphs", where, "a non-empty list")
    documents, seen = [], set()
    for i, p in enumerate(paragraphs):
        pw = f"{where} paragraphs[{i}]"
        if not isinstance(p, dict):
            raise DataError(f"{pw}: expected an object with idx, title, paragraph_text, is_supporting")
        idx = field(p, "idx", pw, "an integer")
        if idx in seen:
            raise DataError(f"{pw}: duplicate paragraph idx {idx}")
        seen.add(idx)
        is_supporting = field(p, "is_supporting", pw, "true or false", default=False)
        documents.append({"id": str(idx), "title": field(p, "title", pw, "a string"),
                          "text": field(p, "paragraph_text", pw, "a string"), "supporting": is_supporting})
    steps = field(row, "question_decomposition", where, "a non-empty list")
    decomposition = []
    for i, s in enumerate(steps):
        sw = f"{where} question_decomposition[{i}]"
        if not isinstance(s, dict):
            raise DataError(f"{sw}: expected an object with question, answer, paragraph_support_idx")
        support = s.get("paragraph_support_idx")
        if support is not None and (not isinstance(support, int) or isinstance(support, bool) or support not in seen):
            raise DataError(f"{sw}: paragraph_support_idx {json.dumps(support)} is not the idx of one of the "
                            f"row's paragraphs ({sorted(seen)})")
        decomposition.append({"question": field(s, "question", sw, "a string"),
                              "answer": field(s, "answer", sw, "a string"), "paragraph_support_idx": support})
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
