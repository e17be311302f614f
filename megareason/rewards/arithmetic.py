"""Arithmetic reward (basic arithmetic, chain sums): simplexity's RLVR format / correct / combined reward.

simplexity's RLVR recipe (TRL, arithmetic; its ``training/reward_functions.py``) rewards a sequence whose
last ``<eoe>`` (end of expression) is immediately preceded by ``=`` and an operand: ``... = answer
<eoe>``. Here the response's **final answer** is, of its markers, the one that comes last:

* ``= <number> <eoe>``: the text before the LAST ``<eoe>`` ends with ``= <number>`` (spaces, bold and
  a final ``.`` allowed); if it does not, there is no final answer, even when an earlier ``<eoe>`` was
  well formed (as in simplexity); text after that ``<eoe>`` is ignored;
* ``\\boxed{<number>}``: the last box (a box that holds no number is no final answer);
* with neither marker, the response ending with ``= <number>`` (``2 + 5 = 7.``): the end of the text
  stands for ``<eoe>``.

Nothing else is a final answer: ``I guess the result is 7`` is not, nor is the last number anywhere.
A response that also boxes a different number is not ``correct``
(the answers policy of ``answers.py``, shared by every family).

* ``format_ok``: the response has a final answer;
* ``correct``: it has one and it equals the ground truth numerically (exact rationals: ``-3 == -3.0``,
  ``3/4 == 0.75``, ``1,250 == 1250``).

``reward_type`` picks the score, as in simplexity: ``boxed`` = ``format_ok`` (0/1), ``correct`` =
``correct`` (0/1), ``combined`` = ``boxed_weight * format_ok + correct_weight * correct`` (simplexity's
``boxed_weight * boxed + correct_weight * boxed * correct``: here ``correct`` implies ``format_ok``).
Defaults: ``combined`` with ``boxed_weight`` 0.3 and ``correct_weight`` 0.7, simplexity's (its
``rlvr_small.yaml`` and ``combined_reward``'s defaults). Each is overridable per row through the
``extra_info`` key of the same name (``reward_type`` one of the three; weights finite non-negative
numbers, else ``ValueError``), or with ``make_arithmetic_reward``.

Also hosts the exact number parsing shared with the gsm8k family.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from megareason.rewards.answers import boxes, consistent
from megareason.rewards.math import last_boxed
from megareason.rewards.registry import RewardFn, RewardOutput, register

REWARD_TYPES = ("boxed", "correct", "combined")
# simplexity's RLVR defaults (its configs/training/rlvr_small.yaml).
REWARD_TYPE = "combined"
BOXED_WEIGHT = 0.3
CORRECT_WEIGHT = 0.7
EOE = "<eoe>"

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


def final_answer(response: str) -> str | None:
    """The response's well-formed final answer (see the module docstring), or None."""
    eoe = response.rfind(EOE)
    box = max(response.rfind("\\boxed"), response.rfind("\\fbox"))
    if eoe < 0 and box < 0:
        return final_equals(response)
    if eoe > box:
        return final_equals(response[:eoe])
    answer = last_boxed(response)
    return answer if answer is not None and parse_number(answer) is not None else None


def committed_elsewhere_differently(response: str, answer: str) -> bool:
    """The answers policy (``answers.py``) on this family's markers: a box giving another number than the
    final answer (answer lines are no marker of this format)."""
    return not consistent(boxes(response), answer, lambda a, b: parse_number(a) == parse_number(b))


def _weight(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"arithmetic {name} must be a finite non-negative number, got {value!r}")
    return float(value)


def _reward_type(value: object) -> str:
    if value not in REWARD_TYPES:
        raise ValueError(f"arithmetic reward_type must be one of {', '.join(REWARD_TYPES)}, got {value!r}")
    return str(value)


def make_arithmetic_reward(reward_type: str = REWARD_TYPE, boxed_weight: float = BOXED_WEIGHT,
                           correct_weight: float = CORRECT_WEIGHT) -> RewardFn:
    """An arithmetic reward with these defaults (each still overridable per row by ``extra_info``)."""
    defaults = {"reward_type": _reward_type(reward_type), "boxed_weight": _weight(boxed_weight, "boxed_weight"),
                "correct_weight": _weight(correct_weight, "correct_weight")}

    def arithmetic_reward(response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
        gold = parse_ground_truth(ground_truth, "arithmetic")
        kind = _reward_type(extra_info.get("reward_type", defaults["reward_type"]))
        answer = final_answer(response)
        format_ok = answer is not None
        correct = format_ok and parse_number(answer) == gold and not committed_elsewhere_differently(response, answer)
        if kind == "boxed":
            score = float(format_ok)
        elif kind == "correct":
            score = float(correct)
        else:
            score = (_weight(extra_info.get("boxed_weight", defaults["boxed_weight"]), "boxed_weight") * format_ok
                     + _weight(extra_info.get("correct_weight", defaults["correct_weight"]), "correct_weight")
                     * correct)
        return RewardOutput(score=float(score), correct=correct)

    return arithmetic_reward


arithmetic_reward = register("arithmetic", "basic_arithmetic", "chain_sum")(make_arithmetic_reward())
