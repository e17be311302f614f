"""Hand-computed expectations for the grade (rubric) reward of the RRM + TinyV recipe:
(1 - |min(X, 10)/10 - target|)**2, X read after the last "Total Score"; the recipe's own reading restated as a
reference that must agree."""

from fractions import Fraction

import pytest

from megareason.rewards import RewardOutput, compute_score, get_reward_fn
from megareason.rewards.rubric import extract_grade, lenient_grade, seed_grade

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
        # the recipe's reading: after the last "Total Score", drop : [ points point * | ', cut at "/", float
        ("Total Score: 12", "1", R(1.0, True)),  # clamped at 10
        ("Total Score: 12", "0.8", R(0.64, False)),  # 10 vs 0.8: (1 - 0.2)**2
        ("Total Score 7/10", "0.7", R(1.0, True)),  # no colon
        ("Total Score: 8/100", "0.8", R(1.0, True)),  # the denominator is ignored: 8
        ("Total Score: 8/100", "0.08", R(0.0784, False)),  # 0.8 vs 0.08: (1 - 0.72)**2
        ("Total Score: 4/5", "0.8", R(0.36, False)),  # 4 -> 0.4: (1 - 0.4)**2
        ("Total Score: 80", "0.8", R(0.64, False)),  # clamped: 10
        ("Total Score: 10.5", "1", R(1.0, True)),
        ("Total Score: 7e1", "0.7", R(0.49, False)),  # float("7e1") = 70 -> 10: (1 - 0.3)**2
        ("Total Score: 7 points", "0.7", R(1.0, True)),
        ("Total Score: |7|", "0.7", R(1.0, True)),
        ("Total Score: '7'", "0.7", R(1.0, True)),
        ("Total Score: [7", "0.7", R(1.0, True)),
        ("7", "0.7", R(1.0, True)),  # no marker: the recipe reads the whole text
        ("8/10", "0.8", R(1.0, True)),
        ("**Total Score**: 8/10", "0.8", R(1.0, True)),
        ("**Total Score:** **6**/10", "1", R(0.36, False)),
        ("**Total Score: 8 / 10**", "0.8", R(1.0, True)),
        ("## Total Score\n8/10 overall", "0.8", R(1.0, True)),
        ("Total Score:\n  7", "0.7", R(1.0, True)),
        ("Total Score: 7.", "0.7", R(1.0, True)),  # sentence-final period
        ("Total Score: .5", "0.05", R(1.0, True)),
        ("Total Score: 7", "7/10", R(1.0, True)),  # a fraction target is fine
        ("Clarity 3/4, depth 2/3.\nTotal Score: 2\nOn reflection...\nTotal Score: 9", "0.9", R(1.0, True)),
        ("Total Score: 9\nOn reflection...\nTotal Score: 2", "0.9", R(0.09, False)),  # last one counts
        ("Total Score: 9\nTotal Score: N/A", "0.9", R(0.0, False)),  # last marker unreadable
        # departures from the seed, for values it reads
        ("Total Score: -1", "0", R(1.0, True)),  # clamped at 0 (seed: -0.1 -> (1 - 0.1)**2 = 0.81)
        ("Total Score: -10", "1", R(0.0, False)),  # seed: -1 -> (1 - 2)**2 = 1.0
        ("Total Score: nan", "1", R(0.0, False)),  # recipe: min(10.0, nan) = 10 -> 1.0
        ("Total Score: inf", "1", R(1.0, True)),  # as the recipe: clamped at 10
        # lenient: readable grades the recipe scores 0
        ("Total Score = 7.5", "0.5", R(0.5625, False)),  # error 0.25 -> 0.75**2
        ("total score: 3", "0.25", R(0.9025, True)),  # error 0.05 -> 0.95**2
        ("TOTAL SCORE: 5", "0.5", R(1.0, True)),
        ("The total score is 7", "0.7", R(1.0, True)),
        ("Total Score: 8 out of 10 -- solid work", "0.8", R(1.0, True)),
        ("Total Score (out of 10): 8", "0.8", R(1.0, True)),
        ("Total Score: [7]", "0.7", R(1.0, True)),  # the recipe removes "[", not "]"
        ("Total Score: [6 points]/10", "0.6", R(1.0, True)),
        ("Total Score: 8 points overall", "0.8", R(1.0, True)),
        ("total score: **9**/10", "0.9", R(1.0, True)),
        # unreadable
        ("Total Score: 7.5.3", "0.75", R(0.0, False)),
        ("Total Score: 7th", "0.7", R(0.0, False)),
        ("Total Score: 7 + 2 = 9", "0.9", R(0.0, False)),  # arithmetic, not a grade
        ("Total Score: N/A", "0.7", R(0.0, False)),
        ("Score: 7", "0.7", R(0.0, False)),
        ("Subtotal score: 7", "0.7", R(0.0, False)),
        ("", "0.7", R(0.0, False)),
    ],
)
def test_rubric(judge, target, expected):
    got = compute_score("grade", judge, target)
    assert got.correct == expected.correct and got.score == pytest.approx(expected.score, abs=1e-12)


def _seed_score(judge: str, target: float) -> float | None:
    """The RRM + TinyV recipe's grade reward restated (its README): None where its float() fails."""
    text = judge.split("Total Score")[-1]
    for s in (":", "[", "points", "point", "*", "|", "'"):
        text = text.replace(s, "")
    try:
        grade = float(text.split("/")[0].strip())
    except ValueError:
        return None
    return (1.0 - abs(min(10.0, grade) / 10.0 - target)) ** 2


@pytest.mark.parametrize("judge", [
    "Total Score: 7", "Total Score 7/10", "Total Score: 8/100", "Total Score: 12", "**Total Score:** **8**/10",
    "Total Score: [6 points/10", "Total Score: 7 point", "Total Score: |5|", "Total Score: 3.25/10 ",
    "rubric...\nTotal Score: 2\nTotal Score: 9", "9", " 4.5 / 10", "Total Score:\n\n**10**", "Total Score: 1e1",
])
@pytest.mark.parametrize("target", [0.0, 0.35, 0.7, 1.0])
def test_everything_the_seed_reads_scores_as_in_the_seed(judge, target):
    expected = _seed_score(judge, target)
    assert expected is not None, judge
    assert compute_score("grade", judge, str(target)).score == pytest.approx(expected, abs=1e-12)


def test_extract_grade():
    assert extract_grade("Total Score: 7.5") == Fraction(15, 2)
    assert extract_grade("**Total Score:** **8**/10") == 8
    assert extract_grade("Total Score: 0.7") == Fraction(7, 10)  # exact, not the nearest double
    assert extract_grade("Total Score: 12") == 12  # read unclamped; the reward clamps
    assert extract_grade("Total Score: -3") == -3
    assert seed_grade("The total score is 7") is None and lenient_grade("The total score is 7") == 7
    assert seed_grade("Total Score: 7/10") == 7 and lenient_grade("no marker") is None
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
