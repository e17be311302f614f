"""Rewards users bring: verl's compute_score signature, TRL's batch reward functions, per-data_source
custom rewards beside the built-ins, the prompt for functions that ask for it, and the data-source names
verl's default_compute_score routes, each scored by the matching built-in family."""

import pickle
import textwrap

import pytest

from megareason.config.schema import Config
from megareason.data.records import DataError, PromptRecord, TokenizedPrompt
from megareason.rewards import RewardOutput, compute_score, get_reward_fn
from megareason.rewards.custom import CustomRewards, load_custom, load_rewards
from megareason.rewards.pool import ScoreOutcome, ScoreRequest, score_all
from megareason.rewards.scoring import score, scorer_from
from megareason.rewards.source_names import SOURCE_NAMES, UNSUPPORTED_SOURCES
from megareason.rollout.records import Completion

R = RewardOutput

VERL = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, method="strict", **kwargs):
    # 1 for an exact answer, 0.5 for the answer in another case; "acc" says what counts as correct
    if solution_str == ground_truth:
        return {"score": 1.0, "acc": True, "pred": solution_str}
    return {"score": 0.5 if solution_str.lower() == ground_truth.lower() else 0.0, "acc": False}

def with_prompt(data_source, solution_str, ground_truth, extra_info=None, prompt=None):
    # the prompt's last message length, so a test sees the prompt arrived
    return float(len(prompt[-1]["content"])) if prompt is not None else -1.0

def no_prompt(data_source, solution_str, ground_truth, extra_info):
    return 2.0

def kwargs_only(data_source, solution_str, ground_truth, **kwargs):
    return 3.0 if "prompt" in kwargs and kwargs["extra_info"] == {"k": 1} else 0.0

def too_few(solution_str, ground_truth):
    return 0.0

def needs_more(data_source, solution_str, ground_truth, extra_info, tokenizer):
    return 0.0

def returns_text(data_source, solution_str, ground_truth, extra_info=None):
    return "1"
"""

TRL = """
CALLS = []

def length_ratio(prompts, completions, solution, **kwargs):
    # len(completion) / len(solution): a batch function, as TRL calls them
    CALLS.append(len(completions))
    return [len(c) / len(s) for c, s in zip(completions, solution)]

def conversational(completions, **kwargs):
    return [float(c[0]["content"].count("a")) for c in completions]

def sees_prompts(prompts, completions, **kwargs):
    return [float(len(p)) for p in prompts]

def columns(completions, ground_truth, data_source, hint, **kwargs):
    return [1.0 if (h == "x" and d == "trl") else 0.0 for h, d in zip(hint, data_source)]

def asks_missing(completions, difficulty):
    return [0.0] * len(completions)

def wrong_length(prompts, completions, **kwargs):
    return [1.0]

def some_none(prompts, completions, **kwargs):
    return [None if c == "skip" else 1.0 for c in completions]
