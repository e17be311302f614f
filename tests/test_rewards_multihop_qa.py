"""Hand-computed expectations for the multihop_qa (musique, fanoutqa) reward and its metrics."""

import pytest

from megareason.rewards import compute_score, get_reward_fn
from megareason.rewards.multihop_qa import (
    exact_match,
    extract_prediction,
    normalize_answer,
    retrieval_recall_precision,
    token_f1,
)


def test_registered_under_all_names():
    assert get_reward_fn("musique") is get_reward_fn("multihop_qa") is get_reward_fn("fanoutqa")


# --- metrics ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Cat  sat.", "cat sat"),
        ("U.S.A.", "usa"),  # punctuation is deleted, not replaced by a space
        ("Rock-and-roll!", "rockandroll"),
        ("An apple a day", "apple day"),
        ("theater another", "theater another"),  # articles only as whole words
        ("  Hello,\tWorld\n", "hello world"),
        ("A", ""),
        ("", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match():
    assert exact_match("the cat sat", ["a cat sat down"]) == 0.0
    assert exact_match("The Cat Sat!", "cat sat") == 1.0  # a bare string is one gold answer
    assert exact_match("Barack Obama", ["Obama", "barack obama"]) == 1.0  # best alias
    assert exact_match("", ["the"]) == 1.0  # both normalise to ""
    with pytest.raises(ValueError, match="at least one gold"):
        exact_match("x", [])


@pytest.mark.parametrize(
    ("pred", "golds", "f1"),
    [
        # "cat sat" vs "cat sat down": 2 common, P = 2/2, R = 2/3, F1 = 2PR/(P+R) = 0.8
        ("the cat sat", ["a cat sat down"], 0.8),
        ("cat cat", ["cat"], 2 / 3),  # common = min(2, 1) = 1: P = 1/2, R = 1
        ("cat", ["cat cat"], 2 / 3),  # P = 1, R = 1/2
        ("the big red dog", ["big dog barked"], 2 / 3),  # 2 common of 3 and 3
        ("New York City", ["York"], 0.5),  # P = 1/3, R = 1
        ("New York City", ["York", "new york city"], 1.0),  # best alias
        ("Paris France", ["London"], 0.0),
        ("", ["Paris"], 0.0),
        ("the", ["Paris"], 0.0),  # empty after normalisation
        ("", ["the"], 1.0),  # two empty answers agree (SQuAD v2)
    ],
)
def test_token_f1(pred, golds, f1):
    assert token_f1(pred, golds) == pytest.approx(f1)


def test_retrieval_recall_precision():
    assert retrieval_recall_precision(["d1", "d2", "d3"], ["d2", "d4"]) == (0.5, pytest.approx(1 / 3))
    assert retrieval_recall_precision(["d2", "d2", "d4"], ["d2", "d4"]) == (1.0, 1.0)  # duplicates count once
    assert retrieval_recall_precision([1, 2], [2]) == (1.0, 0.5)
    assert retrieval_recall_precision([], ["d1"]) == (0.0, 0.0)
    assert retrieval_recall_precision(["d1"], []) == (0.0, 0.0)
    assert retrieval_recall_precision([], []) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("response", "pred"),
    [
        ("reasoning\n<answer>Paris</answer>", "Paris"),
        ("<answer>Rome</answer> no wait <answer> Paris </answer> ok", "Paris"),
        ("<answer>\nNew\nYork\n</answer>", "New\nYork"),
        ("I think...\n  Paris  \n\n", "Paris"),
        ("<answer>Paris", "<answer>Paris"),  # unclosed: the last line
        ("<answer>Rome <answer> Paris</answer>", "Paris"),  # the open tag nearest the last close
        ("<answer>Rome</answer> then </answer>", "Rome</answer> then"),
        ("</answer>Paris<answer>", "</answer>Paris<answer>"),  # no open before the close
        ("", ""),
        ("\n \n", ""),
    ],
)
def test_extract_prediction(response, pred):
    assert extract_prediction(response) == pred


# --- reward -----------------------------------------------------------------
RETRIEVAL = {"retrieved_ids": ["d1", "d2", "d3"], "supporting_ids": ["d2", "d4"]}  # recall 1/2


