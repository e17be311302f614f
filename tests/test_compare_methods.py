"""tools/compare_methods.py: its statistics against hand-computed values, and the recipe's first
steps on the tiny model (the GRPO and RARO arms exactly as the tool runs them, compared to golden curves;
the SmolLM2 comparison itself is a long experiment, not a test: docs/results/compare_methods.md)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from golden_curves import check_golden
from test_plots import error_bars, wilson_by_hand
from test_train_e2e import _env, _metrics

TOOL = Path(__file__).resolve().parent.parent / "tools" / "compare_methods.py"


def _tool():
    spec = importlib.util.spec_from_file_location("compare_methods", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mcnemar_exact_p_by_hand():
    cm = _tool()
    a = np.array([1] * 8 + [0] * 2 + [1] * 5 + [0] * 5)  # 8 prompts only a solves, 2 only b, 10 concordant
    b = np.array([0] * 8 + [1] * 2 + [1] * 5 + [0] * 5)
    # two-sided binomial(10, 1/2) test of 2 vs 8: 2 * (C(10,0) + C(10,1) + C(10,2)) / 2^10
    assert cm.mcnemar_exact_p(a, b) == pytest.approx(2 * (1 + 10 + 45) / 1024)
    assert cm.mcnemar_exact_p(a, a) == 1.0
    assert cm.mcnemar_exact_p(np.ones(5), np.zeros(5)) == pytest.approx(2 / 32)


def test_bootstrap_intervals_match_the_normal_approximation():
    cm = _tool()
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
    assert d["mcnemar_p"] == pytest.approx(2 / 2**40)


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
                           "--rerank-prompts", "2", "--arms", "grpo,raro", "--runs", str(runs),
                           "--results", str(results), *tiny], capture_output=True, text=True, timeout=900, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_golden("compare_grpo", _metrics(runs / "grpo"))
    raro = _metrics(runs / "raro")
    assert all(raro[s]["raro/critic_fresh"] > 0 and raro[s]["raro/format_error_rate"] == 0 for s in (1, 2))
    check_golden("compare_raro", raro)

    table = json.loads((results / "compare_methods.json").read_text())
    for arm, dump in (("base", runs / "grpo" / "rollouts" / "val_step_00000000.jsonl"),
                      ("raro", runs / "raro" / "rollouts" / "val_step_00000002.jsonl")):
        rows = [json.loads(line) for line in dump.read_text().splitlines()]
        assert len(rows) == 6 and table["arms"][arm]["accuracy"] == sum(r["correct"] for r in rows) / 6
    assert table["rerank"]["prompts"] == 2 and table["rerank"]["n"] == 4
    for name in ("compare_methods.md", "compare_methods_heldout.png", "compare_methods_raro_critic.png"):
        assert (results / name).stat().st_size > 0
    assert "| raro |" in (results / "compare_methods.md").read_text()


def test_tuning_runs_score_on_their_own_split_never_the_held_out_one(tmp_path):
    cm = _tool()
    variants = cm.tune_commands(tmp_path, steps=10, prompts=8, val=100, seed=777,
                                variants=["lr=raro:optim.lr=3e-5,raro.tau_pol=0.5", "plain=grpo:"],
                                extra=["model.path=/m"])
    arm, cmd = variants["lr"]
    assert arm == "raro" and cmd[0] == "train" and "algorithm.name=raro" in cmd
    assert cmd[-2:] == ["optim.lr=3e-5", "raro.tau_pol=0.5"]  # the variant's overrides come last: they win
    assert "data.val_sources.0.seed=777" in cmd and "data.val_sources.0.size=100" in cmd
    assert [c for c in cmd if c.startswith("trainer.output_dir=")] == [f"trainer.output_dir={tmp_path / 'lr'}"]
    assert "trainer.val_before_train=true" in cmd  # the base model's score on the split, step 0
    assert variants["plain"][0] == "grpo" and variants["plain"][1][-1] == "trainer.val_before_train=true"
    with pytest.raises(SystemExit, match="expected NAME=ARM"):
        cm.tune_commands(tmp_path, 10, 8, 100, 777, ["x=ppo:optim.lr=1"], [])


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
    assert v == {"says_A": 0.75, "says_B": 0.0, "says_tie": 0.25, "accuracy": pytest.approx(2 / 3),
                 "groups_with_signal": 0.5}
    g = votes.policy_reward_gap(dumps / "step_00000001.jsonl")
    assert g == {"answers": 4, "correct": 2, "reward_gap": 0.75 - 0.25}
    with pytest.raises(SystemExit, match="groups of 3"):
        votes.step_votes(dumps / "step_00000001_critic.jsonl", critic_n=3)
    monkeypatch.setattr(sys, "argv", ["raro_critic_votes.py", str(tmp_path / "run")])
    votes.main()
    out = capsys.readouterr().out
    assert "     1        4        2      +0.500    0.75    0.00      0.25      0.67" in out


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
