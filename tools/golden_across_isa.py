"""Run a golden-curve recipe on this machine with its own kernels and with the CPU restricted to AVX2, and print
how far each run's floats are from the recorded curve (``tests/golden/<name>.jsonl``): what
``tests/golden_curves.py``'s ``ACROSS_CPU_KINDS`` must allow.

    grep -o avx512f /proc/cpuinfo | head -1     # the restriction means something only where AVX-512 exists
    flock /tmp/e2e.lock .venv/bin/python tools/golden_across_isa.py ppo raro --isa native avx2

``--isa avx2`` sets ``ATEN_CPU_CAPABILITY=avx2`` (PyTorch's kernels), ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's),
``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's) and puts ``tools/avx2_only`` on ``PYTHONPATH`` (vLLM's compiled ops:
``_C_AVX2`` instead of ``_C``). Each run is the ``megareason train`` command of the test that records the
curve, with the same overrides (PPO's test goes through NeMo-Run's local executor, which runs the same
command). Writes ``<out>/<name>-<isa>.json`` (the run's metrics) and prints, per metric, the largest
relative and absolute difference from the recorded curve and the step where it is largest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def command(name: str, model: Path, tmp: Path, out: Path) -> list[str]:
    """The ``megareason train`` command of the test that records golden ``name``."""
    from test_train_e2e import _args, _raro_args

    if name == "ppo":  # test_nemo_run.py::test_local_executor_runs_ppo_with_a_critic_whose_value_loss_falls
        return _args(model, tmp, out, "algorithm.name=ppo", "trainer.steps=6", "optim.critic_lr=1e-3",
                     "algorithm.kl_coef=0.01", "algorithm.kl_in_reward=true", "algorithm.kl_reward_kind=k3",
                     "algorithm.mini_batches=2", "trainer.save_every=0", "trainer.offload_optimizer=true")
    if name == "raro":  # test_train_e2e.py::test_raro_with_lora_..., its uninterrupted run
        return _raro_args(model, tmp, out, "--use-lora", "lora.rank=4", "optim.lr=3e-2", "trainer.steps=3",
                          "trainer.save_every=2", "trainer.async_save=true")
    if name == "grpo_env":  # test_train_e2e.py::test_grpo_on_the_retrieval_qa_environment (console logger only)
        return _args(model, tmp, out, "env.name=retrieval_qa", "env.retriever=bm25", "env.initial_search=true",
                     "env.max_turns=2", "env.max_doc_chars=80", "env.top_k=1", "trainer.steps=2",
                     "rollout.max_model_len=1024", "env.system_prompt='Search, then answer in <answer></answer>.'",
                     "trainer.micro_batch_tokens=2048", "data.max_prompt_length=512", "data.system_prompt=''",
                     "data.sources=[{kind: synthetic_multihop, size: 8, seed: 1, options: {distractors: 2}}]",
                     "data.val_sources=[{kind: synthetic_multihop, size: 2, seed: 2, options: {distractors: 2}}]")
    if name == "async":  # test_async_rollouts.py, the separate engine's run
        from test_async_rollouts import _COMMON

        return _args(model, tmp, out, *_COMMON, "trainer.steps=2", "trainer.save_every=0",
                     "rollout.placement=separate")
    raise SystemExit(f"golden_across_isa: no recipe for {name!r} (ppo, raro, grpo_env, async)")


def differences(got: dict[int, dict], want: dict[int, dict]) -> dict[str, tuple[float, float, int]]:
    """metric -> (largest relative difference, largest absolute difference, the step of the relative one)."""
    from golden_curves import curve

    out: dict[str, tuple[float, float, int]] = {}
    for g, w in zip(curve(got), curve(want), strict=True):
        for key in sorted(set(g) | set(w)):
            a, b = g.get(key), w.get(key)
            if key == "step" or not isinstance(a, float | int) or not isinstance(b, float | int):
                if a != b:
                    out[key] = (float("inf"), float("inf"), w["step"])
                continue
            rel = abs(a - b) / abs(b) if b else (0.0 if a == b else float("inf"))
            best = out.get(key, (0.0, 0.0, w["step"]))
            out[key] = (max(best[0], rel), max(best[1], abs(a - b)), w["step"] if rel > best[0] else best[2])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="+", help="golden curves: ppo, raro, grpo_env, async")
    p.add_argument("--isa", nargs="+", default=["native", "avx2"], choices=["native", "avx2"])
    p.add_argument("--out", type=Path, default=REPO / "isa_runs")
    args = p.parse_args()
    from golden_curves import golden

    from megareason.models.tiny import build_tiny_model

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = build_tiny_model(tmp / "tiny_qwen2", "qwen2", tie_word_embeddings=False)  # conftest's tiny_qwen2
        for name in args.names:
            for isa in args.isa:
                run = tmp / f"{name}-{isa}"
                env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
                if isa == "avx2":
                    env.update(AVX2)
                    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tools" / "avx2_only"), env.get("PYTHONPATH", "")])
                start = time.time()
                proc = subprocess.run(command(name, model, tmp, run), env=env, capture_output=True, text=True)
                if proc.returncode:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    return proc.returncode
                rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
                metrics = {r["step"]: r for r in rows}
                (args.out / f"{name}-{isa}.json").write_text(json.dumps(metrics, indent=1) + "\n")
                print(f"== {name} {isa} ({time.time() - start:.0f} s): against tests/golden/{name}.jsonl")
                for key, (rel, absolute, step) in sorted(differences(metrics, golden(name)).items()):
                    if absolute:
                        print(f"  {key:40s} rel {rel:.3g}  abs {absolute:.3g}  (largest rel at step {step})")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