"""


@pytest.fixture
def files(tmp_path):
    verl, trl = tmp_path / "verl_reward.py", tmp_path / "trl_reward.py"
    verl.write_text(textwrap.dedent(VERL))
    trl.write_text(textwrap.dedent(TRL))
    return verl, trl


def _prompt(source, question, truth, **extra):
    record = PromptRecord([{"role": "system", "content": "sys"}, {"role": "user", "content": question}], source,
                          truth, {"index": 0, **extra})
    return TokenizedPrompt(record, question, [1])


def _completions(*texts):
    return [Completion([1], t, [0.0], "stop") for t in texts]


# --- verl's signature ---------------------------------------------------------------------------------
def test_a_verl_function_with_extra_keywords_and_the_default_name(files):
    verl, _ = files
    scorer = load_custom(str(verl))  # only the file: the function is compute_score, as in verl
    assert scorer.name == "compute_score"
    assert scorer("src", "Paris", "Paris", {}) == R(1.0, True)
    assert scorer("src", "paris", "Paris", {}) == R(0.5, False)  # "acc" decides correct, not the score
    assert scorer("src", "Rome", "Paris", {}) == R(0.0, False)
    assert load_custom(f"{verl}:kwargs_only")("s", "r", "g", {"k": 1}, prompt=[]) == R(3.0, True)


def test_the_prompt_reaches_a_function_that_asks_for_it_only(files):
    verl, trl = files
    prompt = [{"role": "user", "content": "What is 2+2?"}]  # 12 characters
    assert load_custom(f"{verl}:with_prompt")("s", "4", "4", {}, prompt=prompt) == R(12.0, True)
    assert load_custom(f"{verl}:with_prompt")("s", "4", "4", {}) == R(-1.0, False)  # no prompt given
    assert load_custom(f"{verl}:no_prompt")("s", "4", "4", {}, prompt=prompt) == R(2.0, True)  # not passed
    # TRL: prompts, as strings (standard: the last user message) or as the messages (conversational)
    rows = [("s", "4", "4", {}, [{"role": "system", "content": "sys"}, *prompt])]
    assert load_custom(f"{trl}:sees_prompts").score_batch(rows) == [12.0]
    assert load_custom(f"{trl}:sees_prompts", trl_format="conversational").score_batch(rows) == [2.0]


@pytest.mark.parametrize(("name", "match"), [
    ("too_few", r"verl_reward\.py:too_few takes \(solution_str, ground_truth\); a reward function must take "
                r"verl's .*TRL's"),
    ("needs_more", r"verl_reward\.py:needs_more takes .*tokenizer.*must take"),
    ("missing", r"verl_reward\.py has no function 'missing'"),
])
def test_bad_functions_are_refused_at_load_naming_file_and_function(files, name, match):
    verl, _ = files
    with pytest.raises(ValueError, match=f"^reward.custom: .*{match}"):
        load_custom(f"{verl}:{name}")


def test_bad_specs_and_returns_are_refused(files, tmp_path):
    verl, _ = files
    with pytest.raises(FileNotFoundError, match="reward.by_source\\['x'\\]: no file .*nowhere.py"):
        load_rewards("", {"x": f"{tmp_path}/nowhere.py"}, "standard")
    for spec in ("no_colon", f"{verl}:not-a-name", ":fn"):
        with pytest.raises(ValueError, match="must look like path/to/file.py or path/to/file.py:function"):
            load_custom(spec)
    with pytest.raises(TypeError, match="verl_reward.py:returns_text returned str; expected a number"):
        load_custom(f"{verl}:returns_text")("s", "r", "g", {})


# --- TRL's batch signature -----------------------------------------------------------------------------
def test_a_trl_batch_function_scores_many_samples_in_one_call(files):
    _, trl = files
    scorer = load_custom(f"{trl}:length_ratio")
    assert scorer.batch
    rows = [("s", "abcd", "ab", {}, None), ("s", "a", "ab", {}, None), ("s", "abc", "ab", {"solution": "abc"}, None)]
    # solution: the row's own column when it has one (row 3), else the ground truth
    assert scorer.score_batch(rows) == [2.0, 0.5, 1.0]
    assert scorer("s", "abcd", "ab", {}) == R(2.0, True)  # one sample: a batch of one
    conversational = load_custom(f"{trl}:conversational", trl_format="conversational")
    assert conversational.score_batch([("s", "banana", "", {}, None)]) == [3.0]


def test_trl_columns_and_refusals_name_the_function(files):
    _, trl = files
    rows = [("trl", "r", "g", {"hint": "x"}, None), ("trl", "r", "g", {}, None),
            ("other", "r", "g", {"hint": "x"}, None)]
    assert load_custom(f"{trl}:columns").score_batch(rows) == [1.0, 0.0, 0.0]  # a missing column is None
    with pytest.raises(ValueError, match=r"trl_reward\.py:asks_missing asks for difficulty, which the rows do "
                                         r"not have; they give answer, data_source, ground_truth, hint, solution"):
        load_custom(f"{trl}:asks_missing").score_batch(rows[:1])
    with pytest.raises(TypeError, match=r"trl_reward\.py:wrong_length returned 1 items for 3 completions"):
        load_custom(f"{trl}:wrong_length").score_batch(rows)


# --- beside the built-ins, by data source --------------------------------------------------------------
def test_each_row_is_scored_by_its_own_function_beside_a_built_in(files):
    verl, trl = files
    cfg = Config()
    cfg.reward.by_source = {"mine": str(verl), "trl_src": f"{trl}:length_ratio", "asks": f"{verl}:with_prompt"}
    prompts = [_prompt("math", "1+1?", "2"), _prompt("mine", "Capital?", "Paris"),
               _prompt("trl_src", "Spell it", "abcd"), _prompt("asks", "hello", "x")]
    scorer = scorer_from(cfg.reward, [p.record for p in prompts])
    assert isinstance(scorer, CustomRewards)
    groups = [_completions(r"\boxed{2}", r"\boxed{3}"), _completions("Paris", "paris"),
              _completions("ab", "abcdabcd"), _completions("x")]
    rows = score(prompts, groups, scorer=scorer)
    got = [(r.data_source, r.reward, r.correct) for r in rows]
    assert got == [("math", 1.0, True), ("math", 0.0, False),  # built-in math: boxed answer
                   ("mine", 1.0, True), ("mine", 0.5, False),  # verl dict: score and acc
                   ("trl_src", 0.5, False), ("trl_src", 2.0, True),  # len(completion) / len(solution)
                   ("asks", 5.0, True)]  # len("hello"): the prompt's last message
    assert all(not r.score_error for r in rows)


def test_custom_for_every_sample_and_by_source_before_it(files):
    verl, trl = files
    cfg = Config()
    cfg.reward.custom = f"{verl}:no_prompt"
    cfg.reward.by_source = {"openai/gsm8k": f"{trl}:length_ratio"}
    # custom covers every data_source
    scorer = scorer_from(cfg.reward, [PromptRecord([], "anything", ""), PromptRecord([], "openai/gsm8k", "")])
    assert scorer("anything", "r", "g", {}) == R(2.0, True)
    assert scorer("openai/gsm8k", "abcd", "ab", {}) == R(2.0, True)
    assert scorer("openai/gsm8k_tinyv", "a", "ab", {}) == R(0.5, False)  # the name before _tinyv


def test_a_trl_batch_is_one_call_and_its_failures_are_counted(files):
    _, trl = files
    cfg = Config()
    cfg.reward.by_source = {"a": f"{trl}:length_ratio", "b": f"{trl}:some_none"}
    scorer = scorer_from(cfg.reward)
    prompts = [_prompt("a", "q", "ab"), _prompt("a", "q2", "ab"), _prompt("b", "q", "")]
    rows = score(prompts, [_completions("ab", "a"), _completions("abab"), _completions("ok", "skip")], scorer=scorer)
    assert scorer.by_source["a"].function.fn.__globals__["CALLS"] == [3]  # 3 completions of 2 prompts, one call
    assert [r.reward for r in rows] == [1.0, 0.5, 2.0, 1.0, 0.0]
    assert rows[4].score_error.endswith("trl_reward.py:some_none returned None for the sample")
    cfg.reward.by_source = {"a": f"{trl}:wrong_length"}
    rows = score(prompts[:2], [_completions("ab", "a"), _completions("abab")], scorer=scorer_from(cfg.reward))
    assert [r.reward for r in rows] == [0.0] * 3 and all("returned 1 items for 3" in r.score_error for r in rows)


def test_an_unknown_source_fails_at_start_up_unless_a_custom_reward_covers_it(files):
    verl, _ = files
    records = [PromptRecord([], "math", "1"), PromptRecord([], "my_task", "1")]
    with pytest.raises(DataError, match=r"unknown data_source 'my_task'.*reward\.by_source \(my_task: "):
        scorer_from(Config().reward, records)
    cfg = Config()
    cfg.reward.by_source = {"my_task": str(verl)}
    assert scorer_from(cfg.reward, records).route("math") is None  # the built-in reward


def test_custom_rewards_pickle_into_reward_workers(files):
    verl, trl = files
    rewards = load_rewards(f"{verl}:no_prompt", {"t": f"{trl}:length_ratio", "p": f"{verl}:with_prompt"}, "standard")
    clone = pickle.loads(pickle.dumps(rewards))
    assert clone.by_source["t"]._fn is None  # re-imported on first use
    assert clone("t", "abcd", "ab", {}) == R(2.0, True)
    prompt = [{"role": "user", "content": "abc"}]
    requests = [ScoreRequest("x", "r", "g"), ScoreRequest("t", "a", "ab"), ScoreRequest("p", "r", "g", prompt=prompt)]
    assert score_all(requests, scorer=rewards, workers=1) == [
        ScoreOutcome(2.0, True), ScoreOutcome(0.5, False), ScoreOutcome(3.0, True)]


# --- verl's data-source names -----------------------------------------------------------------------------
_FAMILY_CASES = {  # family -> (a right response, a wrong response, ground truth)
    "gsm8k": ("so #### 72", "so #### 71", "72"),
    "math": (r"so \boxed{\frac{1}{2}}", r"so \boxed{2}", "0.5"),
    "multihop_qa": ("<answer>Paris</answer>", "<answer>Paris France</answer>", "Paris"),
}


@pytest.mark.parametrize("source", [*SOURCE_NAMES, "aime2024", "AIME_2025", "aime"])
def test_every_verl_name_scores_with_its_family(source):
    family = SOURCE_NAMES.get(source, ("math",))[0]
    right, wrong, truth = _FAMILY_CASES[family]
    assert compute_score(source, right, truth) == R(1.0, True)
    # a wrong answer scores 0: for multihop_qa, verl's exact match only (token F1 would give 0.67)
    assert compute_score(source, wrong, truth) == R(0.0, False)
    assert compute_score(source + "_tinyv", right, truth).correct  # the rule reward of a TinyV source


@pytest.mark.parametrize("source", ["math_dapo", "math_dapo_reasoning", "aime2024"])
def test_dapo_names_read_the_answer_line(source):
    assert compute_score(source, "work\nAnswer: 42\n", "42") == R(1.0, True)
    assert compute_score(source, "work\nanswer: $41$", "42") == R(0.0, False)
    assert compute_score(source, "work\nAnswer: 41, so \\boxed{42}", "42") == R(1.0, True)  # boxed first
    assert compute_score("math", "work\nAnswer: 42", "42") == R(0.0, False)  # not for the math family itself
    assert compute_score(source, "Answer: 7", "42", {"answer_prefix": "Final:"}).score == 0.0  # the row wins


@pytest.mark.parametrize("source", ["grade", "Grade", " GRADE ", "gRaDe"])
def test_grade_in_any_case_is_the_rubric_reward(source):
    assert get_reward_fn(source) is get_reward_fn("rubric")
    assert compute_score(source, "Total Score: 8/10", "0.8") == R(1.0, True)
    assert compute_score(source, "Total Score: 3/10", "0.8").score == pytest.approx(0.25)  # (1 - 0.5)^2


@pytest.mark.parametrize("source", sorted(UNSUPPORTED_SOURCES))
def test_a_code_source_says_what_it_needs_and_how_to_plug_one_in(source):
    with pytest.raises(ValueError, match=f"unknown data_source '{source}': it runs the response's code against "
                                         f"the row's test cases.*reward.by_source \\({source}: "):
        get_reward_fn(source)


def test_a_misspelt_source_names_the_nearest_ones():
    with pytest.raises(ValueError, match=r"'openai/gsm9k'; nearest: openai/gsm8k; .*reward.custom="):
        get_reward_fn("openai/gsm9k")
    with pytest.raises(ValueError, match=r"nearest: lighteval/MATH"):
        get_reward_fn("lighteval/MATHS")
