"""Reward scoring throughput: one process against the reward pool, then pathological inputs.

Scores ``--samples`` generated competition-math responses (right and wrong boxed answers, LaTeX
fractions, decimals, radicals, polynomials, missing boxes) once in this process and once with
``megareason.rewards.pool`` (workers = ``os.cpu_count()``, start-up of the workers included), prints
samples/second for each, their ratio and whether the two agree on every sample; then scores a few
pathological answers (exponent towers, huge factorials, deep continued fractions) in the pool with
``--timeout`` and prints how many timed out.

Then the answer-equivalence layer: on the hand-written pairs in ``--pairs`` (equivalent answers and
near-miss wrong ones, by kind), the accepted-equivalent and rejected-wrong rates of the project's
``math`` reward and of plain math-verify (the reward before the layer: string check + math-verify),
and the scoring time per sample of both, measured in this run on the generated samples and on the
pairs, printed as a ratio (goal: at most 1.5x).

Then the hand-labelled adversarial pairs of ``--adversarial`` (``tools/data/reward_pairs_adversarial.jsonl``:
one JSON object a line, ``family`` (the data_source scored), ``gold``, the full ``response``, ``label``
(1 = a careful grader pays it), ``kind``, optionally ``question``, ``debatable`` (left out of the rates)
and ``note``): paid-right and refused-wrong rates of the project's reward and of plain math-verify
(``verify(parse(gold), parse(response))``, its own answer extraction), per kind, every pair where either
disagrees with the label listed, written to ``--out`` as ``bench_rewards_<name>.{md,json}`` for
``reward_pairs_<name>.jsonl`` (``tools/data/reward_pairs_heldout.jsonl``: pairs written after the rules, to
measure them out of sample).

    .venv/bin/python tools/bench_rewards.py --samples 300
    .venv/bin/python tools/bench_rewards.py                   # 10,000 samples, 5 s timeout
    .venv/bin/python tools/bench_rewards.py --only adversarial --out docs/results
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import Counter
from pathlib import Path

from math_verify import parse, verify

from megareason.rewards.equivalence_sets import to_sympy
from megareason.rewards.math import last_boxed, math_verify_equal, normalize_answer
from megareason.rewards.pool import ScoreRequest, score_all
from megareason.rewards.registry import compute_score

PAIRS = Path(__file__).resolve().parent.parent / "tests" / "data" / "equivalence_pairs.tsv"
ADVERSARIAL = Path(__file__).resolve().parent / "data" / "reward_pairs_adversarial.jsonl"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=10_000, help="generated math samples (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=5.0, help="per-sample timeout in seconds (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sample generator seed (default: %(default)s)")
    p.add_argument("--pairs", type=Path, default=PAIRS, help="equivalence pairs file (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds, best kept (default: %(default)s)")
    p.add_argument("--adversarial", type=Path, default=ADVERSARIAL, help="adversarial pairs (default: %(default)s)")
    p.add_argument("--only", choices=["adversarial"], help="run only this section")
    p.add_argument("--out", type=Path, help="write the adversarial section's results here (.md and .json)")
    return p.parse_args(argv)


def _answer_pair(rng: random.Random) -> tuple[str, str]:
    """(boxed answer, gold): about half equivalent, half wrong, across answer forms."""
    a, b = rng.randint(1, 40), rng.randint(2, 40)
    right = rng.random() < 0.5
    kind = rng.choice(["int", "frac", "frac_scaled", "decimal", "sqrt", "poly", "negative"])
    if kind == "int":
        n = rng.randint(-500, 5000)
        return str(n if right else n + rng.randint(1, 9)), str(n)
    if kind == "frac":
        return (rf"\dfrac{{{a}}}{{{b}}}" if right else rf"\frac{{{b}}}{{{a}}}"), rf"\frac{{{a}}}{{{b}}}"
    if kind == "frac_scaled":  # equal only after reduction: needs math-verify
        k = rng.randint(2, 9)
        return rf"\frac{{{k * a}}}{{{k * b + (0 if right else 1)}}}", rf"\frac{{{a}}}{{{b}}}"
    if kind == "decimal":
        b = rng.choice([2, 4, 5, 8, 10, 20, 25])
        return f"{a / b + (0 if right else 0.5):g}", rf"\frac{{{a}}}{{{b}}}"
    if kind == "sqrt":
        k = rng.randint(2, 6)
        return rf"\sqrt{{{k * k * b}}}", rf"{k if right else k + 1}\sqrt{{{b}}}"
    if kind == "poly":
        return rf"x^2 + {2 * a}x + {a * a}", rf"(x+{a if right else a + 1})^2"
    return rf"-\frac{{{a}}}{{{b}}}", rf"{'-' if right else ''}\frac{{{a}}}{{{b}}}"


def build_samples(n: int, seed: int) -> list[ScoreRequest]:
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        answer, gold = _answer_pair(rng)
        work = " ".join(f"step {j}: {rng.randint(1, 99)} + {rng.randint(1, 99)}." for j in range(rng.randint(1, 8)))
        if rng.random() < 0.05:  # no boxed answer at all
            response = f"{work} I think the answer is {answer}."
        else:
            response = f"{work} Therefore the answer is $\\boxed{{{answer}}}$."
        requests.append(ScoreRequest("math", response, gold, {}, f"math-{i}"))
    return requests


def pathological() -> list[ScoreRequest]:
    cf = "1"
    for _ in range(40):
        cf = rf"1+\frac{{1}}{{{cf}}}"
    answers = [
        (r"9^{9^{9^{9}}}", "5"),
        (r"10^{10^{10}}", "7"),
        (r"2^{2^{2^{2^{2^{2}}}}}", "3"),
        (r"100000000!", "5"),
        (r"\frac{(10^{6})!}{(10^{6}-1)!}", "1000000"),
        (cf, r"\frac{1+\sqrt{5}}{2}"),
    ]
    return [ScoreRequest("math", rf"\boxed{{{a}}}", g, {}, f"pathological-{i}") for i, (a, g) in enumerate(answers)]


def load_pairs(path: Path) -> list[tuple[str, bool, str, str]]:
    """(kind, expected, reference, answer) rows of a tab-separated pairs file ('#' lines skipped)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            kind, expected, reference, answer = line.split("\t")
            rows.append((kind, expected == "1", reference, answer))
    return rows


