"""Answers a careful grader refuses (and right ones it pays) in every rule family, against hand labels:
renamed variables, tiny numbers, hedges, several committed answers, matrix shapes, words, units,
spacing and case; and the rates on the hand-labelled adversarial pairs of tools/data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megareason.rewards.answers import commitments
from megareason.rewards.math import final_answer, math_equal
from megareason.rewards.registry import compute_score

PAIRS = Path(__file__).resolve().parent.parent / "tools" / "data" / "reward_pairs_adversarial.jsonl"


def _paid(family: str, response: str, gold: str) -> bool:
    return compute_score(family, response, gold, {}).correct


@pytest.mark.parametrize(
    ("gold", "answer", "paid"),
    [
        # another variable, or the roles swapped: never renamed (only a function's argument is)
        ("2b", "2a", False),
        (r"\pi r^2", r"\pi h^2", False),
        ("y = 2x + 1", "x = 2y + 1", False),
        ("b = 2a", "a = 2b", False),
        ("x = 5", "y = 5", False),
        ("g(x) = 3x", "g(t) = 3t", True),
        ("g(x) = 3x", "g(t) = 3t + 1", False),
        # tiny numbers compared relatively, not to 6 decimals
        (r"1.6\times10^{-19}", r"1.6\times10^{-20}", False),
        ("0.0000002", "0.0000003", False),
        ("0.1", "0.1000004", False),
        (r"1.6\times10^{-19}", r"16\times10^{-20}", True),
        # a bare-number gold vetoes hedges
        ("3", r"3 \text{ or more}", False),
        ("3", r"\ge 3", False),
        ("3", "3 (or 4)", False),
        ("3", r"x = 3", True),
        # matrix shape
        (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", r"\begin{pmatrix} 1 & 2 & 3 & 4 \end{pmatrix}", False),
        (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", r"\begin{pmatrix} 1 \\ 2 \\ 3 \\ 4 \end{pmatrix}", False),
        (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", "(1, 2, 3, 4)", False),
        (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", r"\begin{bmatrix} 1 & 2 \\ 3 & 4 \end{bmatrix}", True),
        # words are words
        (r"\text{Alice}", r"\text{Celia}", False),
        (r"\text{no}", r"\text{on}", False),
        (r"\text{Yes}", r"\text{yes}", True),
        # currency, temperature, units as fractions, part of a compound quantity
        (r"\$7", r"7 \text{ cents}", False),
        (r"25^\circ \text{C}", r"25^\circ \text{F}", False),
        (r"5 \text{ m/s}", r"5 \frac{\text{s}}{\text{m}}", False),
        (r"5 \text{ m/s}", r"5 \frac{\text{m}}{\text{s}}", True),
        (r"3 \text{ hours } 20 \text{ minutes}", r"3 \text{ hours}", False),
        (r"3 \text{ hours } 20 \text{ minutes}", r"3 \text{ hours and } 20 \text{ minutes}", True),
        # blanks and case are not cosmetic
        ("12", "1 2", False),
        ("e", "E", False),
        ("E", "e", False),
        # right answers once refused
        (r"25\%", "25", True),
        (r"60 \text{ miles per hour}", r"60 \text{ mph}", True),
        (r"\frac{1}{3}", r"0.\overline{3}", True),
        ("0.0032", "3.2e-3", True),
        ("B", r"\textbf{(B) } 12", True),
        ("B", r"\textbf{(D) } 12", False),
        ("(2, 3)", "y = 3, x = 2", True),
        ("(2, 3)", "y = 2, x = 3", False),
    ],
)
def test_math_equal_on_the_examples(gold, answer, paid):
    assert math_equal(answer, gold) is paid


@pytest.mark.parametrize(
    ("family", "response", "gold", "paid"),
    [
        ("math", r"The answer is $\boxed 5$.", "5", True),
        # several answers: the last committed one, never two different ones
        ("math", "The answer is $\\boxed{5}$.\n\nFinal Answer: 7", "7", False),
        ("math", "The answer is $\\boxed{5}$.\n\nFinal Answer: 7", "5", False),
        ("math", "The answer is $\\boxed{5}$.\n\nFinal Answer: $5$", "5", True),
        # the same, the answer line on the box's line (after a sentence, a box or a formula)
        ("math", "So $\\boxed{5}$. Final Answer: The final answer is 7. I hope it is correct.", "5", False),
        ("math", "\\boxed{5} Final answer: 6", "5", False),
        ("math", "So $\\boxed{5}$. Final Answer: The final answer is 5. I hope it is correct.", "5", True),
        ("math", r"Maybe $\boxed{5}$, or $\boxed{6}$, or $\boxed{7}$.", "7", False),
        ("math", r"So $\boxed{\frac{1}{2}}$, that is $\boxed{0.5}$.", r"\frac{1}{2}", True),
        ("math", "The answer is 13.\n\nFinal answer: $\\boxed{12}$", "12", True),  # prose commits to nothing
        ("math_dapo", "Answer: 35\n\nActually, $\\boxed{34}$.", "34", False),
        ("math_dapo", "I first guessed $\\boxed{34}$.\n\nAnswer: 35", "35", False),
        ("math_dapo", "The sum is 34.\n\nAnswer: 34", "34", True),
        ("gsm8k", "#### 72 or 73", "72", False),
        ("gsm8k", "She sells 72 clips.\n#### 72\n####", "72", True),
        ("gsm8k", "#### 72-73", "72", False),
        ("gsm8k", "#### 72 clips", "72", True),
        ("gsm8k", "\\boxed{73}\n#### 72", "72", False),
        ("arithmetic", "3 + 4 = 7 <eoe> then \\boxed{8}", "7", False),
        ("arithmetic", "\\boxed{7} so 3 + 4 = 7 <eoe>", "7", True),
    ],
)
def test_every_family_reads_the_last_commitment_and_refuses_two_different(family, response, gold, paid):
    assert _paid(family, response, gold) is paid


def test_commitments_are_boxes_answer_lines_and_gsm8k_marks_in_order():
    text = "Work: 13.\n\\boxed{12}\n**Final Answer:** $12$\n#### 12\nAnswer: \\boxed{12}"
    found = commitments(text, gsm8k=True)
    assert [(c.kind, c.text) for c in found] == [("box", "12"), ("line", "12"), ("####", "12"), ("box", "12")]
    assert final_answer("Final Answer: 7") is None  # the math family needs a box without an answer_prefix
    assert final_answer("Final Answer: 7", "Answer:") == "7"


def test_the_adversarial_pairs_meet_the_rates():
    """>= 98% of the wrong answers refused and >= 97% of the right ones paid, debatable pairs left out."""
    rows = [json.loads(line) for line in PAIRS.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [r for r in rows if not r.get("debatable")]
    assert len(rows) >= 300
    verdicts = [compute_score(r["family"], r["response"], r["gold"],
                              {"question": r["question"]} if "question" in r else {}).correct for r in rows]
    right = [v for v, r in zip(verdicts, rows, strict=True) if r["label"] == 1]
    wrong = [v for v, r in zip(verdicts, rows, strict=True) if r["label"] == 0]
    assert sum(right) / len(right) >= 0.97
    assert sum(not v for v in wrong) / len(wrong) >= 0.98


def test_an_answer_line_gives_its_value_not_its_sentence():
    """Prose around the value of an answer line is no second answer (the box and the line agree)."""
    assert _paid("math", "$\\boxed{5}$\n\nFinal Answer: The number of ways is 5.", "5")
    assert _paid("math", "$\\boxed{5}$\n\nFinal Answer: The final answer is $5$. I hope it is correct.", "5")
    assert not _paid("math", "$\\boxed{5}$\n\nFinal Answer: The number of ways is 6.", "5")


def test_the_checks_steps_on_their_own():
    from megareason.rewards.equivalence_checks import compound, rewrite_notation, split_digits
    from megareason.rewards.equivalence_forms import normalize_unit

    # 0.1(6) = 1/10 + 6/90 = 1/6; 0.(142857) = 142857/999999 = 1/7; 3.2e-3 as a power of ten
    assert rewrite_notation(r"0.1\overline{6}") == r"\frac{1}{6}"
    assert rewrite_notation(r"0.\overline{142857}") == r"\frac{1}{7}"
    assert rewrite_notation("3.2e-3") == r"3.2\times10^{-3}" and rewrite_notation("2e") == "2e"
    assert rewrite_notation(r"\sin 30^\circ") == r"\sin(\frac{30\pi}{180})"
    assert math_equal(r"\frac{1}{2}", r"\sin 30^\circ") and not math_equal(r"\frac{1}{2}", r"\sin 30")
    assert compound(r"3 \text{ hours } 20 \text{ minutes}") == [(3, "hour"), (20, "minute")]
    assert compound(r"3 \text{ hours}") is None
    assert split_digits("1 2") and split_digits("10 00") and not split_digits(r"1\,000") and not split_digits("3 1/8")
    assert {normalize_unit(u) for u in ("mph", "miles per hour", "mi/hr", r"\frac{mi}{hr}")} == {"mile/hour"}
    assert normalize_unit("square centimeters") == normalize_unit("cm^2") == "centimeter^2"
    assert normalize_unit("degC") == "celsius" != normalize_unit("degF")
