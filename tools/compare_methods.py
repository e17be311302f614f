"""Base vs SFT vs GRPO (rule verifier) vs RARO (no verifier), and their variants, on one model, one task,
one set of training prompts with expert demonstrations and one held-out set (the comparison of the RARO
paper, "Escaping the Verifier", at small scale). Every arm is ``configs/compare_smollm2_cpu.yaml`` plus its
overrides in ``ARMS``; each trains ``--steps`` steps of ``--prompts`` prompts (GRPO and RARO sample
``rollout.n`` responses per prompt, SFT imitates one demonstration per prompt), once per seed
(``trainer.seed``), and is evaluated greedily on the held-out prompts every ``trainer.val_every`` steps by
the trainer itself (``rollouts/val_step_N.jsonl``).

The arms: ``base`` (the untouched model: the step-0 validation of GRPO's first seed), ``sft``, ``grpo`` (the
arithmetic reward's combined score, 0.3 x a final answer + 0.7 x correct), ``grpo_correct`` (rewarded for
correctness alone), ``sft_then_grpo`` (``grpo_correct`` starting from the same seed's SFT model, its final
checkpoint exported to HF), ``raro`` (the recipe), ``raro_fair`` (a critic warm-up, more judgements, a tie
worth less than chance to the critic, cut answers judged) and ``raro_oracle`` (the critic replaced by answer
equality: the upper bound of RARO's policy side).

    .venv/bin/python tools/compare_methods.py                    # SmolLM2-135M, 3 seeds per arm
    .venv/bin/python tools/compare_methods.py --arms grpo,raro --arm-seeds raro=1
    .venv/bin/python tools/compare_methods.py --steps 2 --heldout 20 --seeds 1 --runs /tmp/cmp --results /tmp/cmp
      --rerank-prompts 8 model.path=/path/to/tiny                # (one line) a smoke run

**Tasks.** ``--config`` names the config every arm starts from: ``compare_smollm2_cpu`` (two-term sums,
differences and products of one- and two-digit numbers) or ``compare_multiply_smollm2_cpu`` (two-digit by
two-digit products, each demonstration the worked place-value split: a critic has steps to compare, not
only a number). Give each task its own ``--runs`` and ``--results``.

**Held-out and tuning splits** (``tools/compare_methods_eval.py``). reasoning-gym builds item i of seed s
from ``Random(s + i)`` and two-term arithmetic repeats questions even between far seeds, so the splits are
made disjoint by their operations (``tools/compare_methods_measures.py``: ``b * a`` is ``a * b``, and every
sub-step of a training demonstration, ``57 * 40`` in ``57 * 47 = 57 * 40 + 57 * 7 = ...``, counts as a
training question): the tuning split (``--tune-seed``) keeps the first ``--tune-prompts`` distinct questions
outside the whole training pool (``data.sources``), the held-out set (``--heldout-seed``) the first
``--heldout`` distinct ones outside the training pool and the tuning split. Both are written under
``--runs``/data as ``kind: file`` sources (the trainer reads them through ``data.val_sources``), read back
with the trainer's loader and checked disjoint and duplicate-free; the tool stops on any overlap. The
table states how many candidates each split dropped and why, and the difficulty mix of the held-out set
beside the training pool's. Results record the held-out set's fingerprint and the training pool's.

**Tuning** never looks at the held-out prompts: ``--tune NAME=ARM:key=value,...`` (repeatable) trains each
variant on the same training prompts and scores it on the tuning split, beside the base model's score on
that split; the runs are listed in ``compare_methods_tuning.md``. Choose settings there, then run the
comparison with them.

    .venv/bin/python tools/compare_methods.py --steps 10 --tune raro_lr3e-5=raro:optim.lr=3e-5 \\
      --tune raro_tau=raro:raro.tau_pol=0.5

**Resumable.** Runs go arm by arm within a seed, seed after seed (an arm's dependency first: SFT before
SFT-then-GRPO). A run (arm and seed) that finished is never rerun: as it finishes, its per-prompt rows are
written to ``compare_methods_prompts/ARM_seedS.jsonl`` and its entry to ``compare_methods.json`` under
``--results``, and the table is rewritten; one interrupted resumes from its last checkpoint (the trainer's
own resume). Results computed on another held-out set or training pool are refused. ``--recompute``
rewrites the tables of ``--results`` from its committed per-prompt rows alone (no run).

Writes, under ``--results``: ``compare_methods.md`` (for each arm strict accuracy, parseable rate,
last-number accuracy and forced-format accuracy over the held-out questions operand-disjoint from the
training pool, each with its 95% two-level bootstrap interval over seeds and prompts; strict and
last-number accuracy over every held-out question; each arm's contrasts with base, and RARO's with GRPO,
with their intervals and bootstrap p-values Holm-adjusted over the page; last-number accuracy by difficulty
class; the command and wall time of each run), ``compare_methods.json``, the per-prompt rows (id, question,
gold answer, response, the final answer the arithmetic reward parses or null, parseable, correct,
truncated, and the forced-format answer), ``compare_methods_heldout.png`` (held-out strict accuracy vs
step, mean over seeds, a panel per arm, with its 95% Wilson score interval over the held-out prompts) and
``compare_methods_raro_critic.png`` (the critic's accuracy, tie rate and format-error rate per step of
RARO's first seed; when RARO ran). Forced-format accuracy is decoded after each run from its final weights
(``tools/forced_format.py``, a vLLM engine; ``--no-forced-format`` skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_methods_eval import (  # noqa: E402
    SplitError,
    bootstrap_mean,
    check_splits,
    draw_split,
    fingerprint,
    paired,
    prompt_rows,
    question_key,
    question_of,
    read_jsonl,
    split_rows,
)
from compare_methods_measures import (  # noqa: E402
    forced_rows,
    mix,
    pool_fingerprint,
    pool_keys,
    question_operation,
)
from compare_methods_table import table as _table  # noqa: E402
from compare_methods_table import table_lines  # noqa: E402

from megareason.config.load import load_config  # noqa: E402
from megareason.config.schema import DataConfig, DataSourceConfig  # noqa: E402
from megareason.data.loaders import load_records  # noqa: E402
from megareason.plotting import (  # noqa: E402
    accuracy_with_interval,
    caption,
    counts_text,
    integer_steps,
    panel_grid,
    save,
)

CONFIG = "compare_smollm2_cpu"  # the task of every arm; --config picks another (a second task)
# reasoning-gym seeds of the splits: item i of seed s is Random(s + i), and the training pool (seed 1) draws
# ~4 items per kept one (its '/' items are skipped), so these are millions of items apart; disjointness
# itself is checked on the questions.
HELDOUT_SEED = 20261123
TUNE_SEED = 10_000_000
PROMPTS_DIR = "compare_methods_prompts"


@dataclass(frozen=True)
class Arm:
    """One arm: the megareason command and the overrides that make it (placed after the user's, so they win)."""

    command: str  # train | sft
    overrides: tuple[str, ...] = ()
    # Another arm whose same-seed run's final checkpoint, exported to HF, is this arm's starting model.
    start_from: str = ""


# The arithmetic reward's reward_type for the training source (its data.sources[0]): correctness alone.
CORRECT_ONLY = "++data.sources.0.extra_info.reward_type=correct"
RARO = ("algorithm.name=raro", "algorithm.kl_coef=0.001")
ARMS = {
    "sft": Arm("sft"),
    "grpo": Arm("train"),
    "grpo_correct": Arm("train", (CORRECT_ONLY,)),
    "sft_then_grpo": Arm("train", (CORRECT_ONLY,), start_from="sft"),
    "raro": Arm("train", RARO),
    # RARO made fair to its critic. 4 judgements per triplet (RARO's default; the recipe's 2 saves time). A tie
    # worth less than a coin flip's expected 0.5 to the critic (0.55, RARO's, makes a tie the better bet for a
    # critic at chance). The first 4 of the 20 steps train the critic alone (a policy rewarded by a critic at
    # chance learns noise). Answers cut at rollout.max_tokens judged, not dropped (dropped, nothing pushes the
    # policy to finish one; judged, the critic sees a cut answer beside the expert's). Values to be chosen on
    # the tuning split.
    "raro_fair": Arm("train", (*RARO, "raro.critic_n=4", "raro.tau_crit=0.4", "raro.critic_warmup_steps=4",
                               "raro.truncated=judge")),
    # RARO's policy side with a perfect critic: a tie when the policy's final answer is correct (the arithmetic
    # reward's check), the expert named otherwise; no critic rows.
    "raro_oracle": Arm("train", (*RARO, "raro.critic=answer_equality")),
}
ORDER = ("base", *ARMS)


def megareason() -> list[str]:
    exe = Path(sys.executable).parent / "megareason"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "megareason.cli"]


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---- the splits


