"""GSM8K rewards: numeric answer compared exactly to a number-string gold.

* ``gsm8k`` (strict): the answer is the number right after the LAST ``####`` that holds one (an
  empty ``####`` after it is ignored, as verl's ``gsm8k`` reads it); a response without it scores 0
  even if the right number appears elsewhere.  The rest of that line may be bold markers, a unit
  or a period (``#### 72 clips``), never another number or a joining word (``#### 72 or 73``,
  ``#### 72-73``: a hedge, not paid).  The answers policy of ``answers.py`` applies: a box or an
  answer line elsewhere in the response that gives a different number means no reward.
* ``gsm8k_flexible``: the answer is the last number anywhere in the response.

Numbers compare as exact rationals after stripping commas, ``$`` and a
trailing period (``"1,000" == "1000"``, ``"72.0" == "72"``).  Score is 1.0
when correct, else 0.0.  A non-numeric ground truth raises ``ValueError``.
"""

from __future__ import annotations

import re
from fractions import Fraction

from megareason.rewards.answers import commitments, consistent
from megareason.rewards.arithmetic import NUMBER, last_number, parse_ground_truth, parse_number
from megareason.rewards.equivalence_forms import is_unit
from megareason.rewards.registry import RewardOutput, register

_ONE_NUMBER = re.compile(r"^[*_\s]*(" + NUMBER + r"|-?\.\d+)[*_\s]*(?P<tail>[^\d]*?)[.\s]*$")


def one_number(text: str) -> Fraction | None:
    """The value of an answer that is one number, optionally with a unit (``72 clips``, ``$18``,
    ``**72**``), else None (``72 or 73``, ``72-73``, ``72, 73``)."""
    m = _ONE_NUMBER.match(text)
    if not m or (m.group("tail").strip() and not is_unit(m.group("tail"))) or re.search(r"[-+,/]", m.group("tail")):
        return None
    return parse_number(m.group(1).replace("$", "").lstrip("+"))


def extract_strict(response: str) -> str | None:
    """The number after the last non-empty ``####`` marker, or None (also when that line is no single
    number, or the response commits elsewhere to a different number)."""
    found = commitments(response, gsm8k=True)
    marks = [c for c in found if c.kind == "####"]
    if not marks or one_number(marks[-1].text) is None:
        return None
    final = marks[-1].text
    return final if consistent(found, final, lambda a, b: one_number(a) == one_number(b)) else None


def extract_flexible(response: str) -> str | None:
    """The last number anywhere in ``response``, or None."""
    return last_number(response, NUMBER)


def _score(answer: str | None, ground_truth: str) -> RewardOutput:
    gold = parse_ground_truth(ground_truth, "gsm8k")
    correct = answer is not None and one_number(answer) == gold
    return RewardOutput(score=1.0 if correct else 0.0, correct=correct)


@register("gsm8k")
def gsm8k_strict_reward(response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
    """1.0 iff the number after the last ``####`` equals ``ground_truth``."""
    return _score(extract_strict(response), ground_truth)


@register("gsm8k_flexible")
def gsm8k_flexible_reward(response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
    """1.0 iff the last number in ``response`` equals ``ground_truth``."""
    return _score(extract_flexible(response), ground_truth)
