"""GSM8K rewards: numeric answer compared exactly to a number-string gold.

* ``gsm8k`` (strict): the answer is the number right after the LAST ``####``;
  a response without it scores 0 even if the right number appears elsewhere.
* ``gsm8k_flexible``: the answer is the last number anywhere in the response.

Numbers compare as exact rationals after stripping commas, ``$`` and a
trailing period (``"1,000" == "1000"``, ``"72.0" == "72"``).  Score is 1.0
when correct, else 0.0.  A non-numeric ground truth raises ``ValueError``.
"""

from __future__ import annotations

import re

from megareason.rewards.arithmetic import NUMBER, last_number, parse_ground_truth, parse_number
from megareason.rewards.registry import RewardOutput, register

_AFTER_MARKER = re.compile(r"\s*(" + NUMBER + ")")


def extract_strict(response: str) -> str | None:
    """The number directly after the last ``####`` marker, or None."""
    idx = response.rfind("####")
    if idx < 0:
        return None
    m = _AFTER_MARKER.match(response, idx + len("####"))
    return m.group(1) if m else None


def extract_flexible(response: str) -> str | None:
    """The last number anywhere in ``response``, or None."""
    return last_number(response, NUMBER)


def _score(answer: str | None, ground_truth: str) -> RewardOutput:
    gold = parse_ground_truth(ground_truth, "gsm8k")
    correct = answer is not None and parse_number(answer) == gold
    return RewardOutput(score=1.0 if correct else 0.0, correct=correct)


@register("gsm8k")
def gsm8k_strict_reward(response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
    """1.0 iff the number after the last ``####`` equals ``ground_truth``."""
    return _score(extract_strict(response), ground_truth)


@register("gsm8k_flexible")
def gsm8k_flexible_reward(response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
    """1.0 iff the last number in ``response`` equals ``ground_truth``."""
    return _score(extract_flexible(response), ground_truth)
