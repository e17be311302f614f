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
# Metrics compared within a tolerance, |this run - other| <= abs + rel * |other| (metric or prefix: (abs, rel)).
# Between two runs on one machine (a resumed run and the uninterrupted one; a golden curve):
TOLERANCE = {
    # vLLM's log-probs of the sampled tokens (``rollout_logp_BT``) vary with the engine's batch composition,
    # which depends on when the requests reach the engine core (the tokens, seeded per request, do not);
    # in fp32 they are within ~2e-5 of transformers' per token. Nothing else reads them (the losses use
    # the trainer's own log-probs), so only their size is compared: 1e-4 per token, 1e-4 of the product.
    "rollout/token_mult_prob_error": (1e-4, 1e-4),
    "rollout/max_abs_logp_diff": (1e-4, 1e-4),
    # The KL term's value compares two forward passes over the same tokens (the actor's in the update, the
    # reference's in its own pass): at step 1 the weights are equal and it is 0, up to float noise seen once
    # in CI (2.7e-9 for compare_raro, step 1; 0.0 in every other run).
    "actor/kl": (1e-8, 0.0),
}
# Added for a golden curve, recorded on one kind of CPU and checked on whichever CI runs on: the trainer's
# float sums take other kernels (another vector width, another order) on another CPU kind. Measured against
# the recorded curves, fp32 runs (tools/golden_across_isa.py; DEVELOPERS.md, "Golden curves", has the table):
# - an AMD EPYC (AVX-512, bf16): RARO after two steps, losses 1.8e-6 relative, grad norms 3.9e-7; PPO (a
#   critic, whitened GAE advantages, two mini-batches) after six steps, grad norms up to 8.5e-5 relative, the
#   critic's sums up to 2.6e-4, the policy loss (a mean of terms that nearly cancel) up to 1.3e-3 relative,
#   7.6e-6 absolute, and one token of 128 crossing the value clip at step 6;
# - an Intel Xeon (AVX-512, bf16) with its own kernels: PPO's policy loss 1.6e-4 relative, grad norms 2.6e-5,
#   the critic's 4.1e-5; and with PyTorch, oneDNN, MKL and vLLM restricted to AVX2: PPO's policy loss 1.3e-3
#   relative (8.3e-6 absolute), grad norms 1.6e-4 (the actor's) and 2.1e-4 (the critic's), one value-clip
#   token of 128; RARO within 2e-6; and at PPO's step 6 a greedy validation answer of another token
#   (val/reward 0.1515 against 0.1485): past some steps the run is chaotic, see HORIZON_ACROSS_CPU_KINDS.
# Everything a sampled token decides (rewards, lengths, accuracies) stays exact within the horizon; bf16 runs
# differ by percents between CPU kinds, so they are compared with a run of the same session instead
# (test_faults.py).
ACROSS_CPU_KINDS = {"actor/": (2e-5, 2e-3), "critic/": (2e-5, 2e-3), "sft/": (2e-5, 2e-3), "val/loss": (2e-5, 2e-3),
                    "actor/kl": (2e-5, 2e-3),  # (replaces TOLERANCE's: RARO's KL differed by 2e-6 relative)
                    "actor/clipfrac": (1 / 64, 0.0), "critic/vf_clipfrac": (1 / 64, 0.0)}
# Steps of a golden curve compared across CPU kinds where the run is chaotic further on: a difference in the
# last bits moves a sampled or greedy token a few steps later, and every metric after it differs. PPO: an
# AVX2-only AMD EPYC had the actor's grad norm at step 5 0.58% from the curve (9.816 against 9.759), this
# machine restricted to AVX2 a validation answer at step 6; steps 1-4 agree within ACROSS_CPU_KINDS on both.
# stop_tp2 (GSPO at lr 1e-2) and async_off, restricted to AVX2 here: step 3 of stop_tp2 sampled other tokens
# (reward/mean 0.18847 against 0.18856, a greedy validation answer moved val/reward 0.198 -> 0.260) and
# async_off's step-3 actor/is_ratio_max was 0.45% off (32.82 against 32.67); steps 1-2 agree on both.
# Later steps must still be there with the same metrics; the test's own assertions check what they show.
# On the kind of CPU the curves were recorded on (``cpu_kind.json``) every step is compared.
HORIZON_ACROSS_CPU_KINDS = {"ppo": 4, "stop_tp2": 2, "async_off": 2}
CPU_KIND = GOLDEN / "cpu_kind.json"


