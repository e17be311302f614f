"""Hand-computed expectations for the reasoning_format (think_answer) reward."""

import pytest

from megareason.rewards import compute_score, get_reward_fn
from megareason.rewards.reasoning_format import answers_match, is_well_formed, tag_content, weight_param

LONG = "Three plus four: 3 + 4 = 7, checked twice."  # 42 characters, above the 20 minimum


def test_registered_under_both_names():
    assert get_reward_fn("think_answer") is get_reward_fn("reasoning_format")


# Defaults: format 0.2, answer 0.8, short-thinking penalty 0.1 below 20 characters.
@pytest.mark.parametrize(
    ("response", "gold", "score", "correct"),
    [
        (f"<think>{LONG}</think><answer>7</answer>", "7", 1.0, True),
        (f"\n <think>\n{LONG}\n</think>\n\n<answer> 7 </answer>\n", "7", 1.0, True),  # whitespace is fine
        (f"<think>{LONG}</think><answer>8</answer>", "7", 0.2, False),  # format only
        ("<think>7</think><answer>7</answer>", "7", 0.9, True),  # 0.2 + 0.8 - 0.1
        (f"<think>{'a' * 20}</think><answer>7</answer>", "7", 1.0, True),  # exactly 20: not short
        (f"<think>{'a' * 19}</think><answer>7</answer>", "7", 0.9, True),
        (f"<think>   {'a' * 19}   </think><answer>7</answer>", "7", 0.9, True),  # padding not counted
        ("<think></think><answer>8</answer>", "7", 0.1, False),  # 0.2 - 0.1
        ("<answer>7</answer>", "7", 0.7, True),  # no think: malformed and short, 0.8 - 0.1
        (f"Sure! <think>{LONG}</think><answer>7</answer>", "7", 0.8, True),  # text before
        (f"<think>{LONG}</think><answer>7</answer> Done.", "7", 0.8, True),  # text after
        (f"<think>{LONG}</think>So:<answer>7</answer>", "7", 0.8, True),  # text between
        (f"<answer>7</answer><think>{LONG}</think>", "7", 0.8, True),  # wrong order
        (f"<think>{LONG}</think><answer>6</answer><answer>7</answer>", "7", 0.0, False),  # two answers
        ("<think>I will use <answer> tags at the end.</think><answer>7</answer>", "7", 0.0, False),
        (f"<think><think>{LONG}</think></think><answer>7</answer>", "7", 0.7, True),  # nested think
        (f"<think>{LONG}</think><answer>7", "7", 0.0, False),  # unclosed answer
        (f"<think>{LONG}</think></answer>7<answer>", "7", 0.0, False),  # close before open
        (f"<think>{LONG}<answer>7</answer>", "7", 0.7, True),  # unclosed think counts as no thinking
        (f"<THINK>{LONG}</THINK><ANSWER>7</ANSWER>", "7", -0.1, False),  # tags are case-sensitive
        ("", "7", -0.1, False),
        (f"<think>{LONG}</think><answer>7.0</answer>", "7", 1.0, True),
        (f"<think>{LONG}</think><answer>1, 2</answer>", "12", 0.2, False),  # a list is not 12
        (f"<think>{LONG}</think><answer>  New   York </answer>", "new york", 1.0, True),
        (f"<think>{LONG}</think><answer>seven</answer>", "7", 0.2, False),
    ],
)
def test_reasoning_format(response, gold, score, correct):
    out = compute_score("reasoning_format", response, gold)
    assert out.correct is correct
    assert out.score == pytest.approx(score)


@pytest.mark.parametrize(
    ("pred", "gold", "match"),
    [
        ("7.0", "7", True),
        ("-3", "-3.0", True),
        ("1,000", "1000", True),
        ("$1,000", "1000", True),
        ("1,000,000", "1e6", False),  # exponents are not parsed: compared as strings
        ("3/4", "0.75", True),
        (r"\frac{3}{4}", "0.75", True),
        ("3 / 4", "0.75", True),
        ("0.33", "1/3", False),
        ("1, 2", "12", False),  # whitespace/commas splitting digits make a list, not a number
        ("12", "1,2", False),
        ("3 5", "35", False),
        ("1,2345", "12345", False),  # not a thousands separator
        ("1,2", "1,2", True),  # equal as strings
        ("  New \n York ", "new york", True),
        ("Paris.", "Paris", False),  # punctuation is kept
        ("x = 7", "7", False),
        ("", "7", False),
        ("", "", True),
    ],
)
def test_answers_match(pred, gold, match):
    assert answers_match(pred, gold) is match


def test_tag_content_and_well_formed():
    assert tag_content("<think> a b </think>", "think") == "a b"
    assert tag_content("<think>a</think><think>b</think>", "think") is None
    assert tag_content("</think>a<think>", "think") is None
    assert tag_content("<think>a", "think") is None
    assert tag_content("<think></think>", "think") == ""
    assert is_well_formed("<think>x</think><answer>y</answer>")
    assert is_well_formed("<think></think> <answer></answer>")
    assert not is_well_formed("<think>x</think>")
    assert not is_well_formed("<answer>y</answer><think>x</think>")
    assert not is_well_formed("<think>x</think><answer>y</answer>.")


def test_weights_from_extra_info():
    extra = {"format_weight": 1, "answer_weight": 2, "short_penalty": 0.5, "min_think_chars": 5}
    assert compute_score("think_answer", "<think>abcd</think><answer>7</answer>", "7", extra).score == 2.5
    assert compute_score("think_answer", "<think>abcde</think><answer>7</answer>", "7", extra).score == 3.0
    assert compute_score("think_answer", "<answer>7</answer>", "7", {"min_think_chars": 0}).score == 0.8
    zero = {"format_weight": 0, "answer_weight": 0, "short_penalty": 0}
    out = compute_score("think_answer", f"<think>{LONG}</think><answer>7</answer>", "7", zero)
    assert (out.score, out.correct) == (0.0, True)  # correct does not depend on the weights


@pytest.mark.parametrize(
    "extra",
    [
        {"format_weight": -1},
        {"answer_weight": "0.8"},
        {"short_penalty": float("nan")},
        {"min_think_chars": float("inf")},
        {"min_think_chars": True},
        {"answer_weight": None},
    ],
)
def test_invalid_weights_raise(extra):
    (key,) = extra
    with pytest.raises(ValueError, match=f"extra_info\\['{key}'\\] must be a finite non-negative number"):
        compute_score("reasoning_format", "<think>x</think><answer>7</answer>", "7", extra)


def test_weight_param():
    assert weight_param({}, "w", 0.2) == 0.2
    assert weight_param({"w": 3}, "w", 0.2) == 3.0
    assert isinstance(weight_param({"w": 3}, "w", 0.2), float)
