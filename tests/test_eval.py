"""``megareason eval``: metrics by hand, the runner with a scripted engine, and the real CLI end to end."""

from __future__ import annotations

import json

import pytest

from megareason.cli import main
from megareason.config import from_dict
from megareason.evaluation.runner import format_table, run_eval
from megareason.models.tiny import build_tokenizer
from megareason.rewards.scoring import pass_at_k
from megareason.rollout.records import Completion


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


class ScriptedEngine:
    """Returns canned responses in order; lets the runner be checked against hand-computed figures."""

    def __init__(self, responses: list[list[tuple[str, str]]]):
        self.tokenizer = build_tokenizer()
        self.responses = responses
        self.calls = []

    def generate(self, prompts_token_ids, sampling, use_tqdm=True):
        self.calls.append((list(prompts_token_ids), sampling))
        return [[Completion(token_ids=self.tokenizer(text)["input_ids"], text=text, logprobs_T=[], finish_reason=f)
                 for text, f in group] for group in self.responses]

    def shutdown(self):
        pass


def _cfg(tmp_path, rows, n=2, **rollout):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return from_dict({
        "data": {"sources": [{"kind": "file", "path": str(path)}], "system_prompt": ""},
        "rollout": {"n": n, **rollout},
        "eval": {"output_dir": str(tmp_path / "out"), "pass_k": [1, 2]},
    })


def test_runner_reports_hand_computed_metrics(tmp_path):
    rows = [
        {"question": "2+2?", "answer": "4", "data_source": "math"},
        {"question": "3+3?", "answer": "6", "data_source": "math"},
        {"question": "Q", "answer": "7", "data_source": "gsm8k"},
    ]
    engine = ScriptedEngine([
        [("so \\boxed{4}", "stop"), ("\\boxed{5}", "stop")],  # 1 of 2 right
        [("\\boxed{6}", "stop"), ("\\boxed{6}", "length")],  # 2 of 2 right, one clipped
        [("#### 8", "stop"), ("I think 7", "stop")],  # strict gsm8k: both wrong
    ])
    report = run_eval(_cfg(tmp_path, rows), engine=engine)
    gsm, math = report.summaries  # sorted by data_source
    assert (math.data_source, math.prompts, math.samples) == ("math", 2, 4)
    assert math.accuracy == 0.75 and math.mean_reward == 0.75
    assert math.pass_at == {1: 0.75, 2: 1.0}  # prompt 1: 0.5 / 1.0, prompt 2: 1.0 / 1.0
    assert math.clip_ratio == 0.25
    assert (gsm.accuracy, gsm.pass_at[2], gsm.score_errors) == (0.0, 0.0, 0)
    (prompts, sampling), = engine.calls
    assert sampling.n == 2 and len(prompts) == 3
    # The files: one JSONL line per sample, and a summary that matches the report.
    lines = [json.loads(x) for x in (report.output_dir / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and lines[1]["response"] == "\\boxed{5}" and lines[1]["correct"] is False
    summary = json.loads((report.output_dir / "summary.json").read_text())
    assert summary["summaries"][1]["accuracy"] == 0.75
    assert not list(report.output_dir.glob(".*"))  # no temporary files left behind
    table = format_table(report.summaries)
    assert "pass@2" in table and "0.750" in table


def test_scorer_failure_is_counted_not_silent(tmp_path):
    rows = [{"question": "make 10", "answer": "10", "data_source": "countdown"}]  # no extra_info.numbers
    report = run_eval(_cfg(tmp_path, rows, n=1), engine=ScriptedEngine([[("<answer>5+5</answer>", "stop")]]))
    (s,) = report.summaries
    assert s.score_errors == 1 and s.mean_reward == 0.0
    assert "numbers" in report.samples[0].score_error


def test_unknown_data_source_fails_before_generation(tmp_path):
    from megareason.data import DataError

    rows = [{"question": "q", "answer": "1", "data_source": "no_such_reward"}]
    engine = ScriptedEngine([[("1", "stop")]])
    with pytest.raises(DataError, match="no_such_reward.*registered:"):
        run_eval(_cfg(tmp_path, rows, n=1), engine=engine)
    assert engine.calls == []


def test_a_failing_scorer_is_counted_not_fatal(tmp_path):
    f = tmp_path / "reward.py"
    f.write_text("def boom(data_source, response, ground_truth, extra_info):\n    raise KeyError('x')\n")
    cfg = _cfg(tmp_path, [{"question": "q", "answer": "1", "data_source": "math"}], n=1)
    cfg.reward.custom = f"{f}:boom"
    report = run_eval(cfg, engine=ScriptedEngine([[("1", "stop")]]))
    assert report.summaries[0].score_errors == 1 and report.samples[0].score_error == "KeyError: 'x'"


def test_cli_help_and_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "megareason eval rollout.temperature=0.7" in capsys.readouterr().out
    assert main(["eval", "rollout.tempreature=1"]) == 2
    assert "valid keys of rollout" in capsys.readouterr().err
    assert main(["eval", "model.path=/nonexistent", "--show-config"]) == 0
    assert '"path": "/nonexistent"' in capsys.readouterr().out


def test_cli_bad_data_file_fails_before_engine_start(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    code = main(["eval", f"data.sources=[{{kind: file, path: '{bad}', data_source: math}}]"])
    assert code == 2
    assert f"{bad} row 1: missing field 'answer'" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_eval_end_to_end_on_tiny_model(tiny_qwen2, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i),
                                        "data_source": "arithmetic"}) + "\n" for i in range(5)))
    out = tmp_path / "out"
    code = main(["eval", f"model.path={tiny_qwen2}", f"data.sources=[{{kind: file, path: '{data}'}}]",
                 "rollout.n=3", "rollout.max_tokens=16", "rollout.max_model_len=256",
                 "data.max_prompt_length=128", f"eval.output_dir={out}"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "arithmetic" in printed and "pass@1" in printed
    (run,) = out.iterdir()
    lines = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 15 and {x["index"] for x in lines} == set(range(5))
    assert all(1 <= x["response_tokens"] <= 16 for x in lines)
