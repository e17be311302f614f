"""The evaluation of ``tools/compare_methods.py``: the held-out and tuning splits, the per-prompt rows of a
run's greedy validation, and the statistics of the table.

**Splits.** reasoning-gym builds item i of seed s from ``Random(s + i)``, so two seeds closer than the
number of items drawn share items, and a small task (two-term arithmetic) repeats questions even between
far seeds. The splits are therefore made disjoint by their text, not by their seeds: ``draw_split`` takes
a generator's items in order and keeps the first ``want`` whose question is new (duplicates dropped) and
in none of the excluded sets (the whole training pool; for the held-out set also the tuning split), and
``check_splits`` verifies the result, raising ``SplitError`` on any shared or repeated question. Questions
are compared by a ``key``: by default their text as the model reads it (the user message),
whitespace-normalised; ``tools/compare_methods.py`` passes their operation (commuted forms equal) and adds
the training demonstrations' sub-steps to the training set.

**Per-prompt rows.** ``prompt_rows`` turns a run's ``rollouts/val_step_N.jsonl`` (one greedy sample per
held-out prompt, scored by the task's reward) into rows of id, question, gold answer, response, the final
answer the arithmetic reward parses from it (``megareason.rewards.arithmetic.final_answer``; None: no
final answer), ``parseable`` and ``correct``.

**Statistics used by the tuning list** (the comparison's tables use ``compare_methods_measures.py``;
outcomes as arrays ``[S, P]``: S seeds of an arm by P held-out prompts). Accuracy,
parseable-answer rate and accuracy among parseable answers, each with a 95% percentile bootstrap interval
that resamples prompts (a prompt's seeds together); paired differences against another arm on the same
prompts, with a bootstrap interval and an exact test (``paired_exact_p``: McNemar's exact test for one
seed; for several, the exact sign-flip test of the seed-averaged per-prompt differences, which is
McNemar's when S = 1); and Holm's step-down correction over a table's tests (Holm 1979).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from megareason.config.schema import DataSourceConfig
from megareason.data.loaders import load_reasoning_gym
from megareason.data.records import PromptRecord
from megareason.rewards.arithmetic import final_answer

BOOTSTRAP = 10_000
MAX_DRAW = 64  # draw_split gives up after this many candidates per wanted question


class SplitError(ValueError):
    """Two splits share a question, or a split repeats one."""


def question_key(question: str) -> str:
    """A question as the splits compare it: its text with whitespace runs made one space."""
    return " ".join(question.split())


def question_of(record: PromptRecord) -> str:
    """The question the model reads: the record's last (user) message."""
    return record.prompt[-1]["content"]


@dataclass
class Split:
    """``want`` questions kept from the first ``drawn`` candidates of a generator, and why the others went."""

    records: list[PromptRecord]
    drawn: int
    duplicates: int
    excluded: dict[str, int] = field(default_factory=dict)  # {excluded set's name: questions dropped for it}

    def stats(self) -> dict:
        return {"kept": len(self.records), "drawn": self.drawn, "duplicates": self.duplicates,
                "excluded": dict(self.excluded)}


def select_split(candidates: list[PromptRecord], want: int, exclude: dict[str, set], key=question_key) -> Split | None:
    """The first ``want`` candidates, in order, whose question is not an earlier kept one's and in no set of
    ``exclude`` ({name: keys}; a question in several counts for the first); None when fewer. ``key``: what
    makes two questions the same (default: their whitespace-normalised text)."""
    kept, seen = [], set()
    dropped = {name: 0 for name in exclude}
    duplicates = 0
    for drawn, rec in enumerate(candidates, start=1):
        k = key(question_of(rec))
        if k in seen:
            duplicates += 1
            continue
        hit = next((name for name, keys in exclude.items() if k in keys), None)
        if hit is not None:
            dropped[hit] += 1
            continue
        seen.add(k)
        kept.append(rec)
        if len(kept) == want:
            return Split(kept, drawn, duplicates, dropped)
    return None


def draw_split(source: DataSourceConfig, want: int, exclude: dict[str, set], key=question_key) -> Split:
    """``select_split`` over a reasoning-gym source's items from its seed, drawing more until ``want`` are
    kept (the generator's first items do not depend on how many are drawn, so the split does not either)."""
    if source.kind != "reasoning_gym":
        raise ValueError(f"the held-out and tuning splits are drawn from a reasoning_gym source, not {source.kind}")
    size = want
    while True:
        split = select_split(load_reasoning_gym(replace(source, size=size)), want, exclude, key)
        if split is not None:
            return split
        if size >= MAX_DRAW * want:
            raise SplitError(f"{source.name} (seed {source.seed}, options {source.options}): fewer than {want} "
                             f"distinct questions outside {sorted(exclude)} among its first {size} items")
        size *= 2


