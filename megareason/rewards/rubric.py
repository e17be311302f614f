"""Rubric-grading reward (the RRM recipe's ``grade``): a judge's ``Total Score`` out of 10 against a target in [0, 1].

The response is a judge's text. Its grade ``X`` is read as the rubric reward model (RRM) + TinyV
recipe on verl does (its ``verl/utils/reward_score/__init__.py``, ``data_source == 'grade'``):

1. take the text after the LAST ``Total Score`` (case-sensitive; a text without one is taken whole);
2. remove ``:`` ``[`` ``points`` ``point`` ``*`` ``|`` ``'``;
3. keep what precedes the first ``/`` (a denominator is ignored: ``8/100`` reads 8), strip it;
4. ``X = float(...)``; if that fails, the grade is unreadable.

So ``Total Score: 7``, ``**Total Score:** **8**/10``, ``Total Score 7/10`` (no colon) and a bare ``7``
all read as grades. Where that fails, one more lenient reading is tried, for grades a person reads at
once but the recipe scores 0: after the last ``total score`` in any case (a whole word; optionally
followed by a parenthesis, ``:``, ``=``, ``is``, ``of``, brackets or bold), a number, optionally ``/ N`` or
``out of N`` (ignored as above) and ``points``, then anything but more of the number or arithmetic:
``total score = 7.5``, ``The total score is 7``, ``Total Score: 8 out of 10 -- solid work``,
``Total Score (out of 10): 8``, ``Total Score: [7]``. It is never used where the recipe reads a number.

With ``target = ground_truth`` (a number in [0, 1], else ``ValueError``) and ``X`` clamped to
``[0, 10]`` (the recipe clamps at 10: ``Total Score: 12`` reads 10)::

    score = (1 - |X/10 - target|) ** 2

on exact rationals, and ``correct`` iff ``|X/10 - target| <= 0.1`` (not in the recipe, which only
scores). An unreadable grade scores 0.0 and is incorrect. Two departures from the recipe, both for
values it reads: a negative grade is clamped to 0 (the recipe's formula pays ``-10`` as much as ``10``
at target 1), and ``nan`` is unreadable (the recipe's ``min(10.0, nan)`` is 10).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from megareason.rewards.arithmetic import parse_ground_truth
from megareason.rewards.registry import RewardOutput, register

CORRECT_TOLERANCE = Fraction(1, 10)
MAX_GRADE = 10

SEED_MARKER = "Total Score"
# Removed in this order by the recipe ("points" before "point").
SEED_REMOVED = (":", "[", "points", "point", "*", "|", "'")

_MARKER = re.compile(r"\btotal\s+score\b", re.IGNORECASE)
# After the marker: an optional parenthesis ("(out of 10)"), then separators and one linking word.
_LEAD = re.compile(r"(?:\s*\([^()\n]{0,40}\))?[\s*_:=|\[\]'\"`]*(?:(?:is|of)\b[\s*_:=|\[\]'\"`]*)?", re.IGNORECASE)
# Atomic groups stop backtracking into a shorter number ("7.5.3" -> "7") or past the denominator.
_NUMBER = re.compile(
    r"(?P<value>(?>[-+]?(?:\d+(?:\.\d+)?|\.\d+)))"
    r"(?>(?:[\s*\]]*(?:/|\bout\s+of\b)\s*\d+(?:\.\d+)?)?)"
    r"(?>(?:\s*points?\b)?)"
    r"(?!\.\d|\w|\s*(?:[-+=×÷^/]\s*)?\d)",  # not more of a number, nor arithmetic on it
    re.IGNORECASE,
)


def seed_grade(judge_text: str) -> Fraction | None:
    """The grade as the RRM + TinyV recipe reads it (see the module docstring), unclamped; None if none or NaN."""
    tail = judge_text.split(SEED_MARKER)[-1]
    for s in SEED_REMOVED:
        tail = tail.replace(s, "")
    tail = tail.split("/")[0].strip()
    try:
        value = float(tail)
    except ValueError:
        return None
    if math.isnan(value):
        return None
    if math.isinf(value):
        return Fraction(MAX_GRADE if value > 0 else 0)
    try:
        return Fraction(tail)  # exact: "0.7" is 7/10, not the nearest double
    except (ValueError, ZeroDivisionError):
        return Fraction(value)


def lenient_grade(judge_text: str) -> Fraction | None:
    """The number after the last ``total score`` (any case) when it reads clearly as a grade, else None."""
    markers = list(_MARKER.finditer(judge_text))
    if not markers:
        return None
    lead = _LEAD.match(judge_text, markers[-1].end())
    m = _NUMBER.match(judge_text, lead.end())
    return Fraction(m["value"]) if m else None


def extract_grade(judge_text: str) -> Fraction | None:
    """The judge's grade, unclamped: the recipe's reading, else the lenient one; None if neither reads one."""
    grade = seed_grade(judge_text)
    return grade if grade is not None else lenient_grade(judge_text)


@register("grade", "rubric")
def rubric_reward(response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
    """``(1 - |clamp(grade, 0, 10)/10 - target|)**2``; 0.0 when no grade can be read."""
    target = parse_ground_truth(ground_truth, "grade")
    if not 0 <= target <= 1:
        raise ValueError(f"grade ground_truth must be a number in [0, 1], got {ground_truth!r}")
    grade = extract_grade(response)
    if grade is None:
        return RewardOutput(score=0.0, correct=False)
    error = abs(min(max(grade, 0), MAX_GRADE) / MAX_GRADE - target)
    return RewardOutput(score=float((1 - error) ** 2), correct=error <= CORRECT_TOLERANCE)
