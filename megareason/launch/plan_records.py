"""The records of ``megareason plan`` (``launch/plan.py``): the GPUs and model shapes it knows, the options
a plan is made under, the step's generation passes (``workload``), the ``Plan`` itself and a step's seconds from its
phases (``step_seconds``: synchronous, or one step off-policy)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megareason.config.load import ConfigError
from megareason.config.schema import Config
from megareason.models.arch import ModelArch

GiB = 1024**3
CRITIC_PROMPT_EXTRA = 256  # tokens the RARO critic prompt adds to the question (instructions, two answers)


class PlanError(ConfigError):
    """The config cannot run on the allocation; the message names the field and the numbers."""


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # as nvidia-smi reports it
    cuda_total_gib: float  # cudaMemGetInfo's total: what vLLM's gpu_memory_utilization is a share of
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
        # cudaMemGetInfo totals: H200 measured by tools/check_gpu.py (150,109,880,320 B); H100 and A100 as
        # PyTorch's out-of-memory message reports their "total capacity".
        GPU("H100-80GB", 79.6, 79.19, 989e12, 67e12, 3.35e12, 450e9, 50e9, 1024),  # SXM, 400 Gb/s NDR per GPU
        GPU("H200", 140.4, 139.80, 989e12, 67e12, 4.8e12, 450e9, 50e9, 1024),
        GPU("A100-80GB", 80.0, 79.15, 312e12, 19.5e12, 2.039e12, 300e9, 25e9, 256),  # SXM, 200 Gb/s HDR per GPU
    )
}


def _llama(vocab, hidden, ffn, layers, heads, kv, *, family="llama", tied=False, theta=500000.0, factor=8.0,
           eps=1e-5, max_pos=131072, head_dim=None) -> ModelArch:
    return ModelArch(family=family, vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv, head_dim=head_dim or hidden // heads, rms_norm_eps=eps,
                     rope_theta=theta, rope_scaling_factor=factor, max_position_embeddings=max_pos,
                     tie_word_embeddings=tied, qkv_bias=family == "qwen2", qk_norm=family in ("qwen3", "qwen3_moe"))


def _moe(dense: ModelArch, experts: int, top_k: int, expert_ffn: int, norm_topk: bool = True) -> ModelArch:
    """``dense``'s attention with every MLP a mixture of ``experts`` SwiGLU experts of ``expert_ffn``, top-k."""
    return replace(dense, num_experts=experts, moe_top_k=top_k, moe_ffn_hidden_size=expert_ffn,
                   moe_norm_topk=norm_topk)


