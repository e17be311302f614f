"""The GPU path of the Megatron side, checked on one CUDA device against transformers on the same GPU.

CI has no GPU, so this is what a lent GPU machine runs (see docs/architecture.md, "GPU path"): NCCL process
groups, the model on the device, micro-batches moved to it, log-probs (padded and packed) and one AdamW step
against transformers + torch.optim.AdamW, bf16 log-probs, the critic, the reference's offload/onload, the
streaming export against the naive gather, a CUDA-IPC bucket read by another process (as vLLM's worker does),
and a checkpoint round trip through the HF converter, and the trainer's offload bit-exact against a plain twin
through 3 steps of the loop's memory moves; for a dense Qwen2, a tied Llama and a Qwen3-MoE
(megatron-core's MoE layers on the GPU). Then a ~1.2B Llama (random weights): the device memory of each phase
(resident states, a training step, the checkpoint save's transient, the optimizer offload) against
``megareason plan``'s bytes, its asynchronous checkpoint save (nothing left on the device when it returns, the
loaded state the save's though a step ran meanwhile, where the time goes), training tokens/s and MFU, the bytes an
offload frees mapped through the driver's virtual-memory calls as vLLM's wake-up maps them (also under
``expandable_segments:True``), a resume's load against the plan's resume column, the memory outside torch's
allocator after each phase, and the device's ``cudaMemGetInfo`` total. Needs megatron-core, transformers and
safetensors (not Ray or vLLM); on a bare GPU image ``tools/gpu_wheels.sh`` (run where pip reaches PyPI) fetches
the wheels. Prints one line per check and exits 1 if any failed:

    python tools/check_gpu.py [--out results.json] [--skip-1b] [--only CHECK ...] [--optim-format FORMAT]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

RESULTS: dict[str, dict] = {}
OUT: str | None = None  # --out: rewritten after every check


def _optim(lr: float | None = None, **optim):
    """The config's optimizer settings (``optim.*`` with ``optim`` overridden) at ``lr``, else ``optim.lr``."""
    from megareason.config.schema import Config, OptimConfig
    from megareason.settings import optimizer_settings

    cfg = Config(optim=OptimConfig(**optim))
    return optimizer_settings(cfg, cfg.optim.lr if lr is None else lr)