def cpu_kind() -> dict[str, str]:
    """What decides this machine's float kernels: the CPU's model and the vector width PyTorch picked
    (``ATEN_CPU_CAPABILITY`` lowers it)."""
    import torch

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")
    return {"model": model, "capability": torch.backends.cpu.get_cpu_capability()}


def recorded_here() -> bool:
    """Whether the golden curves were recorded on this kind of CPU (then no horizon applies)."""
    return CPU_KIND.exists() and json.loads(CPU_KIND.read_text()) == cpu_kind()


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


def check_golden(name: str, metrics: dict[int, dict], record: bool = True, tolerance: dict | None = None) -> None:
    """Assert that ``metrics`` (step -> row) equals ``tests/golden/<name>.jsonl`` (``TOLERANCE`` and
    ``ACROSS_CPU_KINDS`` apart) at every step on the CPU kind it was recorded on, elsewhere up to the curve's
    ``HORIZON_ACROSS_CPU_KINDS`` and by its steps and metric names after it; or, while recording, record it
    (``record=False``: a run that must give a curve another run of the test records, compared with it whether
    recording or not; ``tolerance``: more, for such a run)."""
    path = GOLDEN / f"{name}.jsonl"
    if recording() and record:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in curve(metrics)))
        CPU_KIND.write_text(json.dumps(cpu_kind()) + "\n")
        return
    want = golden(name)
    horizon = max(want) if recorded_here() else HORIZON_ACROSS_CPU_KINDS.get(name, max(want))
    assert sorted(metrics) == sorted(want), f"{path.name}: steps {sorted(metrics)}, recorded {sorted(want)}"
    for step in [s for s in sorted(want) if s > horizon]:
        assert set(curve({0: metrics[step]})[0]) == set(curve({0: want[step]})[0]), f"{path.name} step {step}: " \
            f"other metrics"
    _check({s: metrics[s] for s in metrics if s <= horizon}, {s: want[s] for s in want if s <= horizon}, path.name,
           {**TOLERANCE, **ACROSS_CPU_KINDS, **(tolerance or {})})


def check_same(metrics: dict[int, dict], reference: dict[int, dict], what: str) -> None:
    """Assert that two runs of this session have the same metrics, every one of every step (``TOLERANCE``
    apart: vLLM's batch-dependent log-probs)."""
    _check(metrics, reference, what, TOLERANCE)


def _check(metrics: dict[int, dict], expected: dict[int, dict], what: str, tolerance: dict) -> None:
    rows, want_rows = curve(metrics), curve(expected)
    assert [r["step"] for r in rows] == [r["step"] for r in want_rows], f"{what}: other steps"
    for got, want in zip(rows, want_rows, strict=True):
        diff = {k: (got.get(k), want.get(k)) for k in sorted(set(got) | set(want))
                if not _same(tolerance, k, got.get(k), want.get(k))}
        assert not diff, f"{what} step {want['step']}: (this run, expected) differ: {diff}"


def _same(tolerance: dict, key: str, got, want) -> bool:
    bound = tolerance.get(key) or next((v for k, v in tolerance.items() if k.endswith("/") and key.startswith(k)),
                                       None)
    if bound is not None and got is not None and want is not None:
        atol, rtol = bound
        return abs(got - want) <= atol + rtol * abs(want)
    return got == want