# Shapes from the models' published config.json files, for planning without the weights.
MODEL_SHAPES = {
    "llama-3.1-70b": _llama(128256, 8192, 28672, 80, 64, 8),  # also Llama-3.3-70B
    "llama-3.1-8b": _llama(128256, 4096, 14336, 32, 32, 8),
    "llama-3.2-1b": _llama(128256, 2048, 8192, 16, 32, 8, tied=True, factor=32.0),
    "qwen2.5-72b": _llama(152064, 8192, 29568, 80, 64, 8, family="qwen2", theta=1e6, factor=0.0, eps=1e-6,
                          max_pos=32768),
    "qwen2.5-7b": _llama(152064, 3584, 18944, 28, 28, 4, family="qwen2", theta=1e6, factor=0.0, eps=1e-6,
                         max_pos=32768),
    "smollm2-135m": _llama(49152, 576, 1536, 30, 9, 3, tied=True, theta=100000.0, factor=0.0, max_pos=8192),
    # Qwen3 dense: head_dim 128 whatever hidden / heads is; per-head q/k RMSNorm.
    "qwen3-0.6b": _llama(151936, 1024, 3072, 28, 16, 8, family="qwen3", tied=True, theta=1e6, factor=0.0, eps=1e-6,
                         max_pos=40960, head_dim=128),
    "qwen3-8b": _llama(151936, 4096, 12288, 36, 32, 8, family="qwen3", theta=1e6, factor=0.0, eps=1e-6,
                       max_pos=40960, head_dim=128),
    "qwen3-32b": _llama(151936, 5120, 25600, 64, 64, 8, family="qwen3", theta=1e6, factor=0.0, eps=1e-6,
                        max_pos=40960, head_dim=128),
    # Mixtures of experts (total / active parameters: 30.5B / 3.3B, 46.7B / 12.9B). Qwen3-30B-A3B's
    # intermediate_size 6144 is unused (every layer is MoE), kept as from_hf_config reads it.
    "qwen3-30b-a3b": _moe(_llama(151936, 2048, 6144, 48, 32, 4, family="qwen3_moe", theta=1e6, factor=0.0,
                                 eps=1e-6, max_pos=40960, head_dim=128), 128, 8, 768),
    "mixtral-8x7b": _moe(_llama(32000, 4096, 14336, 32, 32, 8, family="mixtral", theta=1e6, factor=0.0,
                                max_pos=32768), 8, 2, 14336),
}


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
    node_memory_gib: float = 2048.0  # host memory of a node (DGX H100 / H200: 2 TiB); preflight reads the real one



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
    ep: int  # parallel.expert_model_parallel_size (1 for a dense model)
    engines: int
    vllm_tp: int
    settings: dict[str, object]  # the config's trainer memory settings (SETTINGS)
    spec: str  # layers the trainer builds: "te" (TransformerEngine) or "local" (megatron-core's, LoRA)
    options: PlanOptions
    params_per_gpu: int
    total_params: int
    active_params: int  # per token: an MoE's top-k experts (= total_params for a dense model)
    memory: dict[str, dict[str, float]]  # phase -> line -> bytes, on the phase's most loaded stage
    stages: dict[str, int]  # phase -> its most loaded pipeline stage
    activations_by_recompute: dict[str, float]  # trainer.recompute none / selective / full -> training bytes
    kv_tokens_per_engine: int
    kv_bytes_per_token: int  # per GPU of an engine
    passes: list[Pass] = field(default_factory=list)  # the step's generation passes (workload)
    seconds: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # phase -> how its seconds were computed
    generation_all_gpus: float = 0.0  # generation if every GPU served a vLLM shard (GPUs / vLLM TP engines)
    placement: str = "colocated"  # rollout.placement: colocated (vLLM on the trainer's GPUs) or separate
    max_staleness: int = 0  # trainer.max_staleness: 0 synchronous, 1 one step off-policy (separate only)
    weight_transfer: str = "shm"  # rollout.weight_transfer (separate only): shm (one node) or broadcast
    host_per_node: dict[str, float] = field(default_factory=dict)  # state -> host bytes of a node's ranks

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def trainer_gpus(self) -> int:
        """GPUs of the Megatron roles, TP x PP x DP: every GPU when colocated, the rest but the engines' when
        separate."""
        return self.tp * self.pp * self.dp

    @property
    def engine_gpus(self) -> int:
        """GPUs that generate: engines x vLLM TP (colocated: shared with the trainer; separate: their own)."""
        return self.engines * self.vllm_tp

    @property
    def sync_seconds(self) -> float:
        """A synchronous step (trainer.max_staleness 0): every phase in turn."""
        return step_seconds(self.seconds, 0)

    @property
    def off_policy_seconds(self) -> float:
        """A one-step-off step (trainer.max_staleness 1, separate engines): see ``step_seconds``."""
        return step_seconds(self.seconds, 1)

    @property
    def step_seconds(self) -> float:
        """The step the config runs: synchronous, or one step off-policy at trainer.max_staleness 1."""
        return step_seconds(self.seconds, self.max_staleness)


def step_seconds(seconds: dict[str, float], max_staleness: int) -> float:
    """Seconds of a step from its phases' (``generation``, ``logprobs``, ``training``, ``weight refit``).

    Synchronous (0): generate, score, log-probs, train, refit, one after another: the sum. One step off (1),
    the runtime's steady state: wait for batch k (launched during step k-1), refit the engines (idle: an
    engine cannot generate while its weights are replaced), launch batch k+1, then log-probs and training of
    step k while the engines generate: refit + max(generation, log-probs + training)."""
    assert max_staleness in (0, 1), max_staleness
    if max_staleness == 0:
        return sum(seconds.values())
    return seconds["weight refit"] + max(seconds["generation"], seconds["logprobs"] + seconds["training"])




def kv_bytes_per_token(arch: ModelArch, vllm_tp: int, dtype_bytes: int) -> int:
    """KV cache bytes per token on one GPU of an engine (kv heads are replicated when fewer than TP)."""
    heads = max(arch.num_kv_heads // vllm_tp, 1)
    return 2 * arch.num_layers * heads * arch.head_dim * dtype_bytes


def element_bytes(dtype: str) -> int:
    """Bytes per element of a vLLM ``rollout.dtype``."""
    return 4 if dtype == "float32" else 2  # "auto" is bf16 for these models


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


