"""A user's data and rewards, with nothing silent: rows go in as written (no system message added unless the
config names one), the start-up table says which reward scores which source and what is validated, TRL's
formats are read from the rows as TRL does, a reward that fails on a whole batch stops the run, validation
follows the data, several weighted rewards are summed and each logged. All in process: no worker starts."""

from __future__ import annotations

import json
import logging

import pandas as pd
import pytest

from megareason.config import ConfigError, load_config
from megareason.config.schema import Config
from megareason.data import DataError, TokenizedPrompt
from megareason.data.loaders import REASONING_GYM_SYSTEM_PROMPT, load_data
from megareason.rewards.data_table import TABLE_FILE, data_table
from megareason.rewards.scoring import RewardError, score, scorer_from
from megareason.rollout.records import Completion

# verl's examples/data_preprocess/gsm8k.py row: the instruction is in the user message, the answer after ####.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
VERL_ROWS = [{
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": f"Natalia sold {a} clips, then {a} more. How many? {GSM8K_INSTRUCTION}"}],
    "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
    "extra_info": {"split": "train", "index": a}} for a in (24, 35)]

VERL_REWARD = """\
def vowels(data_source, solution_str, ground_truth, extra_info=None):
    return sum(ch in "aeiou" for ch in solution_str) / len(solution_str)
"""
# TRL's documented conversational reward shape: completions are message lists, the answer column by name.
TRL_REWARD = """\
def accuracy(completions, solution, **kwargs):
    return [1.0 if c[0]["content"].strip() == s else 0.0 for c, s in zip(completions, solution)]

def form(prompts, completions, **kwargs):
    # 1 where TRL's conversational format arrived (message lists), 0 for its standard one (strings)
    assert all(isinstance(p, list) == isinstance(c, list) for p, c in zip(prompts, completions))
    return [1.0 if isinstance(c, list) else 0.0 for c in completions]

def length(completions, **kwargs):
    return [float(len(c)) for c in completions]

def broken(completions, **kwargs):
    raise KeyError("answer")
"""


def _scored(records, *responses_per_row: tuple[str, ...]):
    prompts = [TokenizedPrompt(r, "", [1]) for r in records]
    return prompts, [[Completion([1], t, [0.0], "stop") for t in texts] for texts in responses_per_row]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    (tmp_path / "trl_reward.py").write_text(TRL_REWARD)
    gsm8k = tmp_path / "gsm8k.parquet"
    pd.DataFrame(VERL_ROWS).to_parquet(gsm8k)
    trl = tmp_path / "trl.jsonl"  # TRL's rows as they are: no data_source
    trl.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": [{"role": "user", "content": "Capital of France?"}], "solution": "Paris"},
        {"prompt": "Capital of Italy?", "solution": "Rome"}]))
    return tmp_path


def test_a_verl_gsm8k_parquet_goes_in_as_written_and_scores_with_its_hashes(files):
    cfg = load_config("grpo_quickstart", [f"data.sources=[{{kind: file, path: {files / 'gsm8k.parquet'}}}]"])
    data = load_data(cfg.data)
    assert [r.prompt for r in data.train] == [row["prompt"] for row in VERL_ROWS]  # no system message added
    scorer = scorer_from(cfg.reward, data.train)
    rows = score(*_scored(data.train, ("so 24 + 24 = 48\n#### 48", "#### 47"), ("#### 70",)), scorer=scorer)
    assert [(r.reward, r.correct) for r in rows] == [(1.0, True), (0.0, False), (1.0, True)]
    table = data_table(data, scorer, "<first prompt>")
    assert "built-in gsm8k" in table and "system message added to rows without one: none" in table
    # the recipe's own data keep the instruction their reward reads, and the recipe's validation set
    recipe = load_data(load_config("grpo_quickstart").data)
    assert recipe.train[0].prompt[0] == {"role": "system", "content": REASONING_GYM_SYSTEM_PROMPT}
    assert len(recipe.val) == 32 and recipe.val_note == "32 rows of data.val_sources"


