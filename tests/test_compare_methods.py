"""tools/compare_methods.py: its held-out and tuning splits (disjoint from the training pool and each
other by their text), the per-prompt rows of a validation dump, its statistics against hand-computed values,
its resumption and the arms it refuses (no model: hand-written dumps), and the recipe's first steps on the
tiny model (the GRPO and RARO arms exactly as the tool runs them, compared to golden curves;
the SmolLM2 comparison itself is a long experiment, not a test: docs/results/compare_methods.md)."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from golden_curves import check_golden
from test_plots import error_bars, wilson_by_hand
from test_train_e2e import _env, _metrics

from megareason.data.loaders import load_file
from megareason.data.records import PromptRecord

TOOL = Path(__file__).resolve().parent.parent / "tools" / "compare_methods.py"


def _tool():
    spec = importlib.util.spec_from_file_location("compare_methods", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations there
    spec.loader.exec_module(module)
    return module


def _eval_module():
    _tool()  # puts tools/ on sys.path
    import compare_methods_eval

    return compare_methods_eval


def test_mcnemar_exact_p_by_hand():
    cm = _eval_module()
    a = np.array([1] * 8 + [0] * 2 + [1] * 5 + [0] * 5)  # 8 prompts only a solves, 2 only b, 10 concordant
    b = np.array([0] * 8 + [1] * 2 + [1] * 5 + [0] * 5)
    # two-sided binomial(10, 1/2) test of 2 vs 8: 2 * (C(10,0) + C(10,1) + C(10,2)) / 2^10
    assert cm.mcnemar_exact_p(a, b) == pytest.approx(2 * (1 + 10 + 45) / 1024)
    assert cm.mcnemar_exact_p(a, a) == 1.0
    assert cm.mcnemar_exact_p(np.ones(5), np.zeros(5)) == pytest.approx(2 / 32)


def test_bootstrap_intervals_match_the_normal_approximation():
    cm = _eval_module()
    rng = np.random.default_rng(1)
    x = np.array([1.0] * 150 + [0.0] * 350)  # accuracy 0.3 on 500 prompts
    lo, hi = cm.bootstrap_mean(x, rng)
    half = 1.96 * math.sqrt(0.3 * 0.7 / 500)
    assert lo == pytest.approx(0.3 - half, abs=0.006) and hi == pytest.approx(0.3 + half, abs=0.006)
    # paired: b solves the same prompts as a plus 40 more; the difference's interval is that of the mean
    # of a 0/1 vector with 40 ones in 500 (not the much wider one of two independent samples)
    b = x.copy()
    b[150:190] = 1.0
    d = cm.paired(b, x, rng)
    half = 1.96 * math.sqrt(0.08 * 0.92 / 500)
    assert d["diff"] == pytest.approx(0.08)
    assert d["ci"][0] == pytest.approx(0.08 - half, abs=0.006) and d["ci"][1] == pytest.approx(0.08 + half, abs=0.006)
    assert d["p"] == pytest.approx(2 / 2**40)


@pytest.mark.slow
def test_the_recipe_first_steps_on_the_tiny_model(tiny_qwen2, tmp_path):
    """The tool end to end on the tiny model (the byte-level tokenizer needs a longer context and stops
    the policy at the first "e", as test_train_e2e's RARO run does), then each arm's curve against its
    golden one, and the table against the validation dumps it was computed from."""
    runs, results = tmp_path / "runs", tmp_path / "results"
    tiny = [f"model.path={tiny_qwen2}", "rollout.max_tokens=16", "rollout.max_model_len=1024",
            "data.max_prompt_length=512", "rollout.stop=[e]",
            "trainer.val_every=1", "trainer.save_every=2", "optim.lr=1e-3"]
    proc = subprocess.run([sys.executable, str(TOOL), "--steps", "2", "--prompts", "4", "--heldout", "6",
                           "--seeds", "1", "--rerank-prompts", "2", "--arms", "grpo,raro", "--runs", str(runs),
                           "--no-forced-format",
                           "--results", str(results), *tiny], capture_output=True, text=True, timeout=900, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_golden("compare_grpo", _metrics(runs / "grpo" / "seed0"))
    raro = _metrics(runs / "raro" / "seed0")
    assert all(raro[s]["raro/critic_fresh"] > 0 and raro[s]["raro/format_error_rate"] == 0 for s in (1, 2))
    check_golden("compare_raro", raro)

    table = json.loads((results / "compare_methods.json").read_text())
    for arm, dump in (("base", runs / "grpo" / "seed0" / "rollouts" / "val_step_00000000.jsonl"),
                      ("raro", runs / "raro" / "seed0" / "rollouts" / "val_step_00000002.jsonl")):
        rows = [json.loads(line) for line in dump.read_text().splitlines()]
        assert len(rows) == 6 and table["arms"][arm]["all_prompts"]["strict"] == sum(r["correct"] for r in rows) / 6
        committed = [json.loads(line) for line in (results / "compare_methods_prompts" / f"{arm}_seed0.jsonl")
                     .read_text().splitlines()]
        assert [r["response"] for r in committed] == [r["response"] for r in sorted(rows, key=lambda r: r["index"])]
    assert table["rerank"]["prompts"] == 2 and table["rerank"]["n"] == 4
    for name in ("compare_methods.md", "compare_methods_heldout.png", "compare_methods_raro_critic.png"):
        assert (results / name).stat().st_size > 0
    assert "| raro | 1 |" in (results / "compare_methods.md").read_text()


def test_tuning_runs_score_on_their_own_split_never_the_held_out_one(tmp_path):
    cm = _tool()
    split = tmp_path / "data" / "tuning.jsonl"
    variants = cm.tune_commands(tmp_path, steps=10, prompts=8, val_file=split,
                                variants=["lr=raro:optim.lr=3e-5,raro.tau_pol=0.5", "plain=grpo:"],
                                extra=["model.path=/m"])
    arm, cmd = variants["lr"]
    assert arm == "raro" and cmd[0] == "train" and "algorithm.name=raro" in cmd
    assert cmd[-2:] == ["optim.lr=3e-5", "raro.tau_pol=0.5"]  # the variant's overrides come last: they win
    assert f'data.val_sources=[{{kind:file,path:"{split}"}}]' in cmd
    assert [c for c in cmd if c.startswith("trainer.output_dir=")] == [f"trainer.output_dir={tmp_path / 'lr'}"]
    assert [c for c in cmd if c.startswith("trainer.val_before_train=")] == ["trainer.val_before_train=true"]
    assert variants["plain"][0] == "grpo" and variants["plain"][1][-1] == "trainer.val_before_train=true"
    for bad in ("x=ppo:optim.lr=1", "x=sft_then_grpo:"):  # unknown, not from base
        with pytest.raises(SystemExit, match="expected NAME=ARM"):
            cm.tune_commands(tmp_path, 10, 8, split, [bad], [])


def test_critic_votes_and_the_policy_reward_gap_by_hand(tmp_path, capsys, monkeypatch):
    """tools/raro_critic_votes.py on dumps written by hand: every share, the non-tie accuracy, the groups
    whose rewards differ, and the policy's correct-minus-wrong reward (a masked answer left out)."""
    spec = importlib.util.spec_from_file_location("raro_critic_votes", TOOL.parent / "raro_critic_votes.py")
    votes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(votes)
    dumps = tmp_path / "run" / "rollouts"
    dumps.mkdir(parents=True)
    policy = [(True, 1.0), (True, 0.5), (False, 0.0), (False, 0.5), (False, None)]
    (dumps / "step_00000001.jsonl").write_text(
        "".join(json.dumps({"correct": c, "reward": r}) + "\n" for c, r in policy))
    critic = [("p1", "Verdict: A", "A", 1.0), ("p1", "Let me see.\nVerdict: Tie", "B", 0.5),  # rewards differ
              ("p2", "Verdict: A", "B", 0.0), ("p2", "Verdict: A", "A", 0.0)]  # the same reward: no signal
    (dumps / "step_00000001_critic.jsonl").write_text("".join(
        json.dumps({"critic_prompt": p, "judgement": j, "expert_shown_as": e, "critic_reward": r}) + "\n"
        for p, j, e, r in critic))
    v = votes.step_votes(dumps / "step_00000001_critic.jsonl", critic_n=2)
    # The tie's GRPO advantage in p1: (0.5 - 0.75) / (unbiased std of [1, 0.5] = 0.3536) = -0.7071.
    assert v == {"says_A": 0.75, "says_B": 0.0, "says_tie": 0.25, "accuracy": pytest.approx(2 / 3),
                 "groups_with_signal": 0.5, "tie_advantage": pytest.approx(-(0.5 ** 0.5), rel=1e-5)}
    g = votes.policy_reward_gap(dumps / "step_00000001.jsonl")
    assert g == {"answers": 4, "correct": 2, "reward_gap": 0.75 - 0.25}
    with pytest.raises(SystemExit, match="groups of 3"):
        votes.step_votes(dumps / "step_00000001_critic.jsonl", critic_n=3)
    monkeypatch.setattr(sys, "argv", ["raro_critic_votes.py", str(tmp_path / "run")])
    votes.main()
    out = capsys.readouterr().out
    assert ("     1        4        2      +0.500    0.75    0.00      0.25      0.67                0.50"
            "         -0.707") in out


def test_heldout_and_critic_figures_one_panel_each_with_wilson_intervals():
    cm = _tool()
    curves = {"grpo": {0: 0.25, 1: 0.5, 2: 0.75}, "raro": {0: 0.25, 2: 0.5}}
    prompts = {"grpo": {0: 4, 1: 4, 2: 4}, "raro": {0: 4}}  # raro's step 2 has no prompt count
    fig = cm.heldout_figure(curves, prompts)
    grpo, raro = fig.axes
    assert [ax.get_title() for ax in fig.axes] == ["grpo", "raro"]
    for ax in fig.axes:  # one arm per panel, one line each, whole steps, the accuracy's own label
        assert len(ax.lines) == 1 and ax.get_ylabel() == "held-out greedy accuracy"
        assert all(float(t).is_integer() for t in ax.xaxis.get_major_locator().tick_values(0, 2))
    # k of 4 held-out prompts correct (1, 2, 3): the Wilson interval of k/4, computed by hand
    assert error_bars(grpo) == pytest.approx([0, *wilson_by_hand(1, 4), 1, *wilson_by_hand(2, 4),
                                              2, *wilson_by_hand(3, 4)])
    assert error_bars(raro) == pytest.approx([0, *wilson_by_hand(1, 4)])
    note = fig.get_supxlabel()
    assert "95% Wilson score interval over the held-out prompts (n=4)" in note
    assert "No interval (held-out prompt count unknown): raro step 2." in note

    critic = {"raro/critic_accuracy": [(1, 0.5), (2, 0.75)], "raro/tie_rate": [(1, 0.1), (2, 0.0)],
              "raro/format_error_rate": []}
    fig = cm.critic_figure(critic)
    assert [ax.get_ylabel() for ax in fig.axes] == ["raro/critic_accuracy", "raro/tie_rate"]
    for ax in fig.axes:
        assert len(ax.lines) == 1 and ax.containers == [] and ax.get_ylim() == (0, 1)
        assert all(float(t).is_integer() for t in ax.get_xticks())
    assert fig.get_supxlabel().startswith("No interval")
    assert cm.critic_figure({"raro/critic_accuracy": []}) is None


def _record(question: str, answer: str = "1") -> PromptRecord:
    return PromptRecord(prompt=[{"role": "system", "content": "s"}, {"role": "user", "content": question}],
                        data_source="basic_arithmetic", ground_truth=answer)


def test_splits_drop_repeats_and_excluded_questions_and_the_check_catches_any_overlap():
    ev = _eval_module()
    candidates = [_record(q) for q in ("Calculate 1 + 2.", "Calculate 3 + 4.", "Calculate  1 + 2.",  # a repeat
                                       "Calculate 5 * 6.", "Calculate 7 - 8.", "Calculate 9 + 9.")]
    exclude = {"training": {"Calculate 3 + 4."}, "tuning": {"Calculate 5 * 6.", "Calculate 3 + 4."}}
    split = ev.select_split(candidates, 3, exclude)
    assert [ev.question_of(r) for r in split.records] == ["Calculate 1 + 2.", "Calculate 7 - 8.", "Calculate 9 + 9."]
    # 6 drawn: one repeat, "3 + 4" dropped for training (the first set naming it), "5 * 6" for tuning
    assert split.stats() == {"kept": 3, "drawn": 6, "duplicates": 1, "excluded": {"training": 1, "tuning": 1}}
    assert ev.select_split(candidates, 4, exclude) is None  # only 3 qualify

    ev.check_splits(["Calculate 3 + 4.", "Calculate 3 + 4."], tuning=["Calculate 5 * 6."],  # the pool may repeat
                    heldout=["Calculate 1 + 2.", "Calculate 7 - 8."])
    with pytest.raises(ev.SplitError, match="training and heldout share 1 question"):
        ev.check_splits(["Calculate 3 + 4."], tuning=["Calculate 5 * 6."], heldout=["Calculate 3 +  4.", "A"])
    with pytest.raises(ev.SplitError, match="tuning and heldout share 1"):
        ev.check_splits(["B"], tuning=["Calculate 5 * 6."], heldout=["Calculate 5 * 6.", "A"])
    with pytest.raises(ev.SplitError, match="heldout repeats 1 question"):
        ev.check_splits(["B"], tuning=["C"], heldout=["A", " A"])


def test_a_split_written_as_a_file_source_reads_back_with_the_trainers_loader(tmp_path):
    ev = _eval_module()
    rec = _record("Calculate 12 + 30.", "42")
    rec.extra_info = {"solution": "12 + 30 = 42", "generator": "basic_arithmetic", "generator_index": 7}
    split = ev.Split([rec, _record("Calculate 2 * 3.", "6")], drawn=2, duplicates=0)
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ev.split_rows(split, seed=99)))
    read = load_file(path)
    assert [(r.prompt, r.ground_truth, r.data_source) for r in read] == [
        ([{"role": "user", "content": "Calculate 12 + 30."}], "42", "basic_arithmetic"),
        ([{"role": "user", "content": "Calculate 2 * 3."}], "6", "basic_arithmetic")]
    assert read[0].extra_info == {"index": 0, "seed": 99, "generator": "basic_arithmetic", "generator_index": 7,
                                  "question": "Calculate 12 + 30.", "solution": "12 + 30 = 42"}
    assert read[1].extra_info["index"] == 1