def prepare_splits(folder: Path, heldout: int, tune_prompts: int, heldout_seed: int, tune_seed: int,
                   overrides: list[str], config: str = CONFIG) -> dict:
    """Draw the tuning and held-out splits (module docstring), write them to ``folder`` as JSONL (an existing
    file must hold the same split), read them back with the trainer's loader and check them against the
    training pool. Returns the files, the questions, each split's counts and the held-out fingerprint."""
    cfg = load_config(config, overrides)
    training, solutions = training_pool(cfg)
    pool = pool_keys(training, solutions)
    exclude = {"training": pool | {split_key(q) for q in training}}
    source = cfg.data.val_sources[0]
    tuning = draw_split(replace(source, seed=tune_seed), tune_prompts, exclude, split_key)
    held = draw_split(replace(source, seed=heldout_seed), heldout,
                      {**exclude, "tuning": {split_key(question_of(r)) for r in tuning.records}}, split_key)
    folder.mkdir(parents=True, exist_ok=True)
    out = {"training_questions": len(training), "training_distinct": len(exclude["training"])}
    for name, split, seed in (("tuning", tuning, tune_seed), ("heldout", held, heldout_seed)):
        path = folder / f"{name}.jsonl"
        text = "".join(json.dumps(r) + "\n" for r in split_rows(split, seed))
        if path.exists() and path.read_text() != text:
            raise SystemExit(f"{path} holds another {name} split than --heldout/--tune-prompts/--heldout-seed/"
                             f"--tune-seed and the training data make now; runs under {folder.parent} were "
                             "evaluated on it: use another --runs, or delete that folder")
        if not path.exists():
            _write(path, text)
        read = load_records(DataConfig(sources=[DataSourceConfig(kind="file", path=str(path))], system_prompt=""))
        out[name] = {"file": path, "seed": seed, "questions": [question_of(r) for r in read], **split.stats()}
    check_splits(training, split_key, frozenset(pool), tuning=out["tuning"]["questions"],
                 heldout=out["heldout"]["questions"])
    out["fingerprint"] = fingerprint(out["heldout"]["questions"])
    out["config"] = config
    out["operands"] = operand_overlap(out["heldout"]["questions"], training, solutions, "by their operands")
    return out


