"""Base vs SFT vs GRPO (rule verifier) vs RARO (no verifier) vs RARO + critic reranking, on one model, one
task, one set of training prompts with expert demonstrations and one held-out set (the comparison of the RARO
paper, "Escaping the Verifier", at small scale). Every arm is ``configs/compare_smollm2_cpu.yaml`` plus the
overrides below; each trains ``--steps`` steps of ``--prompts`` prompts (GRPO and RARO sample ``rollout.n``
responses per prompt, SFT imitates one demonstration per prompt) and is evaluated greedily on the held-out
prompts every ``trainer.val_every`` steps by the trainer itself (``rollouts/val_step_N.jsonl``).

    .venv/bin/python tools/compare_methods.py                    # SmolLM2-135M, ~1.5 h on 2 cores
    .venv/bin/python tools/compare_methods.py --steps 2 --heldout 20 --runs /tmp/cmp --results /tmp/cmp
      --rerank-prompts 8 model.path=/path/to/tiny                # (one line) a smoke run

Tuning never looks at the held-out prompts: ``--tune NAME=ARM:key=value,...`` (repeatable) trains each
variant on the same training prompts and scores it on a separate validation split (``--tune-seed``,
``--tune-prompts`` prompts of the same task), beside the base model's score on that split; the runs are
listed in ``compare_methods_tuning.md``. Choose settings there, then run the comparison with them.

    .venv/bin/python tools/compare_methods.py --steps 10 --tune raro_lr3e-5=raro:optim.lr=3e-5 \\
      --tune raro_tau=raro:raro.tau_pol=0.5

Interrupted, it picks up where it stopped: a finished arm is not rerun, an unfinished one resumes from its
last checkpoint (the trainer's own resume). Writes, under ``--results``: ``compare_methods.md`` (the table:
accuracy with its 95% bootstrap interval, the paired difference vs base with its interval and McNemar's
exact p, wall time, the command of each arm), ``compare_methods.json``, ``compare_methods_heldout.png``
(held-out accuracy vs step, a panel per arm, with its 95% Wilson score interval over the held-out prompts)
and ``compare_methods_raro_critic.png`` (the critic's accuracy, tie rate and format-error rate per step, a
panel each; when RARO ran).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megareason.plotting import (  # noqa: E402
    accuracy_with_interval,
    caption,
    counts_text,
    integer_steps,
    panel_grid,
    save,
)

CONFIG = "compare_smollm2_cpu"
BOOTSTRAP = 10_000


def arm_commands(runs: Path, steps: int, prompts: int, heldout: int, extra: list[str]) -> dict[str, list[str]]:
    """The megareason command of each training arm (base is GRPO's step-0 validation: the same greedy
    pass over the same prompts with the untouched model)."""
    common = ["--config-name", CONFIG, f"trainer.steps={steps}", f"trainer.prompts_per_step={prompts}",
              f"data.val_sources.0.size={heldout}", *extra]
    return {
        "grpo": ["train", *common, f"trainer.output_dir={runs / 'grpo'}"],
        "sft": ["sft", *common, f"trainer.output_dir={runs / 'sft'}", "trainer.val_before_train=false"],
        "raro": ["train", *common, f"trainer.output_dir={runs / 'raro'}", "trainer.val_before_train=false",
                 "algorithm.name=raro", "algorithm.kl_coef=0.001"],
    }


TUNE_SEED = 777  # the tuning split's reasoning-gym seed (the held-out set's is 20261123, training's 1)


def tune_commands(runs: Path, steps: int, prompts: int, val: int, seed: int, variants: list[str],
                  extra: list[str]) -> dict[str, tuple[str, list[str]]]:
    """{variant: (arm, command)}: ``arm_commands`` with the validation split in place of the held-out set
    (``data.val_sources.0.seed``) and each variant's overrides; ``variants`` are ``NAME=ARM:k=v,k=v``."""
    base = arm_commands(runs, steps, prompts, val, [f"data.val_sources.0.seed={seed}", *extra])
    out = {}
    for spec in variants:
        name, _, rest = spec.partition("=")
        arm, _, overrides = rest.partition(":")
        if not name or arm not in base:
            raise SystemExit(f"--tune {spec!r}: expected NAME=ARM:key=value,... with ARM one of {sorted(base)}")
        cmd = [c for c in base[arm] if not c.startswith("trainer.output_dir=")]
        out[name] = (arm, [*cmd, f"trainer.output_dir={runs / name}", "trainer.val_before_train=true",
                           *[o for o in overrides.split(",") if o]])
    return out


