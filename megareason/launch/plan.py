"""``megareason plan``: will a training config fit an allocation of GPUs, and how long will a step take?

A back-of-the-envelope model, written out so that every number can be checked by hand. It plans the
trainer the config describes: ``trainer.precision``, ``trainer.recompute`` (+ ``recompute_num_layers``),
``optim.use_distributed_optimizer`` and ``parallel.sequence_parallel`` are read from the config, never
assumed, and a config that does not fit is refused with the setting that would make it fit.

* **Memory per GPU**, per phase of the colocated layout (vLLM and Megatron share every GPU), on the most
  loaded pipeline stage of each phase: generation (Megatron's resident states + vLLM's
  ``gpu_memory_utilization`` share), training (states + activations; vLLM asleep) and log-probs (states +
  the reference model onloaded + a forward's working set). The byte formulas (parameters, gradients,
  optimizer states per precision and distributed optimizer; activations per layer implementation,
  recomputation and sequence parallelism) are in :mod:`megareason.launch.plan_memory`, whose
  ``memory_per_rank`` gives them for one micro-batch on one rank. Training holds, on stage s under 1F1B,
  min(PP - s, micro-batches) micro-batches' saved activations plus one recomputed layer's rerun.
* **Time per step** from FLOPs (6·N·tokens to train, 2·N·tokens per forward, plus causal attention;
  recomputation adds the rerun forward of the recomputed layers) at an assumed MFU of the precision's
  peak (bf16/fp16 tensor cores, or fp32 without TF32), and from bandwidth for decoding: every decode step
  of a vLLM engine reads its weight shard and the KV cache of the running sequences from HBM. Refit is
  bytes over the network (PP stages live on other nodes) and NVLink plus a per-bucket RPC cost.

``make_plan`` is pure (config + shape + allocation in, numbers out); ``format_plan`` prints it; problems
that make a plan impossible raise :class:`PlanError` naming the config field(s) and, when one exists, the
cheapest change of the settings above that makes the plan fit.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from megareason.config.load import ConfigError
from megareason.config.schema import Config
from megareason.launch.plan_memory import (
    BYTES,
    flop_params,
    layer_bytes,
    layer_spec,
    params_per_gpu,
    recomputed_layers,
    stage_activations,
    stage_params,
    states,
    total_params,
)
from megareason.models.arch import ModelArch

GiB = 1024**3


class PlanError(ConfigError):
    """The config cannot run on the allocation; the message names the field and the numbers."""


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # as nvidia-smi reports it
    bf16_flops: float  # dense peak, FLOP/s (bf16 and fp16 tensor cores)
    fp32_flops: float  # dense fp32 peak without TF32 (megatron-core leaves torch's TF32 matmuls off)
    hbm_bytes_s: float  # HBM bandwidth, bytes/s
    nvlink_bytes_s: float  # per GPU, one direction
    network_bytes_s: float  # inter-node, per GPU (one NIC per GPU)
    max_num_seqs: int  # vLLM's default for LLM(...) on this GPU (engine/arg_utils.py)

    def flops(self, precision: str) -> float:
        return self.fp32_flops if precision == "fp32" else self.bf16_flops


GPUS = {
    g.name: g
    for g in (
        GPU("H100-80GB", 79.6, 989e12, 67e12, 3.35e12, 450e9, 50e9, 1024),  # SXM, 400 Gb/s NDR per GPU
        GPU("H200", 140.4, 989e12, 67e12, 4.8e12, 450e9, 50e9, 1024),
        GPU("A100-80GB", 80.0, 312e12, 19.5e12, 2.039e12, 300e9, 25e9, 256),  # SXM, 200 Gb/s HDR per GPU
    )
}


def _llama(vocab, hidden, ffn, layers, heads, kv, *, family="llama", tied=False, theta=500000.0, factor=8.0,
           eps=1e-5, max_pos=131072) -> ModelArch:
    return ModelArch(family=family, vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads, rms_norm_eps=eps, rope_theta=theta,
                     rope_scaling_factor=factor, max_position_embeddings=max_pos, tie_word_embeddings=tied,
                     qkv_bias=family == "qwen2")


# Shapes from the models' published config.json files, for planning without the weights.
MODEL_SHAPES = {
    "llama-3.1-70b": _llama(128256, 8192, 28672, 80, 64, 8),  # also Llama-3.3-70B
    "llama-3.1-8b": _llama(128256, 4096, 14336, 32, 32, 8),
    "qwen2.5-72b": _llama(152064, 8192, 29568, 80, 64, 8, family="qwen2", theta=1e6, factor=0.0, eps=1e-6,
                          max_pos=32768),
    "qwen2.5-7b": _llama(152064, 3584, 18944, 28, 28, 4, family="qwen2", theta=1e6, factor=0.0, eps=1e-6,
                         max_pos=32768),
    "smollm2-135m": _llama(49152, 576, 1536, 30, 9, 3, tied=True, theta=100000.0, factor=0.0, max_pos=8192),
}

# Assumptions of the time model (stated in the printed plan).
HBM_EFFICIENCY = 0.8  # share of peak HBM bandwidth that decode kernels reach
NET_EFFICIENCY = 0.8  # share of link bandwidth reached by NCCL broadcasts / gathers
DECODE_MFU = 0.5  # compute-bound decode steps (large batches) reach this share of peak
STEP_OVERHEAD_S = 2e-3  # per decode step: scheduling, sampling, detokenization
ALLREDUCE_S = 10e-6  # per TP all-reduce (two per layer) in a decode step
EAGER_LAUNCH_S_PER_LAYER = 50e-6  # rollout.enforce_eager=true: kernels launched one by one, no CUDA graphs
VLLM_RESERVE_GIB = 2.0  # inside vLLM's share: its profiled activation peak and non-torch allocations
RUNTIME_OVERHEAD_GIB = 2.0  # per Megatron process: CUDA context, NCCL buffers, allocator slack
REFIT_RPC_S = 0.01  # per weight bucket: collective_rpc round trip + opening the CUDA IPC handle
CRITIC_PROMPT_EXTRA = 256  # tokens the RARO critic prompt adds to the question (instructions, two answers)


@dataclass(frozen=True)
class PlanOptions:
    """The allocation and the assumptions a plan is made under (the CLI flags of ``megareason plan``)."""

    gpu: str = "H100-80GB"
    nodes: int = 0  # 0: as many as the layout needs (TP x PP x DP / gpus_per_node)
    gpus_per_node: int = 8
    mfu: float = 0.4  # training and log-prob passes, pipeline bubble excluded
    prompt_fraction: float = 0.5  # mean prompt length / data.max_prompt_length
    response_fraction: float = 0.5  # mean response length / rollout.max_tokens (the longest reaches it)
    response_tokens: int = 0  # > 0: the policy's mean response length in tokens (instead of the fraction)


# The trainer's memory settings: read from the config, varied only to say what would make a plan fit.
SETTINGS = ("trainer.precision", "optim.use_distributed_optimizer", "trainer.recompute",
            "trainer.recompute_num_layers", "parallel.sequence_parallel")


def _get(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _with(cfg: Config, changes: dict[str, object]) -> Config:
    for key, value in changes.items():
        section, name = key.split(".")
        cfg = replace(cfg, **{section: replace(getattr(cfg, section), **{name: value})})
    return cfg


def _render(changes: dict[str, object]) -> str:
    """``key=value`` overrides as the CLI takes them."""
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items())


def settings_of(cfg: Config) -> dict[str, object]:
    """The memory settings the trainer runs with (``recompute_num_layers`` only with full recompute)."""
    keys = [k for k in SETTINGS if k != "trainer.recompute_num_layers" or cfg.trainer.recompute == "full"]
    return {k: _get(cfg, k) for k in keys}


@dataclass
class Plan:
    """Per-GPU bytes per phase and seconds per phase of one training step."""

    config_name: str
    arch: ModelArch
    arch_source: str
    gpu: GPU
    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    dp: int
    engines: int
    vllm_tp: int
    settings: dict[str, object]  # the config's trainer memory settings (SETTINGS)
    spec: str  # layers the trainer builds: "te" (TransformerEngine) or "local" (megatron-core's, LoRA)
    options: PlanOptions
    params_per_gpu: int
    total_params: int
    memory: dict[str, dict[str, float]]  # phase -> line -> bytes, on the phase's most loaded stage
    stages: dict[str, int]  # phase -> its most loaded pipeline stage
    activations_by_recompute: dict[str, float]  # trainer.recompute none / selective / full -> training bytes
    kv_tokens_per_engine: int
    kv_bytes_per_token: int  # per GPU of an engine
    passes: list[Pass] = field(default_factory=list)  # the step's generation passes (workload)
    seconds: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # phase -> how its seconds were computed
    generation_all_gpus: float = 0.0  # generation if every GPU served a vLLM shard (GPUs / vLLM TP engines)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


# ----------------------------------------------------------------------------------------- shapes


def kv_bytes_per_token(arch: ModelArch, vllm_tp: int, dtype_bytes: int) -> int:
    """KV cache bytes per token on one GPU of an engine (kv heads are replicated when fewer than TP)."""
    heads = max(arch.num_kv_heads // vllm_tp, 1)
    return 2 * arch.num_layers * heads * arch.head_dim * dtype_bytes


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2  # "auto" is bf16 for these models


# ----------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Pass:
    """One generation pass: ``samples`` sequences of ``prompt`` + ``response`` tokens on average, the
    longest response ``max_response`` tokens."""

    name: str
    samples: int
    prompt: float
    response: float
    max_response: int

    @property
    def tokens(self) -> float:
        return self.samples * (self.prompt + self.response)


def workload(cfg: Config, opt: PlanOptions) -> list[Pass]:
    """The generation passes of one step; their sequences are also the rows trained on."""
    r, t = cfg.rollout, cfg.trainer
    prompt = opt.prompt_fraction * cfg.data.max_prompt_length
    response = min(opt.response_tokens, r.max_tokens) if opt.response_tokens else opt.response_fraction * r.max_tokens
    passes = [Pass("policy", t.prompts_per_step * r.n, prompt, response, r.max_tokens)]
    if cfg.algorithm.name == "raro":
        raro = cfg.raro
        fresh = t.prompts_per_step * r.n
        triplets = fresh + round(fresh * raro.replay_buffer_ratio / (1 - raro.replay_buffer_ratio))
        passes.append(Pass("critic", triplets * raro.critic_n, prompt + CRITIC_PROMPT_EXTRA,
                           opt.response_fraction * raro.critic_max_tokens, raro.critic_max_tokens))
    return passes


# ----------------------------------------------------------------------------------------- the plan


def make_plan(cfg: Config, arch: ModelArch, opt: PlanOptions, *, config_name: str = "",
              arch_source: str = "") -> Plan:
    """The plan of ``cfg`` on ``opt``'s allocation. Raises :class:`PlanError` (or ``ArchError``) when
    the layout does not match the allocation or a phase does not fit in GPU memory; then the message
    names the settings that would make it fit, if any do."""
    if opt.gpu not in GPUS:
        raise PlanError(f"--gpu {opt.gpu!r} is not known; known: {', '.join(GPUS)}")
    gpu = GPUS[opt.gpu]
    p, r, t = cfg.parallel, cfg.rollout, cfg.trainer
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size
    world = tp * pp * dp
    nodes = opt.nodes or max(1, math.ceil(world / opt.gpus_per_node))
    if world != nodes * opt.gpus_per_node:
        raise PlanError(
            f"parallel.tensor_model_parallel_size x pipeline_model_parallel_size x data_parallel_size = "
            f"{tp} x {pp} x {dp} = {world} GPUs does not equal the allocation's {nodes} nodes x "
            f"{opt.gpus_per_node} GPUs = {nodes * opt.gpus_per_node}")
    arch.check_parallelism(tp, pp)
    if p.sequence_parallel and tp == 1:
        raise PlanError("parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1")
    if t.recompute == "full" and t.recompute_num_layers > arch.num_layers // pp:
        raise PlanError(f"trainer.recompute_num_layers={t.recompute_num_layers} is more than the "
                        f"{arch.num_layers // pp} layers of a pipeline stage")
    vtp = r.tensor_parallel_size
    if vtp > tp * pp:
        raise PlanError(f"rollout.tensor_parallel_size={vtp} exceeds the {tp * pp} GPUs of a data-parallel "
                        f"replica (parallel.tensor_model_parallel_size x pipeline_model_parallel_size), which "
                        f"its colocated vLLM engine runs on")
    if arch.num_heads % vtp or (arch.num_kv_heads % vtp and vtp % arch.num_kv_heads):
        raise PlanError(f"rollout.tensor_parallel_size={vtp} does not split {arch.num_heads} attention heads / "
                        f"{arch.num_kv_heads} kv heads (vLLM needs heads % TP == 0 and kv heads % TP == 0 or "
                        f"TP % kv heads == 0)")
    plan = _plan(cfg, arch, opt, gpu, nodes, config_name, arch_source)
    problem = _problem(plan, cfg)
    if problem is None:
        _add_seconds(plan, cfg)
        return plan
    message, hint = problem
    fix = _cheapest_fix(cfg, arch, opt, gpu, nodes)
    if fix is None:
        raise PlanError(f"{message}; {hint}")
    changes, fitted = fix
    peak = max(sum(lines.values()) for lines in fitted.memory.values())
    raise PlanError(f"{message}; set {_render(changes)} to make it fit (then {peak / GiB:.1f} GiB per GPU at the "
                    f"peak, {sum(fitted.seconds.values()):.0f} s per step)")


def _cheapest_fix(cfg: Config, arch: ModelArch, opt: PlanOptions, gpu: GPU,
                  nodes: int) -> tuple[dict[str, object], Plan] | None:
    """The change of the memory settings that makes the plan fit with the shortest estimated step (then the
    fewest changed fields), and its plan; None if none does. Tried: the distributed optimizer, sequence
    parallelism (TP > 1), bf16 for fp32, and more recomputation (selective, then full on 1, 2, ... layers
    of each stage)."""
    t, tp, pp = cfg.trainer, cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    choices: list[list[dict[str, object]]] = [[{}], [{}], [{}], [{}]]
    if not cfg.optim.use_distributed_optimizer:
        choices[0].append({"optim.use_distributed_optimizer": True})
    if tp > 1 and not cfg.parallel.sequence_parallel:
        choices[1].append({"parallel.sequence_parallel": True})
    if t.precision == "fp32":
        choices[2].append({"trainer.precision": "bf16"})
    if t.recompute == "none":
        choices[3].append({"trainer.recompute": "selective"})
    per_stage = arch.num_layers // pp
    for n in range(recomputed_layers(cfg, arch, pp) + 1, per_stage + 1):
        choices[3].append({"trainer.recompute": "full", "trainer.recompute_num_layers": 0 if n == per_stage else n})
    best = None
    for parts in itertools.product(*choices):
        changes = {k: v for part in parts for k, v in part.items()}
        if not changes:
            continue
        changed = _with(cfg, changes)
        plan = _plan(changed, arch, opt, gpu, nodes, "", "")
        if _problem(plan, changed) is None:
            _add_seconds(plan, changed)
            cost = (round(sum(plan.seconds.values()), 6), len(changes))
            if best is None or cost < best[0]:
                best = (cost, changes, plan)
    return None if best is None else (best[1], best[2])


def _plan(cfg: Config, arch: ModelArch, opt: PlanOptions, gpu: GPU, nodes: int, config_name: str,
          arch_source: str) -> Plan:
    """The plan's memory (its seconds come from ``_add_seconds``)."""
    p, r, t, alg = cfg.parallel, cfg.rollout, cfg.trainer, cfg.algorithm
    tp, pp, dp, vtp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size,
                       r.tensor_parallel_size)
    critic, lora, act = alg.name == "ppo", cfg.lora.enabled, BYTES[t.precision]
    spec = layer_spec(cfg)

    # Micro-batches per DP rank and mini-batch; stage s holds min(PP - s, that many) under 1F1B.
    passes = workload(cfg, opt)
    rows_tokens = sum(ps.tokens for ps in passes)
    micro = max(1, math.ceil(rows_tokens / (dp * alg.mini_batches) / t.micro_batch_tokens))
    tok = t.micro_batch_tokens

    # vLLM's share while it generates.
    dbytes = _dtype_bytes(r.dtype)
    budget = r.gpu_memory_utilization * gpu.memory_gib * GiB
    vllm_weights = total_params(arch) * dbytes / vtp
    kv = budget - vllm_weights - VLLM_RESERVE_GIB * GiB
    kv_tok = kv_bytes_per_token(arch, vtp, dbytes)
    vllm = {"vLLM weights": vllm_weights, "vLLM activations + non-torch (reserve)": VLLM_RESERVE_GIB * GiB,
            "vLLM KV cache": kv}

    def training_activations(c: Config, stage: int) -> float:
        a = stage_activations(c, arch, tp, pp, tok, stage)
        return min(pp - stage, micro) * a.saved + a.working

    per_stage: list[dict[str, dict[str, float]]] = []
    for stage in range(pp):
        st = states(cfg, arch, tp, pp, dp, stage)
        lines = {
            f"parameters ({t.precision}{', base + LoRA adapters' if lora else ''})": st["parameters"],
            f"gradients (fp32 main_grad{' of the LoRA adapters' if lora else ''})": st["gradients"],
            (f"optimizer: {'Adam moments' if act == 4 else 'fp32 main weights + Adam moments'}"
             f"{f' (/ DP {dp})' if cfg.optim.use_distributed_optimizer and dp > 1 else ''}"): st["optimizer_state"],
        }
        if critic:  # the critic's own copy of everything (value head instead of the output layer: ~same size)
            lines["critic: parameters + gradients + optimizer"] = sum(lines.values())
        lines["runtime overhead (CUDA contexts, NCCL)"] = RUNTIME_OVERHEAD_GIB * GiB * (2 if critic else 1)
        recompute = {"none": "no recompute", "selective": "selective recompute"}.get(
            t.recompute, f"full recompute {recomputed_layers(cfg, arch, pp)}/{arch.num_layers // pp} layers")
        working = layer_bytes(cfg, arch, tp, tok, spec)  # a forward's transients: about one layer's activations
        if stage == pp - 1:  # + logits, their fp32 copy, fp32 probabilities and log-probabilities
            working += tok * arch.padded_vocab_size(tp) // tp * (act + 12)
        # The weight sync: vLLM's weights woken (KV cache still asleep), every rank gathering whole HF
        # tensors in the engine's dtype (the largest, the embedding, plus a bucket in flight).
        largest = arch.padded_vocab_size(1) * arch.hidden_size * dbytes
        sync = {"vLLM weights": vllm_weights,
                "weight sync: largest gathered tensor + bucket": largest + t.weight_sync_bucket_mb * 2**20}
        phases = {
            "generation": {**lines, **vllm},
            "sync": {**lines, **sync},
            "training": {**lines, f"activations ({recompute}, {min(pp - stage, micro)} in flight)":
                         training_activations(cfg, stage)},
            "logprobs": {**lines, "forward working set": working},
        }
        if alg.kl_coef > 0 and not lora:  # LoRA: the reference is the actor with its adapters off
            phases["logprobs"]["reference model (onloaded)"] = act * stage_params(arch, tp, pp, stage)
        per_stage.append(phases)
    stages = {ph: max(range(pp), key=lambda s, ph=ph: sum(per_stage[s][ph].values())) for ph in per_stage[0]}
    by_recompute = {}
    for name in ("none", "selective", "full"):
        c = _with(cfg, {"trainer.recompute": name, "trainer.recompute_num_layers": 0})
        by_recompute[name] = max(training_activations(c, s) for s in range(pp))
    return Plan(config_name=config_name, arch=arch, arch_source=arch_source, gpu=gpu, nodes=nodes,
                gpus_per_node=opt.gpus_per_node, tp=tp, pp=pp, dp=dp, engines=rollout_engines(tp * pp * dp, vtp, dp),
                vllm_tp=vtp,
                settings=settings_of(cfg), spec=spec, options=opt, params_per_gpu=params_per_gpu(arch, tp, pp),
                total_params=total_params(arch), memory={ph: per_stage[s][ph] for ph, s in stages.items()},
                stages=stages, activations_by_recompute=by_recompute,
                kv_tokens_per_engine=max(0, int(kv // kv_tok)), kv_bytes_per_token=kv_tok, passes=passes)


def rollout_engines(world: int, vllm_tp: int, dp: int) -> int:
    """vLLM engines of the trainer (trainer/workers.py): at rollout.tensor_parallel_size > 1 one SPMD
    engine per ``vllm_tp`` consecutive ranks (every GPU generates, ``rollout/colocated.py``); at 1 one
    engine per data-parallel replica, on its first rank."""
    return world // vllm_tp if vllm_tp > 1 else dp


def _add_seconds(plan: Plan, cfg: Config) -> None:
    """Time per phase, with the engines of ``rollout_engines``."""
    arch, alg, t, pp = plan.arch, cfg.algorithm, cfg.trainer, plan.pp
    passes = plan.passes
    gen, gen_note = generation_seconds(plan, cfg, passes, plan.engines)
    plan.seconds["generation"], plan.notes["generation"] = gen, gen_note
    plan.generation_all_gpus = generation_seconds(plan, cfg, passes, plan.gpus // plan.vllm_tp)[0]
    flops_rate = plan.gpus * plan.gpu.flops(t.precision) * plan.options.mfu
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
    plan.seconds["logprobs"] = len(kinds) * forward / flops_rate * (1 + logprobs_bubble)
    plan.notes["logprobs"] = (f"{' + '.join(kinds)} forward over {rows_tokens / 1e6:.1f}M tokens" if kinds else
                              "none (on-policy, kl_coef = 0: the update's own forward gives the ratio)")
    # forward + input gradients + weight gradients (each ~ a forward); LoRA has no base weight gradients;
    # recomputation reruns the forward of the recomputed layers (selective: core attention only).
    passes_per_update = 3 - (1 if lora else 0)
    share = recomputed_layers(cfg, arch, pp) / (arch.num_layers // pp)
    rerun = share * forward + (attn if t.recompute == "selective" else 0.0)
    per_update = passes_per_update * forward + rerun
    plan.seconds["training"] = alg.ppo_epochs * per_update * (2 if critic else 1) / flops_rate * (1 + bubble)
    recompute = {"none": "", "selective": " + core attention rerun"}.get(t.recompute,
                                                                         f" + {share:.0%} of a forward rerun")
    plan.notes["training"] = (f"{2 * passes_per_update}·N·tokens + attention{recompute}{' (LoRA)' if lora else ''}, "
                              f"{alg.ppo_epochs} epoch(s){' x actor and critic' if critic else ''}; "
                              f"{alg.mini_batches} x {micro} micro-batches of {t.micro_batch_tokens} tokens per DP "
                              f"rank, PP bubble {bubble:.1%}")
    plan.seconds["weight refit"], plan.notes["weight refit"] = refit_seconds(plan, cfg)


def decode_step_seconds(plan: Plan, cfg: Config, concurrent: int, context: float) -> float:
    """One decode step of an engine: read the weight shard and the running sequences' KV cache from HBM
    (or, for large batches, compute), plus TP all-reduces and launch overheads."""
    gpu, arch = plan.gpu, plan.arch
    weights = plan.total_params * _dtype_bytes(cfg.rollout.dtype) / plan.vllm_tp
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


def refit_seconds(plan: Plan, cfg: Config) -> tuple[float, str]:
    """Every engine receives the whole model, in the engine's dtype. Colocated SPMD engines
    (rollout.tensor_parallel_size > 1, ``rollout/colocated.py``): every rank all-gathers its stage's
    tensors over Megatron TP (NVLink) and receives the other stages' over the PP broadcast (the network
    where stages live on other nodes, each rank its own copy over its own NIC), then loads in-process.
    One engine per replica (rollout TP 1): the consumer gathers the same way, and the engine's ranks
    read every bucket over NVLink (CUDA IPC), one RPC per bucket."""
    gpu = plan.gpu
    size = plan.total_params * _dtype_bytes(cfg.rollout.dtype)
    stages_per_node = max(1, plan.gpus_per_node // plan.tp)
    remote = size * max(0, plan.pp - stages_per_node) / plan.pp
    network = remote / (gpu.network_bytes_s * NET_EFFICIENCY)
    if plan.vllm_tp > 1:
        nvlink = size / plan.pp * (plan.tp - 1) / plan.tp / (gpu.nvlink_bytes_s * NET_EFFICIENCY)
        return network + nvlink, (f"{size / 1e9:.0f} GB to every rank, in-process: {network:.1f} s network (PP "
                                  f"broadcast), {nvlink:.1f} s NVLink (TP all-gather of a stage)")
    nvlink = size * (1 + plan.vllm_tp) / (gpu.nvlink_bytes_s * NET_EFFICIENCY)
    buckets = math.ceil(size / (cfg.trainer.weight_sync_bucket_mb << 20))
    rpc = buckets * REFIT_RPC_S
    return network + nvlink + rpc, (f"{size / 1e9:.0f} GB per engine: {network:.1f} s network (PP), "
                                   f"{nvlink:.1f} s NVLink (TP gather + {plan.vllm_tp} vLLM ranks), "
                                   f"{buckets} buckets x {REFIT_RPC_S * 1e3:.0f} ms RPC")


def _trainer_resident(plan: Plan) -> float:
    """The trainer's bytes per GPU while vLLM is awake (its states stay resident; the reference is offloaded)."""
    return sum(v for k, v in plan.memory["generation"].items() if not k.startswith("vLLM"))


def _vllm_share(plan: Plan) -> float:
    return sum(v for k, v in plan.memory["generation"].items() if k.startswith("vLLM"))


def _problem(plan: Plan, cfg: Config) -> tuple[str, str] | None:
    """Why the plan cannot run (naming the fields) and which other field would lower it, or None."""
    cap = plan.gpu.memory_gib * GiB
    gen = plan.memory["generation"]
    kv = gen["vLLM KV cache"]
    if kv <= 0:
        return (f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} gives vLLM "
                f"{cfg.rollout.gpu_memory_utilization * plan.gpu.memory_gib:.1f} GiB per GPU, less than its weights "
                f"({gen['vLLM weights'] / GiB:.1f} GiB at rollout.tensor_parallel_size={plan.vllm_tp}) + "
                f"{VLLM_RESERVE_GIB} GiB: no room for a KV cache", "raise it")
    if plan.kv_tokens_per_engine < cfg.rollout.max_model_len:
        return (f"rollout.max_model_len={cfg.rollout.max_model_len} does not fit the KV cache of "
                f"{plan.kv_tokens_per_engine} tokens (rollout.gpu_memory_utilization="
                f"{cfg.rollout.gpu_memory_utilization})", "lower it or raise rollout.gpu_memory_utilization")
    for phase, lines in plan.memory.items():
        need = sum(lines.values())
        if need > cap:
            big = max(lines, key=lines.get)
            fix = {"generation": "lower rollout.gpu_memory_utilization", "training": "lower trainer.micro_batch_tokens"
                   }.get(phase, "raise parallel.tensor_model_parallel_size")
            if not big.startswith(("activations", "vLLM")):
                fix = ("split the model over more GPUs: parallel.tensor_model_parallel_size / "
                       "pipeline_model_parallel_size")
            return (f"does not fit: the {phase} phase needs {need / GiB:.1f} GiB per GPU > {plan.gpu.memory_gib} GiB "
                    f"on {plan.gpu.name} with {_render(plan.settings)}; largest: {big} {lines[big] / GiB:.1f} GiB",
                    f"no change of {', '.join(SETTINGS)} makes it fit: {fix}")
    return None


# ----------------------------------------------------------------------------------------- printing


def format_plan(plan: Plan) -> str:
    a, g, o = plan.arch, plan.gpu, plan.options
    spec = "TransformerEngine layers" if plan.spec == "te" else "megatron-core's local layers (LoRA)"
    lengths = ", ".join(f"{ps.name} {ps.prompt:.0f} + {ps.response:.0f} (longest {ps.max_response})"
                        for ps in plan.passes)
    out = [
        f"plan: {plan.config_name} on {plan.nodes} node(s) x {plan.gpus_per_node} {g.name} = {plan.gpus} GPUs "
        f"({g.memory_gib} GiB, {g.bf16_flops / 1e12:.0f} TFLOP/s bf16, {g.hbm_bytes_s / 1e12:.2f} TB/s HBM each)",
        f"model: {plan.arch_source}: {a.num_layers} layers, hidden {a.hidden_size}, ffn {a.ffn_hidden_size}, "
        f"{a.num_heads} heads / {a.num_kv_heads} kv heads x {a.head_dim}, vocab {a.vocab_size}; "
        f"{plan.total_params / 1e9:.2f}B parameters, {plan.params_per_gpu / 1e9:.3f}B on the most loaded GPU",
        f"layout: Megatron TP {plan.tp} x PP {plan.pp} x DP {plan.dp} ({spec}); vLLM: {plan.engines} engine(s) "
        f"({'SPMD, colocated on consecutive ranks' if plan.vllm_tp > 1 else 'one per DP replica'}) x TP "
        f"{plan.vllm_tp} = {plan.engines * plan.vllm_tp} of {plan.gpus} GPUs generate",
        f"settings (from the config): {_render(plan.settings)}",
        f"assumed: MFU {o.mfu:.0%}; mean prompt + response tokens: {lengths}",
        "",
        f"{'memory per GPU (GiB)':<62}{'generation':>11}{'sync':>10}{'training':>10}{'logprobs':>10}",
    ]
    phases = ("generation", "sync", "training", "logprobs")
    widths = (11, 10, 10, 10)
    lines = list(dict.fromkeys(k for phase in plan.memory.values() for k in phase))
    for line in lines:
        cells = [plan.memory[ph].get(line) for ph in phases]
        out.append(f"  {line:<60}" + "".join(f"{'-' if c is None else f'{c / GiB:.1f}':>{w}}"
                                           for c, w in zip(cells, widths, strict=True)))
    totals = [sum(plan.memory[ph].values()) / GiB for ph in phases]
    out.append(f"  {'total (of ' + str(g.memory_gib) + ')':<60}" + "".join(f"{x:>{w}.1f}" for x, w in
                                                                           zip(totals, widths, strict=True)))
    act = plan.activations_by_recompute
    out += [
        f"  {'pipeline stage':<60}" + "".join(f"{plan.stages[ph]:>{w}}" for ph, w in zip(phases, widths,
                                                                                         strict=True)),
        f"  training activations by trainer.recompute: none {act['none'] / GiB:.1f}, selective "
        f"{act['selective'] / GiB:.1f}, full (every layer) {act['full'] / GiB:.1f} GiB",
        f"  KV cache: {plan.kv_tokens_per_engine:,} tokens per engine ({plan.kv_bytes_per_token / 1024:.0f} KiB per "
        f"token per GPU)",
        # vLLM starts after the actor and refuses to unless free memory >= gpu_memory_utilization x total
        # (vllm/v1/worker/gpu_worker.py); the generation column is that sum, so it fits iff vLLM starts.
        f"  vLLM start-up: {g.memory_gib - _trainer_resident(plan) / GiB:.1f} GiB free beside the trainer's "
        f"{_trainer_resident(plan) / GiB:.1f} GiB, needs rollout.gpu_memory_utilization x total = "
        f"{_vllm_share(plan) / GiB:.1f} GiB",
        "",
        f"{'time per step (estimate)':<26}{'seconds':>8}   basis",
    ]
    for phase, s in plan.seconds.items():
        out.append(f"  {phase:<24}{s:>8.1f}   {plan.notes[phase]}")
    out.append(f"  {'total':<24}{sum(plan.seconds.values()):>8.1f}")
    if plan.engines * plan.vllm_tp < plan.gpus:
        out.append(f"  (generation with an engine on every GPU, {plan.gpus // plan.vllm_tp} engines: "
                   f"{plan.generation_all_gpus:.1f} s)")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------- entry point


def resolve_arch(cfg: Config, model_shape: str) -> tuple[ModelArch, str]:
    """The model's shape: a ``--model-shape`` preset, else the HF config.json at model.path."""
    if model_shape:
        if model_shape not in MODEL_SHAPES:
            raise PlanError(f"--model-shape {model_shape!r} is not known; known: {', '.join(MODEL_SHAPES)}")
        return MODEL_SHAPES[model_shape], f"{model_shape} (--model-shape)"
    from megareason.models.hub import resolve_model_path

    try:
        path = resolve_model_path(cfg.model.path)
    except FileNotFoundError as e:
        raise PlanError(f"model.path={cfg.model.path!r}: no config.json here ({e}); pass --model-shape "
                        f"({', '.join(MODEL_SHAPES)}) to plan without the weights") from e
    return ModelArch.from_pretrained(path), str(path)


def plan_config(config: str, overrides: list[str], opt: PlanOptions, model_shape: str = "") -> Plan:
    """Load ``config`` (a name in configs/ or a path to a YAML file), validate it for training and plan it."""
    from megareason.config import load_config, validate_training

    path = Path(config)
    if path.suffix in (".yaml", ".yml") or "/" in config:
        cfg = load_config(path.stem, overrides, path.parent)
    else:
        cfg = load_config(config, overrides)
    validate_training(cfg)
    arch, source = resolve_arch(cfg, model_shape)
    return make_plan(cfg, arch, opt, config_name=config, arch_source=source)


HELP = """\
Print, per GPU, the memory of parameters, gradients, optimizer states, activations and the vLLM KV cache
in each phase of a step (generation, training, log-probs), and the estimated seconds per phase from FLOPs
and memory bandwidth. The trainer's memory settings come from the config (trainer.precision,
trainer.recompute, trainer.recompute_num_layers, optim.use_distributed_optimizer,
parallel.sequence_parallel). Refuses (exit code 2, naming the field) a layout whose TP x PP x DP is not
the allocation's GPU count, or a config that does not fit, saying which settings would make it fit. The
model's shape comes from model.path's config.json, or from --model-shape to plan without the weights.
See docs/planner.md.

examples:
  megareason plan --model-shape llama-3.1-70b --nodes 8 --gpus-per-node 8 configs/raro_70b.yaml
  megareason plan --model-shape llama-3.1-70b configs/raro_70b.yaml trainer.recompute=none   # refused
  megareason plan --gpus-per-node 1 --gpu A100-80GB grpo_smollm2_cpu
"""


def add_arguments(p) -> None:
    d = PlanOptions()
    p.add_argument("config", help="a config name in configs/ or a path to a YAML file")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--nodes", type=int, default=d.nodes, help="default: as many as the layout needs")
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    p.add_argument("--gpu", choices=list(GPUS), default=d.gpu)
    p.add_argument("--model-shape", choices=list(MODEL_SHAPES), default="",
                   help="plan this architecture instead of reading model.path's config.json")
    p.add_argument("--mfu", type=float, default=d.mfu, help="assumed model FLOPs utilization")
    p.add_argument("--prompt-fraction", type=float, default=d.prompt_fraction,
                   help="mean prompt length / data.max_prompt_length")
    p.add_argument("--response-fraction", type=float, default=d.response_fraction,
                   help="mean response length / max_tokens")
    p.add_argument("--response-tokens", type=int, default=d.response_tokens,
                   help="mean policy response length in tokens (instead of --response-fraction for the policy)")


def run_cli(args) -> int:
    opt = PlanOptions(gpu=args.gpu, nodes=args.nodes, gpus_per_node=args.gpus_per_node, mfu=args.mfu,
                      prompt_fraction=args.prompt_fraction, response_fraction=args.response_fraction,
                      response_tokens=args.response_tokens)
    print(format_plan(plan_config(args.config, args.overrides, opt, args.model_shape)))
    return 0
