"""Multi-hop QA reward (MuSiQue, FanOutQA): SQuAD exact match and token F1, plus retrieval recall.

The prediction is the content of the LAST ``<answer>...</answer>`` block (the
last ``</answer>`` and the last ``<answer>`` before it), else the last
non-blank line of the response (empty response -> ``""``).
Gold answers are ``ground_truth`` plus ``extra_info["answer_aliases"]`` (a
list of strings); EM and F1 take the best alias.  Answers are compared after
SQuAD normalisation: lowercase, drop ASCII punctuation, drop the articles
a/an/the, collapse whitespace.

``score = (em_weight * EM + f1_weight * F1 + recall_weight * recall) * hop_weight``

* ``recall`` is the retrieval recall of ``extra_info["retrieved_ids"]`` (the
  documents the model retrieved; the retrieval_qa environment leaves out its
  automatic opening search) against ``extra_info["supporting_ids"]`` (lists of
  string or integer ids) when both are present, else 0;
* ``hop_weight = max(1, 1 + hop_bonus * (hops - 2))`` with ``hops =
  extra_info["hops"]`` (a positive integer, default 2).

Defaults: em_weight 0.5, f1_weight 0.5, recall_weight 0.5, hop_bonus 0.0, so
``score = (EM + F1) / 2 + 0.5 * recall``: the MuSiQue RLVR project's "combined
reward [that] balances answer quality and retrieval", as its MuSiQue
environment computes it (bdsaglam/rlvr, on the ``verifiers`` library, ``vf_musique``'s ``MuSiQueRubric``; its hop
factor ``min(hops / 2, 1)`` is 1 for MuSiQue's 2-4 hops).  Each is
overridable through the ``extra_info`` key of the same name (a finite
non-negative number; ``recall_weight: 0`` scores the answer alone).
Malformed ``extra_info`` values raise ``ValueError``.  ``correct`` is
``EM == 1``, independent of retrieval and hop weighting.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping
from numbers import Integral

from megareason.rewards.reasoning_format import weight_param
from megareason.rewards.registry import RewardOutput, register

EM_WEIGHT = 0.5
F1_WEIGHT = 0.5
RECALL_WEIGHT = 0.5
HOP_BONUS = 0.0
DEFAULT_HOPS = 2

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ID_TYPES = (str, int)  # document ids as the dataset gives them: titles, paragraph indices


def normalize_answer(text: str) -> str:
    """SQuAD normalisation (as the official MuSiQue/SQuAD scripts): lowercase, punctuation, articles, spaces.

    Punctuation is deleted, not replaced by a space: ``"U.S."`` -> ``"us"``.
    """
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _golds(golds: str | Iterable[str]) -> list[str]:
    gold_list = [golds] if isinstance(golds, str) else list(golds)
    if not gold_list:
        raise ValueError("at least one gold answer is required")
    return gold_list


def exact_match(pred: str, golds: str | Iterable[str]) -> float:
    """1.0 iff ``pred`` equals some gold answer after normalisation, else 0.0."""
    norm = normalize_answer(pred)
    return max(float(norm == normalize_answer(g)) for g in _golds(golds))


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:  # SQuAD v2: two empty answers agree
        return float(pred_tokens == gold_tokens)
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(pred: str, golds: str | Iterable[str]) -> float:
    """Best SQuAD token F1 (bag-of-tokens overlap of normalised answers) over the gold answers."""
    pred_tokens = normalize_answer(pred).split()
    return max(_f1(pred_tokens, normalize_answer(g).split()) for g in _golds(golds))


def retrieval_recall_precision(
    retrieved_ids: Iterable[Hashable], supporting_ids: Iterable[Hashable]
) -> tuple[float, float]:
    """``(recall, precision)`` of the distinct retrieved ids against the distinct supporting ids.

    recall = |retrieved & supporting| / |supporting|, precision = |retrieved & supporting| / |retrieved|;
    an empty denominator gives 0.0 (no free credit).
    """
    retrieved, supporting = set(retrieved_ids), set(supporting_ids)
    hits = len(retrieved & supporting)
    recall = hits / len(supporting) if supporting else 0.0
    precision = hits / len(retrieved) if retrieved else 0.0
    return recall, precision


def extract_prediction(response: str) -> str:
    """The answer block's content, else the last non-blank line, stripped.

    The answer block ends at the last ``</answer>`` and starts at the last ``<answer>`` before it.
    Found with ``rfind``: a lazy regex rescans to the end from every unclosed ``<answer>``, which is
    quadratic on the repetition loops models fall into.
    """
    end = response.rfind("</answer>")
    start = response.rfind("<answer>", 0, end) if end >= 0 else -1
    if start >= 0:
        return response[start + len("<answer>") : end].strip()
    lines = [line for line in response.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _list_param(extra_info: Mapping, key: str, item_types: tuple[type, ...], what: str) -> list | None:
    """``extra_info[key]`` as a list (None if absent); it must be a list whose items are ``item_types``."""
    value = extra_info.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, item_types) for v in value):
        raise ValueError(f"multihop_qa extra_info[{key!r}] must be a list of {what}, got {value!r}")
    return list(value)


def _hops(extra_info: Mapping) -> int:
    value = extra_info.get("hops", DEFAULT_HOPS)
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"multihop_qa extra_info['hops'] must be a positive integer, got {value!r}")
    return int(value)


@register("multihop_qa", "musique", "fanoutqa")
def multihop_qa_reward(response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
    """Weighted EM + F1 (+ retrieval recall) of the final answer, scaled up for more hops."""
    em_weight = weight_param(extra_info, "em_weight", EM_WEIGHT)
    f1_weight = weight_param(extra_info, "f1_weight", F1_WEIGHT)
    recall_weight = weight_param(extra_info, "recall_weight", RECALL_WEIGHT)
    hop_bonus = weight_param(extra_info, "hop_bonus", HOP_BONUS)
    hop_weight = max(1.0, 1.0 + hop_bonus * (_hops(extra_info) - 2))
    golds = [ground_truth, *(_list_param(extra_info, "answer_aliases", (str,), "strings") or [])]
    retrieved = _list_param(extra_info, "retrieved_ids", _ID_TYPES, "ids")
    supporting = _list_param(extra_info, "supporting_ids", _ID_TYPES, "ids")
    recall = 0.0
    if retrieved is not None and supporting is not None:
        recall, _ = retrieval_recall_precision(retrieved, supporting)
    pred = extract_prediction(response)
    em = exact_match(pred, golds)
    score = (em_weight * em + f1_weight * token_f1(pred, golds) + recall_weight * recall) * hop_weight
    return RewardOutput(score=score, correct=em == 1.0)
