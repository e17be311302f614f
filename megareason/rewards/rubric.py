"""Rubric-grading reward: a judge's ``Total Score`` out of 10 matched against a target in [0, 1].

The response is a judge's text.  Its grade is read from the LAST ``Total
Score`` marker followed by ``:`` or ``=`` (case-insensitive, markdown bold
allowed anywhere around it): ``Total Score: 7``, ``total score = 7.5``,
``**Total Score**: 8/10``, ``**Total Score:** **8**/10``.  An optional
denominator must be 10.

With ``X`` that grade and ``target = ground_truth`` (a number in [0, 1],
else ``ValueError``): ``score = (1 - |X/10 - target|) ** 2`` and ``correct``
iff ``|X/10 - target| <= 0.1``, both computed on exact rationals (so a grade
of 8 against a target of 0.7 is correct).  When the last marker is not
followed by such a number, or ``X`` lies outside [0, 10], the score is 0.0
and the grade incorrect.
"""

from __future__ import annotations

import re
from fractions import Fraction

from megareason.rewards.arithmetic import parse_ground_truth
from megareason.rewards.registry import RewardOutput, register

CORRECT_TOLERANCE = Fraction(1, 10)
MAX_GRADE = 10

_MARKER = re.compile(r"\btotal\s+score[\s*]*[:=]", re.IGNORECASE)
# The sign is kept so "-3" reads as out of range.  Atomic groups stop backtracking into a
# shorter number ("7.5.3" -> "7") or past the denominator ("8/100" -> "8").
_GRADE = re.compile(
    r"[\s*]*(?P<value>(?>-?(?:\d+(?:\.\d+)?|\.\d+)))"
    r"(?>(?:[\s*]*/\s*(?P<denom>\d+(?:\.\d+)?))?)(?!\w|\.\d)"
)


def extract_grade(judge_text: str) -> Fraction | None:
    """The grade after the last ``Total Score:``/``=`` marker, or None if it is not a number out of 10."""
    markers = list(_MARKER.finditer(judge_text))
    if not markers:
        return None
    m = _GRADE.match(judge_text, markers[-1].end())
    if m is None or (m["denom"] is not None and Fraction(m["denom"]) != MAX_GRADE):
        return None
    return Fraction(m["value"])


@register("grade", "rubric")
def rubric_reward(response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
    """``(1 - |grade/10 - target|)**2`` for an in-range grade, else 0.0."""
    target = parse_ground_truth(ground_truth, "grade")
    if not 0 <= target <= 1:
        raise ValueError(f"grade ground_truth must be a number in [0, 1], got {ground_truth!r}")
    grade = extract_grade(response)
    if grade is None or not 0 <= grade <= MAX_GRADE:
        return RewardOutput(score=0.0, correct=False)
    error = abs(grade / MAX_GRADE - target)
    return RewardOutput(score=float((1 - error) ** 2), correct=error <= CORRECT_TOLERANCE)