def check_splits(training: list[str], key=question_key, training_keys: frozenset = frozenset(),
                 **evaluated: list[str]) -> None:
    """Raise ``SplitError`` unless every evaluated split (name: its questions) repeats no question and no two
    of the splits and the training questions (and ``training_keys``, e.g. its demonstrations' sub-steps)
    share one, questions compared by ``key``."""
    problems = []
    keys = {"training": {key(q) for q in training} | set(training_keys)}
    for name, questions in evaluated.items():
        ks = [key(q) for q in questions]
        if len(set(ks)) != len(ks):
            repeated = sorted({k for k in ks if ks.count(k) > 1})
            problems.append(f"{name} repeats {len(repeated)} question(s), e.g. {repeated[:3]}")
        keys[name] = set(ks)
    names = list(keys)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            shared = sorted(keys[a] & keys[b])
            if shared:
                problems.append(f"{a} and {b} share {len(shared)} question(s), e.g. {shared[:3]}")
    if problems:
        raise SplitError("the evaluation splits are not disjoint: " + "; ".join(problems))


def split_rows(split: Split, seed: int) -> list[dict]:
    """A split as rows of a ``kind: file`` source (megareason.data.loaders' question/answer format): the
    question, gold answer, worked solution and data_source of each item, ``extra_info.index`` its position
    (the prompt id of the per-prompt rows) and where reasoning-gym made it."""
    rows = []
    for i, rec in enumerate(split.records):
        extra = {"index": i, "seed": seed, **{k: rec.extra_info[k] for k in ("generator", "generator_index")
                                               if k in rec.extra_info}}
        row = {"question": question_of(rec), "answer": rec.ground_truth, "data_source": rec.data_source,
               "extra_info": extra}
        if "solution" in rec.extra_info:
            row["solution"] = rec.extra_info["solution"]
        rows.append(row)
    return rows


def fingerprint(questions: list[str]) -> str:
    """A short hash of a split's questions, in order: results computed on another split do not match it."""
    return hashlib.sha256("\n".join(question_key(q) for q in questions).encode()).hexdigest()[:16]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prompt_rows(val_rows: list[dict], questions: list[str]) -> list[dict]:
    """One row per held-out prompt from a run's validation dump (one greedy sample per prompt), in prompt
    order; the dump's questions must be ``questions`` (the held-out split), else ``SplitError``."""
    val_rows = sorted(val_rows, key=lambda r: r["index"])
    if [question_key(r["question"]) for r in val_rows] != [question_key(q) for q in questions]:
        raise SplitError(f"the validation dump's {len(val_rows)} questions are not the held-out split's "
                         f"{len(questions)} (another held-out set, or prompts filtered by data.max_prompt_length)")
    out = []
    for r in val_rows:
        answer = final_answer(r["response"])
        if r["correct"] and answer is None:
            raise ValueError(f"held-out prompt {r['index']} is scored correct but has no final answer the "
                             "arithmetic reward parses: the dump was scored by another reward")
        out.append({"id": r["index"], "question": r["question"], "gold": r["ground_truth"], "response": r["response"],
                    "answer": answer, "parseable": answer is not None, "correct": bool(r["correct"]),
                    "truncated": bool(r["truncated"])})
    return out


def outcomes(runs: list[list[dict]]) -> tuple[np.ndarray, np.ndarray]:
    """(correct_SP, parseable_SP) as 0/1 floats from S runs' per-prompt rows (the same prompts, in order)."""
    ids = [[r["id"] for r in rows] for rows in runs]
    assert all(i == ids[0] for i in ids), "the runs' per-prompt rows are not over the same prompts"
    return (np.array([[float(r["correct"]) for r in rows] for rows in runs]),
            np.array([[float(r["parseable"]) for r in rows] for rows in runs]))


# The bootstrap and the exact tests in numpy and integers: scipy.stats has bootstrap and binomtest but is
# not a dependency of megareason, for a few lines each.
def _resample(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, n, size=(BOOTSTRAP, n))


def _interval(values: np.ndarray) -> list[float]:
    """The 2.5th and 97.5th percentiles of bootstrap replicates (a ratio's replicates without a denominator,
    nan, left out; all nan: nan)."""
    if np.isnan(values).all():
        return [float("nan"), float("nan")]
    return [float(np.nanpercentile(values, 2.5)), float(np.nanpercentile(values, 97.5))]


