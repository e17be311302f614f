"""The measures of ``tools/compare_methods.py``: what a held-out response is scored by, which held-out
questions a training pool already holds by their operands, the difficulty mix of a set of questions, and
intervals that resample training seeds as well as prompts.

**Measures** (one value per held-out prompt and run, all over every held-out prompt):

* ``strict``: the response's final answer, as the arithmetic reward reads it (a last ``\\boxed{}`` number,
  ``= number <eoe>`` or a trailing ``= number``), equals the gold answer;
* ``parseable``: the response has such a final answer at all;
* ``last_number``: the last number anywhere in the response equals the gold answer (no format needed: a
  response that computes the answer and then says it in words is counted);
* ``forced``: the model's own response followed by ``FORCED_PREFIX`` (``The final answer is \\boxed{``),
  decoded greedily for at most ``FORCED_TOKENS`` tokens: the number before the closing brace equals the gold
  answer. It separates what the model computed from how it chose to end its answer, and needs the trained
  weights: ``tools/forced_format.py`` decodes it, ``forced_rows`` scores the continuations.

Accuracy among parseable answers is not a measure here: the parseable responses are a selection that
training changes (a base model's unparseable answers can be right more often than its parseable ones).

**Operands.** ``operand_keys`` reads every two-number operation in a text (``57 * 47``, and in a worked
demonstration every sub-step whose operands are both numbers: ``57 * 40``, ``57 * 7``, ``2280 + 399``), as
``(op, a, b)`` with the operands sorted for ``+`` and ``*`` (``b * a`` is ``a * b``). A held-out question is
*operand-disjoint* from a training pool when its operation is none of the pool's questions' nor any of their
demonstrations' sub-steps.

**Intervals.** Each arm is S training runs (seeds) scored on P prompts, ``X_SP``. A training run is a
random draw as much as a prompt is, so the intervals resample both (a two-level bootstrap: S seeds with
replacement, P prompts with replacement, the statistic the mean over the drawn seeds and prompts; Davison
and Hinkley 1997, sec. 3.8, for nested data). Two arms compared on the same prompts share the prompt draw;
their seeds are drawn independently, or jointly when the runs are paired by design (the same seed from the
same start). With one seed an arm's interval covers prompts only. The variance of these replicates has a
closed form (``two_level_variance``) that the tests hold them to.
"""

from __future__ import annotations

import ast
import hashlib
import math
import re
from collections import Counter
from collections.abc import Iterable

import numpy as np

from megareason.rewards.arithmetic import NUMBER, last_number, parse_number

BOOTSTRAP = 10_000
MEASURES = ("strict", "parseable", "last_number", "forced")
MEASURE_NAMES = {"strict": "strict accuracy", "parseable": "parseable rate", "last_number": "last-number accuracy",
                 "forced": "forced-format accuracy"}
FORCED_PREFIX = "\n\nThe final answer is \\boxed{"
FORCED_TOKENS = 8

Key = tuple[str, int, int]
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
# A run of numbers joined by operators (and parentheses): the expressions a question or demonstration holds.
_CHAIN = re.compile(r"[\d(][\d\s+\-*/().]*[\d)]")


# ---- the measures


def same_number(answer: str | None, gold: str) -> bool:
    if answer is None:
        return False
    value = parse_number(answer)
    return value is not None and value == parse_number(gold)


def last_number_answer(response: str) -> str | None:
    """The last number anywhere in ``response`` (the arithmetic reward's number pattern, no fractions)."""
    return last_number(response, NUMBER)


def forced_answer(continuation: str) -> str | None:
    """The number a forced continuation puts in the box: the text before its first ``}``, if a number."""
    inside = continuation.split("}", 1)[0]
    return inside.strip() if parse_number(inside) is not None else None