def _val_row(index: int, question: str, gold: str, response: str, correct: bool, truncated: bool = False) -> dict:
    return {"prompt": "<chat>", "prompt_token_ids": [1], "index": index, "sample": 0, "data_source": "basic_arithmetic",
            "question": question, "ground_truth": gold, "response": response, "reward": 1.0 if correct else 0.0,
            "correct": correct, "response_tokens": 5, "truncated": truncated, "score_error": "", "timed_out": False,
            "env": {}}


def test_per_prompt_rows_from_a_validation_dump():
    ev = _eval_module()
    dump = [_val_row(1, "Calculate 2 * 3.", "6", "2 * 3 = 5", False),  # a trailing '= number': parseable, wrong
            _val_row(0, "Calculate 1 + 2.", "3", "1 + 2 is 3, so \\boxed{3}.", True),
            _val_row(2, "Calculate 9 - 4.", "5", "The result is 5", False, truncated=True)]  # no final answer
    rows = ev.prompt_rows(dump, ["Calculate 1 + 2.", "Calculate 2 * 3.", "Calculate 9 - 4."])
    assert rows == [
        {"id": 0, "question": "Calculate 1 + 2.", "gold": "3", "response": "1 + 2 is 3, so \\boxed{3}.", "answer": "3",
         "parseable": True, "correct": True, "truncated": False},
        {"id": 1, "question": "Calculate 2 * 3.", "gold": "6", "response": "2 * 3 = 5", "answer": "5",
         "parseable": True, "correct": False, "truncated": False},
        {"id": 2, "question": "Calculate 9 - 4.", "gold": "5", "response": "The result is 5", "answer": None,
         "parseable": False, "correct": False, "truncated": True}]
    with pytest.raises(ev.SplitError, match="not the held-out split"):
        ev.prompt_rows(dump, ["Calculate 1 + 2.", "Calculate 2 * 3.", "Calculate 9 - 5."])
    with pytest.raises(ValueError, match="scored correct but has no final answer"):
        ev.prompt_rows([_val_row(0, "Q", "5", "five", True)], ["Q"])


