"""``megareason plan``'s time per step: FLOPs at an assumed MFU for the training and log-prob passes,
HBM bandwidth (or compute, for large batches) per decode step for generation, link bandwidth plus a
per-bucket RPC for the weight refit. Separate engines (rollout.placement=separate): training and log-prob
FLOPs over the trainer's GPUs only, generation on the engines, the refit through host memory on one node
or an NCCL broadcast across nodes (``separate_refit_seconds``). Every assumption is a named constant below."""

from __future__ import annotations

import math

from megareason.config.schema import Config
from megareason.launch.plan_memory import BYTES, expert_params, flop_params, recomputed_layers, total_params
from megareason.launch.plan_records import Pass, Plan, element_bytes
from megareason.models.arch import ModelArch

# Assumptions of the time model (stated in the printed plan).
HBM_EFFICIENCY = 0.8  # share of peak HBM bandwidth that decode kernels reach
NET_EFFICIENCY = 0.8  # share of link bandwidth reached by NCCL broadcasts / gathers
DECODE_MFU = 0.5  # compute-bound decode steps (large batches) reach this share of peak
STEP_OVERHEAD_S = 2e-3  # per decode step: scheduling, sampling, detokenization
ALLREDUCE_S = 10e-6  # per TP all-reduce (two per layer) in a decode step
EAGER_LAUNCH_S_PER_LAYER = 50e-6  # rollout.enforce_eager=true: kernels launched one by one, no CUDA graphs
REFIT_RPC_S = 0.01  # per weight bucket: collective_rpc round trip + opening the CUDA IPC handle
# Separate engines on the trainer's node: buckets through shared memory (tmpfs; trainer/pool.py).
HOST_COPY_BYTES_S = 20e9  # a GPU's copy to or from pageable host memory: ~1/3 of PCIe Gen5 x16's 64 GB/s
HOST_MEMORY_BYTES_S = 200e9  # a node's host memory bandwidth, shared by the engines' concurrent reads