def test_a_system_prompt_is_added_only_where_the_config_names_one(files):
    gsm8k = files / "gsm8k.parquet"
    both = (f"data.sources=[{{kind: file, path: {gsm8k}}}, {{kind: reasoning_gym, name: basic_arithmetic, size: 1, "
            "system_prompt: ''}]")
    data = load_data(load_config("grpo_quickstart", [both]).data)
    assert [len(r.prompt) for r in data.train] == [1, 1, 1]  # the generator's instruction removed too
    data = load_data(load_config("grpo_quickstart", [both, "data.system_prompt='Be brief.'"]).data)
    assert [r.prompt[0]["content"] for r in data.train] == ["Be brief."] * 2 + [data.train[2].prompt[0]["content"]]
    assert data.train[2].prompt[0]["role"] == "user"  # a source's own "" wins over data.system_prompt
    table = data_table(data, scorer_from(Config().reward, data.train), "<first>")
    assert "system message added to rows without one: 'Be brief.'" in table


def test_a_trl_conversational_function_scores_without_a_switch(files):
    cfg = Config()
    cfg.reward.custom = f"{files / 'trl_reward.py'}:accuracy"
    cfg.data.sources = load_config("grpo_quickstart", [f"data.sources=[{{kind: file, path: {files / 'trl.jsonl'}}}]"]
                                   ).data.sources
    data = load_data(cfg.data, any_source=True)  # TRL rows load as they are with reward.custom
    assert [r.data_source for r in data.train] == ["trl", "trl"] and [r.chat for r in data.train] == [True, False]
    scorer = scorer_from(cfg.reward, data.train[:1])
    rows = score(*_scored(data.train[:1], ("Paris", "Lyon")), scorer=scorer)
    assert [r.reward for r in rows] == [1.0, 0.0] and not any(r.score_error for r in rows)
    assert "accuracy (TRL signature, conversational)" in data_table(data, scorer, "")
    # one function, both formats in one batch: each row gets the format it was written in (two calls)
    cfg.reward.custom = f"{files / 'trl_reward.py'}:form"
    rows = score(*_scored(data.train, ("Paris",), ("Rome",)), scorer=scorer_from(cfg.reward, data.train))
    assert [r.reward for r in rows] == [1.0, 0.0]
    cfg.reward.trl_format = "standard"  # the override still forces one format
    rows = score(*_scored(data.train, ("Paris",), ("Rome",)), scorer=scorer_from(cfg.reward, data.train))
    assert [r.reward for r in rows] == [0.0, 0.0]
    with pytest.raises(DataError, match=r"trl\.jsonl row 1: missing field 'data_source' .*or reward\.custom"):
        load_data(cfg.data)  # without a function for every row, the row must say which reward scores it


def test_a_reward_that_fails_on_a_whole_batch_stops_at_once_naming_it(files):
    cfg = Config()
    cfg.reward.by_source = {"trl": f"{files / 'trl_reward.py'}:broken"}
    cfg.data.sources = load_config("grpo_quickstart", [f"data.sources=[{{kind: file, path: {files / 'trl.jsonl'}, "
                                                       "data_source: trl}]"]).data.sources
    data = load_data(cfg.data)
    scorer = scorer_from(cfg.reward, data.train)
    with pytest.raises(RewardError, match=r"reward trl_reward\.py:broken failed on 2 of its 2 samples \(more than "
                                          r"reward.max_error_rate=0.5\): KeyError: 'answer'"):
        score(*_scored(data.train, ("a",), ("b",)), scorer=scorer, max_error_rate=cfg.reward.max_error_rate)
    rows = score(*_scored(data.train, ("a",), ("b",)), scorer=scorer, max_error_rate=1.0)  # 1: counted, never stops
    assert [r.score_error for r in rows] == ["KeyError: 'answer'"] * 2


def test_a_misspelled_by_source_key_is_refused_naming_the_sources(files):
    cfg = Config()
    cfg.reward.by_source = {"open_ai/gsm8k": f"{files / 'verl_reward.py'}:vowels"}
    gsm8k = files / "gsm8k.parquet"
    cfg.data.sources = load_config("grpo_quickstart", [f"data.sources=[{{kind: file, path: {gsm8k}}}, "
                                                       "{kind: reasoning_gym, name: basic_arithmetic, size: 1}]"]
                                   ).data.sources
    data = load_data(cfg.data)
    with pytest.raises(DataError, match=r"^reward.by_source names 'open_ai/gsm8k', which no row has as its "
                                        r"data_source; the data's sources: basic_arithmetic, openai/gsm8k$"):
        scorer_from(cfg.reward, data.train)


