"""The architecture of a decoder, read from an HF config, and its megatron-core TransformerConfig.

``ModelArch`` is plain data: it knows nothing of parallelism. ``check_parallelism`` states what a
TP/PP layout needs from it, so a bad layout fails before any weight is read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

SUPPORTED = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Llama 3.x RoPE scaling as megatron-core implements it (only the factor is configurable there).
_LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class ArchError(ValueError):
    """The checkpoint's architecture or the requested parallel layout is not supported."""


@dataclass(frozen=True)
class ModelArch:
    """A decoder's architecture as ``transformer_config`` and the weight map need it, read from an HF
    config (``from_hf_config``); plain data, saved as ``arch`` in a checkpoint's megareason.json."""

    family: str  # weight-map family: "llama", "qwen2" or "qwen3"
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

    @classmethod
    def from_hf_config(cls, config: dict, source: str = "config") -> ModelArch:
        """From the dict of an HF ``config.json``. Raises ``ArchError`` (naming ``source``) for what the
        megatron-core build cannot reproduce: a ``model_type`` outside ``SUPPORTED``, an activation other
        than SiLU, MLP biases, attention biases (but Qwen2's q/k/v), RoPE scaling other than Llama 3's,
        sliding-window attention layers."""
        model_type = config.get("model_type")
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
            qk_norm=family == "qwen3",  # Qwen3 always has q_norm and k_norm
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelArch:
        """From ``model_dir/config.json`` (``from_hf_config``); ``ArchError`` when there is none."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ArchError(f"{model_dir}: no config.json (expected an HF checkpoint directory)")
        return cls.from_hf_config(json.loads(path.read_text()), source=str(path))

    def check_parallelism(self, tp: int, pp: int) -> None:
        """Raise ``ArchError`` unless this model can be split over ``tp`` x ``pp``."""
        problems = []
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


def transformer_config(arch: ModelArch, *, tp: int = 1, pp: int = 1, params_dtype=None, **overrides):
    """The megatron-core ``TransformerConfig`` for ``arch`` (dropout off: RL needs exact log-probs)."""
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
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