def tune(a) -> None:
    """Run the ``--tune`` variants and list them (module docstring)."""
    runs = a.runs / "tuning"
    variants = tune_commands(runs, a.steps, a.prompts, a.tune_prompts, a.tune_seed, a.tune, a.overrides)
    rng = np.random.default_rng(0)
    lines = [f"Tuning split: {a.tune_prompts} basic_arithmetic prompts, reasoning-gym seed {a.tune_seed} (never the "
             f"held-out set); {a.steps} steps x {a.prompts} training prompts per run; greedy.", "",
             "| run | arm | overrides | base on the split | final accuracy (95% CI) | paired diff vs base (95% CI) "
             "| critic accuracy, first / last 5 steps | wall time |", "|---|---|---|---|---|---|---|---|"]
    for name, (arm, cmd) in variants.items():
        wall = run_arm(name, cmd, runs / name, a.steps)
        curve = held_out(runs / name)
        base, final = curve[0], curve[a.steps]
        lo, hi = bootstrap_mean(final, rng)
        d = paired(final, base, rng)
        critic = "—"
        if arm == "raro":
            acc = [v for _, v in critic_curves(runs / name)["raro/critic_accuracy"]]
            critic = f"{np.mean(acc[:5]):.2f} / {np.mean(acc[-5:]):.2f}"
        overrides = " ".join(cmd[cmd.index("trainer.val_before_train=true") + 1:]) or "(the recipe's)"
        lines.append(f"| {name} | {arm} | `{overrides}` | {base.mean():.3f} | {final.mean():.3f} ({lo:.3f}–{hi:.3f}) "
                     f"| {d['diff']:+.3f} ({d['ci'][0]:+.3f} to {d['ci'][1]:+.3f}) | {critic} | {wall / 60:.0f} min |")
    lines += ["", "Commands (from the repository root):", ""]
    lines += [f"    .venv/bin/megareason {' '.join(c)}".replace(f"{ROOT}/", "") for _, c in variants.values()]
    a.results.mkdir(parents=True, exist_ok=True)
    _write(a.results / "compare_methods_tuning.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def megareason() -> list[str]:
    exe = Path(sys.executable).parent / "megareason"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "megareason.cli"]


def run_arm(name: str, args: list[str], folder: Path, steps: int) -> float:
    """Run (or resume) one arm; its wall time over every attempt, kept in ``folder/wall_seconds.json``."""
    done = folder / "rollouts" / f"val_step_{steps:08d}.jsonl"
    clock = folder / "wall_seconds.json"
    spent = json.loads(clock.read_text())["seconds"] if clock.exists() else 0.0
    if done.exists():
        print(f"[{name}] finished earlier ({spent / 60:.1f} min)", flush=True)
        return spent
    print(f"[{name}] megareason {' '.join(args)}", flush=True)
    start = time.monotonic()
    proc = subprocess.run([*megareason(), *args], cwd=ROOT)
    spent += time.monotonic() - start
    folder.mkdir(parents=True, exist_ok=True)
    _write(clock, json.dumps({"seconds": spent}) + "\n")
    if proc.returncode != 0:
        sys.exit(f"[{name}] failed (exit {proc.returncode}); its log is in {folder / 'logs'}; rerun to resume")
    return spent