def split_key(question: str):
    """What makes two questions the same for the splits: their operation (commuted forms equal), or their
    whitespace-normalised text when they hold no single operation."""
    return question_operation(question) or question_key(question)


def training_pool(cfg) -> tuple[list[str], list[str]]:
    """The training pool's questions and demonstrations (the worked solutions SFT imitates)."""
    records = load_records(replace(cfg.data, val_sources=[]))
    return [question_of(r) for r in records], [str(r.extra_info.get("solution", "")) for r in records]


def operand_overlap(heldout: list[str], training: list[str], solutions: list[str], drawn_by: str) -> dict:
    """Which held-out questions the training pool holds by their operands (``compare_methods_measures``):
    as a question's operation, or else as a demonstration's sub-step; the ids to exclude, the pool's
    fingerprint and the difficulty mixes."""
    questions = {split_key(q) for q in training}
    pool = pool_keys(training, solutions) | questions
    ops = [split_key(q) for q in heldout]
    excluded = [i for i, k in enumerate(ops) if k in pool]
    kept = [q for i, q in enumerate(heldout) if i not in set(excluded)]
    return {"drawn_by": drawn_by, "training_fingerprint": pool_fingerprint(training, solutions),
            "question_overlap": sum(k in questions for k in ops),
            "substep_overlap": sum(k in pool and k not in questions for k in ops), "excluded_ids": excluded,
            "mix": {"training pool": dict(mix(training)), "held-out": dict(mix(heldout)),
                    "held-out, operand-disjoint": dict(mix(kept))}}


def val_override(path: Path, size: int = 0) -> str:
    """The override that makes ``path`` (a split's JSONL) the run's only validation source (its first
    ``size`` rows; 0: all)."""
    if '"' in str(path) or "\\" in str(path):
        raise SystemExit(f"{path}: a path with a double quote or a backslash cannot be passed to hydra; use "
                         "another --runs")
    return f'data.val_sources=[{{kind:file,path:"{path}"{f",size:{size}" if size else ""}}}]'


