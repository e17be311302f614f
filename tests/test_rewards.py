"""Hand-computed expectations for every reward family and the registry."""

from concurrent.futures import ThreadPoolExecutor

import pytest

import megareason.rewards.registry as registry
from megareason.rewards import RewardOutput, compute_score, get_reward_fn, register, registered_sources
from megareason.rewards.arithmetic import make_arithmetic_reward
from megareason.rewards.math import last_boxed

R = RewardOutput


# --- registry ---------------------------------------------------------------
def test_unknown_data_source_lists_registered_names():
    with pytest.raises(ValueError) as err:
        get_reward_fn("nope")
    msg = str(err.value)
    assert msg.startswith("unknown data_source 'nope'; to score it with a function of your own, map it in "
                          "reward.by_source (nope: path/to/file.py:compute_score) or set reward.custom=")
    assert msg.endswith(", ".join(registered_sources()))
    names = registered_sources()
    assert names == sorted(names)
    expected = "math gsm_symbolic competition_math champ gsm8k gsm8k_flexible countdown arithmetic"
    assert set(expected.split()) | {"basic_arithmetic", "chain_sum"} <= set(names)


def test_aliases_resolve_to_same_fn():
    assert get_reward_fn("champ") is get_reward_fn("math") is get_reward_fn("competition_math")
    assert get_reward_fn("chain_sum") is get_reward_fn("arithmetic")
    assert get_reward_fn("gsm8k") is not get_reward_fn("gsm8k_flexible")
    assert compute_score("champ", r"\boxed{3}", "3") == RewardOutput(score=1.0, correct=True)


