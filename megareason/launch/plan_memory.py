"""The planner's memory model: bytes on one GPU rank of a megatron-core role as megareason's trainer builds it.

Pure arithmetic on a config, a model shape and a layout, written so that a benchmark can hold each
number against bytes measured on a live model (``megareason/models/memory.py``: ``state_bytes`` and
``SavedActivations``): :func:`memory_per_rank` gives the figures of ONE training micro-batch on one rank.
The settings are the trainer's own config fields: ``trainer.precision``, ``trainer.recompute``,
``trainer.recompute_num_layers``, ``optim.use_distributed_optimizer`` and ``parallel.sequence_parallel``.

Notation, per rank: h hidden size, d head dim, a = heads / TP, q = a·d, k = (kv heads / TP)·d,
f = ffn hidden / TP, V = padded vocab / TP; T tokens of the micro-batch (one packed row), T' = T / TP
under sequence parallelism, else T; B bytes of an activation and P of a parameter (4 in fp32, 2 in
bf16); n parameters of this rank's pipeline stage (``stage_params``), n_a of its LoRA adapters.

**States** (``states``), kept between steps, bytes on the rank:

- ``trainer.precision=fp32``: parameters 4n, gradients 4n (DDP's ``main_grad`` buffer), optimizer_state 8n
  (Adam's ``exp_avg`` + ``exp_avg_sq``; the parameters are the main weights): 16 B/param.
- ``bf16``: parameters 2n, gradients 4n (fp32 ``main_grad``, ``grad_reduce_in_fp32``),
  optimizer_state 12n (fp32 main weights 4 + Adam moments 8): 18 B/param.
- ``optim.use_distributed_optimizer`` divides optimizer_state by DP: fp32 8 + 8/DP B/param, bf16 6 + 12/DP;
  gradients stay whole (reduce-scattered into the full buffer). Megatron pads its buffers to multiples of
  DP x 128 elements: not counted.
- LoRA: parameters (n + n_a)·P (the frozen base and the adapters, both in the model's precision);
  gradients and optimizer_state count n_a only.

**Activations saved for backward** (``stage_activations``), per layer that is not recomputed, in bytes per
token, for the two layer implementations the trainer builds (``layer_spec``):

- ``te``, TransformerEngine layers (GPU, full fine-tuning):
  norms 2·(2h·B + 4) per token of T' (each RMSNorm, fused into the next linear, saves its input, its
  output = the linear's input, and fp32 1/rms); RoPE 4d·B (cos and sin, for q and for k:
  ``apply_rope_fusion=False``); attention (3q + 3k)·B + 4a (q and k after RoPE, the fused QKV
  projection's output q + 2k, which v is a view into, the attention output = linear_proj's input; the
  fp32 softmax statistics of flash / cuDNN attention: no T x T tensor); MLP 5f·B (fc1's output 2f, and
  megatron-core's unfused SwiGLU: silu(gate) f, up + glu_linear_offset f, their product = fc2's input f).
- ``local``, megatron-core's local layers (CPU, and LoRA on any device):
  norms 2·((8 + B)·h + 4) per token of T' (``torch.nn.RMSNorm`` computes in fp32: its fp32 input 4h, the
  normalised fp32 input 4h, fp32 1/rms, and its output B·h = the linear's input); RoPE 4d·B; attention
  4q·B (q, k and v repeated to all a heads, the context) plus, per layer, the T x T tensors of unfused
  attention a·T²·(4 + B) (the fp32 softmax and its B-byte copy; in fp32 one tensor, a·T²·4); MLP 5f·B;
  and once per stage the packed row's [T, T] bool attention mask, T² (a forward without ``cu_seqlens``,
  ``attention_mask=None``, instead saves a causal mask in each layer: (layers - 1)·T² more).

Recomputation. ``trainer.recompute=selective`` (core attention checkpointed) saves, in both, attention
(3q + 3k)·B: its inputs q, k, v (a view of the QKV output) and linear_proj's input; no statistics and no
T x T tensor (under TE it drops only the statistics: flash attention never keeps T x T). ``full``: a
recomputed layer saves only its input, h·B per token of T', and the stage once the fp32 rotary
frequencies, 4d per token; ``trainer.recompute_num_layers`` N > 0 recomputes the first N layers of each
stage (the others save everything), 0 every layer. While the backward pass reruns a recomputed layer, its
activations exist too: ``working`` = one layer's.

Sequence parallelism splits the sequence outside the TP regions: the norms and a recomputed layer's input
count T' = T / TP tokens, everything else T. The first stage saves the token ids, 8 bytes per token (9
with TP > 1: the vocab-parallel embedding's bool mask). The last saves the final norm (one norm as above,
T' tokens) and the LM head's fp32 probabilities and log-probabilities (``models/logprobs.py``), 8V + 13
bytes per scored token (with the fp32 entropy, int64 target index and bool in-range flag), plus T bytes
(the packed row's sequence-start mask); the logits themselves are not saved.

**Mixtures of experts** (``arch.is_moe``; ``parallel.expert_model_parallel_size`` EP, carved out of DP).
States count the TOTAL parameters, split two ways (``stage_param_split``): the dense ones (attention,
norms, the router E·h, replicated over TP, embeddings) as above over TP × PP, and the experts
(E·3·h·f_e per layer, f_e the expert ffn size) over TP × PP × EP: each EP rank holds E / EP experts, each
split over TP like a dense MLP. The distributed optimizer shards the dense optimizer_state over DP and the
experts' over the expert-data-parallel group, DP / EP ranks. Activations count the ACTIVE parameters: with
balanced routing every rank's experts see k copies of each of the T tokens (k = top-k, whatever EP is), so
the MLP saves k·5·(f_e / TP)·B per token, plus the dispatch's permuted expert inputs and the outputs it
weights by the router probabilities, 2k·h·B per token, and the router's fp32 logits and probabilities,
8E per token of T'. These MoE figures are derived, not measured.

Not counted: tensors of a few bytes per layer (a checkpointed core attention's 4-byte mask-type tensor),
LoRA's rank-r intermediates; prefix-shared rows (``trainer.share_prompt_prefix``, local layers) are
shorter than T. Checked: on CPU (local layers, a packed row through ``models.schedule``, TP 1 and 2, fp32
and bf16, every recompute setting, sequence parallel) ``stage_activations`` equals ``SavedActivations``
to the byte, but for those 4-byte tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megareason.config.schema import Config
from megareason.models.arch import ModelArch

Spec = Literal["te", "local"]
BYTES = {"fp32": 4, "bf16": 2}


def layer_spec(cfg: Config) -> Spec:
    """The layers the trainer builds on GPU: TransformerEngine, but megatron-core's local layers with LoRA
    (``models/roles.py``). On CPU it is always ``local``."""
    return "local" if cfg.lora.enabled else "te"


# ----------------------------------------------------------------------------------------- parameters


def expert_params(arch: ModelArch) -> int:
    """Parameters of one expert (gate, up and down of ``moe_ffn_hidden_size``); 0 for a dense model."""
    return 3 * arch.hidden_size * arch.moe_ffn_hidden_size if arch.is_moe else 0


def stage_param_split(arch: ModelArch, tp: int, pp: int, stage: int, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters on one GPU of pipeline stage ``stage``. Dense: its layers' (q, k, v, o,
    and a dense model's gate, up, down) / TP + 2 replicated norms each, + Qwen3's replicated per-head q/k
    norms, + an MoE router (E × h, replicated); the first stage adds the embedding (vocab × h / TP), the
    last the final norm and the output layer (a separate copy with PP > 1 even when tied). Expert: the
    layers' E / EP local experts, each / TP."""
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    linear = h * q + 2 * h * kv + q * h + (0 if arch.is_moe else 3 * h * arch.ffn_hidden_size)
    bias = q + 2 * kv if arch.qkv_bias else 0
    replicated = 2 * h + (2 * arch.head_dim if arch.qk_norm else 0) + arch.num_experts * h
    layers = arch.num_layers // pp
    n = layers * ((linear + bias) // tp + replicated)
    vocab = arch.padded_vocab_size(tp) * h // tp
    if stage == 0:
        n += vocab
    if stage == pp - 1:
        n += h + (0 if arch.tie_word_embeddings and pp == 1 else vocab)
    return n, layers * arch.num_experts // ep * expert_params(arch) // tp


def stage_params(arch: ModelArch, tp: int, pp: int, stage: int, ep: int = 1) -> int:
    """Parameters on one GPU of pipeline stage ``stage``: dense + expert (``stage_param_split``)."""
    return sum(stage_param_split(arch, tp, pp, stage, ep))


def params_per_gpu(arch: ModelArch, tp: int, pp: int, ep: int = 1) -> int:
    """Parameters on one GPU of the most loaded pipeline stage."""
    return max(stage_params(arch, tp, pp, s, ep) for s in {0, pp - 1})


def total_params(arch: ModelArch) -> int:
    """Every parameter of the model (an MoE's every expert)."""
    return stage_params(arch, 1, 1, 0)


def active_params(arch: ModelArch) -> int:
    """Parameters a token runs through: an MoE's top-k experts of each layer instead of all of them."""
    idle = arch.num_layers * (arch.num_experts - arch.moe_top_k) * expert_params(arch)
    return total_params(arch) - idle


def flop_params(arch: ModelArch) -> int:
    """Parameters that cost FLOPs per token: the active ones but the input embedding (a lookup)."""
    untied_embedding = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    return active_params(arch) - untied_embedding


def lora_params_per_gpu(arch: ModelArch, tp: int, pp: int, rank: int, targets: list[str]) -> int:
    """LoRA adapter parameters on one GPU (every stage has the same layers). A of a column-parallel layer
    and B of a row-parallel one are whole on every TP rank; the other factor is split like its layer
    (``models/lora.py``)."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_target = {  # (A, B)
        "linear_qkv": rank * h + (q + 2 * kv) * rank // tp,
        "linear_proj": rank * q // tp + h * rank,
        "linear_fc1": rank * h + 2 * f * rank // tp,
        "linear_fc2": rank * f // tp + h * rank,
    }
    return arch.num_layers // pp * sum(per_target[t] for t in targets)


def states(cfg: Config, arch: ModelArch, tp: int, pp: int, dp: int, stage: int, ep: int = 1) -> dict[str, int]:
    """Bytes of ``parameters``, ``gradients`` and ``optimizer_state`` on one rank of ``stage`` (see the
    module docstring): the distributed optimizer shards the dense state over DP, the experts' over DP / EP."""
    p = BYTES[cfg.trainer.precision]
    dense, expert = stage_param_split(arch, tp, pp, stage, ep)
    n = dense + expert
    per_param = 8 if p == 4 else 12  # Adam moments (+ fp32 main weights in mixed precision)
    if cfg.lora.enabled:
        trained = lora_params_per_gpu(arch, tp, pp, cfg.lora.rank, cfg.lora.targets)
        optimizer = per_param * trained // (dp if cfg.optim.use_distributed_optimizer else 1)
        return {"parameters": p * (n + trained), "gradients": 4 * trained, "optimizer_state": optimizer}
    dense_shards, expert_shards = (dp, dp // ep) if cfg.optim.use_distributed_optimizer else (1, 1)
    optimizer = per_param * dense // dense_shards + per_param * expert // expert_shards
    return {"parameters": p * n, "gradients": 4 * n, "optimizer_state": optimizer}


def checkpoint_save_bytes(cfg: Config, arch: ModelArch, tp: int, pp: int, dp: int, stage: int, ep: int = 1) -> int:
    """Device bytes a checkpoint save adds on one rank of ``stage``, on top of its resident states.

    The distributed optimizer's ``fully_reshardable`` save (megatron-core 0.16,
    ``optimizer/distrib_optimizer.py``, ``get_parameter_state_dp_zero`` with ``return_on_all_ranks``)
    all-gathers each gradient buffer's DP shards of the fp32 main weights, then of each Adam moment, one
    state at a time, into a list of CUDA receive buffers of the whole buffer's size, sending its own shard
    from the device; PyTorch's NCCL all-gather into a list gathers into one flat tensor of that size first
    (``ProcessGroupNCCL::allgather``, ``newLikeFlat``) and copies out: 4·n·(2 + 1/DP) bytes for a buffer of n
    parameters (measured on an H200 at DP 1: 12·n, ``tools/check_gpu.py``). With ``overlap_grad_reduce`` off DDP makes
    one bucket per buffer (``distributed/distributed_data_parallel.py``: ``bucket_size = None``), so n is
    every trained parameter of the rank: the dense ones over DP, an MoE's experts (their own buffer) over
    DP / EP; the larger of the two counts. A plain optimizer's state is written from the tensors it has (0)."""
    if not cfg.optim.use_distributed_optimizer:
        return 0
    if cfg.lora.enabled:
        return int(4 * lora_params_per_gpu(arch, tp, pp, cfg.lora.rank, cfg.lora.targets) * (2 + 1 / dp))
    dense, expert = stage_param_split(arch, tp, pp, stage, ep)
    return int(max(4 * dense * (2 + 1 / dp), 4 * expert * (2 + ep / dp)))


# ----------------------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class StageActivations:
    """One micro-batch on one rank of a pipeline stage."""

    saved: int  # bytes its forward pass saves for backward
    working: int  # bytes one recomputed layer's activations add while the backward pass reruns it (0: none)


def norm_bytes(h: int, act: int, spec: Spec) -> int:
    """Bytes one RMSNorm and the linear after it save per token."""
    return 2 * h * act + 4 if spec == "te" else (8 + act) * h + 4


def layer_bytes(cfg: Config, arch: ModelArch, tp: int, tokens: int, spec: Spec) -> int:
    """Bytes one layer that is not fully recomputed saves for backward over a row of ``tokens`` tokens."""
    act = BYTES[cfg.trainer.precision]
    h, d, a = arch.hidden_size, arch.head_dim, arch.num_heads // tp
    q, k = a * d, arch.num_kv_heads // tp * d
    outside = -(-tokens // tp) if cfg.parallel.sequence_parallel else tokens
    total = 2 * norm_bytes(h, act, spec) * outside + 4 * d * act * tokens + mlp_bytes(arch, tp, tokens, outside, act)
    if cfg.trainer.recompute == "selective":
        return total + (3 * q + 3 * k) * act * tokens
    if spec == "te":
        return total + ((3 * q + 3 * k) * act + 4 * a) * tokens
    return total + 4 * q * act * tokens + a * tokens * tokens * (4 + (act if act < 4 else 0))


def mlp_bytes(arch: ModelArch, tp: int, tokens: int, outside: int, act: int) -> int:
    """Bytes one layer's MLP saves over ``tokens`` tokens (``outside`` of them outside the TP regions): a
    dense SwiGLU 5f·B per token; an MoE's top-k experts k·5·f_e·B, their dispatched inputs and weighted
    outputs 2k·h·B per token, and the router's fp32 logits and probabilities 8E per token of T'."""
    if not arch.is_moe:
        return 5 * (arch.ffn_hidden_size // tp) * act * tokens
    k, f = arch.moe_top_k, arch.moe_ffn_hidden_size // tp
    return k * (5 * f + 2 * arch.hidden_size) * act * tokens + 8 * arch.num_experts * outside


def recomputed_layers(cfg: Config, arch: ModelArch, pp: int) -> int:
    """How many layers of each pipeline stage ``trainer.recompute`` recomputes in full."""
    t, per_stage = cfg.trainer, arch.num_layers // pp
    if t.recompute != "full":
        return 0
    return per_stage if t.recompute_num_layers == 0 else min(t.recompute_num_layers, per_stage)


def stage_activations(cfg: Config, arch: ModelArch, tp: int, pp: int, tokens: int, stage: int, *,
                      spec: Spec | None = None, scored_tokens: int | None = None) -> StageActivations:
    """One micro-batch of ``tokens`` tokens (one packed row) on a rank of ``stage``; the LM head scores
    ``scored_tokens`` of them (default all: the trainer's packed rows; a plain forward scores T - 1)."""
    spec = spec or layer_spec(cfg)
    act, h, d = BYTES[cfg.trainer.precision], arch.hidden_size, arch.head_dim
    outside = -(-tokens // tp) if cfg.parallel.sequence_parallel else tokens
    layers, recomputed = arch.num_layers // pp, recomputed_layers(cfg, arch, pp)
    layer = layer_bytes(cfg, arch, tp, tokens, spec)
    saved = (layers - recomputed) * layer
    if recomputed:
        saved += recomputed * h * act * outside + 4 * d * tokens
    if spec == "local":  # the packed row's [T, T] attention mask, one tensor for all layers
        saved += tokens * tokens
    if stage == 0:  # token ids, and with TP > 1 the vocab-parallel embedding's out-of-range mask
        saved += (8 + (tp > 1)) * tokens
    if stage == pp - 1:  # final norm; head: fp32 probabilities, log-probs, ...; the sequence-start mask
        scored = tokens if scored_tokens is None else scored_tokens
        saved += (norm_bytes(h, act, spec) * outside + (8 * arch.padded_vocab_size(tp) // tp + 13) * scored
                  + tokens)
    return StageActivations(saved=saved, working=layer if recomputed else 0)


def working_set(cfg: Config, arch: ModelArch, tp: int, pp: int, tokens: int, stage: int, spec: Spec) -> int:
    """Transient bytes of a forward (log-probs) or a backward pass beside what stays saved: about one layer's
    activations (its gradients in the backward, which measured at 1.03 of this on an H200 with local layers
    and the LM head, ``tools/check_gpu.py``), and on the last stage the LM head's logits, their fp32 copy, fp32
    probabilities and log-probabilities (their gradients in the backward)."""
    working = layer_bytes(cfg, arch, tp, tokens, spec)
    if stage == pp - 1:
        working += tokens * arch.padded_vocab_size(tp) // tp * (BYTES[cfg.trainer.precision] + 12)
    return working


def memory_per_rank(cfg: Config, arch: ModelArch, tp: int, pp: int, dp: int, tokens_per_micro_batch: int, *,
                    stage: int | None = None, spec: Spec | None = None, scored_tokens: int | None = None,
                    ep: int = 1) -> dict[str, int]:
    """Bytes on one rank for ONE training micro-batch of ``tokens_per_micro_batch`` tokens (one packed row):

    - ``parameters``: the model's parameters in ``trainer.precision`` (LoRA: base + adapters);
    - ``gradients``: DDP's fp32 gradient buffer (``main_grad``) of the trained parameters;
    - ``optimizer_state``: Adam's ``exp_avg`` + ``exp_avg_sq`` (fp32), plus the fp32 main weights of a
      bf16 run, ÷ DP under ``optim.use_distributed_optimizer`` (an MoE's experts ÷ DP / ``ep``);
    - ``activations``: what the forward pass saves for backward, each storage once, parameters excluded
      (``models.memory.SavedActivations`` around the forward of the micro-batch and its log-prob head),
      without the transient rerun of a recomputed layer (``stage_activations(...).working``).

    ``stage``: that pipeline stage (default: the stage with the largest total); ``spec``: ``te`` or
    ``local`` layers (default: what the trainer builds on GPU; on CPU pass ``local``); ``scored_tokens``:
    positions the LM head scores (default all). Formulas: the module docstring."""
    stages = range(pp) if stage is None else [stage]
    per_stage = [{**states(cfg, arch, tp, pp, dp, s, ep),
                  "activations": stage_activations(cfg, arch, tp, pp, tokens_per_micro_batch, s, spec=spec,
                                                   scored_tokens=scored_tokens).saved} for s in stages]
    return max(per_stage, key=lambda m: sum(m.values()))