def add_seconds(plan: Plan, cfg: Config) -> None:
    """Fill ``plan.seconds`` and ``plan.notes``: time per phase, with the plan's engines (``plan.engines``)."""
    arch, alg, t, pp = plan.arch, cfg.algorithm, cfg.trainer, plan.pp
    passes = plan.passes
    gen, gen_note = generation_seconds(plan, cfg, passes, plan.engines)
    plan.seconds["generation"], plan.notes["generation"] = gen, gen_note
    if plan.placement == "colocated":
        plan.generation_all_gpus = generation_seconds(plan, cfg, passes, plan.gpus // plan.vllm_tp)[0]
    flops_rate = plan.trainer_gpus * plan.gpu.flops(t.precision) * plan.options.mfu  # separate: not the engines'

    rows_tokens = sum(ps.tokens for ps in passes)
    micro = max(1, math.ceil(rows_tokens / (plan.dp * alg.mini_batches) / t.micro_batch_tokens))
    # 1F1B idles (PP - 1) micro-batch slots per pass: the log-prob forward runs every micro-batch at once,
    # each optimizer step (mini-batch) its own share.
    bubble, logprobs_bubble = (pp - 1) / micro, (pp - 1) / (micro * alg.mini_batches)
    attn = sum(ps.samples * 2 * arch.num_layers * arch.num_heads * arch.head_dim * (ps.prompt + ps.response) ** 2
               for ps in passes)  # causal attention, forward: 2·L·d_attn·s per token
    forward = 2 * flop_params(arch) * rows_tokens + attn
    critic, lora = alg.name == "ppo", cfg.lora.enabled
    off_policy = alg.ppo_epochs > 1 or alg.mini_batches > 1
    kinds = [k for k, on in (("reference", alg.kl_coef > 0), ("old log-probs", off_policy),
                             ("critic values", critic)) if on]
    dispatch = all_to_all_seconds(plan, cfg, rows_tokens)  # one forward's MoE dispatch + combine
    plan.seconds["logprobs"] = len(kinds) * (forward / flops_rate * (1 + logprobs_bubble) + dispatch)
    plan.notes["logprobs"] = (f"{' + '.join(kinds)} forward over {rows_tokens / 1e6:.1f}M tokens" if kinds else
                              "none (on-policy, kl_coef = 0: the update's own forward gives the ratio)")
    # forward + input gradients + weight gradients (each ~ a forward); LoRA has no base weight gradients;
    # recomputation reruns the forward of the recomputed layers (selective: core attention only).
    passes_per_update = 3 - (1 if lora else 0)
    share = recomputed_layers(cfg, arch, pp) / (arch.num_layers // pp)
    rerun = share * forward + (attn if t.recompute == "selective" else 0.0)
    per_update = passes_per_update * forward + rerun
    compute = per_update / flops_rate * (1 + bubble) + (2 + share) * dispatch  # backward: 2 more all-to-alls
    plan.seconds["training"] = alg.ppo_epochs * compute * (2 if critic else 1)
    recompute = {"none": "", "selective": " + core attention rerun"}.get(t.recompute,
                                                                         f" + {share:.0%} of a forward rerun")
    plan.notes["training"] = (f"{2 * passes_per_update}·N·tokens + attention{recompute}{' (LoRA)' if lora else ''}, "
                              f"{alg.ppo_epochs} epoch(s){' x actor and critic' if critic else ''}; "
                              f"{alg.mini_batches} x {micro} micro-batches of {t.micro_batch_tokens} tokens per DP "
                              f"rank, PP bubble {bubble:.1%}{_moe_note(plan, dispatch)}")
    plan.seconds["weight refit"], plan.notes["weight refit"] = refit_seconds(plan, cfg)


def all_to_all_seconds(plan: Plan, cfg: Config, tokens: float) -> float:
    """An MoE forward's token dispatch and combine over ``tokens`` tokens (0 without experts or at EP 1):
    two all-to-alls per layer, each sending, from every rank, the k copies of its tokens (1/TP of its
    replica's under sequence parallelism) that go to the other EP ranks' experts, k·h·B bytes a copy,
    1/EP of them to each (uniform routing); see ``ep_link_seconds``. Not overlapped with compute."""
    arch = plan.arch
    if not arch.is_moe or plan.ep == 1:
        return 0.0
    per_rank = tokens / (plan.dp * plan.tp) * arch.num_layers / plan.pp
    return ep_link_seconds(plan, 2 * per_rank * arch.moe_top_k * arch.hidden_size * BYTES[cfg.trainer.precision])


def ep_link_seconds(plan: Plan, volume: float) -> float:
    """Seconds for a rank to send 1/EP of ``volume`` bytes to each other EP rank: the EP ranks are
    consecutive DP ranks (TP apart), GPUs per node / TP of them on a node, reached over NVLink; the
    others over the network."""
    ep, gpu = plan.ep, plan.gpu
    on_node = min(ep, max(1, plan.gpus_per_node // plan.tp))
    nvlink = volume * (on_node - 1) / ep / (gpu.nvlink_bytes_s * NET_EFFICIENCY)
    return nvlink + volume * (ep - on_node) / ep / (gpu.network_bytes_s * NET_EFFICIENCY)


def _moe_note(plan: Plan, dispatch: float) -> str:
    """The training note's MoE part: active parameters and the all-to-all seconds per forward."""
    if not plan.arch.is_moe:
        return ""
    return (f"; MoE: N = {plan.active_params / 1e9:.2f}B active of {plan.total_params / 1e9:.2f}B, all-to-all "
            f"{dispatch:.1f} s per forward (EP {plan.ep})")


def decode_read_params(arch: ModelArch, concurrent: int) -> float:
    """Parameters a decode step of ``concurrent`` sequences reads: every dense one, and of each layer's
    experts those some sequence is routed to, E·(1 - (1 - k/E)^c) expected under uniform routing."""
    if not arch.is_moe:
        return total_params(arch)
    experts, k = arch.num_experts, arch.moe_top_k
    touched = experts * (1 - (1 - k / experts) ** concurrent)
    return total_params(arch) - arch.num_layers * (experts - touched) * expert_params(arch)


def decode_step_seconds(plan: Plan, cfg: Config, concurrent: int, context: float) -> float:
    """One decode step of an engine: read the weight shard (of an MoE, the experts the batch is routed to)
    and the running sequences' KV cache from HBM
    (or, for large batches, compute), plus TP all-reduces and launch overheads."""
    gpu, arch = plan.gpu, plan.arch
    weights = decode_read_params(arch, concurrent) * element_bytes(cfg.rollout.dtype) / plan.vllm_tp
    kv = concurrent * context * plan.kv_bytes_per_token
    memory_s = (weights + kv) / (gpu.hbm_bytes_s * HBM_EFFICIENCY)
    compute_s = 2 * flop_params(arch) * concurrent / plan.vllm_tp / (gpu.bf16_flops * DECODE_MFU)
    step = max(memory_s, compute_s) + STEP_OVERHEAD_S
    if plan.vllm_tp > 1:
        step += 2 * arch.num_layers * ALLREDUCE_S
    if cfg.rollout.enforce_eager:
        step += arch.num_layers * EAGER_LAUNCH_S_PER_LAYER
    return step


def generation_seconds(plan: Plan, cfg: Config, passes: list[Pass], engines: int) -> tuple[float, str]:
    """Sum over passes of prefill (compute bound) and decoding, each engine taking 1/engines of the samples.
    Decoding runs the bulk of the tokens at the concurrency the KV cache and vLLM's max_num_seqs allow,
    then a tail of a few sequences until the longest response reaches its max_tokens."""
    total, notes = 0.0, []
    for ps in passes:
        seqs = math.ceil(ps.samples / engines)
        fits = max(1, int(plan.kv_tokens_per_engine // (ps.prompt + ps.response)))
        concurrent = min(seqs, plan.gpu.max_num_seqs, fits)
        bulk = math.ceil(seqs * ps.response / concurrent)
        tail = max(0, ps.max_response - bulk)
        bulk_s = decode_step_seconds(plan, cfg, concurrent, ps.prompt + ps.response / 2)
        tail_s = decode_step_seconds(plan, cfg, 1, ps.prompt + ps.max_response)
        rate = plan.vllm_tp * plan.gpu.bf16_flops * plan.options.mfu
        prefill = seqs * ps.prompt * 2 * flop_params(plan.arch) / rate
        total += prefill + bulk * bulk_s + tail * tail_s
        notes.append(f"{ps.name}: {seqs} seqs/engine, {concurrent} at once: {bulk} steps x {bulk_s * 1e3:.1f} ms"
                     f" + tail {tail} x {tail_s * 1e3:.1f} ms")
    return total, "; ".join(notes)


def expert_gather_seconds(plan: Plan, cfg: Config) -> float:
    """The refit's expert gather at EP > 1: each rank receives its stage's experts held by the other EP
    ranks, 1/EP of them from each (``ep_link_seconds``)."""
    if plan.ep == 1:
        return 0.0
    experts = plan.arch.num_layers * plan.arch.num_experts * expert_params(plan.arch)
    return ep_link_seconds(plan, experts * element_bytes(cfg.rollout.dtype) / plan.pp)


def refit_seconds(plan: Plan, cfg: Config) -> tuple[float, str]:
    """Every engine receives the whole model, in the engine's dtype. Colocated SPMD engines
    (rollout.tensor_parallel_size > 1, ``rollout/colocated.py``): every rank all-gathers its stage's
    tensors over Megatron TP (NVLink) and receives the other stages' over the PP broadcast (the network
    where stages live on other nodes, each rank its own copy over its own NIC), then loads in-process.
    One engine per replica (rollout TP 1): the consumer gathers the same way, and the engine's ranks
    read every bucket over NVLink (CUDA IPC), one RPC per bucket. At EP > 1 the experts held by the
    other EP ranks are gathered too (``expert_gather_seconds``)."""
    if plan.placement == "separate":
        return separate_refit_seconds(plan, cfg)
    gpu = plan.gpu
    size = plan.total_params * element_bytes(cfg.rollout.dtype)
    stages_per_node = max(1, plan.gpus_per_node // plan.tp)
    remote = size * max(0, plan.pp - stages_per_node) / plan.pp
    network = remote / (gpu.network_bytes_s * NET_EFFICIENCY)
    experts = expert_gather_seconds(plan, cfg)
    ep = f", {experts:.1f} s EP {plan.ep} expert gather" if plan.ep > 1 else ""
    if plan.vllm_tp > 1:
        nvlink = size / plan.pp * (plan.tp - 1) / plan.tp / (gpu.nvlink_bytes_s * NET_EFFICIENCY)
        return network + nvlink + experts, (f"{size / 1e9:.0f} GB to every rank, in-process: {network:.1f} s "
                                            f"network (PP broadcast), {nvlink:.1f} s NVLink (TP all-gather of a "
                                            f"stage){ep}")
    nvlink = size * (1 + plan.vllm_tp) / (gpu.nvlink_bytes_s * NET_EFFICIENCY)
    buckets = math.ceil(size / (cfg.trainer.weight_sync_bucket_mb << 20))
    rpc = buckets * REFIT_RPC_S
    return network + nvlink + rpc + experts, (f"{size / 1e9:.0f} GB per engine: {network:.1f} s network (PP), "
                                             f"{nvlink:.1f} s NVLink (TP gather + {plan.vllm_tp} vLLM ranks){ep}, "
                                             f"{buckets} buckets x {REFIT_RPC_S * 1e3:.0f} ms RPC")


def separate_refit_seconds(plan: Plan, cfg: Config) -> tuple[float, str]:
    """Engines on GPUs of their own (rollout.placement=separate); every engine GPU receives the whole model
    in the engine's dtype (vLLM loads its TP shard of each full tensor), bucket by bucket, one RPC each.

    ``rollout.weight_transfer: shm`` (one node, ``rollout/transfer.py``): the trainer's first rank gathers the
    whole model (NVLink: TP all-gather, PP broadcast), copies each bucket once into shared memory (tmpfs) and
    every engine GPU copies it from there: two pageable host copies (``HOST_COPY_BYTES_S`` each), the engines'
    reads sharing the node's memory bandwidth (``HOST_MEMORY_BYTES_S``), bucket after bucket (no overlap).
    ``broadcast`` (engines on any node, ``rollout/broadcast.py``): the same gather to the first rank, then each
    bucket broadcast to every engine rank at once over NCCL, a pipelined broadcast at the receivers' link,
    the network (InfiniBand, one NIC per GPU) when engines sit on other nodes, NVLink when they share the
    trainer's. At EP > 1 the expert gather too. Not modelled: vLLM's per-tensor load."""
    gpu = plan.gpu
    size = plan.total_params * element_bytes(cfg.rollout.dtype)
    buckets = math.ceil(size / (cfg.trainer.weight_sync_bucket_mb << 20))
    rpc, experts = buckets * REFIT_RPC_S, expert_gather_seconds(plan, cfg)
    ep = f", {experts:.1f} s EP {plan.ep} expert gather" if plan.ep > 1 else ""
    tail = f"{ep}, {buckets} buckets x {REFIT_RPC_S * 1e3:.0f} ms RPC"
    gather = size * (1 - 1 / (plan.tp * plan.pp)) / (gpu.nvlink_bytes_s * NET_EFFICIENCY)
    if cfg.rollout.weight_transfer == "shm" and plan.nodes == 1:
        out = size / HOST_COPY_BYTES_S
        into = max(size / HOST_COPY_BYTES_S, plan.engine_gpus * size / HOST_MEMORY_BYTES_S)
        return gather + out + into + rpc + experts, (
            f"{size / 1e9:.0f} GB to each of {plan.engine_gpus} engine GPU(s) through shared memory: {gather:.1f} s "
            f"NVLink (gather to the first rank), {out:.1f} s into host memory, {into:.1f} s into the engines "
            f"({HOST_COPY_BYTES_S / 1e9:.0f} GB/s pageable copies){tail}")
    link = gpu.network_bytes_s * NET_EFFICIENCY if plan.nodes > 1 else gpu.nvlink_bytes_s * NET_EFFICIENCY
    broadcast = size / link
    return gather + broadcast + rpc + experts, (
        f"{size / 1e9:.0f} GB to each of {plan.engine_gpus} engine GPU(s): {gather:.1f} s NVLink (gather to the "
        f"first rank), {broadcast:.1f} s NCCL broadcast ({link / 1e9:.0f} GB/s per receiving GPU, "
        f"{'the network' if plan.nodes > 1 else 'NVLink'}){tail}")