def test_duplicate_registration_raises(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    def fn(response, ground_truth, extra_info):
        return RewardOutput(0.0, False)

    with pytest.raises(ValueError, match="already registered: math"):
        register("brand_new", "math")(fn)
    assert "brand_new" not in registered_sources()  # nothing half-registered
    register("brand_new")(fn)
    assert get_reward_fn("brand_new") is fn
    with pytest.raises(ValueError, match="already registered: brand_new"):
        register("brand_new")(fn)


# --- math -------------------------------------------------------------------
def test_last_boxed_nested_and_last():
    assert last_boxed(r"a \boxed{1} b \boxed{\frac{1}{\sqrt{2}}} c") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\fbox{ 7 }") == "7"
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed(r"\boxed{\left\{ x>0 \right.}") == r"\left\{ x>0 \right."  # escaped brace unmatched
    assert last_boxed(r"\boxed{4} then \boxed{5") == "4"  # unclosed last box is skipped
    assert last_boxed("no box here") is None


@pytest.mark.parametrize(
    ("response", "gold", "correct"),
    [
        (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", True),
        (r"so \boxed{0.5}", r"\frac{1}{2}", True),
        (r"\boxed{\dfrac{3}{4}}", "$0.75$", True),
        (r"first \boxed{2} then \boxed{3}", "3", False),  # two different committed answers: not paid
        (r"first \boxed{3} then \boxed{2}", "3", False),
        (r"\boxed{\{2, 1\}}", r"\{1,2\}", True),
        (r"\boxed{[1, 2)}", "[1,2)", True),
        (r"\boxed{(1, 2]}", "[1,2)", False),
        (r"\boxed{1 + x^2}", "x^2+1", True),
        (r"\boxed{\text{Monday}}", r"\text{Monday}", True),
        (r"\boxed{50\%}", "50", False),  # 50% is the number 0.5 (gold 0.5 refuses 0.5% alike)
        (r"\boxed{50\%}", "0.5", True),
        (r"\boxed{4}", "5", False),
        ("The answer is 0.5", "0.5", False),  # no boxed answer
    ],
)
def test_math_reward(response, gold, correct):
    out = compute_score("competition_math", response, gold)
    assert out == RewardOutput(score=1.0 if correct else 0.0, correct=correct)


def test_math_works_outside_main_thread():
    with ThreadPoolExecutor(max_workers=1) as pool:
        out = pool.submit(compute_score, "math", r"\boxed{\frac{2}{4}}", "0.5").result()
    assert out == RewardOutput(1.0, True)


# --- gsm8k ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("source", "response", "gold", "correct"),
    [
        ("gsm8k", "She pays 3 * 24 = 72 dollars.\n#### 72", "72", True),
        ("gsm8k", "#### 1,000", "1000", True),
        ("gsm8k", "#### $1,234.", "1,234", True),
        ("gsm8k", "#### 72.0", "72", True),
        ("gsm8k", "#### 71\nWait, #### 72", "72", False),  # two different committed answers
        ("gsm8k", "#### 72\nso again #### 72", "72", True),
        ("gsm8k", "#### 72\nno wait, #### 71", "72", False),
        ("gsm8k", "The answer is 72.", "72", False),  # strict needs ####
        ("gsm8k_flexible", "The answer is 72.", "72", True),
        ("gsm8k_flexible", "72 apples, so 18 left", "72", False),
        ("gsm8k_flexible", "total: $2,500", "2500", True),
        ("gsm8k_flexible", "10 - 3 = -7? no: 7", "7", True),
        ("gsm8k_flexible", "no numbers", "7", False),
        ("gsm8k_flexible", "read pages 10-12", "12", True),  # a hyphen after a digit is no sign
    ],
)
def test_gsm8k(source, response, gold, correct):
    assert compute_score(source, response, gold) == RewardOutput(1.0 if correct else 0.0, correct)


# --- countdown --------------------------------------------------------------

NUMS = {"numbers": [3, 5, 7, 2]}


@pytest.mark.parametrize(
    ("response", "target", "extra", "expected"),
    [
        ("<answer>(7 - 3) * 5</answer>", "20", NUMS, R(1.0, True)),
        ("<answer>(7 - 3) * 5 = 20</answer>", "20", NUMS, R(1.0, True)),
        ("<answer>7 * 3 - 2</answer>, no: <answer>3 + 5 + 7 + 2</answer>", "17", NUMS, R(1.0, True)),
        ("<answer>5 * 5 - 5</answer>", "20", NUMS, R(0.1, False)),  # 5 used 3x
        ("<answer>4 * 5</answer>", "20", NUMS, R(0.1, False)),  # 4 not given
        ("<answer>7 + 5</answer>", "20", NUMS, R(0.1, False)),  # wrong value
        ("<answer>7 / (5 - 5)</answer>", "3", {"numbers": [7, 5, 5]}, R(0.1, False)),
        ("<answer>(3 + 5 / 2) * 2</answer>", "11", NUMS, R(0.1, False)),  # 2 used twice
        ("<answer>(1 + 5 / 2) * 2</answer>", "7", {"numbers": [1, 5, 2, 2]}, R(1.0, True)),
        ("<answer>6 / (1 - 3 / 4)</answer>", "24", {"numbers": [6, 1, 3, 4]}, R(1.0, True)),  # 6/(1/4)
        ("<answer>12 / (3 - 7 / 4)</answer>", "48", {"numbers": [12, 3, 7, 4]}, R(0.1, False)),
        ("<answer>2 ** 3</answer>", "8", NUMS, R(0.0, False)),
        ("<answer>7 // 2</answer>", "3", NUMS, R(0.0, False)),
        ("<answer>7.0 - 2</answer>", "5", NUMS, R(0.0, False)),
        ("<answer>0x3 + 5</answer>", "8", NUMS, R(0.0, False)),  # Python-only int syntax
        (r"Thus \boxed{(5 + 7) * 2 - 3} works", "21", NUMS, R(1.0, True)),
        ("I tried a lot.\nFinal: 3 * 7 - 5 = 16\nDone!", "16", NUMS, R(1.0, True)),
        ("no idea", "16", NUMS, R(0.0, False)),
        ("<answer>-3 + 7 * 5</answer>", "32", NUMS, R(1.0, True)),
    ],
)
def test_countdown(response, target, extra, expected):
    assert compute_score("countdown", response, target, extra) == expected


def test_countdown_malicious_input_is_not_executed(monkeypatch):
    monkeypatch.setattr("os.system", lambda *args: pytest.fail("model output was executed"))
    out = compute_score("countdown", "<answer>__import__('os').system('x')</answer>", "0", NUMS)
    assert out == RewardOutput(0.0, False)


@pytest.mark.parametrize(
    "extra", [{}, {"numbers": None}, {"numbers": "3 5"}, {"numbers": [3, 2.5]}, {"numbers": [True, 2]}]
)
def test_countdown_invalid_numbers_raises(extra):
    with pytest.raises(ValueError, match="numbers"):
        compute_score("countdown", "<answer>3 + 5</answer>", "8", extra)


# --- arithmetic (simplexity's RLVR: "= answer <eoe>", reward_type boxed | correct | combined) -------
@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [  # defaults: combined, 0.3 * format_ok + 0.7 * correct
        ("3 + 4 = 7 <eoe>", "7", R(1.0, True)),  # simplexity's format
        ("3 + 4 = 7<eoe>", "7", R(1.0, True)),
        ("3 + 4 = 8 <eoe>", "7", R(0.3, False)),  # well formed, wrong
        ("3 + 4 = 7 <eoe> Hope that helps!", "7", R(1.0, True)),  # after the last <eoe>: ignored
        ("= 7 <eoe> then 3 + 4 <eoe>", "7", R(0.0, False)),  # the LAST <eoe> has no "= answer" before it
        ("3 + 4 <eoe>", "7", R(0.0, False)),
        ("the answer: 7 <eoe>", "7", R(0.0, False)),  # no "="
        ("1 - 4 = -3 <eoe>", "-3", R(1.0, True)),
        ("= **7** <eoe>", "7", R(1.0, True)),
        (r"2 + 5 = \boxed{7}", "7", R(1.0, True)),
        (r"\boxed{8}", "7", R(0.3, False)),
        (r"\boxed{-3.0}", "-3", R(1.0, True)),
        (r"\boxed{3/4}", "0.75", R(1.0, True)),
        (r"\boxed{\frac{3}{4}}", "3/4", R(1.0, True)),
        (r"\boxed{seven} and 7", "7", R(0.0, False)),  # a box without a number is no final answer
        (r"= 7 <eoe> so \boxed{8}", "7", R(0.3, False)),  # the later marker is the final answer
        (r"\boxed{8}, no: 3 + 4 = 7 <eoe>", "7", R(0.3, False)),  # a box of another number: format only
        ("2 + 5 = 7", "7", R(1.0, True)),  # no marker: the end of the text stands for <eoe>
        ("2 + 5 = 7.\n", "7", R(1.0, True)),
        ("1 - 4 = -3", "-3.0", R(1.0, True)),
        ("so x = 1,250", "1250", R(1.0, True)),
        ("2 + 5 = 8", "7", R(0.3, False)),
        ("I guess the result is 7", "7", R(0.0, False)),  # a bare number in prose: not a formatted answer
        ("The answer is 7 I think", "7", R(0.0, False)),
        ("= 7 is the result", "7", R(0.0, False)),  # "= 7" not at the end
        ("I don't know", "7", R(0.0, False)),
        ("", "7", R(0.0, False)),
    ],
)
def test_arithmetic(response, gold, expected):
    got = compute_score("basic_arithmetic", response, gold)
    assert got.correct == expected.correct and got.score == pytest.approx(expected.score, abs=1e-12)


