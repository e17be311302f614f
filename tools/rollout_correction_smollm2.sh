#!/usr/bin/env bash
# The train/generation mismatch on SmolLM2-135M (CPU) and what rollout correction (TIS/MIS) does with it:
# GRPO on the grpo_smollm2_cpu recipe with bf16 Megatron training against fp32 vLLM generation (a real
# mismatch), with TIS/MIS at loose (2.0) and tight (1.1 / 1.02) caps, and the fp32/fp32 baseline.
# Writes OUT/<run>/metrics.jsonl and prints the table of docs/results/rollout_correction_smollm2_cpu.md.
# About 25 minutes on 2 cores. Results: docs/results/rollout_correction_smollm2_cpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/rollout_correction}
common=(--config-name grpo_smollm2_cpu trainer.val_every=0 trainer.save_every=0)
run() { local name=$1; shift; [ -f "$OUT/$name/metrics.jsonl" ] || .venv/bin/megareason train "${common[@]}" \
  trainer.output_dir="$OUT/$name" "$@"; }
run bf16_tis trainer.steps=6 trainer.precision=bf16 algorithm.rollout_tis_cap=2.0 algorithm.rollout_mis_cap=2.0
run bf16_tight trainer.steps=4 trainer.precision=bf16 algorithm.rollout_tis_cap=1.1 algorithm.rollout_mis_cap=1.02
run fp32_tis trainer.steps=4 algorithm.rollout_tis_cap=2.0
.venv/bin/python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
keys = ["rollout/token_mult_prob_error", "actor/is_ratio", "actor/is_ratio_max", "actor/is_kl", "actor/is_truncated",
        "actor/is_masked", "reward/mean"]
print("| run | step | " + " | ".join(k.split("/")[1] for k in keys) + " |")
print("|---|---|" + "---|" * len(keys))
for run in ("fp32_tis", "bf16_tis", "bf16_tight"):
    for line in (Path(sys.argv[1]) / run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m["step"] > 0 and "actor/is_ratio" in m:
            print(f"| {run} | {m['step']} | " + " | ".join(f"{m.get(k, float('nan')):.4f}" for k in keys) + " |")
PY