@pytest.mark.parametrize(
    ("response", "gold", "extra", "score", "correct"),
    [
        ("<answer>Barack Obama</answer>", "Barack Obama", {}, 1.0, True),
        ("<answer>the cat sat</answer>", "a cat sat down", {}, 0.4, False),  # 0.5 * 0 + 0.5 * 0.8
        ("<answer>Obama</answer>", "Barack Obama", {"answer_aliases": ["Obama"]}, 1.0, True),
        ("<answer>Obama</answer>", "Barack Obama", {}, 1 / 3, False),  # F1: P = 1, R = 1/2
        ("Let me think.\nThe answer is Paris", "Paris", {}, 0.25, False),  # F1 of "answer is paris": 0.5
        ("Let me think.\nParis.", "Paris", {}, 1.0, True),
        ("", "Paris", {}, 0.0, False),
        ("<answer>Paris</answer>", "Paris", {"recall_weight": 1.0, **RETRIEVAL}, 1.5, True),
        # the default is the MuSiQue RLVR project's combined reward: (EM + F1) / 2 + 0.5 * recall
        ("<answer>Paris</answer>", "Paris", RETRIEVAL, 1.25, True),  # (1 + 1) / 2 + 0.5 * 1/2
        ("<answer>Obama</answer>", "Barack Obama", RETRIEVAL, 7 / 12, False),  # (0 + 2/3) / 2 + 0.5 * 1/2
        ("<answer>Lyon</answer>", "Paris", {"retrieved_ids": ["d4", "d2"], "supporting_ids": ["d2", "d4"]}, 0.5,
         False),  # (0 + 0) / 2 + 0.5 * 1: retrieval alone
        ("<answer>Lyon</answer>", "Paris", {"retrieved_ids": [], "supporting_ids": ["d2", "d4"]}, 0.0, False),
        ("<answer>Paris</answer>", "Paris", {"recall_weight": 0, **RETRIEVAL}, 1.0, True),  # the answer alone
        ("<answer>Paris</answer>", "Paris", {"recall_weight": 1.0}, 1.0, True),  # no ids: no recall term
        ("<answer>Paris</answer>", "Paris", {"recall_weight": 1.0, "retrieved_ids": ["d2"]}, 1.0, True),
        ("<answer>Lyon</answer>", "Paris", {"recall_weight": 0.4, **RETRIEVAL}, 0.2, False),
        ("<answer>Paris</answer>", "Paris", {"hops": 4, "hop_bonus": 0.25}, 1.5, True),  # 1 + 0.25 * 2
        ("<answer>the cat sat</answer>", "a cat sat down", {"hops": 4, "hop_bonus": 0.25}, 0.6, False),
        ("<answer>Paris</answer>", "Paris", {"hops": 1, "hop_bonus": 0.5}, 1.0, True),  # 0.5 clipped to 1
        ("<answer>Paris</answer>", "Paris", {"hops": 4}, 1.0, True),  # hop bonus 0 by default
        ("<answer>the cat sat</answer>", "a cat sat down", {"em_weight": 1, "f1_weight": 0}, 0.0, False),
        ("<answer>Paris</answer>", "Paris", {"em_weight": 0, "f1_weight": 0}, 0.0, True),
        (
            "<answer>Paris</answer>",
            "Paris",
            {"em_weight": 0.2, "f1_weight": 0.3, "recall_weight": 0.5, "hops": 3, "hop_bonus": 1.0, **RETRIEVAL},
            1.5,  # (0.2 + 0.3 + 0.5 * 0.5) * (1 + 1 * 1)
            True,
        ),
    ],
)
def test_multihop_qa(response, gold, extra, score, correct):
    out = compute_score("musique", response, gold, extra)
    assert out.correct is correct
    assert out.score == pytest.approx(score)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"hops": 0}, "hops"),
        ({"hops": 2.5}, "hops"),
        ({"hops": True}, "hops"),
        ({"hops": "3"}, "hops"),
        ({"answer_aliases": "Obama"}, "answer_aliases"),  # a bare string, not a list
        ({"answer_aliases": ["Obama", 3]}, "answer_aliases"),
        ({"retrieved_ids": "d1", "supporting_ids": ["d1"]}, "retrieved_ids"),
        ({"supporting_ids": [["d1"]]}, "supporting_ids"),
        ({"em_weight": -0.5}, "em_weight"),
        ({"hop_bonus": float("inf")}, "hop_bonus"),
        ({"recall_weight": "1"}, "recall_weight"),
    ],
)
def test_invalid_extra_info_raises(extra, key):
    with pytest.raises(ValueError, match=f"extra_info\\['{key}'\\]"):
        compute_score("fanoutqa", "<answer>Paris</answer>", "Paris", extra)
