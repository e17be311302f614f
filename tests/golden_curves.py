"""Golden curves: the per-step metrics of short deterministic tiny-model runs, recorded once and compared
exactly (the runs are bit-reproducible on this machine: same seeds, same thread counts, same kernels).

A refactor must leave them unchanged. To re-record them (``tools/regen_golden.sh``) set
``MEGAREASON_WRITE_GOLDEN=1``; a changed ``tests/golden/*.jsonl`` must be explained in its commit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden"
# Wall-clock measurements differ from run to run; everything else must not, except:
VOLATILE_PREFIXES = ("time/", "throughput/", "sync/seconds")
# Metrics compared within a tolerance, |this run - golden| <= abs + rel * |golden| (metric: (abs, rel)):
TOLERANCE = {
    # vLLM's log-probs of the sampled tokens (``rollout_logp_BT``) vary in the last float32 bits with the
    # engine's batch composition, which depends on when the requests reach the engine core (the tokens,
    # seeded per request, do not). Nothing else reads them (the losses use the trainer's own log-probs).
    "rollout/token_mult_prob_error": (0.0, 1e-5),
    "rollout/max_abs_logp_diff": (0.0, 1e-5),
    # The KL term's value compares two forward passes over the same tokens (the actor's in the update, the
    # reference's in its own pass): at step 1 the weights are equal and it is 0, up to float noise seen once
    # in CI (2.7e-9 for compare_raro, step 1; 0.0 in every other run).
    "actor/kl": (1e-8, 0.0),
    # A sum over every response token of every row of the batch (in no loss unless ``entropy_coef`` > 0, so
    # nothing else moves with it); CI saw it differ once in the 7th digit in the RARO e2e (2.93426760 vs
    # golden 2.93426897, every loss, norm and reward equal).
    "actor/entropy": (0.0, 1e-5),
}


def curve(metrics: dict[int, dict]) -> list[dict]:
    """The comparable part of a run's metrics.jsonl rows, in step order."""
    return [{k: v for k, v in sorted(metrics[s].items()) if not k.startswith(VOLATILE_PREFIXES)}
            for s in sorted(metrics)]


def recording() -> bool:
    """Whether this run re-records the golden curves (``tools/regen_golden.sh``) instead of checking them."""
    return os.environ.get("MEGAREASON_WRITE_GOLDEN") == "1"


def golden(name: str) -> dict[int, dict]:
    """``tests/golden/<name>.jsonl`` as step -> row (the comparable metrics of the recorded run)."""
    rows = [json.loads(line) for line in (GOLDEN / f"{name}.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def check_golden(name: str, metrics: dict[int, dict]) -> None:
    """Assert that ``metrics`` (step -> row) equals ``tests/golden/<name>.jsonl`` exactly (or record it)."""
    rows, path = curve(metrics), GOLDEN / f"{name}.jsonl"
    if recording():
        GOLDEN.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return
    expected = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in expected], f"{path.name}: other steps"
    for got, want in zip(rows, expected, strict=True):
        diff = {k: (got.get(k), want.get(k)) for k in sorted(set(got) | set(want))
                if not _same(k, got.get(k), want.get(k))}
        assert not diff, f"{path.name} step {want['step']}: (this run, golden) differ: {diff}"


def _same(key: str, got, want) -> bool:
    if key in TOLERANCE and got is not None and want is not None:
        atol, rtol = TOLERANCE[key]
        return abs(got - want) <= atol + rtol * abs(want)
    return got == want