def plain_math_verify(request: ScoreRequest) -> bool:
    """The math reward before the equivalence layer: last boxed answer, string check, math-verify."""
    answer = last_boxed(request.response)
    if answer is None:
        return False
    return normalize_answer(answer) == normalize_answer(request.ground_truth) or math_verify_equal(
        answer, request.ground_truth
    )


def math_reward(request: ScoreRequest) -> bool:
    """The project's ``math`` reward (math-verify plus the equivalence layer)."""
    return compute_score("math", request.response, request.ground_truth, request.extra_info).correct


def _seconds_per_sample(scorers, requests: list[ScoreRequest], rounds: int) -> list[float]:
    """Per-sample scoring time of each scorer: whole passes over ``requests``, the scorers taking
    turns (so load from other processes hits all alike), best of ``rounds``.  The equivalence
    layer's parse cache is emptied before every pass, so no pass profits from an earlier one."""
    best = [float("inf")] * len(scorers)
    for _ in range(rounds):
        for i, scorer in enumerate(scorers):
            to_sympy.cache_clear()
            t0 = time.perf_counter()
            for r in requests:
                scorer(r)
            best[i] = min(best[i], time.perf_counter() - t0)
    return [b / len(requests) for b in best]


def equivalence_report(pairs: list[tuple[str, bool, str, str]], samples: list[ScoreRequest], rounds: int) -> None:
    """Accepted-equivalent / rejected-wrong rates and time per sample: math reward vs plain math-verify."""
    requests = [ScoreRequest("math", rf"The answer is $\boxed{{{a}}}$.", ref, {}, k) for k, _, ref, a in pairs]
    n_eq = sum(expected for _, expected, _, _ in pairs)
    print(f"\nequivalence pairs ({len(pairs)}: {n_eq} equivalent, {len(pairs) - n_eq} wrong)")
    missed: Counter[str] = Counter()
    for name, scorer in (("plain math-verify", plain_math_verify), ("math reward", math_reward)):
        verdicts = [scorer(r) for r in requests]
        accepted = sum(v for v, (_, e, _, _) in zip(verdicts, pairs, strict=True) if e)
        rejected = sum(not v for v, (_, e, _, _) in zip(verdicts, pairs, strict=True) if not e)
        print(f"  {name:18s} accepts {accepted / n_eq:6.1%} of equivalents ({accepted}/{n_eq}), "
              f"rejects {rejected / (len(pairs) - n_eq):6.1%} of wrong ({rejected}/{len(pairs) - n_eq})")
        if scorer is math_reward:
            missed.update(k for v, (k, e, _, _) in zip(verdicts, pairs, strict=True) if v != e)
    if missed:
        print("  math reward's mistakes by kind: " + ", ".join(f"{k} {n}" for k, n in missed.most_common()))
    for label, reqs in (("generated samples", samples), ("equivalence pairs", requests)):
        t_old, t_new = _seconds_per_sample([plain_math_verify, math_reward], reqs, rounds)
        print(f"  time per sample, {label:17s}: plain math-verify {t_old * 1e3:7.2f} ms, "
              f"math reward {t_new * 1e3:7.2f} ms -> {t_new / t_old:.2f}x")