def test_the_three_accuracy_columns_paired_tests_and_holm_by_hand():
    ev = _eval_module()
    rng = np.random.default_rng(0)
    correct = np.array([[1, 0, 1, 0], [1, 1, 0, 0]], dtype=float)  # 2 seeds x 4 prompts
    parseable = np.array([[1, 1, 1, 0], [1, 1, 0, 1]], dtype=float)
    s = ev.arm_stats(correct, parseable, rng)
    assert (s["accuracy"], s["parseable"], s["accuracy_parseable"]) == (4 / 8, 6 / 8, pytest.approx(4 / 6))
    assert s["accuracy_by_seed"] == [0.5, 0.5] and (s["seeds"], s["prompts"]) == (2, 4)
    for k in ("accuracy", "parseable", "accuracy_parseable"):
        assert s[f"{k}_ci"][0] <= s[k] <= s[f"{k}_ci"][1]
    const = ev.arm_stats(np.ones((1, 5)), np.ones((1, 5)), rng)  # no variation: degenerate intervals
    assert const["accuracy_ci"] == [1.0, 1.0] and const["accuracy_parseable_ci"] == [1.0, 1.0]

    base = (np.array([[1, 0, 0, 0]], dtype=float), np.array([[1, 0, 0, 0]], dtype=float))
    v = ev.versus((correct, parseable), base, rng)
    # accuracy: seed-averaged [1, .5, .5, 0] - [1, 0, 0, 0] = [0, .5, .5, 0]; in halves [0, 1, 1, 0]: of the 4
    # sign assignments of the two nonzero ones, sums 2, 0, 0, -2; |sum| >= 2 in 2 of them
    assert v["accuracy"]["diff"] == 0.25 and v["accuracy"]["p"] == 0.5
    # parseable: [1, 1, .5, .5] - [1, 0, 0, 0] = [0, 1, .5, .5], in halves [0, 2, 1, 1]: of 8 assignments
    # only +2+1+1 and -2-1-1 reach |sum| >= 4
    assert v["parseable"]["diff"] == 0.5 and v["parseable"]["p"] == 2 / 8
    assert v["accuracy_parseable"]["diff"] == pytest.approx(4 / 6 - 1)
    # one seed: the sign-flip test is McNemar's exact test
    a, b = np.array([1] * 7 + [0] * 3 + [1] * 4), np.array([0] * 7 + [1] * 3 + [1] * 4)
    assert ev.paired_exact_p(a - b, 1) == ev.mcnemar_exact_p(a, b) == pytest.approx(2 * (1 + 10 + 45 + 120) / 1024)
    assert ev.paired_exact_p(np.array([1 / 3, 2 / 3, -1 / 3]), 3) == 6 / 8  # sums of +-1 +-2 +-1 with |.| >= 2

    # Holm: sorted 0.01, 0.03, 0.04, 0.2 times 4, 3, 2, 1 = 0.04, 0.09, 0.08 -> 0.09 (monotone), 0.2
    assert ev.holm([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.09, 0.09, 0.2])
    assert ev.holm([0.5, 0.25]) == [0.5, 0.5] and ev.holm([0.6, 0.9]) == [1.0, 1.0]