def held_out(folder: Path) -> dict[int, np.ndarray]:
    """{step: per-prompt greedy correctness (0/1), in held-out order} from the trainer's validation dumps."""
    out = {}
    for path in sorted((folder / "rollouts").glob("val_step_*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows.sort(key=lambda r: r["index"])
        out[int(path.stem.rsplit("_", 1)[1])] = np.array([float(r["correct"]) for r in rows])
    return out


# The bootstrap and the exact McNemar test in numpy: scipy.stats has both (bootstrap, binomtest) but is not a
# dependency of megareason, for two few-line statistics.
def bootstrap_mean(x: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of ``x`` (resampling prompts)."""
    idx = rng.integers(0, len(x), size=(BOOTSTRAP, len(x)))
    means = x[idx].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def mcnemar_exact_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided exact McNemar test on paired 0/1 outcomes: a binomial(n_discordant, 1/2) test."""
    only_a, only_b = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def paired(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> dict:
    """a - b on the same prompts: the difference of accuracies, its 95% bootstrap interval (prompts
    resampled jointly), and McNemar's exact p."""
    lo, hi = bootstrap_mean(a - b, rng)
    return {"diff": float((a - b).mean()), "ci": [lo, hi], "mcnemar_p": mcnemar_exact_p(a, b)}


def rerank_arm(runs: Path, steps: int, n_prompts: int, n: int, extra: list[str]) -> dict | None:
    """RARO's final policy, ``n`` samples per prompt on the first ``n_prompts`` held-out prompts, the model
    as its own critic picking one (``eval.rerank=critic``): critic@n vs pass@1 of the same samples."""
    if n_prompts <= 0:
        return None
    out = runs / "raro_rerank"
    found = sorted(out.glob("*/summary.json"))
    if not found:
        hf = runs / "raro" / "hf"
        if not (hf / "config.json").exists():
            ckpt = runs / "raro" / "checkpoints" / f"step_{steps:08d}" / "actor"
            subprocess.run([*megareason(), "convert", "megatron-to-hf", str(ckpt), str(hf)], cwd=ROOT, check=True)
        args = ["eval", "--config-name", CONFIG, f"model.path={hf}", "algorithm.name=raro", "eval.rerank=critic",
                f"rollout.n={n}", f"eval.pass_k=[1,{n}]", f"eval.output_dir={out}",
                "data.sources=${data.val_sources}", f"data.val_sources.0.size={n_prompts}",
                *[e for e in extra if not e.startswith("model.path=")]]
        print(f"[raro+rerank] megareason {' '.join(args)}", flush=True)
        start = time.monotonic()
        subprocess.run([*megareason(), *args], cwd=ROOT, check=True)
        found = sorted(out.glob("*/summary.json"))
        summary = json.loads(found[-1].read_text())
        summary["wall_seconds"] = time.monotonic() - start
        _write(found[-1], json.dumps(summary, indent=2) + "\n")
    summary = json.loads(found[-1].read_text())
    s = summary["summaries"][0]
    return {"prompts": s["prompts"], "n": n, "pass@1": s["pass_at"]["1"], f"pass@{n}": s["pass_at"][str(n)],
            "critic@n": s["rerank_accuracy"], "wall_seconds": summary.get("wall_seconds")}


def critic_curves(folder: Path) -> dict[str, list[tuple[int, float]]]:
    keys = ("raro/critic_accuracy", "raro/tie_rate", "raro/format_error_rate")
    curves: dict[str, list[tuple[int, float]]] = {k: [] for k in keys}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        for k in keys:
            if k in m:
                curves[k].append((m["step"], m[k]))
    return curves


def heldout_figure(curves: dict[str, dict[int, float]], prompts: dict[str, dict[int, int]]):
    """Held-out greedy accuracy against the training step, one panel per arm (a shared y axis), with the
    95% Wilson score interval over the step's held-out prompts (``prompts[arm][step]``; a step missing
    there is drawn without one, as the caption says)."""
    fig, axes = panel_grid(list(curves), ncols=4, sharex=True, sharey=True, panel_size=(3.2, 2.8))
    notes, counted, missing = [], [], []
    for ax, (name, curve) in zip(axes, curves.items(), strict=True):
        steps = sorted(curve)
        known = [s for s in steps if s in prompts.get(name, {})]
        missing += [f"{name} step {s}" for s in steps if s not in known]
        if len(known) == len(steps):
            accuracy_with_interval(ax, steps, [curve[s] for s in steps], [prompts[name][s] for s in steps])
        else:
            ax.plot(steps, [curve[s] for s in steps], marker="o", markersize=3)
            if known:
                accuracy_with_interval(ax, known, [curve[s] for s in known], [prompts[name][s] for s in known],
                                       fmt="none")
        counted += [prompts[name][s] for s in known]
        ax.set_ylabel("held-out greedy accuracy", fontsize=8)
        integer_steps(ax, "training step")
    axes[0].set_ylim(0, 1)
    fig.suptitle("Held-out accuracy by training step", fontsize=10)
    if counted:
        notes.append(f"Error bars: 95% Wilson score interval over the held-out prompts ({counts_text(counted)}).")
    if missing:
        notes.append(f"No interval (held-out prompt count unknown): {', '.join(missing)}.")
    caption(fig, notes)
    return fig


CRITIC_TITLES = {"raro/critic_accuracy": "critic accuracy (names the expert)", "raro/tie_rate": "tie rate",
                 "raro/format_error_rate": "format-error rate"}


def critic_figure(critic: dict[str, list[tuple[int, float]]]):
    """RARO's critic per training step, one rate per panel (0 to 1); None when no step has a rate."""
    critic = {k: v for k, v in critic.items() if v}
    if not critic:
        return None
    fig, axes = panel_grid([CRITIC_TITLES.get(k, k) for k in critic], sharex=True, panel_size=(3.4, 2.8))
    for ax, (key, points) in zip(axes, critic.items(), strict=True):
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o" if len(points) < 30 else None,
                markersize=3)
        ax.set(ylim=(0, 1), yticks=[0, 0.25, 0.5, 0.75, 1])  # the grid line at 0.5: a coin flip
        ax.set_ylabel(key, fontsize=8)
        integer_steps(ax, "training step")
    fig.suptitle("RARO critic", fontsize=10)
    caption(fig, ["No interval: rates over each step's training judgements, whose count per rate is not "
                  "in metrics.jsonl."])
    return fig


def report(results: Path, table: dict, curves: dict[str, dict[int, float]], prompts: dict[str, dict[int, int]],
           critic: dict, rerank: dict | None, commands: dict[str, list[str]], budget: str) -> None:
    results.mkdir(parents=True, exist_ok=True)
    _write(results / "compare_methods.json", json.dumps({"arms": table, "held_out_curves": curves,
                                                          "held_out_prompts": prompts, "raro_critic": critic,
                                                          "rerank": rerank}, indent=2) + "\n")
    lines = ["| arm | held-out accuracy (95% CI) | paired diff vs base (95% CI) | McNemar p | wall time |",
             "|---|---|---|---|---|"]
    for name, row in table.items():
        lo, hi = row["ci"]
        vs = row.get("vs_base")
        diff = f"{vs['diff']:+.3f} ({vs['ci'][0]:+.3f} to {vs['ci'][1]:+.3f})" if vs else "—"
        p = f"{vs['mcnemar_p']:.2g}" if vs else "—"
        wall = f"{row['wall_seconds'] / 60:.0f} min" if row.get("wall_seconds") else "—"
        lines.append(f"| {name} | {row['accuracy']:.3f} ({lo:.3f}–{hi:.3f}) | {diff} | {p} | {wall} |")
    if "vs_grpo" in table.get("raro", {}):
        v = table["raro"]["vs_grpo"]
        lines += ["", f"RARO − GRPO on the same prompts: {v['diff']:+.3f} (95% CI {v['ci'][0]:+.3f} to "
                      f"{v['ci'][1]:+.3f}), McNemar p {v['mcnemar_p']:.2g}."]
    if rerank:
        lines += ["", f"RARO + critic reranking (first {rerank['prompts']} held-out prompts, {rerank['n']} samples "
                      f"each at the training temperature): pass@1 {rerank['pass@1']:.3f}, critic@{rerank['n']} "
                      f"{rerank['critic@n']:.3f}, pass@{rerank['n']} {rerank['pass@' + str(rerank['n'])]:.3f}."]
    lines += ["", f"Budget per arm: {budget}.", "", "Commands (from the repository root):", ""]
    lines += [f"    .venv/bin/megareason {' '.join(c)}".replace(f"{ROOT}/", "") for c in commands.values()]
    _write(results / "compare_methods.md", "\n".join(lines) + "\n")
    print("\n".join(lines))

    save(heldout_figure(curves, prompts), results / "compare_methods_heldout.png", dpi=120)
    if (fig := critic_figure(critic)) is not None:
        save(fig, results / "compare_methods_raro_critic.png", dpi=120)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=8, help="training prompts per step (every arm)")
    ap.add_argument("--heldout", type=int, default=500, help="held-out prompts (greedy)")
    ap.add_argument("--rerank-prompts", type=int, default=100, help="held-out prompts for critic reranking (0: none)")
    ap.add_argument("--rerank-n", type=int, default=4)
    ap.add_argument("--runs", type=Path, default=ROOT / "outputs" / "compare_methods")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--arms", default="grpo,sft,raro", help="training arms to run, in order (base comes with grpo)")
    ap.add_argument("--tune", action="append", default=[], metavar="NAME=ARM:k=v,...",
                    help="tune instead: train this variant, score it on the tuning split (repeatable)")
    ap.add_argument("--tune-prompts", type=int, default=100, help="prompts of the tuning split")
    ap.add_argument("--tune-seed", type=int, default=TUNE_SEED, help="the tuning split's reasoning-gym seed")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every arm (e.g. model.path=...)")
    a = ap.parse_args()
    if a.heldout < 2:
        ap.error("--heldout must be >= 2")
    if a.tune:
        if a.tune_seed == 20261123:
            ap.error("--tune-seed must differ from the held-out set's seed (20261123)")
        return tune(a)
    commands = arm_commands(a.runs, a.steps, a.prompts, a.heldout, a.overrides)
    wanted = [x for x in a.arms.split(",") if x]
    if unknown := set(wanted) - set(commands):
        ap.error(f"--arms: unknown {sorted(unknown)}; choose from {sorted(commands)}")
    if "grpo" not in wanted:
        ap.error("--arms must include grpo: its step-0 validation is the base model's")
    wall = {name: run_arm(name, commands[name], a.runs / name, a.steps) for name in wanted}
    rerank = rerank_arm(a.runs, a.steps, min(a.rerank_prompts, a.heldout), a.rerank_n, a.overrides) \
        if "raro" in wanted else None

    rng = np.random.default_rng(0)
    curves = {name: held_out(a.runs / name) for name in wanted}
    base = curves["grpo"][0]
    finals = {"base": base, **{name: curves[name][a.steps] for name in wanted}}
    table = {}
    for name, x in finals.items():
        lo, hi = bootstrap_mean(x, rng)
        table[name] = {"accuracy": float(x.mean()), "ci": [lo, hi], "prompts": len(x), "wall_seconds": wall.get(name)}
        if name != "base":
            table[name]["vs_base"] = paired(x, base, rng)
    if "raro" in finals:
        table["raro"]["vs_grpo"] = paired(finals["raro"], finals["grpo"], rng)
    as_means = {name: {s: float(v.mean()) for s, v in c.items()} for name, c in curves.items()}
    prompts = {name: {s: len(v) for s, v in c.items()} for name, c in curves.items()}
    for name in as_means:
        as_means[name].setdefault(0, float(base.mean()))  # every arm starts from the base model
        prompts[name].setdefault(0, len(base))
    critic = critic_curves(a.runs / "raro") if "raro" in wanted else {}
    n = json.loads((a.runs / "grpo" / "config.json").read_text())["rollout"]["n"]
    budget = (f"{a.steps} steps x {a.prompts} training prompts (GRPO and RARO: {n} samples each, RARO's critic "
              f"judging them too; SFT: one demonstration each); held-out: {a.heldout} prompts, greedy")
    report(a.results, table, {k: dict(sorted(v.items())) for k, v in as_means.items()}, prompts, critic, rerank,
           {k: commands[k] for k in wanted}, budget)


if __name__ == "__main__":
    main()