def measure_rows(rows: list[dict]) -> dict[str, np.ndarray]:
    """{measure: per-prompt 0/1 [P]} of one run's per-prompt rows (``compare_methods_eval.prompt_rows``);
    ``forced`` only when every row has its ``forced_answer`` key (the run's weights were kept to decode it)."""
    out = {"strict": np.array([float(r["correct"]) for r in rows]),
           "parseable": np.array([float(r["parseable"]) for r in rows]),
           "last_number": np.array([float(same_number(last_number_answer(r["response"]), r["gold"])) for r in rows])}
    if rows and all("forced_answer" in r for r in rows):
        out["forced"] = np.array([float(same_number(r["forced_answer"], r["gold"])) for r in rows])
    return out


def forced_rows(rows: list[dict], continuations: list[str]) -> list[dict]:
    """``rows`` with ``forced_answer`` (``forced_answer`` of each greedy continuation, None: no number boxed)."""
    assert len(rows) == len(continuations)
    return [{**r, "forced_answer": forced_answer(c)} for r, c in zip(rows, continuations, strict=True)]


# ---- operands


def operand_key(a: int, op: str, b: int) -> Key:
    """An operation as the splits compare it: ``b + a`` and ``b * a`` are ``a + b`` and ``a * b``."""
    return (op, min(a, b), max(a, b)) if op in "+*" else (op, a, b)


def _number(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and isinstance(node.operand.value, int):
        return -node.operand.value
    return None


def operand_keys(text: str) -> set[Key]:
    """Every operation of two numbers in ``text``: in each ``=``-separated expression, each binary operation
    whose operands are both numbers, read with the operators' precedence (``57 * 40 + 57 * 7`` holds
    ``57 * 40`` and ``57 * 7``, not ``40 + 57``)."""
    keys = set()
    for part in re.split(r"=", text):
        for chain in _CHAIN.findall(part):
            try:
                tree = ast.parse(chain.strip(), mode="eval")
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
                    a, b = _number(node.left), _number(node.right)
                    if a is not None and b is not None:
                        keys.add(operand_key(a, _OPS[type(node.op)], b))
    return keys


def question_operation(question: str) -> Key | None:
    """The one operation a two-term question asks (``Calculate 57 * 47.``), or None (no expression, or one
    of more than two terms)."""
    chains = _CHAIN.findall(question)
    if len(chains) != 1:
        return None
    try:
        body = ast.parse(chains[0].strip(), mode="eval").body
    except SyntaxError:
        return None
    if not (isinstance(body, ast.BinOp) and type(body.op) in _OPS):
        return None
    a, b = _number(body.left), _number(body.right)
    return None if a is None or b is None else operand_key(a, _OPS[type(body.op)], b)


def pool_keys(questions: Iterable[str], solutions: Iterable[str]) -> set[Key]:
    """The operations a training pool holds: its questions' and its demonstrations' sub-steps'."""
    keys: set[Key] = set()
    for text in (*questions, *solutions):
        keys |= operand_keys(text)
    return keys


def pool_fingerprint(questions: list[str], solutions: list[str]) -> str:
    """A short hash of a training pool's questions and demonstrations, in order."""
    text = "\n".join(" ".join(q.split()) + "\t" + " ".join(s.split()) for q, s in zip(questions, solutions,
                                                                                          strict=True))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def disjoint_mask(questions: list[str], keys: set[Key]) -> np.ndarray:
    """[P] True where a held-out question's operation is not among ``keys`` (a question whose operation
    cannot be read counts as disjoint only if its text is none of them: it has no key to match)."""
    return np.array([question_operation(q) not in keys for q in questions])


# ---- difficulty


def difficulty(key: Key | None) -> str:
    """A question's difficulty class: its operator and its operands' sizes, a product by a multiple of ten
    (a shifted one-digit product) apart from a genuine two-digit one."""
    if key is None:
        return "other"
    op, a, b = key
    digits = sorted(len(str(abs(x))) for x in (a, b))
    name = {"+": "sum", "-": "difference", "*": "product", "/": "quotient"}[op]
    if digits[0] == 1:
        return f"{name}, a one-digit operand"
    if op == "*" and (a % 10 == 0 or b % 10 == 0):
        return f"{name}, a multiple of ten"
    return f"{name}, both operands 2+ digits"


def mix(questions: Iterable[str]) -> Counter:
    return Counter(difficulty(question_operation(q)) for q in questions)


# ---- the two-level bootstrap


def prompt_weights(n: int, rng: np.random.Generator, draws: int = BOOTSTRAP) -> np.ndarray:
    """[draws, n] bootstrap weights: how often each of n items is drawn in a resample, over n."""
    return rng.multinomial(n, np.full(n, 1 / n), size=draws) / n


def replicates(x_SP: np.ndarray, w_BP: np.ndarray, v_BS: np.ndarray) -> np.ndarray:
    """[B] the mean of ``x_SP`` over each resample's drawn prompts (weights ``w_BP``) and seeds (``v_BS``)."""
    return ((w_BP @ x_SP.T) * v_BS).sum(axis=1)


def two_level(arms: list[np.ndarray], rng: np.random.Generator, paired_seeds: bool = False) -> list[np.ndarray]:
    """Bootstrap replicates [B] of the mean of each of ``arms`` (each ``x_SP`` on the same P prompts), the
    prompts drawn once for all of them; seeds drawn per arm, or once for all when ``paired_seeds`` (every
    arm then has the same S, its seed i paired with the others' seed i)."""
    w = prompt_weights(arms[0].shape[1], rng)
    if paired_seeds:
        assert len({x.shape[0] for x in arms}) == 1, "paired seeds need the same number of seeds"
        v = prompt_weights(arms[0].shape[0], rng)
        return [replicates(x, w, v) for x in arms]
    return [replicates(x, w, prompt_weights(x.shape[0], rng)) for x in arms]


def interval(values: np.ndarray) -> list[float]:
    """The 2.5th and 97.5th percentiles of bootstrap replicates."""
    return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))]


