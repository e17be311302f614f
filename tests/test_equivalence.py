"""The math reward's equivalence layer on hand-written answer pairs (``tests/data/equivalence_pairs.tsv``).

Every equivalent pair must be accepted and every near-miss wrong pair rejected by the project's
``math`` reward (math-verify plus ``megareason.rewards.equivalence``), in both the boxed reward and
the layer's own functions.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import sympy

from megareason.rewards.equivalence import contradicts, equivalent, interpret, rounds_to
from megareason.rewards.equivalence_forms import (
    Labelled,
    RealSet,
    Scalar,
    Seq,
    clean,
    expand_pm,
    mixed_number,
    percent_to_fraction,
    split_quantity,
    written_unit,
)
from megareason.rewards.equivalence_sets import real_set, sets_equal
from megareason.rewards.math import math_equal
from megareason.rewards.registry import compute_score

PAIRS_FILE = Path(__file__).parent / "data" / "equivalence_pairs.tsv"


def load_pairs(path: Path = PAIRS_FILE) -> list[tuple[str, bool, str, str]]:
    """(kind, expected, reference, answer) rows of the tab-separated pairs file."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        kind, expected, reference, answer = line.split("\t")
        rows.append((kind, expected == "1", reference, answer))
    return rows


PAIRS = load_pairs()


def test_pairs_file_covers_every_kind():
    equivalent_kinds = Counter(kind for kind, expected, _, _ in PAIRS if expected)
    wrong_kinds = Counter(kind for kind, expected, _, _ in PAIRS if not expected)
    assert sum(equivalent_kinds.values()) >= 150 and sum(wrong_kinds.values()) >= 150
    kinds = {"rounding", "percent", "mixed", "ratio", "units", "currency", "interval", "function", "equation",
             "labelled", "vector", "set", "pm", "angle", "unicode", "text", "leftright"}
    assert set(equivalent_kinds) == kinds and set(wrong_kinds) == kinds | {"renamed"}  # renamed: wrong only
    assert len({(ref, ans) for _, _, ref, ans in PAIRS}) == len(PAIRS), "duplicate pair"


@pytest.mark.parametrize(
    ("kind", "expected", "reference", "answer"), PAIRS, ids=[f"{p[0]}-{i}" for i, p in enumerate(PAIRS)]
)
def test_math_reward_on_pair(kind, expected, reference, answer):
    _check_pair(kind, reference, answer, expected)


def _check_pair(label: str, reference: str, answer: str, expected: bool) -> None:
    """The math reward of a boxed ``answer`` and ``math_equal`` both say ``expected``."""
    out = compute_score("math", rf"so the answer is $\boxed{{{answer}}}$.", reference)
    assert out.correct is expected, f"{label}: {answer!r} vs reference {reference!r}"
    assert math_equal(answer, reference) is expected


# Answers a competition grader marks wrong (a partial solution set, a different unit, a percentage
# read the other way, a two-digit decimal for an irrational value), each beside its correct form.
GRADER_PAIRS = [
    # a multi-solution reference needs every solution, in any order or list style
    ("solutions", r"5 \text{ or } 7", "5", False),
    ("solutions", r"-2 \text{ or } 2", "-2", False),
    ("solutions", r"3 \text{ but not } 5", "3", False),
    ("solutions", r"5 \text{ and } 7", "5", False),
    ("solutions", r"5 \text{ or more}", "5", False),
    ("solutions", r"5 \text{ or } 7", r"5 \text{ or } 7", True),
    ("solutions", r"5 \text{ or } 7", "7 or 5", True),
    ("solutions", r"5 \text{ or } 7", "5, 7", True),
    ("solutions", r"5 \text{ or } 7", r"7 \text{ and } 5", True),
    ("solutions", r"-2 \text{ or } 2", r"\pm 2", True),
    # units are compared whatever their length; a unit written on one side only is not compared
    ("units", r"5 \text{ ms}", "5 s", False),
    ("units", "5 m", "5 km", False),
    ("units", "5 g", r"5 \text{ kg}", False),
    ("units", "5 m", "5km", False),
    ("units", r"5 \text{ meters}", "5 m", True),
    ("units", r"5 \text{ seconds}", "5 s", True),
    ("units", "5", r"5 \text{ m}", True),
    # a percentage is its value, p% = p/100, on either side
    ("percent", "0.5", r"0.5\%", False),
    ("percent", r"50\%", "50", True),  # the percent's number, as math-verify reads it: never a wrong value
    ("percent", "50", r"50\%", False),
    ("percent", "0.5", r"50\%", True),
    ("percent", r"50\%", r"\frac{1}{2}", True),
    # a decimal for a non-terminating value needs three significant digits
    ("rounding", r"\pi", "3.1", False),
    ("rounding", r"\frac{\sqrt{3}}{2}", "0.87", False),
    ("rounding", r"\frac{1}{3}", r"33\%", False),
    ("rounding", r"\frac{1}{8}", "0.13", False),
    ("rounding", r"\pi", "3.14", True),
    ("rounding", r"\frac{\sqrt{3}}{2}", "0.866", True),
    ("rounding", r"\frac{1}{3}", r"33.3\%", True),
]


@pytest.mark.parametrize(
    ("rule", "reference", "answer", "expected"), GRADER_PAIRS, ids=[f"{p[0]}-{i}" for i, p in enumerate(GRADER_PAIRS)]
)
def test_grader_pairs(rule, reference, answer, expected):
    _check_pair(rule, reference, answer, expected)


# --- the layer's steps on their own -------------------------------------------------------------


