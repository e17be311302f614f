"""The tables of ``tools/compare_methods.py`` and ``tools/controlled_experiment.py``: each arm's measures
(``compare_methods_measures.py``) over the operand-disjoint held-out questions from its committed
per-prompt rows, its contrasts with other arms, and the Markdown that states them."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np
from compare_methods_eval import holm, outcomes, read_jsonl
from compare_methods_measures import (
    BOOTSTRAP,
    FORCED_TOKENS,
    MEASURE_NAMES,
    MEASURES,
    arm_measures,
    contrast,
    difficulty,
    fmt_p,
    measure_rows,
    question_operation,
    signed,
)


def _rng(*names: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32("/".join(names).encode()))


def table(results: Path, state: dict, paired_seeds: bool = False,
          pairs: list[tuple[str, str]] | None = None, order: tuple[str, ...] = ()) -> dict[str, dict]:
    """Each arm's measures over its finished seeds on the operand-disjoint held-out prompts
    (``arm_measures``), strict and last-number accuracy over every held-out prompt, last-number accuracy by
    difficulty class, and its contrasts on the same prompts (``contrast``) with base, RARO's with GRPO, or
    ``pairs`` (arm, other); ``paired_seeds``: two arms' seed i are paired by design (the same start and seed),
    the p-values Holm-adjusted over all of them.
    Each arm's and each pair's bootstrap draws its own resamples, seeded by its names: an interval does not
    move when another arm joins the table."""
    entries = {arm: sorted((e for e in state["runs"].values() if e["arm"] == arm), key=lambda e: e["seed"])
               for arm in dict.fromkeys([*order, *(e["arm"] for e in state["runs"].values())])}
    rows = {arm: [read_jsonl(results / e["file"]) for e in es] for arm, es in entries.items() if es}
    excluded = set(state["heldout"].get("operands", {}).get("excluded_ids", []))
    out, data = {}, {}
    for arm, runs in rows.items():
        outcomes([[{"id": r["id"], "correct": r["correct"], "parseable": r["parseable"]} for r in run]
                  for run in runs])  # asserts the runs cover the same prompts
        keep = np.array([r["id"] not in excluded for r in runs[0]])
        measured = [measure_rows(run) for run in runs]
        data[arm] = [{m: v[keep] for m, v in x.items()} for x in measured]
        classes = np.array([difficulty(question_operation(r["question"])) for r in runs[0]])[keep]
        last = np.mean([x["last_number"] for x in data[arm]], axis=0)
        walls = [e["wall_seconds"] for e in entries[arm] if e["wall_seconds"] is not None]
        out[arm] = {"seeds": len(runs), "seed_values": [e["seed"] for e in entries[arm]], "prompts": int(keep.sum()),
                    "measures": arm_measures(data[arm], _rng(arm)),
                    "all_prompts": {m: float(np.mean([x[m] for x in measured])) for m in ("strict", "last_number")},
                    "last_number_by_class": {c: float(last[classes == c].mean()) for c in sorted(set(classes))},
                    "wall_seconds": sum(walls) / len(walls) if walls else None}
    if pairs is None:
        pairs = [(arm, "base") for arm in data if arm != "base"] + [("raro", "grpo")]
    tests = []
    for arm, other in pairs:
        if arm in data and other in data:
            vs = out[arm][f"vs_{other}"] = {}
            for m in MEASURES:
                if all(m in x for x in data[arm] + data[other]):
                    a, b = (np.stack([x[m] for x in data[k]]) for k in (arm, other))
                    vs[m] = contrast(a, b, _rng(arm, other, m), paired_seeds and a.shape[0] == b.shape[0])
                    tests.append(vs[m])
    for t, p in zip(tests, holm([t["p"] for t in tests]), strict=True):
        t["p_holm"] = p
    return out


def _ci(x: float, ci: list[float]) -> str:
    return "—" if math.isnan(x) else f"{x:.3f} ({ci[0]:.3f} to {ci[1]:.3f})"


def _mix_lines(mixes: dict[str, dict[str, int]]) -> list[str]:
    """The difficulty mix of each set (training pool, held-out, ...), as shares."""
    names = list(mixes)
    classes = sorted({c for m in mixes.values() for c in m})
    lines = ["| difficulty class | " + " | ".join(f"{n} ({sum(mixes[n].values())})" for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for c in classes:
        lines.append(f"| {c} | " + " | ".join(f"{mixes[n].get(c, 0) / max(sum(mixes[n].values()), 1):.0%} "
                                              f"({mixes[n].get(c, 0)})" for n in names) + " |")
    return lines


FORCED_MISSING = "the run's weights were not kept to decode it"


def table_lines(arms: dict[str, dict], heldout: dict) -> list[str]:
    """The tables of ``compare_methods.md`` and the text that says what they hold."""
    h, t = heldout["heldout"], heldout["tuning"]
    ops = heldout.get("operands", {})
    n_tests = sum(len(v) for row in arms.values() for k, v in row.items() if k.startswith("vs_"))
    any_row = next(iter(arms.values()), {"prompts": h["kept"]})
    lines = [
        f"Task: `configs/{heldout['config']}.yaml` (every arm). "
        f"Held-out: {h['kept']} basic_arithmetic prompts, reasoning-gym seed {h['seed']}: the first {h['kept']} "
        f"distinct questions of its first {h['drawn']} items outside the training pool "
        f"({heldout['training_questions']} items, {heldout['training_distinct']} distinct questions) and the "
        f"tuning split; dropped: {h['duplicates']} repeats, {h['excluded'].get('training', 0)} training questions, "
        f"{h['excluded'].get('tuning', 0)} tuning questions ({ops.get('drawn_by', 'by their text')}). "
        f"Tuning split: {t['kept']} prompts, seed {t['seed']}.", ""]
    if ops:
        lines += [f"Operand-level disjointness: a held-out question is in the training pool when its operation "
                  "(commuted forms equal: `b * a` is `a * b`) is a training question's or a sub-step of a training "
                  f"demonstration (`57 * 40` in `57 * 47 = 57 * 40 + 57 * 7 = ...`). {ops['question_overlap']} "
                  f"held-out questions are training questions by their operands and {ops['substep_overlap']} more "
                  f"are sub-steps of training demonstrations: excluded. Every measure below is over the other "
                  f"{any_row['prompts']} (the *operand-disjoint* held-out questions) unless it says all "
                  f"{h['kept']}. Training pool fingerprint `{ops['training_fingerprint']}`, held-out fingerprint "
                  f"`{heldout['fingerprint']}`.", "", "Difficulty mix:", "", *_mix_lines(ops["mix"]), ""]
    lines += ["| arm | seeds | strict accuracy (95% CI) | parseable rate (95% CI) | last-number accuracy (95% CI) "
              f"| forced-format accuracy (95% CI) | strict, all {h['kept']} | last-number, all {h['kept']} "
              "| wall time per run |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in arms.items():
        m = row["measures"]
        cells = [_ci(m[k]["value"], m[k]["ci"]) if k in m else "—" for k in MEASURES]
        if "forced" not in m:
            cells[-1] = "not measured"
        wall = f"{row['wall_seconds'] / 60:.0f} min" if row.get("wall_seconds") else "—"
        lines.append(f"| {name} | {row['seeds']} | {' | '.join(cells)} | {row['all_prompts']['strict']:.3f} "
                     f"| {row['all_prompts']['last_number']:.3f} | {wall} |")
    others = list(dict.fromkeys(k[3:] for row in arms.values() for k in row if k.startswith("vs_")))
    for other in others:
        lines += ["", f"Contrasts with {other} on the same prompts (difference, 95% CI, Holm-adjusted p):", "",
                  f"| arm − {other} | " + " | ".join(MEASURE_NAMES[k] for k in MEASURES) + " |",
                  "|---" * (len(MEASURES) + 1) + "|"]
        for name, row in arms.items():
            if f"vs_{other}" in row:
                v = row[f"vs_{other}"]
                lines.append(f"| {name} | " + " | ".join(
                    f"{signed(v[k]['diff'], v[k]['ci'])}; {'≤ ' if v[k]['p'] <= 1 / BOOTSTRAP else ''}"
                    f"{fmt_p(v[k]['p_holm'])}" if k in v else "—" for k in MEASURES) + " |")
    lines += ["", "Per seed (strict / last-number accuracy, operand-disjoint prompts): " + "; ".join(
        f"{name} " + ", ".join(f"{s:.3f}/{x:.3f}" for s, x in zip(row["measures"]["strict"]["by_seed"],
                                                                 row["measures"]["last_number"]["by_seed"],
                                                                 strict=True))
        for name, row in arms.items()) + ".", ""]
    classes = sorted({c for row in arms.values() for c in row["last_number_by_class"]})
    lines += ["Last-number accuracy by difficulty class (operand-disjoint prompts, pooled over seeds):", "",
              "| arm | " + " | ".join(classes) + " |", "|---" * (len(classes) + 1) + "|"]
    for name, row in arms.items():
        lines.append(f"| {name} | " + " | ".join(f"{row['last_number_by_class'].get(c, float('nan')):.3f}"
                                                 for c in classes) + " |")
    lines += ["", "Strict: the final answer the arithmetic reward reads (a last \\boxed{} number, '= number <eoe>' "
              "or a trailing '= number') is correct. Parseable: the response has such a final answer. Last-number: "
              "the last number anywhere in the response is correct (no format needed). Forced-format: the "
              "model's own response, then 'The final answer is \\boxed{', decoded greedily for at most "
              f"{FORCED_TOKENS} tokens: the boxed number is correct ('not measured': {FORCED_MISSING}). "
              "Intervals: 95% percentile two-level bootstrap (10,000 resamples) that draws the "
              "training seeds and the held-out prompts, both with replacement (an arm of one seed: prompts "
              "only); a contrast's two arms share the prompt draw. p: twice the share of bootstrap differences "
              f"on the far side of 0 (at least 1/10,000, the bootstrap's resolution: '≤' marks a p at it), "
              f"Holm-Bonferroni-adjusted over the {n_tests} contrasts of this page."]
    return lines