def test_a_finished_run_is_never_rerun_and_the_table_resumes(tmp_path, monkeypatch, capsys):
    """main() with the training replaced by hand-written validation dumps: an interruption keeps what
    finished, a rerun runs only what did not (even with a finished run's folder gone), more seeds add runs."""
    cm, ev = _tool(), _eval_module()
    runs, results = tmp_path / "runs", tmp_path / "results"
    questions, golds = ["Calculate 1 + 2.", "Calculate 2 * 3.", "Calculate 9 - 4."], ["3", "6", "5"]
    split = {"seed": 7, "kept": 3, "drawn": 4, "duplicates": 1, "excluded": {"training": 0, "tuning": 0}}
    operands = {"drawn_by": "by their operands", "training_fingerprint": "pool", "question_overlap": 0,
                "substep_overlap": 1, "excluded_ids": [1], "mix": {"training pool": {"sum": 2}, "held-out": {"sum": 3}}}
    splits = {"config": "compare_multiply_smollm2_cpu", "fingerprint": ev.fingerprint(questions),
              "training_questions": 10, "training_distinct": 9, "operands": operands,
              "heldout": {"file": tmp_path / "heldout.jsonl", "questions": questions, **split},
              "tuning": {"file": tmp_path / "tuning.jsonl", "questions": ["Q"], **split}}
    monkeypatch.setattr(cm, "prepare_splits", lambda *args: splits)
    responses = {"base": ["\\boxed{3}", "no idea", "= 2"], "grpo": ["\\boxed{3}", "\\boxed{6}", "\\boxed{4}"],
                 "sft": ["\\boxed{3}", "\\boxed{5}", "\\boxed{5}"]}
    calls, interrupt = [], {"grpo seed 0"}

    def fake_run(name, args, folder, steps):
        calls.append(name)
        assert args[1:3] == ["--config-name", "compare_multiply_smollm2_cpu"]  # --config reaches every arm
        if name in interrupt:
            raise SystemExit(f"[{name}] failed")
        dumps = [(steps, responses[name.split()[0]])]
        if "trainer.val_before_train=true" in args:
            dumps.append((0, responses["base"]))
        (folder / "rollouts").mkdir(parents=True, exist_ok=True)
        for step, texts in dumps:
            (folder / "rollouts" / f"val_step_{step:08d}.jsonl").write_text("".join(
                json.dumps(_val_row(i, q, g, r, ev.final_answer(r) == g)) + "\n"
                for i, (q, g, r) in enumerate(zip(questions, golds, texts, strict=True))))
        return 60.0

    monkeypatch.setattr(cm, "run_arm", fake_run)
    # forced-format decoding by a stub engine: every arm's weights box the gold answer but base's box 0
    forced_calls = []

    def fake_forced(config, overrides):
        def forced(arm, dump):
            forced_calls.append((arm, dump.name))
            return [("0" if arm == "base" else g) + "}." for g in golds]
        return forced

    monkeypatch.setattr(cm, "forced_by", fake_forced)

    def main(*args):
        monkeypatch.setattr(sys, "argv", ["compare_methods.py", "--steps", "2", "--rerank-prompts", "0", "--runs",
                                          str(runs), "--results", str(results), "--arms", "grpo,sft",
                                          "--config", "compare_multiply_smollm2_cpu", *args])
        cm.main()

    with pytest.raises(SystemExit, match="grpo seed 0"):
        main("--seeds", "1")
    assert calls == ["sft seed 0", "grpo seed 0"]  # the order: SFT first
    state = json.loads((results / "compare_methods.json").read_text())
    assert sorted(state["runs"]) == ["sft/seed0"]  # written as SFT finished
    assert [json.loads(x)["correct"] for x in (results / "compare_methods_prompts" / "sft_seed0.jsonl")
            .read_text().splitlines()] == [True, False, True]

    interrupt.clear()
    calls.clear()
    shutil.rmtree(runs / "sft")  # results kept, run folder gone: still finished
    main("--seeds", "1")
    assert calls == ["grpo seed 0"]
    assert sorted(json.loads((results / "compare_methods.json").read_text())["runs"]) == [
        "base/seed0", "grpo/seed0", "sft/seed0"]
    calls.clear()
    main("--seeds", "1")
    assert calls == []
    main("--seeds", "2")
    assert calls == ["sft seed 1", "grpo seed 1"]
    table = json.loads((results / "compare_methods.json").read_text())["arms"]
    assert list(table) == ["base", "sft", "grpo"]
    # over every prompt; the measures over prompts 0 and 2 (prompt 1 is a training demonstration's sub-step)
    assert table["base"]["all_prompts"] == {"strict": 1 / 3, "last_number": 1 / 3}
    m = table["base"]["measures"]
    assert (m["strict"]["value"], m["parseable"]["value"], m["last_number"]["value"], m["forced"]["value"]) == (
        0.5, 1.0, 0.5, 0.0)  # base: "\\boxed{3}" right, "= 2" wrong; forced: boxes 0
    m = table["grpo"]["measures"]
    assert table["grpo"]["seeds"] == 2 and table["grpo"]["prompts"] == 2
    assert (m["strict"]["value"], m["parseable"]["value"], m["forced"]["value"]) == (0.5, 1.0, 1.0)
    assert m["strict"]["by_seed"] == [0.5, 0.5]
    assert table["sft"]["vs_base"]["strict"]["diff"] == pytest.approx(0.5)
    assert table["sft"]["vs_base"]["forced"]["diff"] == pytest.approx(1.0)
    assert ("base", "val_step_00000000.jsonl") in forced_calls and ("grpo", "val_step_00000002.jsonl") in forced_calls
    rows = [json.loads(x) for x in (results / "compare_methods_prompts" / "sft_seed1.jsonl").read_text().splitlines()]
    assert [r["forced_answer"] for r in rows] == golds
    md = (results / "compare_methods.md").read_text()
    assert "| grpo | 2 |" in md and "Task: `configs/compare_multiply_smollm2_cpu.yaml`" in md
    assert "0 held-out questions are training questions by their operands and 1 more" in md

    # another held-out set: the results are refused, not mixed
    splits["fingerprint"] = "other"
    with pytest.raises(SystemExit, match="another held-out set"):
        main("--seeds", "1")


