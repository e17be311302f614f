"""Arithmetic reward (basic arithmetic, chain sums): format credit + correctness.

``score = boxed_weight * format_ok + correct_weight * correct`` where

* ``format_ok``: the response contains ``\\boxed{...}`` or ends with
  ``= <number>`` (trailing whitespace/punctuation ignored);
* ``correct``: the extracted answer -- the last boxed content, else the final
  ``= <number>``, else the last number in the text -- equals the ground truth
  numerically (exact rationals: ``-3 == -3.0``, ``3/4 == 0.75``).

Also hosts the exact number parsing shared with the gsm8k family.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from megareason.rewards.math import last_boxed
from megareason.rewards.registry import RewardFn, RewardOutput, register

BOXED_WEIGHT = 0.1
CORRECT_WEIGHT = 0.9

# A minus sign glued to a preceding digit is subtraction ("5-3"), not a sign.
NUMBER = r"(?:(?<![\w)])-)?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_OR_FRACTION = NUMBER + r"(?:\s*/\s*\d+)?"
_FINAL_EQUALS = re.compile(r"=\s*\**\s*(" + _NUMBER_OR_FRACTION + r")$")
_TRAILING_NOISE = " \t\r\n.!?;:*$"
# No exponents: Fraction("1e999999999") would try to build a gigantic integer.
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")
_LATEX_FRACTION = re.compile(r"([-+]?)\\[dt]?frac\{([-+]?\d+)\}\{([-+]?\d+)\}")


def parse_number(text: str) -> Fraction | None:
    """Exact value of a number string, or None if ``text`` is not a plain number.

    Accepts ints, decimals, ``a/b`` and ``\\frac{a}{b}``; ignores whitespace,
    commas, ``$`` signs and a trailing period.
    """
    s = re.sub(r"[\s,$]|\\\$|\\[,;! ]", "", text).rstrip(".")
    if latex := _LATEX_FRACTION.fullmatch(s):
        sign, num, den = latex.groups()
        s = f"{sign}{num}/{den}"
    if not _PLAIN_NUMBER.fullmatch(s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):  # zero denominator, or over int's digit limit
        return None


def parse_ground_truth(ground_truth: str, family: str) -> Fraction:
    """``parse_number`` for gold answers: bad data is a user error, not a zero reward."""
    value = parse_number(ground_truth)
    if value is None:
        raise ValueError(f"{family} ground_truth must be a number, got {ground_truth!r}")
    return value


def last_number(text: str, pattern: str = _NUMBER_OR_FRACTION) -> str | None:
    """The last number-looking substring of ``text`` (None if there is none)."""
    matches = re.findall(pattern, text)
    return matches[-1] if matches else None


def final_equals(text: str) -> str | None:
    """The number in a trailing ``= <number>`` (e.g. ``"2 + 5 = 7."``), else None."""
    m = _FINAL_EQUALS.search(text.rstrip(_TRAILING_NOISE))
    return m.group(1) if m else None


def make_arithmetic_reward(
    boxed_weight: float = BOXED_WEIGHT, correct_weight: float = CORRECT_WEIGHT
) -> RewardFn:
    """Build an arithmetic reward with the given non-negative, finite weights."""
    for name, weight in (("boxed_weight", boxed_weight), ("correct_weight", correct_weight)):
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise ValueError(f"{name} must be a finite non-negative number, got {weight!r}")

    def arithmetic_reward(response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
        gold = parse_ground_truth(ground_truth, "arithmetic")
        boxed = last_boxed(response)
        equals = final_equals(response)
        format_ok = boxed is not None or equals is not None
        # A boxed answer is a commitment: a non-numeric box is wrong, not skipped.
        answer = boxed if boxed is not None else equals if equals is not None else last_number(response)
        correct = answer is not None and parse_number(answer) == gold
        score = boxed_weight * float(format_ok) + correct_weight * float(correct)
        return RewardOutput(score=score, correct=correct)

    return arithmetic_reward


arithmetic_reward = register("arithmetic", "basic_arithmetic", "chain_sum")(make_arithmetic_reward())
