"""The controlled experiment: does the correctness reward teach the model to compute, or only the answer's
format? Every arm starts from one common SFT model (so every arm writes a parseable answer from its first
step) and trains ``--steps`` more steps of ``--prompts`` prompts from it, once per seed (``trainer.seed``
0..``--seeds``-1; seed i of every arm trains on the same prompts in the same order):

* ``grpo_correct``: GRPO, the arithmetic reward's correctness alone (1 for a correct final answer);
* ``grpo_format``: GRPO, a format-only reward (1 for a final answer the reward can read, right or wrong:
  the arithmetic reward's ``reward_type=boxed``);
* ``grpo_random``: GRPO, a random reward matched in rate (``tools/controlled_rewards.py``): 1 with the
  probability that ``grpo_correct``'s run of the same seed paid a training sample (its mean ``accuracy``
  over its steps), independent of the answer;
* ``sft_more``: SFT on the demonstrations for the same number of further steps.

Each arm's run is scored on the held-out questions by the four measures of
``tools/compare_methods_measures.py`` (strict, parseable, last-number and forced-format accuracy) over the
held-out questions that are operand-disjoint from the training pool (drawn so by ``compare_methods``'s
splits: no training question and no demonstration sub-step, commuted forms included). The claim under test:
``grpo_correct`` above each control on last-number and forced-format accuracy, the paired seed-and-prompt
interval of the contrast excluding 0. The table lists each contrast whatever it shows, and each seed's
paired difference.

    .venv/bin/python tools/controlled_experiment.py --runs outputs/controlled \\
      --results docs/results/compare_methods_controlled          # 4 arms x 5 seeds, ~10 min a run on 2 cores

**Resumable** as ``tools/compare_methods.py`` is: the start first, then seed after seed, the arms in the order
above (``grpo_correct`` before the random arm matched to it); a run that finished (its per-prompt rows under
``--results``) is never rerun, an interrupted one resumes from its checkpoint. Results computed on another
held-out set or training pool are refused.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_methods as cm  # noqa: E402
from compare_methods_measures import measure_rows, signed  # noqa: E402

from megareason.config.load import load_config  # noqa: E402

CONFIG = "compare_addition_smollm2_cpu"
START = "start"
CORRECT = "grpo_correct"
RANDOM_REWARD = "reward.by_source={basic_arithmetic:'tools/controlled_rewards.py:random_matched'}"
ARMS = {
    CORRECT: ("train", ("++data.sources.0.extra_info.reward_type=correct",)),
    "grpo_format": ("train", ("++data.sources.0.extra_info.reward_type=boxed",)),
    "grpo_random": ("train", (RANDOM_REWARD,)),
    "sft_more": ("sft", ()),
}
CONTROLS = ("grpo_format", "grpo_random", "sft_more")


def base_command(command: str, config: str, steps: int, prompts: int, val_file: Path, seed: int,
                 extra: list[str], folder: Path, validate_first: bool) -> list[str]:
    return [command, "--config-name", config, f"trainer.steps={steps}", f"trainer.prompts_per_step={prompts}",
            cm.val_override(val_file), f"trainer.seed={seed}", *extra, f"trainer.output_dir={folder}",
            f"trainer.val_before_train={'true' if validate_first else 'false'}"]


def start_command(runs: Path, steps: int, prompts: int, val_file: Path, extra: list[str], config: str) -> list[str]:
    """The common start: SFT from the configured model, validating before training too (base's score)."""
    return base_command("sft", config, steps, prompts, val_file, 0, extra, cm.run_folder(runs, START, 0), True)


def arm_command(name: str, seed: int, runs: Path, steps: int, prompts: int, val_file: Path, extra: list[str],
                config: str, rate: float | None = None) -> list[str]:
    """One arm's run from the common start (its final weights, exported to HF); ``rate``: the random arm's
    reward rate."""
    command, overrides = ARMS[name]
    cmd = [*base_command(command, config, steps, prompts, val_file, seed, extra, cm.run_folder(runs, name, seed),
                         False), *overrides]
    if name == "grpo_random":
        if rate is None:
            raise ValueError("the random arm needs the rate of its matched correctness run")
        cmd += [f"++data.sources.0.extra_info.random_rate={rate:.6f}",
                f"++data.sources.0.extra_info.random_seed={seed}"]
    return [*cmd, f"model.path={cm.run_folder(runs, START, 0) / 'hf'}"]


def matched_rate(folder: Path) -> float:
    """The share of training samples a run's reward paid: the mean of its per-step ``accuracy`` (with the
    correctness reward, the share of samples rewarded 1)."""
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    values = [r["accuracy"] for r in rows if "accuracy" in r]
    if not values:
        raise SystemExit(f"{folder / 'metrics.jsonl'}: no training accuracy to match the random reward to")
    return float(np.mean(values))


def plan(seeds: int) -> list[tuple[str, int]]:
    return [(arm, seed) for seed in range(seeds) for arm in ARMS]


def pairs() -> list[tuple[str, str]]:
    """The contrasts: correctness-GRPO against each control (seeds paired), every arm against the start, the
    start against base."""
    return [(CORRECT, c) for c in CONTROLS] + [(arm, START) for arm in ARMS] + [(START, "base")]


def seed_contrasts(results: Path, state: dict) -> list[str]:
    """Each seed's paired difference, correctness-GRPO minus each control, of the mean per-prompt
    last-number and forced-format accuracy over the operand-disjoint prompts."""
    excluded = set(state["heldout"]["operands"]["excluded_ids"])
    lines = []
    for control in CONTROLS:
        diffs = {m: [] for m in ("last_number", "forced")}
        for seed in sorted(e["seed"] for e in state["runs"].values() if e["arm"] == CORRECT):
            a, b = (state["runs"].get(f"{arm}/seed{seed}") for arm in (CORRECT, control))
            if a is None or b is None:
                continue
            ma, mb = (measure_rows([r for r in cm.read_jsonl(results / e["file"]) if r["id"] not in excluded])
                      for e in (a, b))
            for m in diffs:
                if m in ma and m in mb:
                    diffs[m].append(float(ma[m].mean() - mb[m].mean()))
        text = "; ".join(f"{m.replace('_', '-')}: " + ", ".join(f"{d:+.3f}" for d in v) for m, v in diffs.items() if v)
        if text:
            lines.append(f"- {CORRECT} − {control}, by seed: {text}.")
    return lines


def publish(results: Path, state: dict, budget: str, show: bool = False) -> None:
    arms = cm.table(results, state, paired_seeds=True, pairs=pairs(), order=("base", START, *ARMS))
    curves, _ = cm.curves_of(state, arms)
    state.update({"arms": arms, "held_out_curves": curves})
    cm._write(results / "compare_methods.json", json.dumps(state, indent=2) + "\n")
    start = arms.get(START, {}).get("measures", {}).get("parseable", {}).get("value")
    lines = ["# Controlled experiment: correctness reward against format-only, random and further SFT", "",
             f"Every arm starts from one SFT model (`{START}`: parseable rate "
             f"{'—' if start is None else f'{start:.3f}'} on the operand-disjoint held-out questions; the "
             "design asks at least 0.98) and trains the same steps on the same prompts; seed i of every arm "
             "trains on the same prompts in the same order, so contrasts between arms draw their seeds "
             "together (paired) in the bootstrap.", ""]
    lines += cm.table_lines(arms, state["heldout"])
    lines += ["", "Seed-level paired contrasts (the decision: correctness-GRPO above every control on last-number "
              "and forced-format accuracy, each interval above 0):", "", *seed_contrasts(results, state)]
    for control in CONTROLS:
        v = arms.get(CORRECT, {}).get(f"vs_{control}", {})
        for m in ("last_number", "forced"):
            if m in v:
                lines.append(f"- {CORRECT} − {control}, {m.replace('_', '-')} accuracy: "
                             f"{signed(v[m]['diff'], v[m]['ci'])} (Holm p {v[m]['p_holm']:.2g}).")
    lines += ["", f"Budget per run: {budget}. Per-prompt rows: `{cm.PROMPTS_DIR}/ARM_seedS.jsonl`.", "",
              "Commands (from the repository root; the held-out file is written by the tool):", ""]
    lines += [f"    .venv/bin/megareason {shlex.join(e['command'])}" for e in state["runs"].values() if e["command"]]
    cm._write(results / "compare_methods.md", "\n".join(lines) + "\n")
    if show:
        print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--start-steps", type=int, default=40, help="SFT steps of the common start")
    ap.add_argument("--steps", type=int, default=20, help="steps of every arm from the start")
    ap.add_argument("--prompts", type=int, default=8, help="training prompts per step (every arm)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--heldout", type=int, default=500)
    ap.add_argument("--heldout-seed", type=int, default=cm.HELDOUT_SEED)
    ap.add_argument("--tune-prompts", type=int, default=100)
    ap.add_argument("--tune-seed", type=int, default=cm.TUNE_SEED)
    ap.add_argument("--runs", type=Path, default=cm.ROOT / "outputs" / "controlled")
    ap.add_argument("--results", type=Path, default=cm.ROOT / "docs" / "results" / "compare_methods_controlled")
    ap.add_argument("--no-forced-format", action="store_true", help="skip forced-format decoding")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every run (e.g. model.path=...)")
    a = ap.parse_args()
    if a.seeds < 1 or a.heldout < 2:
        ap.error("--seeds must be >= 1 and --heldout >= 2")
    try:
        splits = cm.prepare_splits(a.runs / "data", a.heldout, a.tune_prompts, a.heldout_seed, a.tune_seed,
                                   a.overrides, a.config)
    except cm.SplitError as e:
        sys.exit(f"error: {e}")
    a.results.mkdir(parents=True, exist_ok=True)
    state = cm.load_state(a.results, splits)
    held = splits["heldout"]
    forced = None if a.no_forced_format else cm.forced_by(a.config, a.overrides)
    n = load_config(a.config, a.overrides).rollout.n
    budget = (f"start: {a.start_steps} SFT steps x {a.prompts} demonstrations; each arm {a.steps} steps x "
              f"{a.prompts} training prompts (GRPO: {n} samples each; SFT: one demonstration each); held-out: "
              f"{a.heldout} prompts, greedy")
    folder = cm.run_folder(a.runs, START, 0)
    if not cm.finished(a.results, state, START, 0):
        cmd = start_command(a.runs, a.start_steps, a.prompts, held["file"], a.overrides, a.config)
        wall = cm.run_arm(START, cmd, folder, a.start_steps)
        cm.record_run(a.results, state, START, 0, folder, a.start_steps, wall, cmd, held["questions"], forced)
        publish(a.results, state, budget)
    cm.hf_export(folder, a.start_steps)
    for name, seed in plan(a.seeds):
        if cm.finished(a.results, state, name, seed):
            print(f"[{name} seed {seed}] finished earlier", flush=True)
            continue
        rate = matched_rate(cm.run_folder(a.runs, CORRECT, seed)) if name == "grpo_random" else None
        cmd = arm_command(name, seed, a.runs, a.steps, a.prompts, held["file"], a.overrides, a.config, rate)
        wall = cm.run_arm(f"{name} seed {seed}", cmd, cm.run_folder(a.runs, name, seed), a.steps)
        cm.record_run(a.results, state, name, seed, cm.run_folder(a.runs, name, seed), a.steps, wall, cmd,
                      held["questions"], forced)
        publish(a.results, state, budget)
    publish(a.results, state, budget, show=True)


if __name__ == "__main__":
    main()
