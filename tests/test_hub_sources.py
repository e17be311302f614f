"""Hugging Face Hub ids as model.path, ``kind: hf`` data sources, and the verl / TRL row formats, all
offline: the Hub caches are folders made here in the layout huggingface_hub writes
(``<kind>s--org--name/snapshots/<commit>/`` and ``refs/main`` holding the commit)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub.constants
import pandas as pd
import pytest

from megareason.config import Config, DataConfig, DataSourceConfig, ModelConfig
from megareason.config.load import ConfigError, load_config
from megareason.data import DataError, PromptRecord, load_file, load_records
from megareason.models.hf_check import CheckpointError, check_hf_dir
from megareason.models.hub import resolve_model_path
from megareason.rewards.registry import compute_score
from megareason.settings import engine_settings

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache in use (HF_HUB_CACHE), offline."""
    cache = tmp_path / "hf_hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # huggingface_hub reads both variables when it is imported; the module attributes are what it uses.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_repo(cache: Path, repo_type: str, repo_id: str, files: Path) -> Path:
    """Put the contents of ``files`` into ``cache`` as the cached revision ``main`` of ``repo_id``."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(files, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


# --- models ---------------------------------------------------------------------------------------------


def test_a_hub_id_resolves_to_its_cached_snapshot(hub_cache, tiny_llama):
    snapshot = cache_repo(hub_cache, "model", "tiny-org/tiny-llama", tiny_llama)
    assert resolve_model_path("tiny-org/tiny-llama").resolve() == snapshot.resolve()
    # What the training workers do: the cache only.
    assert resolve_model_path("tiny-org/tiny-llama", download=False).resolve() == snapshot.resolve()
    # vLLM is given the local folder, not the id.
    settings = engine_settings(Config(model=ModelConfig(path="tiny-org/tiny-llama")))
    assert Path(settings.model_path).resolve() == snapshot.resolve()
    check_hf_dir(resolve_model_path("tiny-org/tiny-llama"), megatron=True)  # the checks before a run pass


@pytest.mark.parametrize("download", [True, False])
def test_an_uncached_hub_id_fails_offline_in_one_line_naming_the_fetch_command(hub_cache, download):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("tiny-org/not-cached", download=download)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("model.path 'tiny-org/not-cached'")
    assert message.endswith("fetch it with: hf download tiny-org/not-cached")
    assert str(hub_cache) in message


def test_local_paths_win_over_hub_ids_and_unknown_names_explain_all_three(tmp_path, monkeypatch, tiny_llama):
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "org" / "model"
    shutil.copytree(tiny_llama, local)
    assert resolve_model_path("org/model") == Path("org/model")  # a relative folder, not the Hub
    with pytest.raises(FileNotFoundError, match="neither a known model .*, a directory with a config.json, "
                                                r"nor a Hugging Face Hub id \(org/name\)"):
        resolve_model_path(str(tmp_path / "a" / "b"))


# --- row formats ----------------------------------------------------------------------------------------

# Rows as verl's examples/data_preprocess/gsm8k.py and math_dataset.py write them.
VERL_GSM8K = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many "
                "in total? Let's think step by step and output the final answer after \"####\"."}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "72"},
    "extra_info": {"split": "train", "index": 0, "answer": "48/2 = 24\n48+24 = 72\n#### 72",
                   "question": "Natalia sold 48 clips in April and half as many in May. How many in total?"},
}
VERL_MATH = {
    "data_source": "DigitalLearningGmbH/MATH-lighteval",
    "prompt": [{"role": "user", "content": "What is $\\frac{1}{4} + \\frac{1}{4}$? Let's think step by step and "
                "output the final answer within \\boxed{}."}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
    "extra_info": {"split": "test", "index": 7},
}


def test_verl_gsm8k_and_math_parquet_rows_load_as_written(tmp_path):
    path = tmp_path / "train.parquet"
    pd.DataFrame([VERL_GSM8K, VERL_MATH]).to_parquet(path)
    gsm8k, math = load_file(path)
    assert gsm8k == PromptRecord(prompt=VERL_GSM8K["prompt"], data_source="openai/gsm8k", ground_truth="72",
                                 extra_info=VERL_GSM8K["extra_info"], chat=True)
    assert math == PromptRecord(prompt=VERL_MATH["prompt"], data_source="DigitalLearningGmbH/MATH-lighteval",
                                ground_truth="\\frac{1}{2}", extra_info={"split": "test", "index": 7}, chat=True)
    # Parquet gives every row every struct field; the MATH row keeps only its own extra_info.
    assert "answer" not in math.extra_info
    # Scored with the families those sets use (data_source overridden to the built-in names).
    assert compute_score("gsm8k", "24 + 48 = 72\n#### 72", gsm8k.ground_truth, gsm8k.extra_info).correct
    assert compute_score("math", "so \\boxed{\\frac{2}{4}}", math.ground_truth, math.extra_info).correct


def test_trl_standard_prompt_only_rows_with_a_solution(tmp_path):
    path = tmp_path / "trl.jsonl"
    rows = [{"prompt": "What is 6 * 7?", "solution": "42"}, {"prompt": "What is 2 ** 5?", "solution": "32"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second = load_file(path, data_source="math")
    assert first == PromptRecord(prompt=[{"role": "user", "content": "What is 6 * 7?"}], data_source="math",
                                 ground_truth="42", extra_info={})
    assert (second.prompt[0]["content"], second.ground_truth) == ("What is 2 ** 5?", "32")
    assert compute_score(first.data_source, "\\boxed{42}", first.ground_truth, first.extra_info).correct


def test_trl_conversational_prompt_only_rows_with_an_answer(tmp_path):
    path = tmp_path / "trl.parquet"
    prompt = [{"role": "system", "content": "Answer in \\boxed{}."}, {"role": "user", "content": "1/2 + 1/3?"}]
    pd.DataFrame([{"prompt": prompt, "answer": "\\frac{5}{6}", "solution": "3/6 + 2/6 = 5/6"},
                  {"prompt": prompt, "answer": "3"}]).to_parquet(path)
    first, second = load_file(path, data_source="math")
    assert first == PromptRecord(prompt=prompt, data_source="math", ground_truth="\\frac{5}{6}",
                                 extra_info={"solution": "3/6 + 2/6 = 5/6"}, chat=True)
    assert (second.ground_truth, second.extra_info) == ("3", {})


def test_a_row_without_a_reference_answer_names_file_row_and_what_was_expected(tmp_path):
    path = tmp_path / "trl.jsonl"
    path.write_text(json.dumps({"prompt": "q", "solution": "1"}) + "\n" + json.dumps({"prompt": "q", "hint": "h"}))
    with pytest.raises(DataError, match=rf"^{path} row 2: missing the reference answer: expected "
                                        r"'reward_model.ground_truth' \(verl's format\) or an 'answer', "
                                        r"'solution' or 'ground_truth' field .*; found: hint, prompt$"):
        load_file(path, data_source="math")


@pytest.mark.parametrize("prompt, message", [
    (7, r"row 1: field 'prompt' must be a non-empty list of chat messages or text, got 7"),
    ("  ", r"row 1: field 'prompt' must be non-empty text"),
    ([], r"row 1: field 'prompt' must be a non-empty list"),
])
def test_a_bad_prompt_names_the_row_and_the_field(tmp_path, prompt, message):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "answer": "1"}))
    with pytest.raises(DataError, match=message):
        load_file(path, data_source="math")


def test_columns_rename_a_files_columns_before_the_row_is_read(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"problem": "2 + 2?", "expected_answer": "4", "question": "ignored"}) + "\n")
    (rec,) = load_file(path, "math", {"problem": "question", "expected_answer": "answer"})
    assert (rec.prompt[0]["content"], rec.ground_truth) == ("2 + 2?", "4")
    with pytest.raises(DataError, match=rf"^{path}: data.sources\[\].columns renames \['nope'\], which the data "
                                        r"does not have; its columns: \['expected_answer', 'problem', 'question'\]"):
        load_file(path, "math", {"nope": "question"})


# --- kind: hf -------------------------------------------------------------------------------------------


def _dataset_folder(folder: Path) -> Path:
    """A data set folder as the Hub holds one: train and test splits as JSON lines under data/."""
    (folder / "data").mkdir(parents=True)
    train = [{"problem": "What is 6 * 7?", "solution": "42"}, {"problem": "What is 9 - 4?", "solution": "5"}]
    (folder / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (folder / "data" / "test.jsonl").write_text(json.dumps({"problem": "What is 1 + 1?", "solution": "2"}) + "\n")
    return folder


def test_an_hf_source_reads_a_local_folder_with_a_split_and_a_column_mapping(tmp_path):
    folder = _dataset_folder(tmp_path / "my_set")
    # As a user writes it on the command line.
    cfg = load_config("grpo_smollm2_cpu", [
        f"data.sources=[{{kind: hf, name: {folder}, split: test, data_source: math, columns: {{problem: prompt}}}}]",
        "data.system_prompt=''"])
    (rec,) = load_records(cfg.data)
    assert rec == PromptRecord(prompt=[{"role": "user", "content": "What is 1 + 1?"}], data_source="math",
                               ground_truth="2", extra_info={"index": 0})
    # A local folder gives no data_source of its own: the rows or the source must.
    source = DataSourceConfig(kind="hf", name=str(folder), columns={"problem": "prompt"})
    with pytest.raises(DataError, match=rf"^data set '{folder}' split 'train' row 1: missing field 'data_source'"):
        load_records(DataConfig(sources=[source]))
    with pytest.raises(DataError, match=rf"^data set '{folder}' split 'validation': cannot be loaded: .*validation"):
        load_records(DataConfig(sources=[DataSourceConfig(kind="hf", name=str(folder), split="validation")]))


def test_an_hf_source_reads_a_hub_data_set_from_the_hub_cache_offline(hub_cache, tmp_path):
    cache_repo(hub_cache, "dataset", "tiny-org/tiny-math", _dataset_folder(tmp_path / "files"))
    source = DataSourceConfig(kind="hf", name="tiny-org/tiny-math", columns={"problem": "prompt"}, size=1)
    (rec,) = load_records(DataConfig(sources=[source], system_prompt=""))
    # Rows without a data_source get the data set's id, as verl's preprocessing writes it.
    assert rec == PromptRecord(prompt=[{"role": "user", "content": "What is 6 * 7?"}],
                               data_source="tiny-org/tiny-math", ground_truth="42", extra_info={"index": 0})
    source = DataSourceConfig(kind="hf", name="tiny-org/tiny-math", columns={"problem": "prompt"}, data_source="math")
    assert [r.data_source for r in load_records(DataConfig(sources=[source]))] == ["math", "math"]


def test_an_uncached_hub_data_set_fails_offline_naming_it_and_the_fetch_command(hub_cache):
    source = DataSourceConfig(kind="hf", name="tiny-org/not-cached", config_name="main")
    with pytest.raises(DataError) as e:
        load_records(DataConfig(sources=[source]))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("data set 'tiny-org/not-cached' config 'main' split 'train': not in the datasets cache")
    assert message.endswith("fetch it with: hf download --repo-type dataset tiny-org/not-cached")


def test_an_hf_source_needs_a_name():
    with pytest.raises(ConfigError, match=r"data.sources\[0\].name.*is required when kind=hf"):
        load_config("grpo_smollm2_cpu", ["data.sources=[{kind: hf, split: train}]"])


def test_train_inputs_from_a_hub_model_and_a_hub_data_set(hub_cache, tiny_llama, tmp_path):
    """What `megareason train model.path=<hub id> data.sources=[{kind: hf, ...}]` checks and loads before
    any worker starts: the cached model passes the checks, the prompts load through its tokenizer; an
    uncached model is one problem, in one line."""
    from megareason.launch.preflight import PreflightError, check_run
    from megareason.trainer.loop import _load_prompts

    cache_repo(hub_cache, "model", "tiny-org/tiny-llama", tiny_llama)
    cache_repo(hub_cache, "dataset", "tiny-org/tiny-math", _dataset_folder(tmp_path / "files"))
    overrides = [f"trainer.output_dir={tmp_path / 'run'}", "trainer.prompts_per_step=2",
                 "data.sources=[{kind: hf, name: tiny-org/tiny-math, data_source: math, columns: {problem: prompt}}]",
                 "data.val_sources=[{kind: hf, name: tiny-org/tiny-math, split: test, data_source: math, "
                 "columns: {problem: prompt}}]"]
    cfg = load_config("grpo_smollm2_cpu", ["model.path=tiny-org/tiny-llama", *overrides])
    check_run(cfg, "train")
    prompts, val, _, _ = _load_prompts(cfg)
    assert [(p.record.prompt[-1]["content"], p.record.ground_truth) for p in prompts + val] == [
        ("What is 6 * 7?", "42"), ("What is 9 - 4?", "5"), ("What is 1 + 1?", "2")]
    with pytest.raises(PreflightError) as e:
        check_run(load_config("grpo_smollm2_cpu", ["model.path=tiny-org/not-cached", *overrides]), "train")
    (problem,) = e.value.problems
    assert "\n" not in problem and problem.endswith("fetch it with: hf download tiny-org/not-cached")


def test_the_planner_reads_only_the_config_of_a_hub_model(hub_cache, tiny_qwen3, tmp_path):
    from megareason.launch.plan import resolve_arch

    (tmp_path / "config_only").mkdir()
    shutil.copy(tiny_qwen3 / "config.json", tmp_path / "config_only" / "config.json")
    snapshot = cache_repo(hub_cache, "model", "tiny-org/tiny-qwen3", tmp_path / "config_only")
    arch, where = resolve_arch(Config(model=ModelConfig(path="tiny-org/tiny-qwen3")), "")
    assert Path(where).resolve() == snapshot.resolve() and arch.head_dim == 32
    with pytest.raises(CheckpointError, match="has no weights"):  # what training checks finds in that copy
        check_hf_dir(resolve_model_path("tiny-org/tiny-qwen3"), megatron=True)
