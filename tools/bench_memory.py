"""Memory of a training micro-batch, measured on live tensors and set beside `megareason plan`'s figures.

For each setting (precision, optimizer, recomputation, layout) this starts TP x PP x DP gloo processes
(the code the GPU runs, on CPU), builds the model with the trainer's own builders, takes one optimizer
step on a packed row of ``--tokens`` tokens (so Adam's state exists), and reports per rank:

* parameters, gradients (DDP's grad buffers) and optimizer state (main weights + Adam moments), counted
  from the live tensors (``megareason.models.memory.state_bytes``);
* the bytes autograd saves for backward during the forward pass of that micro-batch and its log-prob
  head (``SavedActivations``: ``torch.autograd.graph.saved_tensors_hooks``, each storage once);

next to ``megareason.launch.plan_memory.memory_per_rank`` for the same config, with the ratio
measured / planned. Goal: states within 5% of the plan, activations within 25%.

    python tools/bench_memory.py                      # SmolLM2-135M, every setting of SETTINGS
    python tools/bench_memory.py --model tiny --tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

KEYS = ("parameters", "gradients", "optimizer_state", "activations")


@dataclass(frozen=True)
class Setting:
    name: str
    overrides: tuple[str, ...]  # config overrides (the same fields the trainer and the planner read)
    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


SETTINGS = [
    Setting("fp32, plain optimizer, DP=1", ()),
    Setting("fp32, distributed optimizer, DP=2", ("optim.use_distributed_optimizer=true",), dp=2),
    Setting("bf16, distributed optimizer, DP=1", ("trainer.precision=bf16", "optim.use_distributed_optimizer=true")),
    Setting("bf16, distributed optimizer, DP=2", ("trainer.precision=bf16", "optim.use_distributed_optimizer=true"),
            dp=2),
    Setting("bf16, distributed optimizer, full recompute, DP=2",
            ("trainer.precision=bf16", "optim.use_distributed_optimizer=true", "trainer.recompute=full"), dp=2),
    Setting("bf16, selective recompute, TP=2 + sequence parallel",
            ("trainer.precision=bf16", "trainer.recompute=selective", "parallel.sequence_parallel=true"), tp=2),
]


def _config(overrides: tuple[str, ...], s: Setting):
    from megareason.config.load import load_config

    layout = (f"parallel.tensor_model_parallel_size={s.tp}", f"parallel.pipeline_model_parallel_size={s.pp}",
              f"parallel.data_parallel_size={s.dp}")
    return load_config("grpo_quickstart", [*overrides, *layout])


def _measure(rank: int, world: int, port: int, model_dir: str, setting: Setting, tokens: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        results.put((rank, _measure_rank(model_dir, setting, tokens), None))
    except BaseException as e:  # reported by the parent, which then stops
        import traceback

        results.put((rank, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _measure_rank(model_dir: str, setting: Setting, tokens: int) -> dict:
    import torch.distributed as dist

    from megareason.models.build import HFCheckpoint, build_gpt, load_hf_weights
    from megareason.models.logprobs import logprob_head
    from megareason.models.memory import SavedActivations, state_bytes
    from megareason.models.parallel import init_parallel
    from megareason.models.schedule import _run
    from megareason.models.train import TrainBatch, train_step, wrap_for_training
    from megareason.settings import compute_settings, optimizer_settings

    torch.set_num_threads(1)
    cfg = _config(setting.overrides, setting)
    layout = init_parallel(setting.tp, setting.pp, seed=0)
    ckpt = HFCheckpoint(model_dir)
    model = build_gpt(ckpt.arch, compute_settings(cfg))
    load_hf_weights(model, ckpt)
    ddp, optimizer = wrap_for_training(model, optimizer_settings(cfg, 1e-6))
    head = logprob_head(ckpt.arch.vocab_size)
    g = torch.Generator().manual_seed(layout.dp_rank)
    row = torch.randint(0, ckpt.arch.vocab_size, (1, tokens), generator=g)
    batch = TrainBatch(row, torch.ones(1, tokens), cu_seqlens=torch.tensor([0], dtype=torch.int32))

    def nll(logp, entropy, b):
        return -(logp * b.loss_mask_BT).sum(), b.loss_mask_BT.sum(), {}

    train_step(ddp, optimizer, [batch], head, nll)  # Adam's state exists from the first step on
    out = state_bytes(ddp, optimizer)
    ddp.train()
    if setting.pp == 1:
        with SavedActivations(ddp) as saved:
            logp, entropy = head(_run(batch, ddp), batch)
        (logp.sum() + entropy.sum()).backward()
        out["activations"] = saved.bytes
    dist.barrier()
    out["rank"] = (layout.tp_rank, layout.pp_rank, layout.dp_rank)
    return out


def measure(model_dir: str, setting: Setting, tokens: int) -> list[dict]:
    from datetime import timedelta

    from megareason.ports import rendezvous_store

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = rendezvous_store("127.0.0.1", setting.world, timedelta(minutes=10))  # the ranks are its clients
    port = store.port
    procs = [ctx.Process(target=_measure, args=(r, setting.world, port, model_dir, setting, tokens, results))
             for r in range(setting.world)]
    for p in procs:
        p.start()
    out, error = {}, None
    for _ in procs:
        rank, value, err = results.get(timeout=1800)
        if err:
            error = f"rank {rank}: {err}"
            break
        out[rank] = value
    for p in procs:
        p.join(timeout=5 if error else 300)
        if p.is_alive():
            p.kill()
    if error:
        raise RuntimeError(f"{setting.name}: {error}")
    return [out[r] for r in sorted(out)]


def planned(model_dir: str, setting: Setting, tokens: int) -> dict[str, int]:
    from megareason.launch.plan_memory import memory_per_rank
    from megareason.models.arch import ModelArch

    cfg = _config(setting.overrides, setting)
    arch = ModelArch.from_pretrained(model_dir)
    # CPU builds megatron-core's local layers; a packed row's LM head scores every position but the last.
    return memory_per_rank(cfg, arch, setting.tp, setting.pp, setting.dp, tokens, spec="local",
                           scored_tokens=tokens - 1)


def _model_dir(name: str, tmp: str) -> str:
    if name == "tiny":
        from megareason.models.tiny import build_tiny_model

        return str(build_tiny_model(os.path.join(tmp, "tiny"), "qwen2", tie_word_embeddings=False))
    from megareason.models.hub import resolve_model_path

    return str(resolve_model_path(name))


def _refuses(arch, tp: int, error: type) -> bool:
    try:
        arch.check_parallelism(tp, 1)
    except error:
        return True
    return False


def _mib(n: int) -> str:
    return f"{n / 2**20:9.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model name, an HF directory, or 'tiny'")
    p.add_argument("--tokens", type=int, default=512, help="tokens of the measured micro-batch (one packed row)")
    p.add_argument("--only", nargs="*", default=None, help="indices of SETTINGS to run (default all)")
    p.add_argument("--json", default="", help="also write the table as JSON here")
    args = p.parse_args(argv)
    chosen = SETTINGS if args.only is None else [SETTINGS[int(i)] for i in args.only]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(args.model, tmp)
        print(f"model {args.model}, one micro-batch of {args.tokens} tokens; MiB per rank (rank 0 shown; "
              f"measured / planned)", flush=True)
        print(f"{'setting':<52} " + " ".join(f"{k:>30}" for k in KEYS))
        from dataclasses import replace

        from megareason.models.arch import ArchError, ModelArch

        arch = ModelArch.from_pretrained(model_dir)
        for s in chosen:
            if s.tp > 1:  # SmolLM2's 9 heads do not split over 2: the smallest TP the model splits over
                s = replace(s, tp=next(t for t in range(s.tp, 9) if not _refuses(arch, t, ArchError)))
                s = replace(s, name=s.name.replace("TP=2", f"TP={s.tp}"))
            tokens = -(-args.tokens // s.tp) * s.tp  # sequence parallelism splits the row over TP
            ranks = measure(model_dir, s, tokens)
            plan = planned(model_dir, s, tokens)
            first = ranks[0]
            cells = []
            for k in KEYS:
                if k not in first:
                    cells.append(f"{'n/a':>30}")
                    continue
                cells.append(f"{_mib(first[k])} /{_mib(plan[k])} ({first[k] / max(plan[k], 1):5.3f})")
            print(f"{s.name:<52} " + " ".join(cells), flush=True)
            rows.append({"setting": s.name, "tp": s.tp, "pp": s.pp, "dp": s.dp, "tokens": tokens,
                         "measured": ranks, "planned": plan})
    if args.json:
        tmp_path = args.json + ".tmp"
        with open(tmp_path, "w") as f:
            json.dump(rows, f, indent=1, default=list)
        os.replace(tmp_path, args.json)
    by_name = {r["setting"]: r for r in rows}
    one, two = by_name.get(SETTINGS[2].name), by_name.get(SETTINGS[3].name)
    if one and two:
        ratio = one["measured"][0]["optimizer_state"] / two["measured"][0]["optimizer_state"]
        print(f"optimizer state per rank, DP=1 / DP=2 under the distributed optimizer: {ratio:.3f} (goal 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