@pytest.mark.parametrize(("reward_type", "scores"), [
    # responses: right and well formed, wrong and well formed, right but unformatted, nothing
    ("boxed", [1.0, 1.0, 0.0, 0.0]),
    ("correct", [1.0, 0.0, 0.0, 0.0]),
    ("combined", [1.0, 0.3, 0.0, 0.0]),
])
def test_arithmetic_reward_types(reward_type, scores):
    responses = ["5 + 2 = 7 <eoe>", "5 + 2 = 6 <eoe>", "I guess the result is 7", "hmm"]
    got = [compute_score("arithmetic", r, "7", {"reward_type": reward_type}) for r in responses]
    assert [g.score for g in got] == pytest.approx(scores, abs=1e-12)
    assert [g.correct for g in got] == [True, False, False, False]  # correctness does not depend on the type


def test_arithmetic_weights_per_row_and_by_factory():
    info = {"boxed_weight": 0.5, "correct_weight": 2.0}
    assert compute_score("arithmetic", r"\boxed{7}", "7", info) == RewardOutput(2.5, True)
    assert compute_score("arithmetic", r"\boxed{6}", "7", info) == RewardOutput(0.5, False)
    assert compute_score("arithmetic", "it is 7 ok", "7", info) == RewardOutput(0.0, False)
    # boxed / correct are 0/1 rewards: the weights do not apply
    assert compute_score("arithmetic", "= 6 <eoe>", "7", {**info, "reward_type": "boxed"}) == RewardOutput(1.0, False)
    fn = make_arithmetic_reward("combined", boxed_weight=0.1, correct_weight=0.9)
    assert fn("= 6 <eoe>", "7", {}) == RewardOutput(0.1, False)
    assert fn("= 6 <eoe>", "7", {"boxed_weight": 0.2}).score == 0.2  # a row overrides the factory's default
    assert make_arithmetic_reward("correct")("= 6 <eoe>", "7", {}) == RewardOutput(0.0, False)


def test_arithmetic_invalid_settings_raise():
    with pytest.raises(ValueError, match="boxed_weight"):
        make_arithmetic_reward(boxed_weight=-0.1)
    with pytest.raises(ValueError, match="correct_weight"):
        make_arithmetic_reward(correct_weight=float("nan"))
    with pytest.raises(ValueError, match="reward_type must be one of boxed, correct, combined, got 'format'"):
        make_arithmetic_reward("format")
    with pytest.raises(ValueError, match="reward_type"):
        compute_score("arithmetic", "= 7 <eoe>", "7", {"reward_type": "both"})
    with pytest.raises(ValueError, match="correct_weight"):
        compute_score("arithmetic", "= 7 <eoe>", "7", {"correct_weight": "1"})


@pytest.mark.parametrize("source", ["gsm8k", "gsm8k_flexible", "countdown", "arithmetic"])
def test_non_numeric_ground_truth_raises(source):
    with pytest.raises(ValueError, match=f"{source.split('_')[0]} ground_truth"):
        compute_score(source, r"<answer>3 + 5</answer> \boxed{8} #### 8", "eight", NUMS)
