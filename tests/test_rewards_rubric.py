"""Hand-computed expectations for the grade (rubric) reward: (1 - |X/10 - target|)**2."""

from fractions import Fraction

import pytest

from megareason.rewards import RewardOutput, compute_score, get_reward_fn
from megareason.rewards.rubric import extract_grade

R = RewardOutput


def test_registered_under_both_names():
    assert get_reward_fn("rubric") is get_reward_fn("grade")


@pytest.mark.parametrize(
    ("judge", "target", "expected"),
    [
        ("Total Score: 7", "0.7", R(1.0, True)),
        ("Total Score: 8", "0.7", R(0.81, True)),  # error exactly 0.1: correct on exact rationals
        ("Total Score: 6", "0.7", R(0.81, True)),
        ("Total Score: 9", "0.7", R(0.64, False)),  # error 0.2
        ("Total Score: 10", "0", R(0.0, False)),  # error 1
        ("Total Score: 0", "0", R(1.0, True)),
        ("Total Score: 10", "1", R(1.0, True)),
        ("Total Score = 7.5", "0.5", R(0.5625, False)),  # error 0.25 -> 0.75**2
        ("total score: 3", "0.25", R(0.9025, True)),  # error 0.05 -> 0.95**2
        ("TOTAL SCORE: 5", "0.5", R(1.0, True)),
        ("**Total Score**: 8/10", "0.8", R(1.0, True)),
        ("**Total Score:** **6**/10", "1", R(0.36, False)),
        ("**Total Score: 8 / 10**", "0.8", R(1.0, True)),
        ("Total Score:\n  7", "0.7", R(1.0, True)),
        ("Total Score: 7.", "0.7", R(1.0, True)),  # sentence-final period
        ("Total Score: .5", "0.05", R(1.0, True)),
        ("Total Score: 7", "7/10", R(1.0, True)),  # a fraction target is fine
        ("Clarity 3/4, depth 2/3.\nTotal Score: 2\nOn reflection...\nTotal Score: 9", "0.9", R(1.0, True)),
        ("Total Score: 9\nOn reflection...\nTotal Score: 2", "0.9", R(0.09, False)),  # last one counts
        ("Total Score: 9\nTotal Score: N/A", "0.9", R(0.0, False)),  # last marker unparseable
        ("Total Score: 11", "1", R(0.0, False)),
        ("Total Score: 10.5", "1", R(0.0, False)),
        ("Total Score: -1", "0", R(0.0, False)),
        ("Total Score: 80", "0.8", R(0.0, False)),
        ("Total Score: 8/100", "0.08", R(0.0, False)),  # only out of 10
        ("Total Score: 4/5", "0.8", R(0.0, False)),
        ("Total Score: 7e1", "0.7", R(0.0, False)),
        ("Total Score: 7.5.3", "0.75", R(0.0, False)),
        ("Total Score: 7th", "0.7", R(0.0, False)),
        ("The total score is 7", "0.7", R(0.0, False)),  # needs ':' or '='
        ("Score: 7", "0.7", R(0.0, False)),
        ("Subtotal score: 7", "0.7", R(0.0, False)),
        ("", "0.7", R(0.0, False)),
    ],
)
def test_rubric(judge, target, expected):
    assert compute_score("grade", judge, target) == expected


def test_extract_grade():
    assert extract_grade("Total Score: 7.5") == Fraction(15, 2)
    assert extract_grade("**Total Score:** **8**/10") == 8
    assert extract_grade("Total Score: -3") == -3  # read, then rejected as out of range by the reward
    assert extract_grade("no marker") is None


@pytest.mark.parametrize(
    ("target", "match"),
    [
        ("1.5", "must be a number in \\[0, 1\\]"),
        ("-0.1", "must be a number in \\[0, 1\\]"),
        ("7", "must be a number in \\[0, 1\\]"),
        ("high", "must be a number, got"),
        ("1e-1", "must be a number, got"),
        ("", "must be a number, got"),
    ],
)
def test_invalid_target_raises(target, match):
    with pytest.raises(ValueError, match=f"grade ground_truth {match}"):
        compute_score("rubric", "Total Score: 7", target)