def check(name, needs: str = ""):
    """``needs``: a module the check imports (e.g. vllm); without it the check is reported as not run."""
    def wrap(fn):
        def run(*args):
            start = time.perf_counter()
            if needs and importlib.util.find_spec(needs) is None:
                RESULTS[name] = {"ok": None, "not_run": f"needs {needs}, not installed here"}
                print(f"NOT RUN {name}: needs {needs}", flush=True)
                return
            try:
                detail = fn(*args) or {}
                RESULTS[name] = {"ok": True, **detail}
            except Exception as e:  # noqa: BLE001 - every check runs and reports
                RESULTS[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            RESULTS[name]["seconds"] = round(time.perf_counter() - start, 2)
            r = RESULTS[name]
            print(f"{'PASS' if r['ok'] else 'FAIL'} {name} {json.dumps({k: v for k, v in r.items() if k != 'trace'})}",
                  flush=True)
            if not r["ok"]:
                print(r["trace"], flush=True)
            if OUT:
                Path(OUT).write_text(json.dumps(RESULTS, indent=2))
        run.check_name = name
        return run
    return wrap


def _tokens(vocab, shape=(4, 24), seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _hf_logp(hf, tokens):
    with torch.no_grad():
        logits = hf(tokens.cuda()).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens.cuda()[:, 1:, None])[..., 0].cpu()


def _megatron_logp(out_BT):
    return out_BT[:, 1:]  # column 0 has no prediction


@check("logprobs_fp32_padded")
def logprobs_fp32(model_dir):
    from transformers import AutoModelForCausalLM

    from megareason.models.build import HFCheckpoint
    from megareason.models.roles import Actor

    ckpt = HFCheckpoint(model_dir)
    actor = Actor(ckpt, _optim())
    assert next(actor.model.parameters()).is_cuda, "actor weights are not on the GPU"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    tokens = _tokens(ckpt.arch.vocab_size)
    logp, _ = actor.logprobs(tokens, micro_batch_size=2)
    diff = (_megatron_logp(logp) - _hf_logp(hf, tokens)).abs().max().item()
    assert diff < 2e-4, f"max |logp - transformers| = {diff}"
    return {"max_abs_diff": diff}


@check("logprobs_fp32_packed")
def logprobs_packed(model_dir):
    from transformers import AutoModelForCausalLM

    from megareason.models.build import HFCheckpoint
    from megareason.models.roles import Actor
    from megareason.models.schedule import TokenBatch

    ckpt = HFCheckpoint(model_dir)
    actor = Actor(ckpt, _optim())
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    lengths = (9, 5, 13)
    seqs = [_tokens(ckpt.arch.vocab_size, (1, n), seed=10 + i)[0] for i, n in enumerate(lengths)]
    row = torch.cat([*seqs, torch.zeros(5, dtype=torch.long)])[None]
    cu = torch.tensor([0, 9, 14, 27], dtype=torch.int32)
    (logp, _), = actor.logprobs_of([TokenBatch(row, cu)])
    worst = 0.0
    for start, seq in zip(cu.tolist(), seqs, strict=False):
        want = _hf_logp(hf, seq[None])[0]
        got = logp[0, start + 1 : start + len(seq)]
        worst = max(worst, (got - want).abs().max().item())
    assert worst < 2e-4, f"max |packed logp - transformers| = {worst}"
    return {"max_abs_diff": worst}


@check("logprobs_bf16")
def logprobs_bf16(model_dir):
    from transformers import AutoModelForCausalLM

    from megareason.models.build import ComputeSettings, HFCheckpoint
    from megareason.models.roles import Actor

    ckpt = HFCheckpoint(model_dir)
    actor = Actor(ckpt, _optim(), ComputeSettings("bf16", "none", 0, False, 0.0, 0.0))
    assert next(actor.model.parameters()).dtype == torch.bfloat16
    hf32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    hf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    tokens = _tokens(ckpt.arch.vocab_size)
    logp, _ = actor.logprobs(tokens, micro_batch_size=4)
    exact = _hf_logp(hf32, tokens)
    err = (_megatron_logp(logp) - exact).abs()
    hf_err = (_hf_logp(hf16, tokens) - exact).abs()
    # The yardstick is transformers' own bf16 error against float32 on the same weights and GPU.
    assert err.mean().item() < 1.5 * hf_err.mean().item(), (err.mean().item(), hf_err.mean().item())
    return {"mean_abs_diff_vs_fp32": err.mean().item(), "transformers_bf16_mean_abs_diff_vs_fp32": hf_err.mean().item()}


def _checkpoint_names(hf) -> dict[str, torch.Tensor]:
    """``hf``'s weights by their checkpoint names: transformers fuses an MoE's experts in memory
    (``mlp.experts.gate_up_proj``) and writes them one per expert, the names the weight map uses."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        return {k: v for f in sorted(Path(tmp).glob("*.safetensors")) for k, v in load_file(f).items()}


def _nll(logp_BT, entropy_BT, batch):
    mask = batch.loss_mask_BT
    return -(logp_BT * mask).sum(), mask.sum(), {"entropy_sum": (entropy_BT * mask).sum()}


@check("train_step_vs_transformers_adamw")
def train_step(model_dir):
    from transformers import AutoModelForCausalLM

    from megareason.models import weight_map
    from megareason.models.build import HFCheckpoint, build_gpt, load_hf_weights
    from megareason.models.logprobs import logprob_head
    from megareason.models.packing import pack, plan_micro_batches
    from megareason.models.schedule import forward_backward
    from megareason.models.train import TrainBatch, wrap_for_training

    lr, eps, clip = 1e-2, 1e-3, 0.5
    ckpt = HFCheckpoint(model_dir)
    tokens = _tokens(ckpt.arch.vocab_size, (8, 12))
    mask = torch.zeros(8, 12)
    for i in range(8):
        mask[i, 3 + i % 3 : 12 - i % 4] = 1.0
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    logits = hf(tokens.cuda()).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, tokens.cuda()[:, 1:, None])[..., 0]
    loss = -(logp * mask.cuda()[:, 1:]).sum() / mask.sum()
    loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), clip).item()
    torch.optim.AdamW(hf.parameters(), lr=lr, eps=eps, weight_decay=0.0).step()

    model = build_gpt(ckpt.arch)
    load_hf_weights(model, ckpt)
    ddp, opt = wrap_for_training(model, _optim(lr, eps=eps, clip_grad=clip))
    micro = [TrainBatch(t, m) for t, m in zip(tokens.split(2), mask.split(2), strict=True)]
    opt.zero_grad()
    # The same rows packed two to a micro-batch (block-diagonal attention) give the same gradients.
    plan = plan_micro_batches([tokens.shape[1]] * 8, 2 * tokens.shape[1])
    packed = [TrainBatch(b.tokens_BT, torch.cat([mask[i] for i in b.index])[None], b.cu_seqlens)
              for b in pack(list(tokens), plan)]
    forward_backward(ddp, packed, logprob_head(ckpt.arch.vocab_size), _nll)
    packed_grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
    sums = forward_backward(ddp, micro, logprob_head(ckpt.arch.vocab_size), _nll)
    packed_rel = max(((packed_grads[n] - p.main_grad).norm() / p.main_grad.norm().clamp_min(1e-12)).item()
                     for n, p in ddp.module.named_parameters())
    assert packed_rel < 1e-4, f"packed vs padded gradients: relative error {packed_rel}"
    ok, grad_norm, _ = opt.step()
    assert ok, "optimizer step skipped"
    params = weight_map.to_hf({(0, 0): weight_map.model_state(ddp.module)}, ckpt.arch, 1, 1)
    named = _checkpoint_names(hf)
    worst = max((params[n].cpu() - named[n]).abs().max().item() for n in params)
    assert abs(sums["loss_sum"] / sums["count"] - loss.item()) < 1e-4, (sums, loss.item())
    assert abs(grad_norm - ref_norm) / ref_norm < 1e-3, (grad_norm, ref_norm)
    assert worst < 1e-4, f"max |param after AdamW - transformers'| = {worst}"
    return {"loss": loss.item(), "grad_norm": grad_norm, "ref_grad_norm": ref_norm, "max_param_diff": worst,
            "packed_vs_padded_grad_rel": packed_rel}


@check("prefix_sharing_and_response_only_head")
def sharing(model_dir):
    """The trainer's packing (prompt shared by its group, LM head on response positions only) gives the
    outputs and gradients of plain packing, on the GPU too."""
    from megareason.models.build import HFCheckpoint, build_gpt, load_hf_weights
    from megareason.models.logprobs import logprob_head
    from megareason.models.schedule import forward_backward, forward_outputs
    from megareason.models.train import wrap_for_training
    from megareason.trainer.experience import Experience, pack_experience, unpack_to_rows

    ckpt = HFCheckpoint(model_dir)
    g = torch.Generator().manual_seed(3)
    vocab = ckpt.arch.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=g) for n in (9, 5)]
    rows = [(p, torch.randint(1, vocab, (n,), generator=g)) for p in prompts for n in (6, 3, 11, 1)]
    width = max(len(p) + len(r) for p, r in rows)
    tokens, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width)
    for b, (p, r) in enumerate(rows):
        tokens[b, : len(p) + len(r)] = torch.cat([p, r])
        mask[b, len(p) : len(p) + len(r)] = 1.0
    exp = Experience(tokens_BT=tokens, lengths_B=torch.tensor([len(p) + len(r) for p, r in rows]), mask_BT=mask,
                     rollout_logp_BT=torch.zeros_like(mask))
    model = build_gpt(ckpt.arch)
    load_hf_weights(model, ckpt)
    ddp, _ = wrap_for_training(model, _optim())
    head = logprob_head(vocab)
    results = {}
    for variant in ((False, False), (True, True)):
        micro = pack_experience(exp, 32, ["mask_BT"], share_prefix=variant[0], responses_only=variant[1])
        logp = unpack_to_rows([o[0] for o in forward_outputs(model, micro, head, 2)], micro, exp.lengths_B, width)
        forward_backward(ddp, micro, head, _nll_fields)
        results[variant] = (logp, {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()})
    (plain, g_plain), (shared, g_shared) = results.values()
    m = mask.bool()
    diff = (plain[m] - shared[m]).abs().max().item()
    rel = max(((g_shared[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in g_plain.items())
    assert diff < 2e-5 and rel < 1e-4, (diff, rel)
    return {"max_abs_logp_diff": diff, "max_grad_rel_diff": rel}


def _nll_fields(logp_1W, entropy_1W, batch):
    mask = batch.fields["mask_BT"]
    return -(logp_1W * mask).sum(), mask.sum(), {}


@check("critic_values_and_update")
def critic(model_dir):
    from megareason.models.build import HFCheckpoint
    from megareason.models.roles import Critic
    from megareason.models.train import TrainBatch

    ckpt = HFCheckpoint(model_dir)
    c = Critic(ckpt, _optim(1e-2))
    tokens = _tokens(ckpt.arch.vocab_size, (4, 16))
    target = torch.linspace(-1, 1, 4)[:, None].expand(4, 16)

    def vf(values_BT, batch):
        err = (values_BT - batch.loss_mask_BT) ** 2
        return err.sum(), torch.tensor(err.numel(), device=err.device), {}

    losses = []
    for _ in range(6):
        r = c.train_step([TrainBatch(tokens, target.contiguous())], vf)
        losses.append(r.loss)
    values = c.values(tokens, micro_batch_size=2)
    assert values.shape == (4, 16) and torch.isfinite(values).all()
    assert losses[-1] < losses[0], f"value loss did not fall: {losses}"
    return {"vf_loss": losses}


@check("reference_offload_onload")
def reference(model_dir):
    from megareason.models.build import HFCheckpoint
    from megareason.models.roles import Reference

    ckpt = HFCheckpoint(model_dir)
    ref = Reference(ckpt)
    tokens = _tokens(ckpt.arch.vocab_size)
    before = ref.logprobs(tokens, micro_batch_size=4)
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated()
    ref.offload()
    torch.cuda.synchronize()
    freed = used - torch.cuda.memory_allocated()
    assert all(p.device.type == "cpu" and p.is_pinned() for p in ref.model.parameters())
    ref.onload()
    after = ref.logprobs(tokens, micro_batch_size=4)
    assert torch.equal(before, after)
    weights = sum(p.numel() * p.element_size() for p in ref.model.parameters())
    assert freed >= weights, f"offload freed {freed} bytes of {weights}"
    return {"freed_bytes": freed, "weight_bytes": weights}


@check("stream_export_vs_naive_gather")
def stream(model_dir):
    from safetensors.torch import load_file

    from megareason.models.build import HFCheckpoint
    from megareason.models.roles import Actor
    from megareason.rollout.weight_sync import gather_hf_naive, stream_hf_tensors

    ckpt = HFCheckpoint(model_dir)
    actor = Actor(ckpt, _optim())
    streamed = {n: t.clone() for n, t in stream_hf_tensors(actor.model, ckpt.arch)}
    naive = gather_hf_naive(actor.model, ckpt.arch)
    original = load_file(str(Path(model_dir) / "model.safetensors"))
    assert set(streamed) == set(naive) == set(original) - ({"lm_head.weight"} if ckpt.arch.tie_word_embeddings
                                                           else set())
    for n, t in streamed.items():
        assert t.is_cuda, f"{n} left the GPU"
        assert torch.equal(t, naive[n].to(t.device)), n
        assert torch.equal(t.cpu(), original[n]), n
    return {"tensors": len(streamed)}


def _read_in_child(transport, specs, queue):
    from megareason.rollout.buckets import read_bucket

    torch.cuda.set_device(0)
    names, tensors = read_bucket(transport, specs)
    queue.put({n: t.double().sum().item() for n, t in zip(names, tensors, strict=True)})


@check("cuda_ipc_bucket_across_processes", needs="vllm")  # read through vLLM's packed-buffer import
def ipc(model_dir):
    from megareason.models.build import HFCheckpoint
    from megareason.models.roles import Actor
    from megareason.rollout.buckets import CudaIpcBucket, new_bucket
    from megareason.rollout.weight_sync import stream_hf_tensors

    ckpt = HFCheckpoint(model_dir)
    actor = Actor(ckpt, _optim())
    tensors = list(stream_hf_tensors(actor.model, ckpt.arch))
    ctx = mp.get_context("spawn")
    checked, buckets = 0, 0
    with new_bucket(256 * 1024) as bucket:
        assert isinstance(bucket, CudaIpcBucket)

        def ship():
            nonlocal checked, buckets
            q = ctx.Queue()
            p = ctx.Process(target=_read_in_child, args=(bucket.transport(), list(bucket.specs), q))
            p.start()
            sums = q.get(timeout=120)
            p.join(60)
            assert p.exitcode == 0
            want = dict(tensors)
            for n, s in sums.items():
                assert abs(s - want[n].double().sum().item()) <= 1e-9 * max(1.0, abs(s)), n
            checked += len(sums)
            buckets += 1
            bucket.clear()

        for name, t in tensors:
            if not bucket.add(name, t):
                ship()
                bucket.add(name, t)
        if bucket.specs:
            ship()
    assert checked == len(tensors)
    return {"tensors": checked, "buckets": buckets}


@check("bucket_fill_bandwidth")
def bandwidth(_model_dir):
    """Copying into a CUDA bucket vs a plain device-to-device copy of the same bytes."""
    from megareason.rollout.buckets import new_bucket

    src = [torch.randn(4096, 4096, device="cuda") for _ in range(8)]  # 512 MiB
    nbytes = sum(t.numel() * t.element_size() for t in src)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

    def timed(fn, reps=5):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / reps

    def memcpy():
        off = 0
        for t in src:
            n = t.numel() * 4
            dst[off : off + n].view(torch.float32).copy_(t.view(-1))
            off += n

    with new_bucket(nbytes) as bucket:
        def fill():
            bucket.clear()
            for i, t in enumerate(src):
                bucket.add(f"t{i}", t)
            bucket.transport()
        t_bucket, t_copy = timed(fill), timed(memcpy)
    return {"bytes": nbytes, "bucket_GBps": nbytes / t_bucket / 1e9, "memcpy_GBps": nbytes / t_copy / 1e9,
            "ratio_to_memcpy": t_copy / t_bucket}


@check("checkpoint_roundtrip_and_hf_conversion")
def checkpoint(model_dir):
    from transformers import AutoModelForCausalLM

    from megareason.models.build import HFCheckpoint, build_gpt
    from megareason.models.checkpoint import load_checkpoint, save_checkpoint
    from megareason.models.convert import megatron_to_hf
    from megareason.models.roles import Actor

    ckpt = HFCheckpoint(model_dir)
    actor = Actor(ckpt, _optim())
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    tokens = _tokens(ckpt.arch.vocab_size)
    want, _ = actor.logprobs(tokens, micro_batch_size=4)
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(f"{tmp}/ckpt", actor.model, ckpt.arch, model_dir)
        fresh = build_gpt(ckpt.arch)
        load_checkpoint(f"{tmp}/ckpt", fresh)
        same = all(torch.equal(a, b) for a, b in zip(actor.model.parameters(), fresh.parameters(), strict=True))
        assert same, "weights differ after save/load"
        out = megatron_to_hf(f"{tmp}/ckpt", f"{tmp}/hf")
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).cuda().eval()
        diff = (_megatron_logp(want) - _hf_logp(hf, tokens)).abs().max().item()
    assert diff < 2e-4, f"converted checkpoint: max |logp diff| = {diff}"
    return {"max_abs_diff": diff}


# ------------------------------------------------------------- a ~1B Llama at scale: memory phases, speed

ONE_B = "llama-3.2-1b"  # megareason plan's shape of Llama-3.2-1B, random weights (nothing downloaded)
ONE_B_TOKENS, ONE_B_SEQ = 4096, 1024  # one packed row per micro-batch: 4 sequences of 1,024 tokens


def _one_b_setup(recompute: str = "none"):
    """(cfg, arch, compute, optimizer settings) of a bf16 + distributed-optimizer run of the 1B shape."""
    from megareason.config.load import load_config
    from megareason.launch.plan_records import MODEL_SHAPES
    from megareason.settings import compute_settings, optimizer_settings

    cfg = load_config("grpo_quickstart", ["trainer.precision=bf16", "optim.use_distributed_optimizer=true",
                                          f"trainer.recompute={recompute}",
                                          f"trainer.micro_batch_tokens={ONE_B_TOKENS}"])
    return cfg, MODEL_SHAPES[ONE_B], compute_settings(cfg), optimizer_settings(cfg, 1e-5)


def _one_b_batches(arch, rows: int, seed: int = 0):
    from megareason.models.train import TrainBatch

    cu = torch.arange(0, ONE_B_TOKENS, ONE_B_SEQ, dtype=torch.int32)
    return [TrainBatch(_tokens(arch.vocab_size, (1, ONE_B_TOKENS), seed=seed + i), torch.ones(1, ONE_B_TOKENS),
                       cu_seqlens=cu) for i in range(rows)]


def _sum_nll(logp, entropy, b):
    return -(logp * b.loss_mask_BT).sum(), b.loss_mask_BT.sum(), {}


@check("llama_1b_memory_by_phase")
def one_b_memory(_model_dir):
    """A ~1.2B Llama (bf16, distributed optimizer, megatron-core's local layers): the device memory each phase
    allocates (``torch.cuda.max_memory_allocated`` around it) beside megareason plan's bytes for it — the
    resident states, a training step's peak, the checkpoint save's transient — and what the optimizer
    offload (``trainer.offload_optimizer``) frees and how long its round trip takes."""
    from megareason.launch.plan_memory import checkpoint_save_bytes, memory_per_rank, working_set
    from megareason.models.build import build_gpt, uses_transformer_engine
    from megareason.models.checkpoint import save_checkpoint
    from megareason.models.logprobs import logprob_head
    from megareason.models.offload import TrainingStateOffload
    from megareason.models.train import train_step, wrap_for_training

    cfg, arch, compute, optim = _one_b_setup()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = build_gpt(arch, compute)
    ddp, optimizer = wrap_for_training(model, optim)
    spec = "te" if uses_transformer_engine(model) else "local"
    plan = memory_per_rank(cfg, arch, 1, 1, 1, ONE_B_TOKENS, spec=spec)
    head = logprob_head(arch.vocab_size)
    batches = _one_b_batches(arch, 1)
    out = {"spec": spec, "params": sum(p.numel() for p in model.parameters()),
           "built_bytes": torch.cuda.memory_allocated() - base}
    peaks = []
    for _ in range(2):  # the second step holds Adam's moments from the first
        torch.cuda.reset_peak_memory_stats()
        train_step(ddp, optimizer, batches, head, _sum_nll)
        peaks.append(torch.cuda.max_memory_allocated() - base)
    resident = torch.cuda.memory_allocated() - base
    planned_states = plan["parameters"] + plan["gradients"] + plan["optimizer_state"]
    plan["backward working set"] = working_set(cfg, arch, 1, 1, ONE_B_TOKENS, 0, spec)
    out.update(step_peaks_bytes=peaks, planned_step_bytes=sum(plan.values()), resident_bytes=resident,
               planned_resident_bytes=planned_states, planned=plan)

    with tempfile.TemporaryDirectory() as tmp:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        save_checkpoint(f"{tmp}/ckpt", model, arch, tmp, optimizer)
        out["save_seconds"] = round(time.perf_counter() - start, 2)
        out["save_transient_bytes"] = torch.cuda.max_memory_allocated() - before
    out["planned_save_transient_bytes"] = checkpoint_save_bytes(cfg, arch, 1, 1, 1, 0)

    offload = TrainingStateOffload(ddp, optimizer)
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    offload.offload()
    out["offload_seconds"] = round(time.perf_counter() - start, 3)
    out["offload_freed_bytes"] = before - torch.cuda.memory_allocated()
    out["planned_offload_bytes"] = plan["gradients"] + plan["optimizer_state"]
    start = time.perf_counter()
    offload.onload()
    out["onload_seconds"] = round(time.perf_counter() - start, 3)
    after = train_step(ddp, optimizer, batches, head, _sum_nll)
    out["loss_after_onload"] = after.loss
    del ddp, optimizer, model, offload
    torch.cuda.empty_cache()
    # The step within 10 % (the plan leaves out the allocator's rounding and small temporaries).
    ratio = max(peaks) / out["planned_step_bytes"]
    out["step_ratio"] = round(ratio, 3)
    out["save_ratio"] = round(out["save_transient_bytes"] / max(out["planned_save_transient_bytes"], 1), 3)
    out["offload_ratio"] = round(out["offload_freed_bytes"] / out["planned_offload_bytes"], 3)
    problems = []
    if not 0.9 <= ratio <= 1.1:
        problems.append(f"step peak / plan = {ratio:.2f}")
    if not 0.9 <= out["save_ratio"] <= 1.1:
        problems.append(f"save transient / plan = {out['save_ratio']}")
    if not 0.95 <= out["offload_ratio"] <= 1.05:
        problems.append(f"offload freed / plan = {out['offload_ratio']}")
    if not math.isfinite(after.loss):
        problems.append("loss not finite after onload")
    assert not problems, f"{problems}: {json.dumps(out, default=str)}"
    return out


def _main_state(optimizer, limit: int | None = None) -> list[torch.Tensor]:
    """This rank's fp32 main weights and Adam moments (the distributed optimizer's shards), on the host, in
    order (main weight, first moment, second moment per parameter); the first ``limit`` of them only."""
    out = []
    for d in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in d.optimizer.param_groups:
            for p in group["params"]:
                state = d.optimizer.state[p]
                out += [t.detach().to("cpu", copy=True) for t in (p, state["exp_avg"], state["exp_avg_sq"])]
                if limit is not None and len(out) >= limit:
                    return out[:limit]
    return out


@check("llama_1b_async_save")
def one_b_async_save(_model_dir):
    """``trainer.async_save`` on the device (megatron-core's asynchronous save, its writer forked from a process
    that holds a CUDA context): the ~1.2B Llama's checkpoint with its distributed-optimizer state staged on the
    host before the save returns (the device memory it holds after returning, against the synchronous save's
    transient), a training step taken while the forked writer writes, then the committed checkpoint loaded
    into a fresh model and optimizer: every weight, fp32 main weight and Adam moment equal to the state at the
    save, not the step's after it."""
    from megatron.core import dist_checkpointing

    from megareason.models import checkpoint as ckpt_module
    from megareason.models.build import build_gpt
    from megareason.models.checkpoint import finish_saves, load_checkpoint, save_checkpoint
    from megareason.models.logprobs import logprob_head
    from megareason.models.train import train_step, wrap_for_training

    gc.collect()  # an earlier check's model in a reference cycle would be freed during the save, not before
    torch.cuda.empty_cache()
    cfg, arch, compute, optim = _one_b_setup()
    model = build_gpt(arch, compute)
    ddp, optimizer = wrap_for_training(model, optim)
    head = logprob_head(arch.vocab_size)
    train_step(ddp, optimizer, _one_b_batches(arch, 1), head, _sum_nll)  # Adam's moments exist
    phases: dict[str, float] = {}

    def timed(name, fn):
        def run(*args, **kwargs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            torch.cuda.synchronize()
            phases[name] = round(phases.get(name, 0.0) + time.perf_counter() - start, 2)
            return result
        return run

    # Where the time before the save returns goes: the optimizer's state dict (the distributed optimizer
    # gathers its fully_reshardable state), megatron-core's planning (which includes the state dict of the
    # model), the copy to the host, the writer's fork.
    optimizer.sharded_state_dict = timed("optimizer_state_dict", optimizer.sharded_state_dict)
    patched = [(dist_checkpointing, "save"), (ckpt_module, "_stage_on_host")]
    originals = [getattr(m, n) for m, n in patched]
    for (m, n), f in zip(patched, originals, strict=True):
        setattr(m, n, timed({"save": "plan_and_state_dicts", "_stage_on_host": "copy_to_host"}[n], f))
    queue = ckpt_module._async_saves()
    queue.schedule_async_request = timed("fork_writer", queue.schedule_async_request)
    weights = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    main = _main_state(optimizer)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        try:
            save_checkpoint(f"{tmp}/ckpt", model, arch, tmp, optimizer, asynchronous=True)
        finally:  # the later checks see megatron-core and the checkpoint module as they were
            for (m, n), f in zip(patched, originals, strict=True):
                setattr(m, n, f)
            del queue.schedule_async_request
        out["return_seconds"] = round(time.perf_counter() - start, 2)
        out["held_after_return_bytes"] = torch.cuda.memory_allocated() - before
        out["transient_bytes"] = torch.cuda.max_memory_allocated() - before
        out["committed_before_finish"] = Path(f"{tmp}/ckpt").exists()
        out["return_phases_seconds"] = phases
        gc.collect()
        out["held_after_return_gc_bytes"] = torch.cuda.memory_allocated() - before
        step = train_step(ddp, optimizer, _one_b_batches(arch, 1, seed=1), head, _sum_nll)  # while it writes
        changed = not torch.equal(_main_state(optimizer, limit=2)[1], main[1])  # the first Adam moment moved
        assert finish_saves(blocking=True)
        out["finish_seconds"] = round(time.perf_counter() - start, 2)
        del ddp, optimizer, model
        torch.cuda.empty_cache()
        fresh = build_gpt(arch, compute)
        _, fresh_opt = wrap_for_training(fresh, optim)
        load_checkpoint(f"{tmp}/ckpt", fresh, fresh_opt)
        weights_equal = all(torch.equal(weights[n], p.detach().cpu()) for n, p in fresh.named_parameters())
        loaded = _main_state(fresh_opt)
        main_equal = len(loaded) == len(main) and all(torch.equal(a, b) for a, b in zip(main, loaded, strict=True))
        del fresh, fresh_opt
        torch.cuda.empty_cache()
    out.update(step_loss_while_writing=step.loss, step_moved_adam_state=changed, weights_equal=weights_equal,
               main_state_tensors=len(main), main_state_equal=main_equal)
    problems = []
    if out["committed_before_finish"]:
        problems.append("the checkpoint appeared before its write was committed")
    if max(out["held_after_return_bytes"], out["held_after_return_gc_bytes"]) > 64 * 2**20:
        problems.append("the save still holds device memory after returning")
    if not (changed and weights_equal and main_equal):
        problems.append("the loaded state is not the state at the save")
    assert not problems, f"{problems}: {json.dumps(out, default=str)}"
    return out


@check("llama_1b_training_throughput")
def one_b_throughput(_model_dir):
    """Training tokens/s of the ~1.2B Llama (bf16, distributed optimizer, local layers, no recomputation) over
    steps of 4 micro-batches of one packed 4,096-token row each, and the model FLOPs utilisation: (6·N·tokens +
    causal attention's 3·2·L·d_attn·s² per sequence) / seconds / the GPU's dense bf16 peak, beside the MFU
    megareason plan assumes."""
    from megareason.launch.plan_memory import flop_params
    from megareason.launch.plan_records import GPUS, PlanOptions
    from megareason.models.build import build_gpt
    from megareason.models.logprobs import logprob_head
    from megareason.models.train import train_step, wrap_for_training

    _, arch, compute, optim = _one_b_setup()
    model = build_gpt(arch, compute)
    ddp, optimizer = wrap_for_training(model, optim)
    head = logprob_head(arch.vocab_size)
    batches = _one_b_batches(arch, 4)
    for _ in range(2):
        train_step(ddp, optimizer, batches, head, _sum_nll)
    torch.cuda.synchronize()
    steps = 5
    start = time.perf_counter()
    for _ in range(steps):
        train_step(ddp, optimizer, batches, head, _sum_nll)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    tokens = len(batches) * ONE_B_TOKENS
    sequences = tokens // ONE_B_SEQ
    attention = sequences * 2 * arch.num_layers * arch.num_heads * arch.head_dim * ONE_B_SEQ ** 2
    flops = 3 * (2 * flop_params(arch) * tokens + attention)
    name = torch.cuda.get_device_name()
    gpu = GPUS["H200"] if "H200" in name else GPUS["H100-80GB"] if "H100" in name else None
    del ddp, optimizer, model
    torch.cuda.empty_cache()
    out = {"tokens_per_step": tokens, "step_seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds),
           "tflops_per_s": round(flops / seconds / 1e12, 1), "plan_mfu": PlanOptions().mfu}
    if gpu is not None:
        out["mfu"] = round(flops / seconds / gpu.bf16_flops, 3)
    return out


# ------------------------------------------------------------- the memory ledger's moves on the device


def _tools():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_memory

    return gpu_memory


@check("offload_twins_bit_exact")
def offload_twins(model_dir):
    """Two copies of the model, plain and distributed optimizer: one trained plainly, the other with its
    gradient buffers and optimizer state moved as the loop moves them between steps (offload before each
    engine wake-up, the save's onload without gradients and a checkpoint, the next update's onload); after 3
    steps each pair's parameters are bit-exact (``tools/gpu_memory.twin_steps``)."""
    from megareason.models.build import HFCheckpoint, build_gpt, load_hf_weights
    from megareason.models.checkpoint import save_checkpoint
    from megareason.models.logprobs import logprob_head
    from megareason.models.offload import TrainingStateOffload
    from megareason.models.train import TrainBatch, train_step, wrap_for_training

    ckpt = HFCheckpoint(model_dir)
    head = logprob_head(ckpt.arch.vocab_size)
    batches = [TrainBatch(_tokens(ckpt.arch.vocab_size, (2, 16), seed=i), torch.ones(2, 16)) for i in range(2)]
    out = {}
    still = type("Still", (), {"offload": lambda self, optimizer=True: None,
                               "onload": lambda self, gradients=True: None})()
    for distributed in (False, True):
        twins = []
        for _ in range(4):
            torch.manual_seed(0)
            model = build_gpt(ckpt.arch)
            load_hf_weights(model, ckpt)
            ddp, opt = wrap_for_training(model, _optim(1e-3, use_distributed_optimizer=distributed))
            twins.append(type("Twin", (), {"parameters": lambda self, m=model: list(m.parameters()), "ddp": ddp,
                                           "opt": opt, "model": model,
                                           "training_state": TrainingStateOffload(ddp, opt)})())
        twins[3].training_state = still  # the control pair: the same steps and saves, no memory moves
        with tempfile.TemporaryDirectory() as tmp:
            saves = iter(range(20))

            def save(t, saves=saves, tmp=tmp):
                save_checkpoint(f"{tmp}/{next(saves)}", t.model, ckpt.arch, model_dir, t.opt)

            results = [_tools().twin_steps(plain, twin, lambda t: train_step(t.ddp, t.opt, batches, head, _nll), save)
                       for plain, twin in (twins[:2], twins[2:])]
        key = "distributed" if distributed else "plain"
        out[key], out[key + "_control"] = results
        # a device whose kernels are not deterministic fails the control too: then the offload is not to blame
        assert all(results[0]) or not all(results[1]), f"offloaded twin differs (distributed {distributed}): {out}"
    return out


def _one_b_trainer():
    """The ~1.2B Llama of the memory checks, built and trained one step (Adam's moments exist)."""
    from megareason.models.build import build_gpt
    from megareason.models.logprobs import logprob_head
    from megareason.models.offload import TrainingStateOffload
    from megareason.models.train import train_step, wrap_for_training

    cfg, arch, compute, optim = _one_b_setup()
    model = build_gpt(arch, compute)
    ddp, optimizer = wrap_for_training(model, optim)
    head, batches = logprob_head(arch.vocab_size), _one_b_batches(arch, 1)
    train_step(ddp, optimizer, batches, head, _sum_nll)
    return cfg, arch, model, ddp, optimizer, TrainingStateOffload(ddp, optimizer), head, batches


def _outside_allocator() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


@check("llama_1b_offload_then_vmm")
def one_b_offload_vmm(_model_dir):
    """After ``offload()`` the bytes it freed are allocated through the CUDA driver's virtual-memory calls, as
    vLLM's wake-up maps its weights and KV cache (``tools/gpu_memory.VMM``): they succeed only if torch's
    caching allocator gave the memory back to the driver; then the onload and a step still run. Under
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (``offload_expandable_segments``) too."""
    from megareason.models.train import train_step

    cfg, arch, model, ddp, optimizer, offload, head, batches = _one_b_trainer()
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    offload.offload()
    free_after, _ = torch.cuda.mem_get_info()
    freed = free_after - free_before
    vmm = _tools().VMM(torch.cuda.current_device())
    mapping = vmm.allocate(offload.offloaded_bytes)  # raises CudaError (out of memory) if the bytes are not free
    out = {"offloaded_bytes": offload.offloaded_bytes, "driver_freed_bytes": freed, "vmm_mapped_bytes": mapping.size,
           "free_after_vmm_bytes": torch.cuda.mem_get_info()[0],
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    vmm.free(mapping)
    offload.onload()
    out["loss_after_onload"] = train_step(ddp, optimizer, batches, head, _sum_nll).loss
    del ddp, optimizer, model, offload
    gc.collect()
    torch.cuda.empty_cache()
    assert freed >= 0.95 * out["offloaded_bytes"], f"the driver got back {freed} of {out['offloaded_bytes']} bytes"
    assert math.isfinite(out["loss_after_onload"])
    return out


@check("offload_expandable_segments")
def offload_expandable(_model_dir):
    """``llama_1b_offload_then_vmm`` in a fresh process under ``expandable_segments:True`` (PyTorch maps its
    segments with the same driver calls; vLLM turns it off inside its own pool only)."""
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        proc = subprocess.run([sys.executable, __file__, "--only", "llama_1b_offload_then_vmm", "--out",
                               f"{tmp}/r.json"], env=env, capture_output=True, text=True, timeout=300)
        result = json.loads(Path(f"{tmp}/r.json").read_text())["llama_1b_offload_then_vmm"]
    assert proc.returncode == 0 and result["ok"], proc.stdout[-2000:] + proc.stderr[-2000:]
    return result


def planned_resume(cfg, arch) -> dict[str, int]:
    """The ledger's device bytes of a trainer rank (no engine on the device) at the resume's load: the bytes
    ``launch/ledger.py`` puts there (parameters, main weights, Adam moments, outside the allocator)."""
    from megareason.launch.ledger import Ledger, rank_terms
    from megareason.launch.plan_records import GPUS, PlanOptions, workload

    terms = rank_terms(cfg, arch, GPUS["H200"], 0, sum(p.tokens for p in workload(cfg, PlanOptions())))
    led = Ledger(terms.sizes)
    led.build_trainer()
    led.offload_training_state()
    led.enter("resume")
    led.onload_training_state(gradients=False)
    led.load()
    return led.peaks["resume"]


@check("llama_1b_resume_vs_plan")
def one_b_resume(_model_dir):
    """A checkpoint of the ~1.2B Llama after one step, loaded into a fresh model and optimizer whose training
    state was offloaded (as at start-up): the allocator's peak through the load against the plan's resume
    column for a trainer rank (``planned_resume``, torch's part: the ledger less the memory outside the
    allocator), and the memory outside the allocator after each phase (build, step, offload, save, load)."""
    from megareason.models.build import build_gpt
    from megareason.models.checkpoint import load_checkpoint, save_checkpoint
    from megareason.models.offload import TrainingStateOffload
    from megareason.models.train import wrap_for_training

    outside = {"start": _outside_allocator()}
    cfg, arch, model, ddp, optimizer, offload, _, _ = _one_b_trainer()
    outside["step"] = _outside_allocator()
    offload.offload()
    outside["offload"] = _outside_allocator()
    with tempfile.TemporaryDirectory() as tmp:
        offload.onload(gradients=False)
        offload.offload(optimizer=False)
        save_checkpoint(f"{tmp}/ckpt", model, arch, tmp, optimizer)
        outside["save"] = _outside_allocator()
        del ddp, optimizer, model, offload
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        _, _, compute, optim = _one_b_setup()
        fresh = build_gpt(arch, compute)
        ddp, optimizer = wrap_for_training(fresh, optim)
        state = TrainingStateOffload(ddp, optimizer)
        state.offload()
        torch.cuda.reset_peak_memory_stats()
        state.onload(gradients=False)
        load_checkpoint(f"{tmp}/ckpt", fresh, optimizer)
        peak = torch.cuda.max_memory_allocated() - base
        outside["load"] = _outside_allocator()
    plan = planned_resume(cfg, arch)
    torch_part = sum(v for k, v in plan.items() if k not in ("outside", "nccl"))
    out = {"load_peak_bytes": peak, "planned_bytes": torch_part, "ratio": round(peak / torch_part, 3),
           "outside_allocator_bytes_by_phase": outside}
    assert 0.9 <= out["ratio"] <= 1.1, out
    return out


@check("device_memory_totals")
def device_totals(_model_dir):
    """What the CUDA runtime reports as the device's memory (``cudaMemGetInfo``: vLLM sizes its share of
    this), beside the planner's figure for the GPU, and what this process holds outside torch's allocator
    (the CUDA context, cuBLAS workspaces, NCCL) after the checks above."""
    from megareason.launch.plan_records import GPUS

    free, total = torch.cuda.mem_get_info()
    name = torch.cuda.get_device_name()
    gpu = GPUS["H200"] if "H200" in name else GPUS["H100-80GB"] if "H100" in name else None
    return {"device": name, "cuda_total_bytes": total, "cuda_total_gib": round(total / 2**30, 3),
            "plan_gib": gpu.memory_gib if gpu else None,
            "outside_torch_bytes": total - free - torch.cuda.memory_reserved()}


def use_optim_format(name: str) -> None:
    """Save the distributed optimizer's state in megatron-core's ``name`` format instead of megareason's
    ``fully_reshardable`` (the loader reads the format back from megareason.json). ``dp_reshardable`` writes
    each rank's shards as they lie (no gather over DP, no buffers for it) and reshards over DP only. Its
    loader in megatron-core 0.16.1 copies into the fp32 main parameters outside ``torch.no_grad`` (an error
    where they are views of the model's leaf parameters, as in fp32 training), so loads run under it here."""
    from megareason.models import checkpoint as ckpt_module

    ckpt_module.DISTRIB_OPTIM_SHARDING = name
    load = ckpt_module.load_checkpoint

    @functools.wraps(load)
    def load_without_grad(*args, **kwargs):
        with torch.no_grad():
            return load(*args, **kwargs)

    ckpt_module.load_checkpoint = load_without_grad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--skip-1b", action="store_true", help="leave out the ~1.2B-parameter Llama's checks")
    ap.add_argument("--only", action="append", default=[], metavar="CHECK",
                    help="run only this check (repeatable; a tiny model's by its name, e.g. llama_1b_async_save)")
    ap.add_argument("--optim-format", choices=("fully_reshardable", "dp_reshardable"),
                    help="megatron-core's format for the distributed optimizer's state in the checks' saves "
                         "(default: megareason's, fully_reshardable, which the memory check's planned save transient "
                         "assumes)")
    args = ap.parse_args()
    global OUT
    OUT = args.out
    if not torch.cuda.is_available():
        sys.exit("check_gpu.py needs a CUDA device")
    from megareason.models.build import transformer_engine_available
    from megareason.models.parallel import init_parallel
    from megareason.models.tiny import build_tiny_model
    from megareason.ports import rendezvous_store

    store = rendezvous_store("127.0.0.1", 1, datetime.timedelta(minutes=10))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    init_parallel(1, 1, store=store)
    if args.optim_format:
        use_optim_format(args.optim_format)
    import torch.distributed as dist

    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} backend {dist.get_backend()} "
          f"transformer_engine {transformer_engine_available()}", flush=True)
    def wanted(*fns):
        return [fn for fn in fns if not args.only or fn.check_name in args.only]

    per_model = wanted(logprobs_fp32, logprobs_packed, logprobs_bf16, train_step, sharing, critic, reference, stream,
                       ipc, checkpoint, offload_twins)
    with tempfile.TemporaryDirectory() as tmp:
        # qwen3_moe: megatron-core's MoE layers (router, all-to-all dispatch, per-expert MLPs) on the GPU
        moe = dict(hidden_size=64, head_dim=32, intermediate_size=128, moe_intermediate_size=64)
        for family, tied, kw in (("qwen2", False, {}), ("llama", True, {}), ("qwen3_moe", False, moe)):
            if not per_model:
                break
            model_dir = str(build_tiny_model(Path(tmp) / family, family, tie_word_embeddings=tied, **kw))
            for fn in per_model:
                before = set(RESULTS)
                fn(model_dir)
                for k in set(RESULTS) - before:
                    RESULTS[f"{family}/{k}"] = RESULTS.pop(k)
        one_b = (one_b_memory, one_b_async_save, one_b_throughput, one_b_offload_vmm, one_b_resume,
                 offload_expandable)
        for fn in wanted(bandwidth, *(() if args.skip_1b else one_b), device_totals):
            fn(None)
    if args.out:
        Path(args.out).write_text(json.dumps(RESULTS, indent=2))
    failed = [k for k, r in RESULTS.items() if r["ok"] is False]
    not_run = [k for k, r in RESULTS.items() if r["ok"] is None]
    print(f"{len(RESULTS) - len(failed) - len(not_run)} passed, {len(failed)} failed {failed}, "
          f"{len(not_run)} not run {not_run}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