def test_replaced_data_is_validated_on_its_own_held_out_slice(files, tmp_path):
    rows = files / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{a} + 1?", "answer": str(a + 1), "data_source": "math"}) + "\n"
                            for a in range(10)))
    mine = f"data.sources=[{{kind: file, path: {rows}}}]"
    cfg = load_config("grpo_quickstart", [mine, "data.val_size=3"])
    assert cfg.data.val_sources == []
    data = load_data(cfg.data)
    assert len(data.val) == 3 and len(data.train) == 7 and {r.data_source for r in data.val} == {"math"}
    questions = [r.extra_info["question"] for r in data.train + data.val]
    assert sorted(questions) == sorted(f"{a} + 1?" for a in range(10))  # disjoint, together every row
    assert data.val_note == "3 of the 10 rows of data.sources held out (data.val_size)"
    assert load_data(cfg.data).val == data.val  # the same slice on every start (a resume validates on it too)
    none = load_data(load_config("grpo_quickstart", [mine]).data)  # none rather than the recipe's, and said so
    assert none.val == [] and none.val_note.startswith("none: data.val_sources is empty (a recipe's are dropped")
    # a YAML of one's own that inherits the recipe and brings its data: the same
    (tmp_path / "mine.yaml").write_text(f"defaults: [grpo_quickstart, _self_]\ndata:\n  sources:\n"
                                        f"    - {{kind: file, path: {rows}}}\n")
    assert load_config(str(tmp_path / "mine.yaml")).data.val_sources == []
    # naming data.val_sources keeps them
    kept = load_config("grpo_quickstart", [mine, f"data.val_sources=[{{kind: file, path: {rows}, size: 2}}]"])
    assert len(load_data(kept.data).val) == 2


def test_two_weighted_rewards_are_summed_and_each_logged(files):
    from megareason.trainer.metrics import _sample_metrics

    cfg = load_config("grpo_quickstart", [f"reward.funcs=[{files / 'verl_reward.py'}:vowels, "
                                          f"{files / 'trl_reward.py'}:length]", "reward.weights=[1.0, 0.5]"])
    rows = files / "rows.jsonl"  # text prompts: TRL's standard format, completions as strings
    rows.write_text(json.dumps({"question": "Say something.", "answer": "x", "data_source": "mine"}) + "\n")
    data = load_data(load_config("grpo_quickstart", [f"data.sources=[{{kind: file, path: {rows}}}]"]).data)
    scorer = scorer_from(cfg.reward, data.train)
    rows = score(*_scored(data.train[:1], ("abcd", "eeeeeeee")), scorer=scorer)
    # vowels: 1/4 and 8/8; length: 4 and 8 characters, weighed by 0.5
    assert [r.reward for r in rows] == [pytest.approx(0.25 + 2.0), pytest.approx(1.0 + 4.0)]
    assert [r.parts for r in rows] == [{"vowels": 0.25, "length": 4.0}, {"vowels": 1.0, "length": 8.0}]
    m = _sample_metrics(rows)
    assert m["rewards/vowels/mean"] == pytest.approx(0.625) and m["rewards/length/mean"] == pytest.approx(6.0)
    assert "1 x verl_reward.py:vowels + 0.5 x trl_reward.py:length" in data_table(data, scorer, "")
    with pytest.raises(ConfigError, match="reward.weights must give one weight per reward.funcs entry"):
        load_config("grpo_quickstart", [f"reward.funcs=[{files / 'verl_reward.py'}:vowels]", "reward.weights=[1, 2]"])


def test_the_step_line_shows_the_reward_errors_when_not_0(tmp_path, capsys):
    from megareason.trainer.tracking import Tracker

    tracker = Tracker(tmp_path, ["console"], 0)
    tracker.log(1, {"reward/mean": 0.5, "reward/errors": 0})
    tracker.log(2, {"reward/mean": 0.5, "reward/errors": 3})
    out = capsys.readouterr().out.splitlines()
    assert out == ["step 1: reward=0.5", "step 2: reward=0.5 reward_errors=3"]


