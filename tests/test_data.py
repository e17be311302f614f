"""Data loaders against hand-made files; errors name the file, the row and the field."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megareason.config import DataConfig, DataSourceConfig
from megareason.data import DataError, PromptRecord, arithmetic, load_file, load_records, tokenize_prompts
from megareason.models.tiny import build_tokenizer

VERL_ROW = {
    "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
    "data_source": "math",
    "reward_model": {"ground_truth": "4"},
    "extra_info": {"split": "test"},
}
SEED_ROW = {"question": "What is 3 * 3?", "answer": 9, "solution": "3 * 3 = 9", "data_source": "arithmetic"}


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_verl_jsonl(tmp_path):
    (rec,) = load_file(_jsonl(tmp_path / "d.jsonl", [VERL_ROW]))
    assert rec == PromptRecord(prompt=VERL_ROW["prompt"], data_source="math", ground_truth="4",
                               extra_info={"split": "test"}, chat=True)


def test_seed_json_list_and_number_answers(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([SEED_ROW, {**SEED_ROW, "answer": "10", "question": "3 * 3 + 1?"}]))
    recs = load_file(path)
    assert [r.ground_truth for r in recs] == ["9", "10"]
    assert recs[0].prompt == [{"role": "user", "content": "What is 3 * 3?"}]
    assert recs[0].extra_info == {"question": "What is 3 * 3?", "solution": "3 * 3 = 9"}


def test_parquet(tmp_path):
    import pandas as pd

    path = tmp_path / "d.parquet"
    pd.DataFrame([{"question": "1 + 1?", "answer": "2"}, {"question": "2 + 2?", "answer": "4"}]).to_parquet(path)
    recs = load_file(path, data_source="gsm8k")
    assert [(r.data_source, r.ground_truth) for r in recs] == [("gsm8k", "2"), ("gsm8k", "4")]


def test_missing_field_names_file_row_and_field(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [SEED_ROW, SEED_ROW, {"question": "no answer here", "data_source": "m"}])
    with pytest.raises(DataError, match=rf"{path} row 3: missing field 'answer'"):
        load_file(path)


def test_missing_data_source(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"row 1: missing field 'data_source'"):
        load_file(path)


def test_bad_messages(tmp_path):
    bad = {**VERL_ROW, "prompt": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]}
    path = _jsonl(tmp_path / "d.jsonl", [VERL_ROW, bad])
    with pytest.raises(DataError, match=r"row 2: prompt\[1\] must be"):
        load_file(path)


def test_neither_prompt_nor_question(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "hello", "data_source": "math"}])
    with pytest.raises(DataError, match=r"row 1: expected a 'prompt' .* or a 'question' field; found: data_source, t"):
        load_file(path)


def test_invalid_json_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(SEED_ROW) + "\n" + json.dumps(SEED_ROW) + "\n{not json\n")
    with pytest.raises(DataError, match=rf"{path} line 3: invalid JSON"):
        load_file(path)


def test_unsupported_extension_and_missing_file(tmp_path):
    (tmp_path / "d.csv").write_text("question,answer\n")
    with pytest.raises(DataError, match=r"unsupported extension '\.csv'"):
        load_file(tmp_path / "d.csv")
    with pytest.raises(DataError, match="no such file"):
        load_file(tmp_path / "missing.jsonl")


def test_reasoning_gym_countdown_carries_numbers_and_target():
    import reasoning_gym

    cfg = DataConfig(sources=[DataSourceConfig(kind="reasoning_gym", name="countdown", size=3, seed=5,
                                               options={"min_numbers": 3, "max_numbers": 3}, system_prompt="")])
    recs = load_records(cfg)
    expected = reasoning_gym.create_dataset("countdown", size=3, seed=5, min_numbers=3, max_numbers=3)
    assert len(recs) == 3
    for i, (rec, item) in enumerate(zip(recs, expected, strict=True)):
        assert rec.data_source == "countdown"
        assert rec.ground_truth == str(item["metadata"]["target"])
        assert rec.extra_info["numbers"] == item["metadata"]["numbers"]
        assert rec.extra_info["index"] == i
        assert rec.prompt == [{"role": "user", "content": item["question"]}]


_TWO_TERMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
              "allow_negation": False, "allow_parentheses": False}


@pytest.mark.parametrize(("expression", "answer", "ok"), [
    ("57 * 47", "2679", True), ("10 / 5", "2", True), ("-(3 + 4) * 2", "-14", True), ("1 - 5", "-4", True),
    ("4 / 1", "2", False),  # reasoning-gym's answer to 'Calculate 4 / 1.' (seed 1, item 8)
    ("7 / 2", "3", False),  # floor division is not what the question asks
    ("3 / 0", "18", False), ("2 ** 3", "8", False), ("57 * 47", "about 2679", False),
])
def test_an_arithmetic_answer_is_checked_against_its_expression(expression, answer, ok):
    assert arithmetic.answer_matches(expression, answer) is ok


def test_worked_solutions_by_hand_and_every_step_equals_the_answer():
    assert arithmetic.worked_solution("57 * 47", "2679") == "57 * 47 = 57 * 40 + 57 * 7 = 2280 + 399 = 2679"
    assert arithmetic.worked_solution("88 + 94", "182") == "88 + 94 = 88 + 90 + 4 = 178 + 4 = 182"
    assert arithmetic.worked_solution("57 - 65", "-8") == "57 - 65 = 57 - 60 - 5 = -3 - 5 = -8"
    assert arithmetic.worked_solution("6 * 10", "60") == "6 * 10 = 60"  # nothing to split
    assert arithmetic.worked_solution("12 / 4", "3") == "12 / 4 = 3"
    for a in range(0, 100, 7):
        for b in range(0, 100, 3):
            for op in "+-*":
                truth = str(eval(f"{a} {op} {b}"))  # Python's own arithmetic, not the module's
                steps = arithmetic.worked_solution(f"{a} {op} {b}", truth).split(" = ")
                assert steps[-1] == truth
                assert all(eval(step) == int(truth) for step in steps), steps


def test_basic_arithmetic_keeps_only_items_whose_answer_is_their_question(caplog):
    import reasoning_gym

    raw = reasoning_gym.create_dataset("basic_arithmetic", size=200, seed=1, **_TWO_TERMS)
    # Python's true division on the question's expression, independently of megareason.data.arithmetic
    def right(item):
        try:
            return eval(item["metadata"]["expression"]) == int(item["answer"])
        except ZeroDivisionError:  # 'Calculate 3 / 0.' exists, with an answer
            return False

    good = [item for item in raw if right(item)]
    bad = len(raw) - len(good)
    assert 20 < bad < 100  # the generator's '/' answers: about a quarter of the items
    with caplog.at_level(logging.WARNING):
        recs = load_records(DataConfig(sources=[
            DataSourceConfig(kind="reasoning_gym", name="basic_arithmetic", size=len(good), seed=1,
                             options=_TWO_TERMS, system_prompt="")]))
    assert [(r.prompt[0]["content"], r.ground_truth) for r in recs] == [
        (item["question"], item["answer"]) for item in good]
    assert f"skipped {bad} items" in caplog.text
    assert recs[1].extra_info["solution"] == "88 + 94 = 88 + 90 + 4 = 178 + 4 = 182"
    # A source that can not give `size` right items says so instead of training on wrong answers.
    with pytest.raises(DataError, match=r"basic_arithmetic.*seed 1.*only \d+ of the first 864.*operators"):
        load_records(DataConfig(sources=[DataSourceConfig(
            kind="reasoning_gym", name="basic_arithmetic", size=200, seed=1,
            options={**_TWO_TERMS, "operators": ["/"]})]))


def test_reasoning_gym_unknown_generator():
    cfg = DataConfig(sources=[DataSourceConfig(kind="reasoning_gym", name="no_such_task", size=2)])
    with pytest.raises(DataError, match="no_such_task"):
        load_records(cfg)


def test_load_records_system_prompt_size_and_override(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [SEED_ROW] * 5)
    cfg = DataConfig(system_prompt="Be brief.", sources=[
        DataSourceConfig(kind="file", path=str(path), size=2, data_source="math"),
        DataSourceConfig(kind="reasoning_gym", name="basic_arithmetic", size=1),
    ])
    recs = load_records(cfg)
    assert [r.data_source for r in recs] == ["math", "math", "basic_arithmetic"]
    assert all(r.prompt[0] == {"role": "system", "content": "Be brief."} for r in recs)
    assert [r.extra_info["index"] for r in recs] == [0, 1, 2]


def test_tokenize_filters_or_rejects_long_prompts():
    tok = build_tokenizer()
    short = PromptRecord(prompt=[{"role": "user", "content": "2+2?"}], data_source="math", ground_truth="4")
    long = PromptRecord(prompt=[{"role": "user", "content": "word " * 200}], data_source="math",
                        ground_truth="4", extra_info={"index": 7})
    out = tokenize_prompts([short, long], tok, max_prompt_length=64)
    assert [p.record for p in out] == [short]
    assert out[0].text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(out[0].token_ids) == out[0].text
    with pytest.raises(DataError, match=r"prompt 7 \(math\) has \d+ tokens, more than data.max_prompt_length=64"):
        tokenize_prompts([short, long], tok, max_prompt_length=64, truncation="error")


BOM = b"\xef\xbb\xbf"  # the UTF-8 byte-order mark some Windows editors write first


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_utf8_bom_loads_the_same_rows(tmp_path, suffix):
    rows = [VERL_ROW, SEED_ROW, {**SEED_ROW, "question": "Ünïcode ✓ 3 * 3?"}]
    text = json.dumps(rows) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in rows)
    plain, marked = tmp_path / f"plain{suffix}", tmp_path / f"bom{suffix}"
    plain.write_bytes(text.encode("utf-8"))
    marked.write_bytes(BOM + text.encode("utf-8"))
    recs = load_file(marked)
    assert recs == load_file(plain)
    assert [r.ground_truth for r in recs] == ["4", "9", "9"]
    assert recs[2].prompt == [{"role": "user", "content": "Ünïcode ✓ 3 * 3?"}]


def test_utf8_bom_file_with_a_bad_line_names_that_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(BOM + (json.dumps(SEED_ROW) + "\n\n{not json\n").encode())
    with pytest.raises(DataError, match=rf"^{path} line 3: invalid JSON"):
        load_file(path)


def test_utf8_bom_musique(tmp_path):
    from megareason.data.musique import load_musique

    row = {"id": "2hop__1", "question": "Who founded Quorel Labs?", "answer": "Bo Lind", "answerable": True,
           "paragraphs": [{"idx": 0, "title": "Quorel Labs", "paragraph_text": "Bo Lind founded Quorel Labs.",
                           "is_supporting": True}],
           "question_decomposition": [{"id": 1, "question": "Who founded Quorel Labs?", "answer": "Bo Lind",
                                       "paragraph_support_idx": 0}]}
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "bom.jsonl"
    plain.write_text(json.dumps(row) + "\n")
    marked.write_bytes(BOM + plain.read_bytes())
    (rec,) = load_musique(marked)
    assert rec == load_musique(plain)[0] and rec.ground_truth == "Bo Lind"


def test_json_file_of_json_lines_or_one_object(tmp_path):
    lines, one = tmp_path / "lines.json", tmp_path / "one.json"
    lines.write_text(json.dumps(SEED_ROW) + "\n" + json.dumps({**SEED_ROW, "answer": 10}) + "\n")
    one.write_text(json.dumps(SEED_ROW, indent=2))
    assert [r.ground_truth for r in load_file(lines)] == ["9", "10"]
    assert [r.ground_truth for r in load_file(one)] == ["9"]


def test_line_separator_inside_a_string_is_not_a_line_break(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({**SEED_ROW, "question": "a\u2028b"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_file(path)[0].prompt[0]["content"] == "a\u2028b"


@pytest.mark.parametrize("name,content", [("d.jsonl", b'{"question": "q", "answer": 1}\n{bad\n'),
                                          ("d.json", b'[{"question": "q"},'), ("d.parquet", b"PAR1 not parquet")])
def test_malformed_file_logs_nothing_from_datasets(tmp_path, caplog, capfd, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(DataError, match=rf"^{path}"):
        load_file(path, data_source="m")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("datasets")] == []
    out, err = capfd.readouterr()
    assert "Failed to" not in out + err and "datasets" not in out + err


def test_a_source_sets_extra_info_for_its_rows_and_the_reward_reads_it(tmp_path):
    """data.sources[i].extra_info reaches every row (a row's own key wins) and so the reward family's
    settings: the arithmetic reward with reward_type=correct pays nothing for a well-formed wrong answer
    (combined, the default, pays its boxed_weight 0.3)."""
    from megareason.config import load_config
    from megareason.rewards.registry import compute_score

    path = tmp_path / "rows.jsonl"
    path.write_text('{"question": "1 + 1", "answer": "2", "data_source": "arithmetic"}\n'
                    '{"question": "2 + 2", "answer": "4", "data_source": "arithmetic", '
                    '"extra_info": {"reward_type": "boxed"}}\n')
    cfg = load_config("grpo_smollm2_cpu", [f"data.sources=[{{kind: file, path: {path}, "
                                           "extra_info: {reward_type: correct, boxed_weight: 0.5}}]"])
    first, second = load_records(cfg.data)
    assert first.extra_info["reward_type"] == "correct" and first.extra_info["boxed_weight"] == 0.5
    assert second.extra_info["reward_type"] == "boxed"  # the row's own value
    wrong = "1 + 1 = 3 <eoe>"
    assert compute_score("arithmetic", wrong, "2", first.extra_info).score == 0.0
    assert compute_score("arithmetic", wrong, "2", {}).score == pytest.approx(0.3)
    assert compute_score("arithmetic", "2 + 2 = 5 <eoe>", "4", second.extra_info).score == 1.0
