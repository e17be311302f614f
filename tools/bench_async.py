"""GRPO step time: synchronous vs one step off-policy, same model, prompts and settings, one run.

Three arms of ``megareason train`` on SmolLM2-135M-Instruct (configs/grpo_smollm2_cpu.yaml, float32, no
validation, no checkpoints), each PROMPTS x GROUP samples of at most MAX_TOKENS tokens per step:

* ``colocated``: today's default: the engine in the policy's rank, generate -> train -> sync in turn;
* ``separate``: the engine in a process of its own (``rollout.placement: separate``), still in turn
  (``trainer.max_staleness: 0``): what separating alone costs;
* ``one-step-off``: the same separate engine generating batch k+1 while step k trains
  (``trainer.max_staleness: 1``);
* ``separate-broadcast``, ``one-step-off-broadcast``: the two separate arms with the weights sent by the
  collective broadcast (``rollout.weight_transfer: broadcast``, what engines on other nodes take) instead of the
  trainer node's tmpfs: the ``sync`` column compares the two transfers, and one step off over in turn is
  printed for each.

For each: the median seconds per step over the steps after the first two (step 1 warms up; in the
one-step-off arm, step 1 generates its batch in turn, as the on-policy arms do), and where the driver's
time goes per step: ``generate`` (waiting for a generation it started in turn), ``generate_wait`` (waiting
for the batch started during the previous step), ``sync`` (the weight push), ``reward``, ``train``, and,
beside them, ``engine_generate``: the seconds the engine itself spent on the step's batch. On a machine
whose cores are shared by the trainer and the engine (this one: 2), overlap gives little: the separate
engine has only its own cores while the trainer trains on the rest.

    .venv/bin/python tools/bench_async.py --steps 6
    .venv/bin/python tools/bench_async.py --steps 6 --json docs/results/bench_async.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"colocated": [], "separate": ["rollout.placement=separate"],
        "one-step-off": ["rollout.placement=separate", "trainer.max_staleness=1"],
        "separate-broadcast": ["rollout.placement=separate", "rollout.weight_transfer=broadcast"],
        "one-step-off-broadcast": ["rollout.placement=separate", "trainer.max_staleness=1",
                                   "rollout.weight_transfer=broadcast"]}
PHASES = ("generate", "generate_wait", "sync", "reward", "logprobs", "train", "engine_generate")


def run(args, arm: str, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "megareason.cli", "train", "--config-name", "grpo_smollm2_cpu",
           f"trainer.steps={args.steps}", f"trainer.prompts_per_step={args.prompts}", f"rollout.n={args.group}",
           f"rollout.max_tokens={args.max_tokens}", "trainer.val_before_train=false", "trainer.val_every=0",
           "data.val_sources=[]", "trainer.save_every=0", "trainer.dump_rollouts_every=0",
           "trainer.loggers=[console]", f"trainer.output_dir={out}", "trainer.resume_mode=disable", *ARMS[arm]]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(records: list[dict], skip: int) -> dict[str, float]:
    steps = [r for r in records if "time/step" in r][skip:]
    out = {"step": statistics.median(r["time/step"] for r in steps)}
    for phase in PHASES:
        values = [r.get(f"time/{phase}", 0.0) for r in steps]
        out[phase] = statistics.median(values)
    out["response_length"] = statistics.median(r["response_length/mean"] for r in steps)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of: " + ", ".join(ARMS))
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    if args.steps < 3:
        p.error("--steps must be >= 3 (the first two steps are left out of the median)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for arm in args.arms.split(","):
            if arm not in ARMS:
                p.error(f"unknown arm {arm!r}; one of {', '.join(ARMS)}")
            records = run(args, arm, Path(tmp) / arm)
            results[arm] = {"per_step": [r["time/step"] for r in records if "time/step" in r],
                            "median": summary(records, skip=2)}
    base = results.get("colocated", next(iter(results.values())))["median"]["step"]
    print(f"\nGRPO on SmolLM2-135M-Instruct, {args.prompts} prompts x {args.group} samples, <= {args.max_tokens} "
          f"tokens, {args.steps} steps (median of steps 3..{args.steps}; seconds)")
    print(f"{'arm':<24}{'step':>8}{'vs colocated':>14}" + "".join(f"{ph:>17}" for ph in PHASES))
    for arm, r in results.items():
        m = r["median"]
        print(f"{arm:<24}{m['step']:>8.1f}{base / m['step']:>13.2f}x" + "".join(f"{m[ph]:>17.1f}" for ph in PHASES))
    for off, in_turn, transfer in (("one-step-off", "separate", "tmpfs"),
                                   ("one-step-off-broadcast", "separate-broadcast", "broadcast")):
        if off in results and in_turn in results:
            ratio = results[in_turn]["median"]["step"] / results[off]["median"]["step"]
            results[off]["over_in_turn"] = ratio
            print(f"one step off over in turn on the same layout, weights by {transfer}: {ratio:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "arms": results},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