def test_unknown_arms_are_refused_and_dependencies_come_first(tmp_path):
    cm = _tool()
    state = {"runs": {}}
    with pytest.raises(SystemExit, match="unknown"):
        cm.check_arms(["grpo", "raro_prophet"], {}, state)
    cm.check_arms(["grpo", "raro_fair", "raro_oracle"], {}, state)
    with pytest.raises(SystemExit, match="include sft"):
        cm.check_arms(["grpo", "sft_then_grpo"], {}, state)
    with pytest.raises(SystemExit, match="must include grpo"):
        cm.check_arms(["sft"], {}, state)
    cm.check_arms(["sft"], {}, {"runs": {"base/seed0": {"arm": "base"}}})  # base already in the results
    assert cm.plan(["sft_then_grpo", "raro", "grpo", "sft"], 2, {"raro": 1}) == [
        ("sft", 0), ("grpo", 0), ("sft_then_grpo", 0), ("raro", 0), ("sft", 1), ("grpo", 1), ("sft_then_grpo", 1)]
    cmd = cm.arm_command("sft_then_grpo", 1, tmp_path, 20, 8, tmp_path / "h.jsonl", ["model.path=/m"])
    assert cmd[0] == "train" and "trainer.seed=1" in cmd and "trainer.val_before_train=false" in cmd
    assert cmd[-2:] == [cm.CORRECT_ONLY, f"model.path={tmp_path / 'sft' / 'seed1' / 'hf'}"]  # after the user's


def test_run_arm_skips_a_run_whose_final_validation_exists(tmp_path, monkeypatch):
    cm = _tool()
    folder = tmp_path / "grpo" / "seed0"
    (folder / "rollouts").mkdir(parents=True)
    (folder / "rollouts" / "val_step_00000020.jsonl").write_text("{}\n")
    (folder / "wall_seconds.json").write_text('{"seconds": 90.0}\n')
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a finished run was started again"))
    assert cm.run_arm("grpo seed 0", ["train"], folder, 20) == 90.0


