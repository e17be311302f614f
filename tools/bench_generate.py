"""Generation throughput: vLLM (CPU) against HF transformers ``generate``, measured in one run.

Both backends get the same model, the same chat-templated gsm_symbolic prompts, the same sampling
settings (temperature, top_p=1, no top-k, ``n`` samples per prompt, ``max_tokens``) and all CPU cores.
Sampled response lengths differ between backends, so the fair comparison is generated tokens per
second, not wall time.

    .venv/bin/python tools/bench_generate.py --model tiny --prompts 4 --n 2 --max-tokens 32
    .venv/bin/python tools/bench_generate.py --json outputs/bench_generate.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

MODEL_NAME = "smollm2-135m-instruct"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                   help="smollm2: the provisioned SmolLM2-135M-Instruct; tiny: a random tiny Qwen2 "
                        "built in a temp dir (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=8, help="gsm_symbolic prompts (default: %(default)s)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="max new tokens (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7, help="(default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights dtype for both backends (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one small untimed generate per backend first; the first vLLM call on CPU "
                        "pays a one-time ~15 s kernel warm-up (default: on)")
    p.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    return p.parse_args(argv)


def load_prompts(model_dir: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from megareason.config import DataConfig, DataSourceConfig
    from megareason.data import load_records, tokenize_prompts

    # load_records adds the project's default system prompt, so these are the prompts training sees.
    cfg = DataConfig(sources=[DataSourceConfig(kind="reasoning_gym", name="gsm_symbolic", size=count)])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = tokenize_prompts(load_records(cfg), tokenizer, max_prompt_length=cfg.max_prompt_length)
    if len(prompts) < count:
        print(f"note: {count - len(prompts)} prompts longer than {cfg.max_prompt_length} tokens dropped",
              file=sys.stderr)
    return [p.token_ids for p in prompts]


def bench_vllm(model_dir: Path, prompts: list[list[int]], args) -> dict:
    from megareason.config.schema import Config, ModelConfig, RolloutConfig
    from megareason.rollout.engine import VLLMEngine
    from megareason.rollout.records import Sampling
    from megareason.settings import engine_settings

    max_len = max(map(len, prompts)) + args.max_tokens
    t0 = time.perf_counter()
    engine = VLLMEngine(engine_settings(Config(model=ModelConfig(path=str(model_dir)), rollout=RolloutConfig(
        dtype=args.dtype, max_model_len=max_len, seed=args.seed))))
    start_s = time.perf_counter() - t0
    try:
        if args.warmup:
            engine.generate(prompts[:1], Sampling(n=1, temperature=args.temperature, max_tokens=8),
                            use_tqdm=False)
        sampling = Sampling(n=args.n, temperature=args.temperature, top_p=1.0, max_tokens=args.max_tokens)
        t0 = time.perf_counter()
        groups = engine.generate(prompts, sampling, use_tqdm=False)
        gen_s = time.perf_counter() - t0
    finally:
        # Before transformers runs, so the two never compete for the cores.
        engine.shutdown()
    lengths = [len(c.token_ids) for group in groups for c in group]
    return summarize(gen_s, lengths, start_s=start_s)


def eos_ids(model, tokenizer) -> list[int]:
    # vLLM stops on the tokenizer's EOS and on generation_config's; give transformers the same set.
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def bench_transformers(model_dir: Path, prompts: list[list[int]], args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # vLLM binds all cores in our affinity mask (see rollout.engine); match it.
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    load_s = time.perf_counter() - t0
    eos = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]

    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    # top_k=0: transformers otherwise applies its global default top_k=50, which vLLM does not.
    kwargs = dict(do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0,
                  eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(args.seed)
    with torch.inference_mode():
        if args.warmup:
            model.generate(input_ids=input_ids[:1], attention_mask=attention_mask[:1], max_new_tokens=4,
                           **kwargs)
        t0 = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                             max_new_tokens=args.max_tokens, num_return_sequences=args.n, **kwargs)
        gen_s = time.perf_counter() - t0
    lengths = [response_length(row, eos) for row in out[:, width:].tolist()]
    return summarize(gen_s, lengths, load_s=load_s)


def response_length(tokens: list[int], eos: list[int]) -> int:
    """Tokens up to and including the first EOS; what follows is padding from finished sequences."""
    for i, tok in enumerate(tokens):
        if tok in eos:
            return i + 1
    return len(tokens)


def summarize(gen_s: float, lengths: list[int], **extra) -> dict:
    tokens = sum(lengths)
    return dict(seconds=gen_s, sequences=len(lengths), generated_tokens=tokens, tokens_per_s=tokens / gen_s,
                mean_response_length=tokens / len(lengths), **extra)


def report(results: dict, args) -> float:
    ratio = results["vllm"]["tokens_per_s"] / results["transformers"]["tokens_per_s"]
    print(f"\nmodel={args.model} prompts={args.prompts} n={args.n} max_tokens={args.max_tokens} "
          f"temperature={args.temperature} dtype={args.dtype} threads={len(os.sched_getaffinity(0))}")
    print(f"vLLM engine start: {results['vllm']['start_s']:.1f} s; "
          f"transformers load: {results['transformers']['load_s']:.1f} s (not in the table)")
    print(f"{'backend':<14}{'seconds':>9}{'gen tokens':>12}{'tokens/s':>10}{'mean len':>10}")
    for name, r in results.items():
        print(f"{name:<14}{r['seconds']:>9.2f}{r['generated_tokens']:>12d}{r['tokens_per_s']:>10.1f}"
              f"{r['mean_response_length']:>10.1f}")
    print(f"vllm/transformers throughput ratio: {ratio:.2f}x")
    print("(sampled response lengths differ between backends: compare tokens/s, not seconds)")
    return ratio


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_generate.") as tmp:
        if args.model == "tiny":
            from megareason.models.tiny import build_tiny_model

            model_dir = build_tiny_model(tmp)
        else:
            from megareason.models.hub import resolve_model_path

            try:
                model_dir = resolve_model_path(MODEL_NAME)
            except FileNotFoundError:
                print(f"SmolLM2 is not provisioned; run: megareason models fetch {MODEL_NAME}",
                      file=sys.stderr)
                return 1
        prompts = load_prompts(model_dir, args.prompts)
        results = {"vllm": bench_vllm(model_dir, prompts, args),
                   "transformers": bench_transformers(model_dir, prompts, args)}
    ratio = report(results, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps(dict(settings=settings, **results, ratio=ratio), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