@pytest.mark.parametrize(
    ("decimal", "exact", "ok"),
    [
        ("12.86", r"\frac{90}{7}", True),  # 12.857142...
        ("12.87", r"\frac{90}{7}", False),  # off in the last digit
        ("12.85", r"\frac{90}{7}", False),  # truncated, not rounded
        ("0.333", r"\frac{1}{3}", True),
        ("0.33", r"\frac{1}{3}", False),  # two significant digits are no rounded answer
        ("0.3", r"\frac{1}{3}", False),
        ("0.125", r"\frac{1}{8}", False),  # equal, not rounded: math-verify compares exact values
        ("0.13", r"\frac{1}{8}", False),  # 1/8 has an exact decimal: a rounding of it is no answer
        ("1.667", r"\frac{5}{3}", True),
        ("1.666", r"\frac{5}{3}", False),  # truncated, not rounded
        ("13", r"\frac{90}{7}", False),  # an integer is not a rounding
        ("1.41", "1.414", False),  # both plain numbers: math-verify's business
        ("3.14", r"\pi", True),
        ("3.14", "x", False),
    ],
)
def test_rounds_to(decimal, exact, ok):
    assert rounds_to(decimal, exact) is ok


def test_cosmetic_cleaning():
    assert clean(r"$\left( -∞, 2 \right]$.") == r"( -\infty , 2 ]"
    assert clean(r"x ≥ −1") == r"x \ge -1"
    assert clean(r"3√5") == r"3\sqrt{5}"
    assert clean(r"\text{the } 7\text{th day}") == "the 7 th day"
    assert clean(r"\dfrac{1}{2} \leq x") == r"\frac{1}{2} \le x"


def test_written_forms():
    assert percent_to_fraction(r"27.5\%") == "0.275"
    assert percent_to_fraction("12.5 percent") == "0.125"
    assert mixed_number(r"-2\frac{1}{3}") == r"-\frac{7}{3}"
    assert mixed_number(r"2\frac{4}{3}") is None  # improper: a product, not a mixed number
    assert split_quantity(r"\$1,234.50", from_text=False) == ("1234.50", "")
    assert split_quantity("42.5 grams", from_text=False) == ("42.5", "grams")
    assert split_quantity("1,234", from_text=False) is None  # may be a list
    assert split_quantity("2 x", from_text=False) is None  # a product
    assert split_quantity("100 m", from_text=True) == ("100", "m")
    assert split_quantity("5 or 7", from_text=True) is None  # two solutions, not 5 of the unit "or 7"
    assert split_quantity("5 or more", from_text=True) is None
    assert split_quantity("18 cm ^2", from_text=True) == ("18", "cm ^2")  # an exponent is part of a unit
    assert written_unit("5 s", from_text=False) == "second"  # any length, for refusing different units
    assert written_unit("5km", from_text=False) == "kilometer"  # a unit written straight after the number
    assert written_unit("3t", from_text=False) == ""  # a product
    assert expand_pm(r"(\pm 1, 2)") == ["(1, 2)", "(-1, 2)"]
    assert expand_pm(r"a \pm b \mp c") == ["a +b -c", "a -b +c"]  # tied signs
    assert len(expand_pm(r"(\pm 1, \pm 2)")) == 4  # independent signs


def test_structures():
    assert interpret("p=4, q=9") == [Labelled(("p", "q"), (Scalar("4"), Scalar("9")))]
    assert interpret(r"\begin{pmatrix}1\\2\end{pmatrix}") == [Seq("tuple", (Scalar("1"), Scalar("2")))]
    assert interpret("15:4") == [Scalar(r"\frac{15}{4}")]
    reals, pair = interpret("(2,5)")
    assert isinstance(reals, RealSet) and pair == Seq("tuple", (Scalar("2"), Scalar("5")))


def test_real_sets():
    lopen = sympy.Interval.Lopen(2, 5)
    for text in ["(2,5]", r"2 < t \le 5", r"\{t \mid 2 < t \le 5\}", r"t \in (2, 5]", r"5 \ge t > 2"]:
        assert sets_equal(real_set(text), lopen), text
    assert sets_equal(real_set(r"x \ne 0"), real_set(r"(-\infty,0)\cup(0,\infty)"))
    assert sets_equal(real_set(r"x<-1 or x>2"), real_set(r"(-\infty,-1)\cup(2,\infty)"))
    assert not sets_equal(real_set("[2,5]"), lopen)
    assert real_set("(5,2)") is None  # an empty "interval" is no answer
    assert real_set("x = 3") is None


def test_contradicts_only_what_math_verify_overlooks():
    assert contradicts("9,4", "p=4, q=9")  # math-verify compares the lists as sets
    assert contradicts(r"42.5\text{ kg}", r"42.5\text{ g}")  # and drops the unit words
    assert contradicts("5 s", r"5 \text{ ms}")  # of any length
    assert contradicts("5", r"5 \text{ or more}")  # and reads the first of several solutions
    assert contradicts(r"0.5\%", "0.5")  # and drops the percent sign
    assert not contradicts(r"50\%", "0.5")
    assert not contradicts("4,9", "p=4, q=9")
    assert not contradicts("q=9, p=4", "p=4, q=9")  # matched by label
    assert not contradicts(r"\frac{1}{2}", "0.5")  # no labels, no words: nothing to say


def test_layer_never_raises_and_bounds_length():
    assert equivalent("", "") is False
    assert equivalent(r"\frac{", "1") is False
    assert equivalent("1" * 2000, "1" * 2000) is False
    assert contradicts(r"p=\frac{, q=", "1,2") is False