# ---- the runs


def run_folder(runs: Path, arm: str, seed: int) -> Path:
    return runs / arm / f"seed{seed}"


def arm_command(name: str, seed: int, runs: Path, steps: int, prompts: int, val_file: Path, extra: list[str],
                validate_base: bool = False, config: str = CONFIG) -> list[str]:
    """The megareason command of one arm and seed; ``validate_base``: validate before training too (the
    base model's score)."""
    arm = ARMS[name]
    cmd = [arm.command, "--config-name", config, f"trainer.steps={steps}", f"trainer.prompts_per_step={prompts}",
           val_override(val_file), f"trainer.seed={seed}", *extra,
           f"trainer.output_dir={run_folder(runs, name, seed)}",
           f"trainer.val_before_train={'true' if validate_base else 'false'}", *arm.overrides]
    if arm.start_from:
        cmd.append(f"model.path={run_folder(runs, arm.start_from, seed) / 'hf'}")
    return cmd


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


def hf_export(folder: Path, steps: int) -> Path:
    """The run's final checkpoint as an HF folder (``folder/hf``), exported once."""
    hf = folder / "hf"
    if not (hf / "config.json").exists():
        ckpt = folder / "checkpoints" / f"step_{steps:08d}" / "actor"
        if not ckpt.is_dir():
            raise SystemExit(f"{ckpt}: no final checkpoint to start from (run that arm first)")
        subprocess.run([*megareason(), "convert", "megatron-to-hf", str(ckpt), str(hf)], cwd=ROOT, check=True)
    return hf


def held_out(folder: Path) -> dict[int, np.ndarray]:
    """{step: per-prompt greedy correctness (0/1), in held-out order} from the trainer's validation dumps."""
    out = {}
    for path in sorted((folder / "rollouts").glob("val_step_*.jsonl")):
        rows = sorted(read_jsonl(path), key=lambda r: r["index"])
        out[int(path.stem.rsplit("_", 1)[1])] = np.array([float(r["correct"]) for r in rows])
    return out


def load_state(results: Path, splits: dict) -> dict:
    """``compare_methods.json``'s finished runs, refused when they were computed on another held-out set."""
    path = results / "compare_methods.json"
    state = json.loads(path.read_text()) if path.exists() else {}
    found = state.get("heldout", {}).get("fingerprint")
    if state.get("runs") and found != splits["fingerprint"]:
        raise SystemExit(f"{path} holds runs evaluated on another held-out set (fingerprint {found}, now "
                         f"{splits['fingerprint']}): use another --results, or move it away")
    pool = state.get("heldout", {}).get("operands", {}).get("training_fingerprint")
    if state.get("runs") and pool and pool != splits["operands"]["training_fingerprint"]:
        raise SystemExit(f"{path} holds runs trained on another training pool (fingerprint {pool}, now "
                         f"{splits['operands']['training_fingerprint']}): use another --results, or move it away")
    return {"heldout": heldout_info(splits), "runs": state.get("runs", {})}


def heldout_info(splits: dict) -> dict:
    """What the results record of the splits: seeds, sizes, what each dropped, the held-out fingerprint."""
    return {"config": splits["config"], "fingerprint": splits["fingerprint"], "operands": splits["operands"],
            "training_questions": splits["training_questions"],
            "training_distinct": splits["training_distinct"],
            **{name: {k: v for k, v in splits[name].items() if k not in ("file", "questions")}
               for name in ("tuning", "heldout")}}


def forced_continuations(model: str, dump: Path, max_model_len: int) -> list[str]:
    """``tools/forced_format.py`` on a validation dump (once: its output is kept beside the dump), the
    continuations in held-out order."""
    out = dump.with_name(dump.stem + "_forced.jsonl")
    if not out.exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "forced_format.py"), model, str(dump), str(out),
                        "--max-model-len", str(max_model_len)], cwd=ROOT, check=True)
    return [r["continuation"] for r in sorted(read_jsonl(out), key=lambda r: r["index"])]


