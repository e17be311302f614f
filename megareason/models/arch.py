"""The architecture of a decoder, read from an HF config, and its megatron-core TransformerConfig.

``ModelArch`` is plain data: it knows nothing of parallelism. ``check_parallelism`` states what a
TP/PP layout needs from it, so a bad layout fails before any weight is read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

SUPPORTED = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
             "mixtral": "mixtral"}
# Families whose every MLP is a mixture of experts (megatron-core MoE layers).
MOE_FAMILIES = ("qwen3_moe", "mixtral")
# Llama 3.x RoPE scaling as megatron-core implements it (only the factor is configurable there).
_LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class ArchError(ValueError):
    """The checkpoint's architecture or the requested parallel layout is not supported."""


@dataclass(frozen=True)
class ModelArch:
    """A decoder's architecture as ``transformer_config`` and the weight map need it, read from an HF
    config (``from_hf_config``); plain data, saved as ``arch`` in a checkpoint's megareason.json."""

    family: str  # weight-map family: "llama", "qwen2", "qwen3", "qwen3_moe" or "mixtral"
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float  # Llama 3.x scaling factor; 0 for none
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    # Qwen3: per-head RMSNorm on q and k before RoPE (megatron-core's qk_layernorm). False where a
    # checkpoint's megareason.json predates the field.
    qk_norm: bool = False
    # Mixture of experts (0 experts: a dense MLP). Every layer's MLP is ``num_experts`` SwiGLU experts of
    # ``moe_ffn_hidden_size``, each token sent to the ``moe_top_k`` with the highest router scores and its
    # outputs weighted by the softmax of the router logits: renormalised over the chosen experts
    # (``moe_norm_topk``: Mixtral always, Qwen3-MoE's ``norm_topk_prob``) or not.
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk: bool = True

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.num_experts > 0

    def param_counts(self) -> tuple[int, int]:
        """(total, active per token) parameter counts: equal for a dense model; an MoE token runs
        ``moe_top_k`` of the ``num_experts`` experts (router included in both)."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += (self.num_heads + 2 * self.num_kv_heads) * hd if self.qkv_bias else 0
        attn += 2 * hd if self.qk_norm else 0
        norms = 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        if not self.is_moe:
            mlp = 3 * h * self.ffn_hidden_size
            total = embed + self.num_layers * (attn + norms + mlp)
            return total, total
        expert = 3 * h * self.moe_ffn_hidden_size
        router = self.num_experts * h
        base = embed + self.num_layers * (attn + norms + router)
        return base + self.num_layers * self.num_experts * expert, base + self.num_layers * self.moe_top_k * expert

    @classmethod
    def from_hf_config(cls, config: dict, source: str = "config") -> ModelArch:
        """From the dict of an HF ``config.json``. Raises ``ArchError`` (naming ``source``) for what the
        megatron-core build cannot reproduce: a ``model_type`` outside ``SUPPORTED``, an activation other
        than SiLU, MLP biases, attention biases (but Qwen2's q/k/v), RoPE scaling other than Llama 3's,
        sliding-window attention layers."""
        model_type = config.get("model_type")
        if config.get("kv_lora_rank") or config.get("q_lora_rank"):
            raise ArchError(f"{source}: multi-head latent attention (MLA: kv_lora_rank={config.get('kv_lora_rank')}, "
                            f"model_type={model_type!r}) is not supported")
        if config.get("shared_expert_intermediate_size") or config.get("n_shared_experts"):
            raise ArchError(f"{source}: MoE with shared experts (model_type={model_type!r}) is not supported; "
                            "supported MoE families: qwen3_moe, mixtral")
        if model_type not in SUPPORTED:
            raise ArchError(f"{source}: unsupported architecture model_type={model_type!r} "
                            f"({config.get('architectures')}); supported: {', '.join(sorted(SUPPORTED))}")
        if config.get("hidden_act", "silu") != "silu":
            raise ArchError(f"{source}: hidden_act={config['hidden_act']!r}; only silu (SwiGLU) is supported")
        if config.get("mlp_bias"):
            raise ArchError(f"{source}: mlp_bias=true is not supported")
        if model_type != "qwen2" and config.get("attention_bias"):
            raise ArchError(f"{source}: attention_bias=true (biases on q/k/v and o_proj) is not supported")
        _check_full_attention(config, source)
        moe = _moe_fields(config, source) if SUPPORTED[model_type] in MOE_FAMILIES else {}
        rope = dict(config.get("rope_parameters") or {})
        scaling = config.get("rope_scaling") or {}
        rope.update({k: v for k, v in scaling.items() if k not in rope})
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        factor = 0.0
        if rope_type == "llama3":
            for key, expected in _LLAMA3_SCALING.items():
                if float(rope.get(key, expected)) != expected:
                    raise ArchError(f"{source}: rope {key}={rope[key]} is not supported (megatron-core fixes "
                                    f"it at {expected})")
            factor = float(rope["factor"])
        elif rope_type != "default":
            raise ArchError(f"{source}: rope_type={rope_type!r} is not supported (default, llama3)")
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        heads = config["num_attention_heads"]
        family = SUPPORTED[model_type]
        return cls(
            family=family,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            ffn_hidden_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=float(theta),
            rope_scaling_factor=factor,
            max_position_embeddings=config["max_position_embeddings"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",  # Qwen2 always has q/k/v biases and no o_proj bias
            qk_norm=family in ("qwen3", "qwen3_moe"),  # Qwen3 always has q_norm and k_norm
            **moe,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelArch:
        """From ``model_dir/config.json`` (``from_hf_config``); ``ArchError`` when there is none."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ArchError(f"{model_dir}: no config.json (expected an HF checkpoint directory)")
        return cls.from_hf_config(json.loads(path.read_text()), source=str(path))

    def check_parallelism(self, tp: int, pp: int, ep: int = 1) -> None:
        """Raise ``ArchError`` unless this model can be split over ``tp`` x ``pp`` (and its experts over
        ``ep`` expert-parallel ranks, each expert split over the same ``tp`` ranks)."""
        problems = []
        if ep > 1 and not self.is_moe:
            problems.append(f"expert_model_parallel_size={ep} needs a mixture-of-experts model (this one is dense)")
        if self.is_moe and self.num_experts % ep:
            problems.append(f"num_experts={self.num_experts} is not divisible by EP={ep}")
        if self.is_moe and self.moe_ffn_hidden_size % tp:
            problems.append(f"moe_intermediate_size={self.moe_ffn_hidden_size} is not divisible by TP={tp}")
        if self.num_heads % tp:
            problems.append(f"num_attention_heads={self.num_heads} is not divisible by TP={tp}")
        if self.num_kv_heads % tp:
            problems.append(f"num_key_value_heads={self.num_kv_heads} is not divisible by TP={tp}")
        if self.ffn_hidden_size % tp:
            problems.append(f"intermediate_size={self.ffn_hidden_size} is not divisible by TP={tp}")
        if self.num_layers % pp:
            problems.append(f"num_hidden_layers={self.num_layers} is not divisible by PP={pp}")
        if problems:
            raise ArchError("cannot split the model: " + "; ".join(problems))

    def padded_vocab_size(self, tp: int) -> int:
        """Vocab rounded up to a multiple of TP (each rank holds an equal slice; pads are masked)."""
        return -(-self.vocab_size // tp) * tp


def _moe_fields(config: dict, source: str) -> dict:
    """The ``ModelArch`` MoE fields of a Qwen3-MoE or Mixtral config; ``ArchError`` for what the megatron-core
    MoE layer does not reproduce (dense layers between the MoE ones, router jitter, a shared expert)."""
    if config.get("model_type") == "qwen3_moe":
        dense = config.get("mlp_only_layers") or []
        step = config.get("decoder_sparse_step", 1)
        if dense or step != 1:
            raise ArchError(f"{source}: mlp_only_layers={dense}, decoder_sparse_step={step} (dense MLP layers "
                            "between the MoE ones) are not supported; every layer must be MoE")
        # the Hub's configs say num_experts; transformers 5 writes num_local_experts
        experts = config.get("num_experts") or config["num_local_experts"]
        ffn, norm = config["moe_intermediate_size"], bool(config.get("norm_topk_prob"))
    else:  # mixtral: softmax over the top-k logits, always renormalised
        if config.get("router_jitter_noise"):
            raise ArchError(f"{source}: router_jitter_noise={config['router_jitter_noise']} is not supported (0)")
        experts, ffn, norm = config["num_local_experts"], config["intermediate_size"], True
    top_k = config["num_experts_per_tok"]
    if not 0 < top_k <= experts:
        raise ArchError(f"{source}: num_experts_per_tok={top_k} must be in 1..{experts} (the number of experts)")
    return dict(num_experts=experts, moe_top_k=top_k, moe_ffn_hidden_size=ffn, moe_norm_topk=norm)


def _check_full_attention(config: dict, source: str) -> None:
    """Refuse sliding-window attention layers (Qwen2/Qwen3 ``use_sliding_window``, any ``layer_types``
    entry but full attention): the megatron-core build attends over the whole sequence in every layer."""
    if config.get("use_sliding_window"):
        raise ArchError(f"{source}: use_sliding_window=true (sliding-window attention layers) is not supported")
    # Mistral attends over a window whenever sliding_window is set (Qwen2/Qwen3 only with use_sliding_window);
    # a window covering every position changes nothing.
    window = config.get("sliding_window")
    if config.get("model_type") == "mistral" and window is not None \
            and window < config.get("max_position_embeddings", math.inf):
        raise ArchError(f"{source}: sliding_window={window} (Mistral's sliding-window attention over "
                        f"{config.get('max_position_embeddings')} positions) is not supported; models with "
                        "sliding_window=null are")
    other = sorted({t for t in config.get("layer_types") or [] if t != "full_attention"})
    if other:
        raise ArchError(f"{source}: layer_types {other} are not supported (only full_attention)")


def transformer_config(arch: ModelArch, *, tp: int = 1, pp: int = 1, ep: int = 1, params_dtype=None,
                       moe_aux_loss_coeff: float = 0.0, moe_z_loss_coeff: float = 0.0, **overrides):
    """The megatron-core ``TransformerConfig`` for ``arch`` (dropout off: RL needs exact log-probs).

    MoE: megatron-core's router and dropless all-to-all token dispatch over ``ep`` expert-parallel ranks
    (each expert split over TP like a dense MLP); the router runs in fp32; its load-balancing loss
    (``moe_aux_loss_coeff``, 0 = off) and z-loss (0 = off) are added to the training loss."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    dtype = params_dtype or torch.float32
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        # Initialise even though a checkpoint overwrites the weights: megatron-core 0.16.1 marks
        # TP-split parameters (``tensor_model_parallel``) only inside its init routines, and without
        # the mark the grad norm and the checkpoint sharding treat them as replicated.
        perform_initialization=True,
        # Losses return (sum, count); megatron-core divides the gradients by the global count.
        calculate_per_token_loss=True,
    )
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_top_k,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            # topk of the logits then softmax over them == softmax then renormalising the top k
            moe_router_pre_softmax=not arch.moe_norm_topk,
            moe_router_score_function="softmax",
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff else "none",
            moe_aux_loss_coeff=moe_aux_loss_coeff,
            moe_z_loss_coeff=moe_z_loss_coeff or None,
            moe_grouped_gemm=False,
            expert_model_parallel_size=ep,
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