@pytest.mark.parametrize("override, ours", [
    ("custom_reward_function.path=r.py", "reward.custom=path/to/file.py:function"),
    ("data.train_files=[a.parquet]", "data.sources=[{kind: file, path: train.parquet}]"),
    ("actor_rollout_ref.rollout.n=8", "here set rollout.n"),
    ("reward_funcs=[a.py]", "reward.funcs=[a.py:f, b.py:g]"),
    ("num_generations=8", "here set rollout.n"),
])
def test_verl_and_trl_keys_are_answered_with_ours(override, ours, tmp_path):
    with pytest.raises(ConfigError, match="that is (verl|TRL)'s; here set") as refused:
        load_config("grpo_quickstart", [override])
    assert ours in str(refused.value)
    (tmp_path / "verl.yaml").write_text("defaults: [grpo_quickstart, _self_]\ncustom_reward_function:\n"
                                        "  path: r.py\n  name: compute_score\n")
    with pytest.raises(ConfigError, match=r"unknown key 'custom_reward_function': that is verl's; here set "
                                          r"reward.custom"):
        load_config(str(tmp_path / "verl.yaml"))


def test_the_table_is_shown_and_written_before_ray_and_a_bad_reward_fails_in_one_line(tiny_qwen2, files, monkeypatch,
                                                                                      capsys, caplog):
    from megareason.cli import main
    from megareason.launch import reaper
    from megareason.trainer import loop

    class RayStarted(Exception):
        pass

    def ray(*args, **kwargs):
        raise RayStarted

    monkeypatch.setattr(loop, "ray_session", ray)
    out = files / "run"
    overrides = [f"model.path={tiny_qwen2}", f"trainer.output_dir={out}", "trainer.prompts_per_step=2",
                 f"reward.custom={files / 'trl_reward.py'}:accuracy",
                 f"data.sources=[{{kind: file, path: {files / 'trl.jsonl'}}}, {{kind: reasoning_gym, name: "
                 "basic_arithmetic, size: 3}]", "data.val_size=1"]
    with caplog.at_level(logging.INFO), pytest.raises(RayStarted):
        loop.train(load_config("grpo_smollm2_cpu", overrides, training=True))
    table = (out / TABLE_FILE).read_text()
    assert table.strip() in caplog.text  # shown, then Ray
    lines = table.splitlines()
    assert lines[0] == "data: 4 training rows from 2 source(s)"
    assert "accuracy (TRL signature, conversational)" in table and "accuracy (TRL signature, standard)" in table
    assert "validation: 1 of the 5 rows of data.sources held out (data.val_size)" in table
    assert f"system message added to rows without one: {REASONING_GYM_SYSTEM_PROMPT!r}" in table
    assert "first prompt as the model sees it:" in table and "Capital of France?" in table
    # A reward with a wrong signature: one line, exit 2, before the model loads; no run folder left behind.
    monkeypatch.setattr(reaper, "reap_descendants_on_exit", lambda: None)
    monkeypatch.setenv("MEGAREASON_VERBOSE", "1")
    (files / "bad.py").write_text("def compute_score(solution_str):\n    return 0.0\n")
    bad = files / "bad_run"
    capsys.readouterr()
    assert main(["train", "--config-name", "grpo_smollm2_cpu", *overrides, f"trainer.output_dir={bad}",
                 f"reward.custom={files / 'bad.py'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: reward.custom: ") and "bad.py:compute_score takes" in err[0]
    assert not bad.exists()


def test_convert_on_a_step_or_run_folder_names_the_checkpoint_and_plan_says_fetch(tmp_path, capsys, monkeypatch):
    from megareason.cli import main

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    (step / "actor").mkdir(parents=True)
    (step / "actor" / "megareason.json").write_text('{"arch": {}}')
    out = tmp_path / "hf"
    assert main(["convert", "megatron-to-hf", str(step), str(out)]) == 2
    assert capsys.readouterr().err == (f"error: checkpoint {step} is a step folder, not a model's checkpoint: did "
                                       f"you mean {step / 'actor'}?\n")
    assert main(["convert", "megatron-to-hf", str(tmp_path / "run"), str(out)]) == 2
    assert f"is a run folder, not a model's checkpoint: did you mean {step / 'actor'}?" in capsys.readouterr().err
    assert main(["convert", "hf-to-megatron", str(step), str(out)]) == 2
    assert capsys.readouterr().err == (f"error: {step} holds a megareason checkpoint, not a Hugging Face model; to "
                                       f"export it: megareason convert megatron-to-hf {step / 'actor'} OUT_DIR\n")
    assert main(["plan", "grpo_qwen3_8b", "model.path=tiny-org/not-cached"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.path 'tiny-org/not-cached': this Hugging Face Hub model is not in the cache")
    assert "hf download tiny-org/not-cached; or pass --model-shape" in err and "config.json" not in err