def record_run(results: Path, state: dict, name: str, seed: int, folder: Path, steps: int, wall: float,
               command: list[str], questions: list[str], forced=None) -> None:
    """A finished run's per-prompt rows (its final validation; also base's, from the step-0 validation of the
    run that made it) and its entry in the state, written at once. ``forced(arm, dump)``: the forced-format
    continuations of a dump's prompts by that arm's weights (None: not measured)."""
    (results / PROMPTS_DIR).mkdir(parents=True, exist_ok=True)
    entries = [(name, steps, wall, command)]
    if "trainer.val_before_train=true" in command:
        entries.insert(0, ("base", 0, None, None))
    curve = {s: float(x.mean()) for s, x in held_out(folder).items()}
    for arm, step, seconds, cmd in entries:
        dump = folder / "rollouts" / f"val_step_{step:08d}.jsonl"
        rows = prompt_rows(read_jsonl(dump), questions)
        if forced is not None:
            rows = forced_rows(rows, forced(arm, dump))
        file = f"{PROMPTS_DIR}/{arm}_seed{seed}.jsonl"
        _write(results / file, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
        state["runs"][f"{arm}/seed{seed}"] = {
            "arm": arm, "seed": seed, "file": file, "wall_seconds": seconds,
            "command": [str(c).replace(f"{ROOT}/", "") for c in cmd] if cmd else None,
            "curve": {str(s): v for s, v in curve.items()} if arm != "base" else {"0": curve[0]}}
    _write(results / "compare_methods.json", json.dumps(state, indent=2) + "\n")


def finished(results: Path, state: dict, name: str, seed: int) -> bool:
    entry = state["runs"].get(f"{name}/seed{seed}")
    return entry is not None and (results / entry["file"]).exists()


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


# ---- the table (compare_methods_table.py)


def table(results: Path, state: dict, paired_seeds: bool = False, pairs: list[tuple[str, str]] | None = None,
          order: tuple[str, ...] = ORDER) -> dict[str, dict]:
    """``compare_methods_table.table`` with this tool's arms first, in their order."""
    return _table(results, state, paired_seeds, pairs, order)


def curves_of(state: dict, arms: dict[str, dict]) -> tuple[dict, dict]:
    """Held-out strict accuracy (every held-out prompt, as the trainer validates) per step of each trained
    arm, the mean over its seeds at the steps all of them have, and the held-out prompt count per step (for
    the figure's intervals)."""
    curves = {}
    for arm in arms:
        if arm == "base":
            continue
        per_seed = [e["curve"] for e in state["runs"].values() if e["arm"] == arm]
        steps = set.intersection(*(set(c) for c in per_seed))
        curves[arm] = {int(s): float(np.mean([c[s] for c in per_seed])) for s in steps}
        if "base" in arms and arm in ARMS and not ARMS[arm].start_from:
            curves[arm].setdefault(0, arms["base"]["all_prompts"]["strict"])  # these arms start from base
    held = state["heldout"]["heldout"]["kept"]  # the trainer validates on every held-out prompt
    prompts = {arm: {s: held for s in c} for arm, c in curves.items()}
    return {k: dict(sorted(v.items())) for k, v in curves.items()}, prompts


def publish(results: Path, runs: Path, state: dict, rerank: dict | None, budget: str, show: bool = False) -> None:
    """Rewrite the table, ``compare_methods.json`` and the figures from every finished run in ``state``
    (``show``: print the table too)."""
    arms = table(results, state)
    curves, prompts = curves_of(state, arms)
    critic = state.get("raro_critic") or {}  # kept when the run folders are gone (a recomputation)
    rerank = rerank or state.get("rerank")
    raro = sorted(e["seed"] for e in state["runs"].values() if e["arm"] == "raro")
    if raro and (run_folder(runs, "raro", raro[0]) / "metrics.jsonl").exists():
        critic = critic_curves(run_folder(runs, "raro", raro[0]))
    state.update({"arms": arms, "held_out_curves": curves, "raro_critic": critic, "rerank": rerank})
    _write(results / "compare_methods.json", json.dumps(state, indent=2) + "\n")
    lines = table_lines(arms, state["heldout"])
    if rerank:
        lines += ["", f"RARO + critic reranking (first {rerank['prompts']} held-out prompts, {rerank['n']} samples "
                      f"each at the training temperature): pass@1 {rerank['pass@1']:.3f}, critic@{rerank['n']} "
                      f"{rerank['critic@n']:.3f}, pass@{rerank['n']} {rerank['pass@' + str(rerank['n'])]:.3f}."]
    lines += ["", f"Budget per run: {budget}. Per-prompt rows: `{PROMPTS_DIR}/ARM_seedS.jsonl`.", "",
              "Commands (from the repository root; the held-out file is written by the tool):", ""]
    lines += [f"    .venv/bin/megareason {shlex.join(e['command'])}" for e in state["runs"].values() if e["command"]]
    _write(results / "compare_methods.md", "\n".join(lines) + "\n")
    if show:
        print("\n".join(lines[:len(arms) + 5]), flush=True)
    if curves:
        save(heldout_figure(curves, prompts), results / "compare_methods_heldout.png", dpi=120)
    if (fig := critic_figure(critic)) is not None:
        save(fig, results / "compare_methods_raro_critic.png", dpi=120)


# ---- tuning, reranking, the driver


def tune_commands(runs: Path, steps: int, prompts: int, val_file: Path, variants: list[str],
                  extra: list[str], config: str = CONFIG) -> dict[str, tuple[str, list[str]]]:
    """{variant: (arm, command)}: the arm's command (first seed) validating on the tuning split
    (``val_file``) before and after training, then the variant's overrides; ``variants`` are
    ``NAME=ARM:k=v,k=v`` with ARM a runnable arm that starts from the base model."""
    allowed = sorted(n for n, arm in ARMS.items() if not arm.start_from)
    out = {}
    for spec in variants:
        name, _, rest = spec.partition("=")
        arm, _, overrides = rest.partition(":")
        if not name or arm not in allowed:
            raise SystemExit(f"--tune {spec!r}: expected NAME=ARM:key=value,... with ARM one of {allowed}")
        cmd = [c for c in arm_command(arm, 0, runs, steps, prompts, val_file, extra, config=config)
               if not c.startswith(("trainer.output_dir=", "trainer.val_before_train="))]
        out[name] = (arm, [*cmd, f"trainer.output_dir={runs / name}", "trainer.val_before_train=true",
                           *[o for o in overrides.split(",") if o]])
    return out


def tune(a, splits: dict) -> None:
    """Run the ``--tune`` variants and list them (module docstring)."""
    runs = a.runs / "tuning"
    t = splits["tuning"]
    variants = tune_commands(runs, a.steps, a.prompts, t["file"], a.tune, a.overrides, a.config)
    rng = np.random.default_rng(0)
    lines = [f"Tuning split: {t['kept']} basic_arithmetic prompts, reasoning-gym seed {t['seed']}, none among the "
             f"training pool's questions or the held-out set's (checked); {a.steps} steps x {a.prompts} training "
             "prompts per run; greedy.", "",
             "| run | arm | overrides | base on the split | final accuracy (95% CI) | paired diff vs base (95% CI) "
             "| critic accuracy, first / last 5 steps | wall time |", "|---|---|---|---|---|---|---|---|"]
    for name, (arm, cmd) in variants.items():
        wall = run_arm(name, cmd, runs / name, a.steps)
        curve = held_out(runs / name)
        base, final = curve[0], curve[a.steps]
        lo, hi = bootstrap_mean(final, rng)
        d = paired(final, base, rng)
        critic = "—"
        if arm.startswith("raro"):
            acc = [v for _, v in critic_curves(runs / name)["raro/critic_accuracy"]]
            critic = f"{np.mean(acc[:5]):.2f} / {np.mean(acc[-5:]):.2f}"
        overrides = " ".join(cmd[cmd.index("trainer.val_before_train=true") + 1:]) or "(the recipe's)"
        lines.append(f"| {name} | {arm} | `{overrides}` | {base.mean():.3f} | {final.mean():.3f} ({lo:.3f}–{hi:.3f}) "
                     f"| {d['diff']:+.3f} ({d['ci'][0]:+.3f} to {d['ci'][1]:+.3f}) | {critic} | {wall / 60:.0f} min |")
    lines += ["", "Commands (from the repository root):", ""]
    lines += [f"    .venv/bin/megareason {shlex.join(c)}".replace(f"{ROOT}/", "") for _, c in variants.values()]
    a.results.mkdir(parents=True, exist_ok=True)
    _write(a.results / "compare_methods_tuning.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def rerank_arm(runs: Path, folder: Path, steps: int, n_prompts: int, n: int, val_file: Path,
               extra: list[str], config: str = CONFIG) -> dict | None:
    """RARO's final policy (the run in ``folder``), ``n`` samples per prompt on the first ``n_prompts``
    held-out prompts, the model as its own critic picking one (``eval.rerank=critic``): critic@n vs pass@1
    of the same samples."""
    if n_prompts <= 0:
        return None
    out = runs / "raro_rerank"
    found = sorted(out.glob("*/summary.json"))
    if not found:
        hf = hf_export(folder, steps)
        args = ["eval", "--config-name", config, f"model.path={hf}", "algorithm.name=raro", "eval.rerank=critic",
                f"rollout.n={n}", f"eval.pass_k=[1,{n}]", f"eval.output_dir={out}", val_override(val_file, n_prompts),
                "data.sources=${data.val_sources}",
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


def forced_by(config: str, overrides: list[str]):
    """``record_run``'s ``forced``: base's dump decoded by the configured model, a run's by the weights of the
    dump's step (its final checkpoint)."""
    cfg = load_config(config, overrides)

    def forced(arm: str, dump: Path) -> list[str]:
        step = int(dump.stem.rsplit("_", 1)[1])
        model = cfg.model.path if arm == "base" else str(hf_export(dump.parent.parent, step))
        return forced_continuations(model, dump, cfg.rollout.max_model_len)

    return forced


def recompute(results: Path, runs: Path, config: str, overrides: list[str], budget: str) -> None:
    """Rewrite ``results``' tables from its committed per-prompt files alone: the held-out questions are
    theirs (checked against the recorded fingerprint), the training pool is ``config``'s (checked against a
    recorded pool fingerprint, when there is one), and operand-level disjointness is computed anew."""
    path = results / "compare_methods.json"
    state = json.loads(path.read_text())
    questions = [r["question"] for r in read_jsonl(results / next(iter(state["runs"].values()))["file"])]
    if fingerprint(questions) != state["heldout"]["fingerprint"]:
        raise SystemExit(f"{results}: the per-prompt files' questions are not the recorded held-out set")
    if state["heldout"].get("config", config) != config:
        raise SystemExit(f"{path} was run with --config {state['heldout']['config']}, not {config}")
    training, solutions = training_pool(load_config(config, overrides))
    old = state["heldout"].get("operands", {})
    ops = operand_overlap(questions, training, solutions, old.get("drawn_by", "by their text"))
    if old.get("training_fingerprint") not in (None, ops["training_fingerprint"]):
        raise SystemExit(f"{path} was trained on another training pool than {config}'s")
    state["heldout"]["operands"] = ops
    publish(results, runs, state, None, budget, show=True)


def plan(arms: list[str], seeds: int, arm_seeds: dict[str, int]) -> list[tuple[str, int]]:
    """The runs in order, (arm, seed): seed after seed, the arms in ``ORDER`` within a seed (base is no run)."""
    count = {arm: arm_seeds.get(arm, seeds) for arm in arms}
    return [(arm, seed) for seed in range(max(count.values(), default=0)) for arm in ORDER
            if arm in count and arm != "base" and seed < count[arm]]


def check_arms(wanted: list[str], arm_seeds: dict[str, int], state: dict) -> None:
    """Refuse unknown arms, an arm without the arm it starts from, and a table without its base."""
    if unknown := sorted(set(wanted) - set(ORDER)):
        raise SystemExit(f"--arms: unknown {unknown}; choose from {list(ORDER)}")
    if unknown := sorted(set(arm_seeds) - set(wanted)):
        raise SystemExit(f"--arm-seeds: {unknown} not in --arms")
    for n in wanted:
        if n != "base" and ARMS[n].start_from and ARMS[n].start_from not in wanted:
            dep = ARMS[n].start_from
            raise SystemExit(f"--arms: {n} starts from {dep}'s final model; include {dep}")
    if "grpo" not in wanted and not any(e["arm"] == "base" for e in state["runs"].values()):
        raise SystemExit("--arms must include grpo: the step-0 validation of its first seed is the base model's")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default=CONFIG, help="the config every arm starts from (configs/NAME.yaml): its "
                    "data.sources[0] is the training pool, its data.val_sources[0] the generator of the splits")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=8, help="training prompts per step (every arm)")
    ap.add_argument("--heldout", type=int, default=500, help="held-out prompts (greedy)")
    ap.add_argument("--heldout-seed", type=int, default=HELDOUT_SEED, help="the held-out set's reasoning-gym seed")
    ap.add_argument("--seeds", type=int, default=3, help="runs per arm (trainer.seed 0, 1, ...)")
    ap.add_argument("--arm-seeds", action="append", default=[], metavar="ARM=N", help="another number of runs "
                    "for one arm (repeatable), e.g. raro=1")
    ap.add_argument("--rerank-prompts", type=int, default=100, help="held-out prompts for critic reranking (0: none)")
    ap.add_argument("--rerank-n", type=int, default=4)
    ap.add_argument("--runs", type=Path, default=ROOT / "outputs" / "compare_methods")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--arms", default=",".join(ORDER),
                    help=f"arms to run, in this order within a seed (base comes with grpo's first seed): {list(ORDER)}")
    ap.add_argument("--tune", action="append", default=[], metavar="NAME=ARM:k=v,...",
                    help="tune instead: train this variant, score it on the tuning split (repeatable)")
    ap.add_argument("--tune-prompts", type=int, default=100, help="prompts of the tuning split")
    ap.add_argument("--tune-seed", type=int, default=TUNE_SEED, help="the tuning split's reasoning-gym seed")
    ap.add_argument("--no-forced-format", action="store_true", help="skip forced-format decoding of each "
                    "finished run (tools/forced_format.py: a vLLM engine on its final weights)")
    ap.add_argument("--recompute", action="store_true", help="rewrite the tables under --results from their "
                    "committed per-prompt files and the training pool of --config; no run")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every arm (e.g. model.path=...)")
    a = ap.parse_args()
    if a.heldout < 2:
        ap.error("--heldout must be >= 2")
    if a.seeds < 1:
        ap.error("--seeds must be >= 1")
    arm_seeds = {}
    for spec in a.arm_seeds:
        arm, _, n = spec.partition("=")
        if not n.isdigit() or int(n) < 1:
            ap.error(f"--arm-seeds {spec!r}: expected ARM=N with N >= 1")
        arm_seeds[arm] = int(n)
    n = load_config(a.config, a.overrides).rollout.n
    budget = (f"{a.steps} steps x {a.prompts} training prompts (GRPO and RARO: {n} samples each, RARO's critic "
              f"judging them too; SFT: one demonstration each); held-out: {a.heldout} prompts, greedy")
    if a.recompute:
        return recompute(a.results, a.runs, a.config, a.overrides, budget)
    try:
        splits = prepare_splits(a.runs / "data", a.heldout, a.tune_prompts, a.heldout_seed, a.tune_seed, a.overrides,
                                a.config)
    except SplitError as e:
        sys.exit(f"error: {e}")
    if a.tune:
        return tune(a, splits)
    a.results.mkdir(parents=True, exist_ok=True)
    state = load_state(a.results, splits)
    wanted = [x for x in a.arms.split(",") if x]
    check_arms(wanted, arm_seeds, state)
    heldout = splits["heldout"]
    forced = None if a.no_forced_format else forced_by(a.config, a.overrides)
    runs = plan(wanted, a.seeds, arm_seeds)
    first = min((s for arm, s in runs if arm == "grpo"), default=0)
    for name, seed in runs:
        folder = run_folder(a.runs, name, seed)
        if finished(a.results, state, name, seed):
            print(f"[{name} seed {seed}] finished earlier: {state['runs'][f'{name}/seed{seed}']['file']}", flush=True)
            continue
        if ARMS[name].start_from:
            hf_export(run_folder(a.runs, ARMS[name].start_from, seed), a.steps)
        cmd = arm_command(name, seed, a.runs, a.steps, a.prompts, heldout["file"], a.overrides,
                          validate_base=name == "grpo" and seed == first, config=a.config)
        wall = run_arm(f"{name} seed {seed}", cmd, folder, a.steps)
        record_run(a.results, state, name, seed, folder, a.steps, wall, cmd, heldout["questions"], forced)
        publish(a.results, a.runs, state, None, budget)
    raro = sorted(s for arm, s in runs if arm == "raro")
    rerank = rerank_arm(a.runs, run_folder(a.runs, "raro", raro[0]), a.steps, min(a.rerank_prompts, a.heldout),
                        a.rerank_n, heldout["file"], a.overrides, a.config) if raro else None
    publish(a.results, a.runs, state, rerank, budget, show=True)


if __name__ == "__main__":
    main()