def load_adversarial(path: Path) -> list[dict]:
    """The adversarial pairs; a malformed line is a ValueError naming the file, the line and the field."""
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        for field, kind in (("family", str), ("gold", str), ("response", str), ("label", int), ("kind", str)):
            if not isinstance(row.get(field), kind):
                raise ValueError(f"{path}:{n}: field {field!r} must be a {kind.__name__}, got {row.get(field)!r}")
        rows.append(row)
    return rows


def plain_math_verify_grader(row: dict) -> bool:
    """math-verify as a grader: its own extraction of the response's answer, then ``verify``."""
    try:
        gold = parse(row["gold"] if "$" in row["gold"] else f"${row['gold']}$")
        pred = parse(row["response"])
        return bool(gold and pred and verify(gold, pred))
    except Exception:
        return False


def project_grader(row: dict) -> bool:
    extra = {"question": row["question"]} if "question" in row else {}
    return compute_score(row["family"], row["response"], row["gold"], extra).correct


def adversarial_report(rows: list[dict], out: Path | None, source: Path = ADVERSARIAL) -> dict:
    """Paid-right / refused-wrong rates of the project and plain math-verify; disagreements listed."""
    scored = [r for r in rows if not r.get("debatable")]
    graders = {"project": project_grader, "plain math-verify": plain_math_verify_grader}
    verdicts, seconds = {}, {}
    for name, grader in graders.items():
        to_sympy.cache_clear()
        t0 = time.perf_counter()
        verdicts[name] = [grader(r) for r in scored]
        seconds[name] = (time.perf_counter() - t0) / len(scored)
    n_right = sum(r["label"] == 1 for r in scored)
    n_wrong = len(scored) - n_right
    summary = {"pairs": len(rows), "debatable_left_out": len(rows) - len(scored), "right": n_right, "wrong": n_wrong}
    by_kind: dict[str, dict[str, list[int]]] = {}
    for name, vs in verdicts.items():
        paid = sum(v for v, r in zip(vs, scored, strict=True) if r["label"] == 1)
        refused = sum(not v for v, r in zip(vs, scored, strict=True) if r["label"] == 0)
        summary[name] = {"paid_right": paid, "paid_right_rate": paid / n_right, "refused_wrong": refused,
                         "refused_wrong_rate": refused / n_wrong, "ms_per_pair": seconds[name] * 1e3}
        # seconds: one pass, the parse cache emptied first (a loaded machine inflates both alike)
        for v, r in zip(vs, scored, strict=True):
            k = by_kind.setdefault(r["kind"], {}).setdefault(name, [0, 0])
            k[0] += v == bool(r["label"])
            k[1] += 1
    disagreements = [
        {**{k: r[k] for k in ("family", "kind", "gold", "response", "label")},
         **{name: verdicts[name][i] for name in graders}}
        for i, r in enumerate(scored) if any(verdicts[name][i] != bool(r["label"]) for name in graders)
    ]
    summary["by_kind"] = by_kind
    summary["disagreements"] = disagreements
    summary["debatable"] = [{**{k: r.get(k, "") for k in ("family", "kind", "gold", "response", "label", "note")},
                             **{name: grader(r) for name, grader in graders.items()}}
                            for r in rows if r.get("debatable")]
    for name in graders:
        s = summary[name]
        print(f"  {name:18s} pays {s['paid_right_rate']:6.1%} of right ({s['paid_right']}/{n_right}), refuses "
              f"{s['refused_wrong_rate']:6.1%} of wrong ({s['refused_wrong']}/{n_wrong}), "
              f"{s['ms_per_pair']:.1f} ms/pair")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = "bench_rewards_" + source.stem.removeprefix("reward_pairs_")
        _write_atomic(out / f"{stem}.json", json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
        _write_atomic(out / f"{stem}.md", _markdown(summary, list(graders), source))
    return summary


def _cell(text: str) -> str:
    return "`" + text.replace("\n", "⏎").replace("|", "\\|").replace("`", "'") + "`"


def _markdown(summary: dict, names: list[str], source: Path) -> str:
    lines = [
        "# Rewards on hand-labelled adversarial pairs",
        "",
        f"`tools/data/{source.name}`: {summary['pairs']} (gold, response, label) pairs, "
        f"{summary['debatable_left_out']} marked debatable and left out, {summary['right']} right and "
        f"{summary['wrong']} wrong answers. Made by `.venv/bin/python tools/bench_rewards.py --only adversarial "
        f"--adversarial tools/data/{source.name} --out docs/results`. Plain math-verify is "
        "`verify(parse(gold), parse(response))`: its own answer "
        "extraction, for every family.",
        "",
        "| grader | right answers paid | wrong answers refused | ms per pair |",
        "|---|---|---|---|",
    ]
    for name in names:
        s = summary[name]
        lines.append(f"| {name} | {s['paid_right_rate']:.1%} ({s['paid_right']}/{summary['right']}) | "
                     f"{s['refused_wrong_rate']:.1%} ({s['refused_wrong']}/{summary['wrong']}) | "
                     f"{s['ms_per_pair']:.1f} |")
    lines += ["", "## Agreement with the labels by kind", "", "| kind | " + " | ".join(names) + " |",
              "|---|" + "---|" * len(names)]
    for kind, per in sorted(summary["by_kind"].items()):
        lines.append(f"| {kind} | " + " | ".join(f"{per[n][0]}/{per[n][1]}" for n in names) + " |")
    lines += ["", "## Every pair where a grader disagrees with the label", "",
              "| family | kind | gold | response | label | " + " | ".join(names) + " |",
              "|---|---|---|---|---|" + "---|" * len(names)]
    for d in summary["disagreements"]:
        lines.append(f"| {d['family']} | {d['kind']} | {_cell(d['gold'])} | {_cell(d['response'])} | {d['label']} | "
                     + " | ".join("paid" if d[n] else "refused" for n in names) + " |")
    lines += ["", "## The debatable pairs (left out of the rates), with the label written for them", "",
              "| family | kind | gold | response | label | note | " + " | ".join(names) + " |",
              "|---|---|---|---|---|---|" + "---|" * len(names)]
    for d in summary["debatable"]:
        lines.append(f"| {d['family']} | {d['kind']} | {_cell(d['gold'])} | {_cell(d['response'])} | {d['label']} | "
                     f"{d['note']} | " + " | ".join("paid" if d[n] else "refused" for n in names) + " |")
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _timed(requests, **kwargs):
    t0 = time.perf_counter()
    out = score_all(requests, **kwargs)
    return out, time.perf_counter() - t0


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.only == "adversarial":
        print(f"adversarial pairs ({args.adversarial})")
        adversarial_report(load_adversarial(args.adversarial), args.out, args.adversarial)
        return
    workers = os.cpu_count() or 1
    requests = build_samples(args.samples, args.seed)

    single, t_single = _timed(requests, workers=0, timeout=args.timeout)
    pooled, t_pool = _timed(requests, workers=workers, timeout=args.timeout)
    agree = sum(a == b for a, b in zip(single, pooled, strict=True))
    print(f"{len(requests)} math samples, {sum(o.correct for o in single)} correct")
    print(f"single process: {len(requests) / t_single:9.1f} samples/s ({t_single:.2f} s)")
    print(f"pool ({workers} workers): {len(requests) / t_pool:9.1f} samples/s ({t_pool:.2f} s, start-up included)")
    print(f"speed-up: {t_single / t_pool:.2f}x; outcomes agree on {agree}/{len(requests)} samples")

    bad = pathological()
    out, t_bad = _timed(bad, workers=workers, timeout=args.timeout)
    timed_out = sum(o.timed_out for o in out)
    print(f"pathological: {timed_out}/{len(bad)} timed out (timeout {args.timeout:g} s), "
          f"{sum(bool(o.error) and not o.timed_out for o in out)} errors, {t_bad:.1f} s wall")
    for r, o in zip(bad, out, strict=True):
        status = "timed out" if o.timed_out else (o.error or f"score {o.score:g}")
        print(f"  {r.response[:50]:50s} vs {r.ground_truth[:20]:20s} -> {status}")

    equivalence_report(load_pairs(args.pairs), requests, args.rounds)
    print(f"\nadversarial pairs ({args.adversarial})")
    adversarial_report(load_adversarial(args.adversarial), args.out, args.adversarial)


if __name__ == "__main__":
    main()