def test_an_arms_interval_does_not_move_when_another_arm_joins_the_table(tmp_path):
    """Each arm's bootstrap is seeded by its name: the table with SFT alone and with base and GRPO beside it
    gives SFT the same intervals (one generator shared in table order would draw other resamples for it)."""
    cm = _tool()
    rng = np.random.default_rng(1)
    runs = {}
    for arm in ("sft", "base", "grpo"):
        rows = [{"id": i, "question": f"Calculate {i} + 1.", "gold": str(i + 1), "correct": bool(c),
                 "parseable": bool(c or p), "response": f"= {i + 1}" if c else "no"}
                for i, (c, p) in enumerate(zip(rng.random(60) < 0.3, rng.random(60) < 0.5, strict=True))]
        (tmp_path / f"{arm}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs[f"{arm}/seed0"] = {"arm": arm, "seed": 0, "file": f"{arm}.jsonl", "wall_seconds": 1.0}

    def state(*names):
        return {"heldout": {}, "runs": {k: runs[k] for k in names}}

    alone = cm.table(tmp_path, state("sft/seed0"))["sft"]
    full = cm.table(tmp_path, state(*runs))
    assert full["sft"]["measures"] == alone["measures"]
    assert full["sft"]["vs_base"] == cm.table(tmp_path, state("base/seed0", "sft/seed0"))["sft"]["vs_base"]


def _measures_module():
    _tool()
    import compare_methods_measures

    return compare_methods_measures


def test_the_four_measures_of_a_run_by_hand():
    ms = _measures_module()
    rows = [{"gold": "12", "correct": True, "parseable": True, "response": "5 + 7 = 12"},
            {"gold": "12", "correct": False, "parseable": False, "response": "It is 12, I think"},  # no format
            {"gold": "-4", "correct": False, "parseable": True, "response": "1 - 5 = 4"},
            {"gold": "-4", "correct": False, "parseable": False, "response": "so 1 - 5 gives -4 in the end"}]
    m = ms.measure_rows(rows)
    assert list(m["strict"]) == [1, 0, 0, 0] and list(m["parseable"]) == [1, 0, 1, 0]
    assert list(m["last_number"]) == [1, 1, 0, 1]  # the right number in words counts; "-4" keeps its sign
    assert "forced" not in m  # no forced_answer: not measured
    forced = ms.forced_rows(rows, ["12}.", " 12 }", "4}", "-4"])  # the box's contents, up to its "}"
    assert [r["forced_answer"] for r in forced] == ["12", "12", "4", "-4"]
    assert list(ms.measure_rows(forced)["forced"]) == [1, 1, 0, 1]
    assert ms.forced_answer("twelve}") is None and ms.forced_answer("1,250} and") == "1,250"


def test_operations_commuted_forms_and_demonstration_sub_steps():
    ms = _measures_module()
    assert ms.operand_keys("57 * 47 = 57 * 40 + 57 * 7 = 2280 + 399 = 2679") == {
        ("*", 47, 57), ("*", 40, 57), ("*", 7, 57), ("+", 399, 2280)}  # not 40 + 57: precedence
    assert ms.operand_keys("88 + 94 = 88 + 90 + 4 = 178 + 4 = 182") == {("+", 88, 94), ("+", 88, 90), ("+", 4, 178)}
    assert ms.operand_keys("1 - 5 = -4") == {("-", 1, 5)}
    assert ms.question_operation("Calculate 47 * 57.") == ms.question_operation("Calculate 57 * 47.") == ("*", 47, 57)
    assert ms.question_operation("Calculate 5 - 1.") != ms.question_operation("Calculate 1 - 5.")
    assert ms.question_operation("Calculate 2 + 3 + 4.") is None  # two operations: no single one
    pool = ms.pool_keys(["Calculate 57 * 47."], ["57 * 47 = 57 * 40 + 57 * 7 = 2280 + 399 = 2679"])
    held = ["Calculate 47 * 57.", "Calculate 7 * 57.", "Calculate 57 * 8.", "Calculate 40 * 57."]
    assert list(ms.disjoint_mask(held, pool)) == [False, False, True, False]
    assert [ms.difficulty(ms.question_operation(q)) for q in held] == [
        "product, both operands 2+ digits", "product, a one-digit operand", "product, a one-digit operand",
        "product, a multiple of ten"]
    assert ms.pool_fingerprint(["Q"], ["a"]) != ms.pool_fingerprint(["Q"], ["b"])


def test_splits_drop_commuted_questions_and_sub_steps_of_the_training_demonstrations():
    cm, ev = _tool(), _eval_module()
    training, solutions = ["Calculate 57 * 47."], ["57 * 47 = 57 * 40 + 57 * 7 = 2280 + 399 = 2679"]
    pool = cm.pool_keys(training, solutions)
    candidates = [_record(q) for q in ("Calculate 47 * 57.", "Calculate 7 * 57.", "Calculate 12 * 13.",
                                       "Calculate 13 * 12.", "Calculate 21 * 22.")]
    split = ev.select_split(candidates, 2, {"training": pool}, cm.split_key)
    assert [ev.question_of(r) for r in split.records] == ["Calculate 12 * 13.", "Calculate 21 * 22."]
    assert split.stats() == {"kept": 2, "drawn": 5, "duplicates": 1, "excluded": {"training": 2}}  # 13*12 repeats
    with pytest.raises(ev.SplitError, match="training and heldout share 1"):
        ev.check_splits(training, cm.split_key, frozenset(pool), heldout=["Calculate 57 * 7."])
    ops = cm.operand_overlap(["Calculate 47 * 57.", "Calculate 57 * 7.", "Calculate 12 * 13."], training, solutions,
                             "by their text")
    assert (ops["question_overlap"], ops["substep_overlap"], ops["excluded_ids"]) == (1, 1, [0, 1])
    assert ops["mix"]["held-out, operand-disjoint"] == {"product, both operands 2+ digits": 1}


def test_the_two_level_bootstrap_has_the_variance_computed_by_hand():
    """The replicates' variance against its closed form (each pair of drawn cells shares a seed, a prompt,
    both or neither), for one arm, one arm of one seed, and a paired difference of two arms."""
    ms = _measures_module()
    rng = np.random.default_rng(0)
    x = (rng.random((3, 40)) < np.linspace(0.1, 0.9, 40)).astype(float) * (rng.random((3, 1)) < 0.8)
    s, p = x.shape
    by_hand = ((p - 1) * x.mean(axis=1).var() + (s - 1) * x.mean(axis=0).var() + x.var()) / (s * p)
    assert ms.two_level_variance(x) == pytest.approx(by_hand)
    (rep,) = ms.two_level([x], np.random.default_rng(1))
    assert rep.mean() == pytest.approx(x.mean(), abs=0.01)
    assert rep.var() == pytest.approx(by_hand, rel=0.06)  # 10,000 replicates: the variance within ~3%
    one = x[:1]
    (rep,) = ms.two_level([one], np.random.default_rng(2))
    assert rep.var() == pytest.approx(one.var() / p, rel=0.06)  # one seed: the prompt bootstrap's p(1-p)/n
    # a - b, seeds drawn apart, prompts together: var(a) + var(b) - 2 cov(prompt means of a, of b) / P
    b = np.roll(x, 1, axis=1)[:2]
    cov = np.mean((x.mean(axis=0) - x.mean()) * (b.mean(axis=0) - b.mean()))
    ra, rb = ms.two_level([x, b], np.random.default_rng(3))
    assert (ra - rb).var() == pytest.approx(ms.two_level_variance(x) + ms.two_level_variance(b) - 2 * cov / p,
                                            rel=0.06)
    # seeds paired: the difference is one arm of per-seed, per-prompt differences
    c = x[::-1]
    ra, rc = ms.two_level([x, c], np.random.default_rng(4), paired_seeds=True)
    assert (ra - rc).var() == pytest.approx(ms.two_level_variance(x - c), rel=0.06)
    d = ms.contrast(x, x, np.random.default_rng(5), paired_seeds=True)
    assert d == {"diff": 0.0, "ci": [0.0, 0.0], "p": 1.0}
    assert ms.bootstrap_p(np.full(100, 0.5)) == 0.01 and ms.bootstrap_p(np.array([-1.0, 1.0, 2.0, 3.0])) == 0.5


def test_forced_format_inputs_and_decoding_with_a_stub_engine():
    """tools/forced_format.py's inputs (the prompt's ids, then the response and the answer prefix) and its
    decoding by an engine stubbed to box the number the response ends with, doubled."""
    spec = importlib.util.spec_from_file_location("forced_format", TOOL.parent / "forced_format.py")
    ff = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ff)
    dump = [{"index": 1, "prompt_token_ids": [7, 8], "response": "2 * 3 = 6  \n"},
            {"index": 0, "prompt_token_ids": [9], "response": "1 + 2 is 3"}]

    def encode(text):
        return [ord(c) for c in text]

    inputs = ff.forced_inputs(dump, encode)
    assert inputs[0] == [9, *encode("1 + 2 is 3\n\nThe final answer is \\boxed{")]
    assert inputs[1][:2] == [7, 8] and "".join(map(chr, inputs[1][2:])) == "2 * 3 = 6" + ff.FORCED_PREFIX

    def generate(prompts):
        texts = ["".join(map(chr, p)) for p in prompts]
        return [f"{2 * int(t.split(ff.FORCED_PREFIX)[0].split()[-1])}}}." for t in texts]

    continuations = ff.decode(generate, inputs)
    assert continuations == ["6}.", "12}."]
    ms = _measures_module()
    rows = [{"gold": "3", "correct": False, "parseable": False, "response": "1 + 2 is 3"},
            {"gold": "6", "correct": True, "parseable": True, "response": "2 * 3 = 6"}]
    assert list(ms.measure_rows(ms.forced_rows(rows, continuations))["forced"]) == [0, 0]


