"""Retrievers on hand-made corpora with known rankings; RRF and one BM25 score by hand."""

import math

import pytest

from megareason.envs.retrieval import RETRIEVERS, Document, build_retriever, embed, reciprocal_rank_fusion

CORPUS = [
    Document("0", "", "the cat sat on the mat"),
    Document("1", "", "dogs chase cats", supporting=True),
    Document("2", "", "the river flows to the sea"),
    Document("3", "", "cat cat cat food", supporting=True),
]


def test_bm25_ranking_and_a_score_by_hand():
    r = build_retriever("bm25", CORPUS)
    # Lucene BM25 (k1 1.5, b 0.75), stopwords removed: lengths 3 (cat sat mat), 3, 3, 4 -> avgdl 3.25.
    # "cat" is in docs 0 and 3: idf = ln(1 + (4 - 2 + 0.5) / (2 + 0.5)) = ln 2.
    # doc 3 (tf 3, dl 4): ln 2 * 3 / (3 + 1.5 * (0.25 + 0.75 * 4 / 3.25)) = 0.43689
    # doc 0 (tf 1, dl 3): ln 2 * 1 / (1 + 1.5 * (0.25 + 0.75 * 3 / 3.25)) = 0.28720
    idf = math.log(2)
    d3 = idf * 3 / (3 + 1.5 * (0.25 + 0.75 * 4 / 3.25))
    d0 = idf * 1 / (1 + 1.5 * (0.25 + 0.75 * 3 / 3.25))
    [(a, sa), (b, sb)] = r.search("cat", 4)  # "cats" is another word (no stemming): doc 1 does not match
    assert (a, b) == ("3", "0")
    assert sa == pytest.approx(d3, rel=1e-5) and sb == pytest.approx(d0, rel=1e-5)
    assert [i for i, _ in r.search("Where does the river flow?", 2)] == ["2"]
    assert r.search("cat", 1) == [("3", pytest.approx(d3, rel=1e-5))]
    assert r.search("zebra", 3) == [] and r.search("", 3) == [] and r.search("the", 3) == []


def test_bm25_ties_keep_corpus_order():
    docs = [Document("b", "", "red apples"), Document("a", "", "green pears"), Document("c", "", "red apples")]
    hits = build_retriever("bm25", docs).search("red apples", 3)
    assert [i for i, _ in hits] == ["b", "c"] and hits[0][1] == hits[1][1] > 0


def test_bm25_reads_titles():
    r = build_retriever("bm25", [Document("a", "Varnholt", "A city by the sea."),
                                 Document("b", "Quillmere", "A city in the hills.")])
    assert [i for i, _ in r.search("Where is Quillmere?", 2)] == ["b"]


@pytest.fixture(scope="module")
def dense():
    return build_retriever("dense", [
        Document("stocks", "", "Share prices fell sharply on the exchange today."),
        Document("kitten", "", "A small kitten is sleeping on the rug."),
        Document("recipe", "", "Mix flour, eggs and milk to make pancakes."),
    ])


def test_embeddings_are_unit_vectors_of_minilm():
    v = embed(["A small kitten is sleeping on the rug.", ""])
    assert v.shape == (2, 384) and v.dtype.name == "float32"
    assert [round(float(n), 5) for n in (v * v).sum(1)] == [1.0, 1.0]
    assert embed([]).shape == (0, 384)


def test_dense_ranks_the_paraphrase_first(dense):
    hits = dense.search("a cat naps on a carpet", 3)
    assert [i for i, _ in hits][0] == "kitten"
    assert hits[0][1] > hits[1][1] + 0.2  # cosine similarities: the paraphrase stands clear of the rest
    assert all(-1.0 <= s <= 1.0 + 1e-6 for _, s in hits)
    assert [i for i, _ in dense.search("stock market crash", 1)] == ["stocks"]
    [(top, cos)] = dense.search("Mix flour, eggs and milk to make pancakes.", 1)  # the document's own text: cos 1
    assert top == "recipe" and cos == pytest.approx(1.0, abs=1e-5)


def test_reciprocal_rank_fusion_by_hand():
    # k = 60: a = 1/61 + 1/63, b = 1/62 + 1/61, c = 1/63, d = 1/62
    fused = dict(reciprocal_rank_fusion([["a", "b", "c"], ["b", "d", "a"]], k=60))
    assert fused == pytest.approx({"a": 1 / 61 + 1 / 63, "b": 1 / 62 + 1 / 61, "c": 1 / 63, "d": 1 / 62})
    assert [i for i, _ in reciprocal_rank_fusion([["a", "b", "c"], ["b", "d", "a"]], k=60)] == ["b", "a", "d", "c"]
    assert reciprocal_rank_fusion([["x", "y"]], k=1) == [("x", 1 / 2), ("y", 1 / 3)]
    assert reciprocal_rank_fusion([["p", "q"], ["q", "p"]], k=0) == [("p", 1.5), ("q", 1.5)]  # tie: first seen
    assert reciprocal_rank_fusion([], k=60) == [] and reciprocal_rank_fusion([[], []], k=60) == []
    with pytest.raises(ValueError, match="k must be >= 0"):
        reciprocal_rank_fusion([["a"]], k=-1)


def test_hybrid_fuses_bm25_and_dense():
    docs = [Document("0", "", "The river Lorvane flows to the sea."), Document("1", "", "A kitten sleeps on a rug."),
            Document("2", "", "Pancakes need flour and milk.")]
    hybrid = build_retriever("hybrid", docs)
    bm25 = [i for i, _ in build_retriever("bm25", docs).search("kitten resting on a carpet", 3)]
    dense = [i for i, _ in build_retriever("dense", docs).search("kitten resting on a carpet", 3)]
    assert bm25 == ["1"] and dense[0] == "1"  # only doc 1 shares a word ("kitten")
    # doc 1: first in both -> 2 / 61; the others only in the dense ranking, at ranks 2 and 3
    expected = {"1": 2 / 61, dense[1]: 1 / 62, dense[2]: 1 / 63}
    hits = hybrid.search("kitten resting on a carpet", 3)
    assert [i for i, _ in hits] == ["1", dense[1], dense[2]]
    assert dict(hits) == pytest.approx(expected)
    assert hybrid.search("kitten resting on a carpet", 1) == [("1", pytest.approx(2 / 61))]


def test_golden_and_bad_arguments():
    assert build_retriever("golden", CORPUS).search("anything", 5) == [("1", 1.0), ("3", 1.0)]
    assert build_retriever("golden", CORPUS).search("anything", 1) == [("1", 1.0)]
    with pytest.raises(ValueError, match="unknown retriever 'tfidf'; expected one of bm25, dense, hybrid, golden"):
        build_retriever("tfidf", CORPUS)
    with pytest.raises(ValueError, match="k must be >= 1"):
        build_retriever("bm25", CORPUS).search("cat", 0)
    with pytest.raises(ValueError, match="rrf_k must be >= 0"):
        build_retriever("hybrid", CORPUS, rrf_k=-1)
    with pytest.raises(ValueError, match="at least one document"):
        build_retriever("bm25", [])
    with pytest.raises(ValueError, match="unique"):
        build_retriever("golden", [Document("1", "", "a"), Document("1", "", "b")])
    assert set(RETRIEVERS) == {"bm25", "dense", "hybrid", "golden"}