def bootstrap_mean(x: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of per-prompt values ``x`` [P] (resampling prompts)."""
    lo, hi = _interval(x[_resample(len(x), rng)].mean(axis=1))
    return lo, hi


def _ratio(num_P: np.ndarray, den_P: np.ndarray, idx: np.ndarray) -> np.ndarray:
    den = den_P[idx].sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num_P[idx].sum(axis=-1) / np.maximum(den, 1), np.nan)


def mcnemar_exact_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided exact McNemar test on paired 0/1 outcomes: a binomial(n_discordant, 1/2) test."""
    only_a, only_b = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def paired_exact_p(d: np.ndarray, seeds: int) -> float:
    """Two-sided exact sign-flip test of per-prompt differences ``d`` [P], each a multiple of 1/``seeds``
    (a difference of seed-averaged 0/1 outcomes): under the null every nonzero difference is as likely
    positive as negative, independently; p = P(|sum of randomly signed d| >= |sum d|), counted exactly.
    With ``seeds`` 1 this is McNemar's exact test (``mcnemar_exact_p``)."""
    units = np.rint(np.asarray(d, dtype=float) * seeds).astype(int)
    assert np.allclose(units, np.asarray(d, dtype=float) * seeds), "differences must be multiples of 1/seeds"
    counts = {0: 1}  # {sum of the signed units: number of sign assignments giving it}
    for size in range(1, seeds + 1):
        m = int((np.abs(units) == size).sum())
        if not m:
            continue
        signed = {size * (2 * j - m): math.comb(m, j) for j in range(m + 1)}  # j of the m made positive
        new: dict[int, int] = {}
        for s, c in counts.items():
            for t, k in signed.items():
                new[s + t] = new.get(s + t, 0) + c * k
        counts = new
    observed = abs(int(units.sum()))
    tail = sum(c for s, c in counts.items() if abs(s) >= observed)
    return tail / sum(counts.values())


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the j-th smallest p times (m - j + 1), made
    non-decreasing, at most 1 (rejecting where adjusted p <= alpha controls the family-wise error at alpha)."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def arm_stats(correct_SP: np.ndarray, parseable_SP: np.ndarray, rng: np.random.Generator) -> dict:
    """Accuracy, parseable-answer rate and accuracy among parseable answers (pooled over seeds), each with its
    95% bootstrap interval over prompts, and each seed's accuracy."""
    idx = _resample(correct_SP.shape[1], rng)
    correct_P, parseable_P = correct_SP.mean(axis=0), parseable_SP.mean(axis=0)
    among = float(correct_SP.sum() / parseable_SP.sum()) if parseable_SP.sum() else float("nan")
    return {"seeds": correct_SP.shape[0], "prompts": correct_SP.shape[1],
            "accuracy": float(correct_P.mean()), "accuracy_ci": _interval(correct_P[idx].mean(axis=1)),
            "parseable": float(parseable_P.mean()), "parseable_ci": _interval(parseable_P[idx].mean(axis=1)),
            "accuracy_parseable": among, "accuracy_parseable_ci": _interval(_ratio(correct_P, parseable_P, idx)),
            "accuracy_by_seed": [float(x) for x in correct_SP.mean(axis=1)]}


def paired(a: np.ndarray, b: np.ndarray, rng: np.random.Generator, seeds: int = 1) -> dict:
    """a - b on the same prompts (per-prompt values [P], seed-averaged over ``seeds`` runs): the difference of
    the means, its 95% bootstrap interval (prompts resampled jointly) and ``paired_exact_p``."""
    lo, hi = bootstrap_mean(a - b, rng)
    return {"diff": float((a - b).mean()), "ci": [lo, hi], "p": paired_exact_p(a - b, seeds)}


def versus(arm: tuple[np.ndarray, np.ndarray], other: tuple[np.ndarray, np.ndarray],
           rng: np.random.Generator) -> dict:
    """An arm against another on the same prompts (each ``(correct_SP, parseable_SP)``; the other arm has
    one seed or as many): the paired difference of accuracy and of parseable rate (``paired``), and of
    accuracy among parseable answers (its bootstrap interval alone: a ratio, no exact test)."""
    (ca, pa), (cb, pb) = arm, other
    seeds = math.lcm(ca.shape[0], cb.shape[0])
    out = {"accuracy": paired(ca.mean(axis=0), cb.mean(axis=0), rng, seeds),
           "parseable": paired(pa.mean(axis=0), pb.mean(axis=0), rng, seeds)}
    idx = _resample(ca.shape[1], rng)
    diffs = _ratio(ca.mean(axis=0), pa.mean(axis=0), idx) - _ratio(cb.mean(axis=0), pb.mean(axis=0), idx)
    ra, rb = (c.sum() / p.sum() if p.sum() else float("nan") for c, p in ((ca, pa), (cb, pb)))
    out["accuracy_parseable"] = {"diff": float(ra - rb), "ci": _interval(diffs)}
    return out