def test_the_scoring_tools_start_a_complete_engine_of_the_run_settings(tiny_qwen2, monkeypatch):
    """tools/forced_format.py and tools/critic_discrimination.py start their vLLM engine from the settings a
    run's engine has (every field of ``EngineSettings``: a field the tools left out made both fail before any
    engine started): one rank, the given context, the schema's model runner; the critic also the run's
    ``rollout`` settings. The engine is stubbed: what it is given is the test."""
    from megareason.config.load import load_config
    from megareason.config.schema import RolloutConfig
    from megareason.rollout import engine as engine_module

    started = []

    class Engine:
        def __init__(self, settings):
            started.append(settings)
            self.tokenizer = None

    monkeypatch.setattr(engine_module, "VLLMEngine", Engine)
    _load("forced_format").vllm_generate(str(tiny_qwen2), 384)
    cfg = load_config("compare_smollm2_cpu", ["rollout.seed=5"])
    _load("critic_discrimination").vllm_critic(str(tiny_qwen2), cfg)
    ff, critic = started
    assert (ff.model_path, ff.max_model_len, ff.tensor_parallel_size) == (str(tiny_qwen2), 384, 1)
    assert ff.model_runner == RolloutConfig().model_runner and ff.dtype == RolloutConfig().dtype
    assert (critic.model_path, critic.max_model_len, critic.seed) == (str(tiny_qwen2), cfg.rollout.max_model_len, 5)
    assert critic.model_runner == cfg.rollout.model_runner and critic.tensor_parallel_size == 1


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOL.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_rate_matched_random_reward_pays_at_its_rate_whatever_the_answer():
    rewards = _load("controlled_rewards")
    right = [rewards.random_matched("basic_arithmetic", f"{i} + 1 = {i + 1}", str(i + 1),
                                    {"random_rate": 0.3, "random_seed": 1}) for i in range(4000)]
    wrong = [rewards.random_matched("basic_arithmetic", f"{i} + 1 = {i}", str(i + 1),
                                    {"random_rate": 0.3, "random_seed": 1}) for i in range(4000)]
    assert all(r["acc"] for r in right) and not any(r["acc"] for r in wrong)  # acc: the real correctness
    for rows in (right, wrong):  # paid at the rate (binomial sd 0.007), right or wrong alike
        assert np.mean([r["score"] for r in rows]) == pytest.approx(0.3, abs=0.025)
    again = rewards.random_matched("basic_arithmetic", "1 + 1 = 2", "2", {"random_rate": 0.3, "random_seed": 1})
    assert again == right[1]  # the same response, question and seed: the same draw (a resumed run agrees)
    seeds = [rewards.random_matched("basic_arithmetic", "1 + 1 = 2", "2", {"random_rate": 0.5, "random_seed": s})
             ["score"] for s in range(40)]
    assert 0 < sum(seeds) < 40  # another seed, another draw
    with pytest.raises(ValueError, match="random_rate"):
        rewards.random_matched("basic_arithmetic", "2", "2", {})