def bootstrap_p(diffs: np.ndarray) -> float:
    """Two-sided bootstrap p of a difference being 0: twice the smaller share of replicates on either side of
    0 (at least one replicate's share: the resolution of the bootstrap), at most 1."""
    side = min(float((diffs <= 0).mean()), float((diffs >= 0).mean()))
    return min(1.0, max(2 * side, 1 / len(diffs)))


def two_level_variance(x_SP: np.ndarray) -> float:
    """The exact variance of ``replicates`` for one arm: with r the seeds' means, c the prompts' means and all
    population variances, (P-1) var(r) / (S P) + (S-1) var(c) / (S P) + var(x) / (S P) (a drawn pair of
    cells shares its seed, its prompt, both, or neither)."""
    s, p = x_SP.shape
    return ((p - 1) * x_SP.mean(axis=1).var() + (s - 1) * x_SP.mean(axis=0).var() + x_SP.var()) / (s * p)


def contrast(a_SP: np.ndarray, b_SP: np.ndarray, rng: np.random.Generator, paired_seeds: bool = False) -> dict:
    """a − b on the same prompts: the difference of the means, its 95% two-level bootstrap interval and
    bootstrap p (not yet adjusted for multiplicity)."""
    ra, rb = two_level([a_SP, b_SP], rng, paired_seeds)
    d = ra - rb
    return {"diff": float(a_SP.mean() - b_SP.mean()), "ci": interval(d), "p": bootstrap_p(d)}


def arm_measures(runs: list[dict[str, np.ndarray]], rng: np.random.Generator) -> dict:
    """Each measure every run has: the mean over seeds and prompts, its 95% two-level interval, each seed's
    value."""
    out = {}
    for m in MEASURES:
        if not all(m in r for r in runs):
            continue
        x = np.stack([r[m] for r in runs])
        (rep,) = two_level([x], rng)
        out[m] = {"value": float(x.mean()), "ci": interval(rep), "by_seed": [float(v) for v in x.mean(axis=1)]}
    return out


def fmt_p(p: float) -> str:
    return "<1e-4" if p <= 1e-4 else f"{p:.2g}"


def signed(x: float, ci: list[float]) -> str:
    if math.isnan(x):
        return "—"
    return f"{x:+.3f} ({ci[0]:+.3f} to {ci[1]:+.3f})"
