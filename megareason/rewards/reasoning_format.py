"""Reasoning-format reward: ``<think>...</think>`` then ``<answer>...</answer>``.

``score = format_weight * well_formed + answer_weight * correct - short_penalty * short_thinking``

* ``well_formed``: the response is exactly ``<think>T</think>`` followed by
  ``<answer>A</answer>``, each of the four tags occurring exactly once, with
  nothing but whitespace before, between and after the two blocks.  Tags are
  case-sensitive.
* ``correct``: the response contains exactly one ``<answer>`` and one
  ``</answer>``, in that order, and their stripped content equals the ground
  truth -- as exact numbers when both parse as one number (``parse_number``:
  ``"7.0" == "7"``, ``"1,000" == "1000"``, ``"3/4" == "0.75"``), otherwise as
  strings after lowercasing, stripping and collapsing whitespace.  A
  malformed response thus gets no format credit but keeps answer credit when
  its single answer block is right.
* ``short_thinking``: the stripped content of the single ``<think>...</think>``
  block (empty if there is not exactly one ``<think>`` and one ``</think>``,
  in order) has fewer than ``min_think_chars`` characters.

Defaults: format_weight 0.2, answer_weight 0.8, short_penalty 0.1,
min_think_chars 20, each overridable per row through the ``extra_info`` key of
the same name (a finite non-negative number, else ``ValueError``).  The score
lies in ``[-short_penalty, format_weight + answer_weight]``.

Also hosts ``weight_param``, the ``extra_info`` override shared with the
multihop_qa family.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from numbers import Real

from megareason.rewards.arithmetic import parse_number
from megareason.rewards.registry import RewardOutput, register

FORMAT_WEIGHT = 0.2
ANSWER_WEIGHT = 0.8
SHORT_PENALTY = 0.1
MIN_THINK_CHARS = 20

_WELL_FORMED = re.compile(r"\s*<think>.*</think>\s*<answer>.*</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
# Digits split by whitespace, or a comma that is not a thousands separator,
# mean a list ("1, 2", "3 5"), which parse_number would glue into one number.
_NOT_ONE_NUMBER = re.compile(r"\d\s+\d|,(?!\d{3}(?!\d))")


def weight_param(extra_info: Mapping, key: str, default: float) -> float:
    """``extra_info[key]`` if present, else ``default``; must be a finite non-negative number."""
    value = extra_info.get(key, default)
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"extra_info[{key!r}] must be a finite non-negative number, got {value!r}")
    return float(value)


def tag_content(response: str, tag: str) -> str | None:
    """Stripped text between ``<tag>`` and ``</tag>`` if each occurs exactly once, open first; else None."""
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    if response.count(open_tag) != 1 or response.count(close_tag) != 1:
        return None
    start, end = response.index(open_tag) + len(open_tag), response.index(close_tag)
    return response[start:end].strip() if start <= end else None


def is_well_formed(response: str) -> bool:
    """True iff ``response`` is one think block then one answer block, whitespace aside."""
    return all(response.count(t) == 1 for t in _TAGS) and _WELL_FORMED.fullmatch(response) is not None


def _normalize(text: str) -> str:
    return " ".join(text.lower().split())


def answers_match(pred: str, gold: str) -> bool:
    """Exact numeric equality when both are one number, else normalised string equality."""
    pred_num = None if _NOT_ONE_NUMBER.search(pred) else parse_number(pred)
    gold_num = None if _NOT_ONE_NUMBER.search(gold) else parse_number(gold)
    if pred_num is not None and gold_num is not None:
        return pred_num == gold_num
    return _normalize(pred) == _normalize(gold)


@register("reasoning_format", "think_answer")
def reasoning_format_reward(response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
    """Format credit for think-then-answer, answer credit, minus a penalty for too little thinking."""
    format_weight = weight_param(extra_info, "format_weight", FORMAT_WEIGHT)
    answer_weight = weight_param(extra_info, "answer_weight", ANSWER_WEIGHT)
    short_penalty = weight_param(extra_info, "short_penalty", SHORT_PENALTY)
    min_think_chars = weight_param(extra_info, "min_think_chars", MIN_THINK_CHARS)
    answer = tag_content(response, "answer")
    correct = answer is not None and answers_match(answer, ground_truth)
    short = len(tag_content(response, "think") or "") < min_think_chars
    score = format_weight * float(is_well_formed(response)) + answer_weight * float(correct)
    score -= short_penalty * float(short)
    return RewardOutput(score=score, correct=correct)