def test_the_controlled_experiment_runs_each_arm_from_the_start_and_contrasts_them_paired(tmp_path, monkeypatch):
    """main() with training replaced by hand-written validation dumps: the start (and base) first, every arm
    from the start's weights, the random arm at its matched run's rate, and the contrasts in the table."""
    ev = _eval_module()
    ce = _load("controlled_experiment")
    cm = ce.cm  # the module it runs through (patched below: no run starts)
    runs, results = tmp_path / "runs", tmp_path / "results"
    questions, golds = ["Calculate 10 + 20.", "Calculate 11 + 22.", "Calculate 12 + 23."], ["30", "33", "35"]
    split = {"seed": 7, "kept": 3, "drawn": 3, "duplicates": 0, "excluded": {"training": 0, "tuning": 0}}
    operands = {"drawn_by": "by their operands", "training_fingerprint": "pool", "question_overlap": 0,
                "substep_overlap": 0, "excluded_ids": [], "mix": {"training pool": {"sum": 9}, "held-out": {"sum": 3}}}
    splits = {"config": ce.CONFIG, "fingerprint": ev.fingerprint(questions), "training_questions": 9,
              "training_distinct": 9, "operands": operands,
              "heldout": {"file": tmp_path / "heldout.jsonl", "questions": questions, **split},
              "tuning": {"file": tmp_path / "tuning.jsonl", "questions": ["Q"], **split}}
    monkeypatch.setattr(cm, "prepare_splits", lambda *args: splits)
    monkeypatch.setattr(cm, "hf_export", lambda folder, steps: folder / "hf")
    monkeypatch.setattr(cm, "forced_by", lambda config, overrides: lambda arm, dump: ["0}"] * 3)
    answers = {"base": ["30", "x", "x"], "start": ["30", "0", "0"], "grpo_correct": ["30", "33", "35"],
               "grpo_format": ["30", "0", "0"], "grpo_random": ["30", "33", "0"], "sft_more": ["30", "0", "35"]}
    commands = {}

    def fake_run(name, args, folder, steps):
        arm = name.split()[0]
        commands[name] = args
        dumps = [(steps, answers[arm])] + ([(0, answers["base"])] if "trainer.val_before_train=true" in args else [])
        (folder / "rollouts").mkdir(parents=True, exist_ok=True)
        for step, texts in dumps:
            (folder / "rollouts" / f"val_step_{step:08d}.jsonl").write_text("".join(
                json.dumps(_val_row(i, q, g, f"so = {t}", t == g)) + "\n"
                for i, (q, g, t) in enumerate(zip(questions, golds, texts, strict=True))))
        if arm == "grpo_correct":  # its training accuracy, which the random arm is matched to
            (folder / "metrics.jsonl").write_text('{"step": 0, "val/accuracy": 0.1}\n{"step": 1, "accuracy": 0.25}\n'
                                                  '{"step": 2, "accuracy": 0.5}\n')
        return 60.0

    monkeypatch.setattr(cm, "run_arm", fake_run)
    monkeypatch.setattr(sys, "argv", ["controlled_experiment.py", "--seeds", "2", "--steps", "2", "--start-steps",
                                      "3", "--runs", str(runs), "--results", str(results)])
    ce.main()
    assert list(commands) == ["start", *(f"{arm} seed {s}" for s in (0, 1) for arm in ce.ARMS)]
    assert commands["start"][0] == "sft" and "trainer.steps=3" in commands["start"]
    start_hf = f"model.path={runs / 'start' / 'seed0' / 'hf'}"
    for name, cmd in commands.items():
        assert name == "start" or cmd[-1] == start_hf
    assert "++data.sources.0.extra_info.reward_type=boxed" in commands["grpo_format seed 1"]
    assert commands["sft_more seed 0"][0] == "sft"
    random = commands["grpo_random seed 1"]
    assert ce.RANDOM_REWARD in random and "++data.sources.0.extra_info.random_rate=0.375000" in random
    assert "++data.sources.0.extra_info.random_seed=1" in random
    table = json.loads((results / "compare_methods.json").read_text())["arms"]
    assert list(table)[:3] == ["base", "start", "grpo_correct"]
    v = table["grpo_correct"]["vs_grpo_format"]["last_number"]
    # per prompt 1 - [1, 0, 0] in both seeds: three prompts drawn, all three the first (0) in 1/27 > 2.5% of draws
    assert v["diff"] == pytest.approx(2 / 3) and v["ci"] == [0.0, 1.0]
    assert table["grpo_correct"]["vs_sft_more"]["strict"]["diff"] == pytest.approx(1 / 3)
    assert table["start"]["vs_base"]["parseable"]["diff"] == pytest.approx(2 / 3)
    md = (results / "compare_methods.md").read_text()
    assert "- grpo_correct − grpo_random, by seed: last-number: +0.333, +0.333; forced: +0.000, +0.000." in md
    calls = len(commands)
    ce.main()  # everything finished: nothing runs again
    assert len(commands) == calls


def test_critic_discrimination_of_a_position_bias_and_of_a_critic_that_checks_the_answer():
    """tools/critic_discrimination.py with stub critics: one that always says A (a coin flip's 0.5 over
    both orders, never testable) and one that names the answer boxing the gold number (1.0 on the pairs
    whose policy answer is wrong)."""
    from megareason.config.load import load_config

    cd = _load("critic_discrimination")
    cfg = load_config("compare_multiply_smollm2_cpu", [])
    rows = [{"id": 0, "question": "Calculate 57 * 47.", "gold": "2679", "response": "57 * 47 = 2000", "correct": False},
            {"id": 1, "question": "Calculate 12 * 3.", "gold": "36", "response": "12 * 3 = 36", "correct": True}]
    ps = cd.pairs(rows, cfg.raro.expert_template)
    assert ps[0]["expert"] == ("57 * 47 = 57 * 40 + 57 * 7 = 2280 + 399 = 2679\n\nThe final answer is "
                               "\\boxed{2679}.")
    judged = cd.judgements(ps, "judge")
    assert [(p["id"], first) for p, first, _ in judged] == [(0, True), (0, False), (1, True), (1, False)]
    assert "Answer A:\n57 * 47 = 57 * 40" in judged[0][2][1]["content"]
    assert "Answer B:\n57 * 47 = 57 * 40" in judged[1][2][1]["content"]

    always_a = cd.measure(rows, cfg, lambda chats: ["Verdict: A"] * len(chats))
    assert always_a == {"judgements": 4, "names_expert": 0.5, "wrong_pairs": 1, "names_expert_wrong": 0.5,
                        "tie": 0.0, "no_verdict": 0.0, "testable": False}

    def checks(chats):
        out = []
        for chat in chats:
            text = chat[1]["content"]
            a = text.split("Answer A:\n")[1].split("Answer B:")[0]
            out.append("Verdict: A" if "\\boxed{" in a else "Verdict: B")
        return out

    checker = cd.measure(rows, cfg, checks)
    assert checker["names_expert_wrong"] == 1.0 and checker["testable"] and checker["names_expert"] == 1.0
    assert cd.measure(rows, cfg, lambda chats: ["Verdict: Tie", "I cannot"] * 2)["tie"] == 0.5


def test_the_random_arms_overrides_route_its_rows_to_the_random_reward(monkeypatch):
    """The random arm's command-line overrides, loaded as the trainer loads them: the configured scorer pays
    basic_arithmetic rows by tools/controlled_rewards.py at the row's rate, and still reports correctness."""
    from megareason.config.load import load_config
    from megareason.rewards.scoring import scorer_from

    ce = _load("controlled_experiment")
    monkeypatch.chdir(TOOL.parent.parent)  # the tool runs megareason from the repository root
    for rate, paid in ((1.0, 1.0), (0.0, 0.0)):
        cfg = load_config(ce.CONFIG, [ce.RANDOM_REWARD, f"++data.sources.0.extra_info.random_rate={rate}",
                                      "++data.sources.0.extra_info.random_seed=3"])
        out = scorer_from(cfg.reward)("basic_arithmetic", "12 + 30 = 42", "42", dict(cfg.data.sources[0].extra_info))
        assert (out.score, out.correct) == (paid, True)
