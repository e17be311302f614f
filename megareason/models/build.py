"""Build this rank's megatron-core GPTModel and fill it from an HF checkpoint.

``build_gpt`` uses the parallel groups that ``parallel.init_parallel`` created (it reads nothing else
about the layout); ``load_hf_weights`` reads only the HF tensors this rank needs, through the
declarative map in ``weight_map``. Missing tensors are reported before anything is loaded.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from megareason.models import weight_map
from megareason.models.arch import ArchError, ModelArch, transformer_config
from megareason.models.parallel import current_layout

log = logging.getLogger(__name__)


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ComputeSettings:
    """How a model runs, apart from what it is and how it is split: the precision of its parameters and
    activations, megatron-core's activation recomputation and sequence parallelism (the config's
    ``trainer.precision``, ``trainer.recompute``, ``trainer.recompute_num_layers`` and
    ``parallel.sequence_parallel``; ``FP32`` is the plain build)."""

    precision: str
    recompute: str  # none | selective (core attention) | full
    recompute_num_layers: int  # full: 0 = every layer, one per checkpoint; N = the first N of each stage
    sequence_parallel: bool
    # MoE models: the router's load-balancing loss and z-loss coefficients (0 = off; dense models ignore them)
    moe_aux_loss_coeff: float
    moe_z_loss_coeff: float

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of ``precision`` (``KeyError`` for an unknown one; ``config_overrides`` says why)."""
        return PRECISIONS[self.precision]

    def config_overrides(self, arch: ModelArch, pp: int, tp: int) -> dict:
        """megatron-core ``TransformerConfig`` fields for these settings (checked against the layout)."""
        if self.precision not in PRECISIONS:
            raise ArchError(f"precision {self.precision!r}: expected one of {', '.join(PRECISIONS)}")
        if self.sequence_parallel and tp == 1:
            raise ArchError("sequence parallelism needs tensor parallelism (TP > 1)")
        if arch.is_moe and tp > 1 and not self.sequence_parallel:
            raise ArchError(f"a mixture-of-experts model at TP={tp} needs sequence parallelism "
                            "(parallel.sequence_parallel=true): megatron-core trains MoE layers with TP only so")
        kwargs: dict = {"sequence_parallel": self.sequence_parallel}
        if arch.is_moe:
            kwargs.update(moe_aux_loss_coeff=self.moe_aux_loss_coeff, moe_z_loss_coeff=self.moe_z_loss_coeff)
        if self.recompute == "selective":
            kwargs.update(recompute_granularity="selective", recompute_modules=["core_attn"])
        elif self.recompute == "full":
            per_stage = arch.num_layers // pp
            if self.recompute_num_layers > per_stage:
                raise ArchError(f"recompute_num_layers={self.recompute_num_layers} is more than the "
                                f"{per_stage} layers of a pipeline stage")
            if self.recompute_num_layers == 0:
                kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
            else:
                kwargs.update(recompute_granularity="full", recompute_method="block",
                              recompute_num_layers=self.recompute_num_layers)
        elif self.recompute != "none":
            raise ArchError(f"recompute {self.recompute!r}: expected none, selective or full")
        return kwargs


FP32 = ComputeSettings(precision="fp32", recompute="none", recompute_num_layers=0, sequence_parallel=False,
                       moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm for megatron-core's local layers, with its weight marked ``sequence_parallel``
    under sequence parallelism: each TP rank then normalises its own slice of the sequence, and
    ``finalize_model_grads`` sums the weight's gradient over the TP ranks (megatron-core's own
    ``WrappedTorchNorm`` refuses sequence parallelism for want of that mark). As Qwen3's q/k norm each
    TP rank normalises its own heads; ``finalize_model_grads`` sums those gradients over TP by name
    (``qk_layernorm``), with sequence parallelism or without."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def transformer_engine_available() -> bool:
    """Whether TransformerEngine layers can be built here: CUDA is available and ``transformer_engine``
    imports (never on CPU)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(num_layers: int, local: bool = False, qk_norm: bool = False, num_experts: int = 0):
    """The block spec of a stage of ``num_layers`` layers: TransformerEngine layers on GPU when it is
    installed (the NGC containers have it), else (or with ``local``) megatron-core's local (pure torch)
    layers, on CPU and GPU alike; ``qk_norm``: with per-head norms of q and k (Qwen3); ``num_experts``:
    MoE layers of that many experts, each a separate MLP (megatron-core's ``SequentialMLP``: the weight
    map's per-expert names; no grouped GEMM)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    experts = num_experts or None
    if transformer_engine_available() and not local:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm, num_experts=experts,
                                                                moe_grouped_gemm=False)
    if torch.cuda.is_available():
        log.warning("TransformerEngine is not installed: megatron-core's local layers on GPU (slower)")
    return _local_spec(num_layers, qk_norm, experts)


def _local_spec(num_layers: int, qk_norm: bool, num_experts: int | None = None):
    """megatron-core's local layer spec with ``RMSNorm`` (above) in every norm, the final one and (with
    ``qk_norm``) the per-head q and k norms included."""
    from dataclasses import replace as replace_fields

    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm, num_experts=num_experts,
                                           moe_grouped_gemm=False)
    attention = layer.submodules.self_attention
    if qk_norm:
        attention.submodules = replace_fields(attention.submodules, q_layernorm=RMSNorm, k_layernorm=RMSNorm)
    layer.submodules = replace_fields(layer.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=RMSNorm)


def uses_transformer_engine(model) -> bool:
    """Whether ``model`` (or a wrapper of it) was built with TransformerEngine layers."""
    return any(n.endswith(".layer_norm_weight") for n, _ in model.named_parameters())


def _fix_moe_without_transformer_engine() -> None:
    """megatron-core 0.16.1's router (``moe_utils.RouterGatingLinearFunction``) tests
    ``te_general_gemm is not None``, a name that module defines only when TransformerEngine imports:
    without TE (CPU, or a GPU image without it) every MoE forward raises NameError. Define it as None
    there, which selects the plain ``torch.mm`` path the function already has."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt(arch: ModelArch, compute: ComputeSettings = FP32, local_spec: bool = False):
    """This rank's stage of ``arch`` as a ``GPTModel`` with vocab-parallel (un-gathered) logits, its
    parameters in ``compute.dtype``; ``local_spec``: megatron-core's local layers even where
    TransformerEngine is installed (LoRA)."""
    from megatron.core.models.gpt import GPTModel

    layout = current_layout()
    arch.check_parallelism(layout.tp, layout.pp, layout.ep)
    if arch.is_moe:
        _fix_moe_without_transformer_engine()
    params_dtype = compute.dtype
    config = transformer_config(arch, tp=layout.tp, pp=layout.pp, ep=layout.ep, params_dtype=params_dtype,
                                **compute.config_overrides(arch, layout.pp, layout.tp))
    spec = layer_spec(arch.num_layers // layout.pp, local_spec, arch.qk_norm, arch.num_experts)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.padded_vocab_size(layout.tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=layout.first_stage,
        post_process=layout.last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        rope_scaling=arch.rope_scaling_factor > 0,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
    )
    # megatron-core builds its parallel linears on the current device in params_dtype, but the local
    # spec's norms on the CPU in float32 (megatron's own training moves the model afterwards too).
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return model.to(device=device, dtype=params_dtype)


class HFCheckpoint:
    """Lazy access to the tensors of an HF safetensors checkpoint (one or several shards)."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(model_dir)
        self.arch = ModelArch.from_pretrained(self.dir)  # architecture errors first
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        self._handles = {f: safe_open(str(self.dir / f), "pt") for f in files}
        self._where = {name: f for f, h in self._handles.items() for name in h.keys()}

    def names(self) -> set[str]:
        """Every tensor name in the checkpoint's shards."""
        return set(self._where)

    def get(self, name: str) -> torch.Tensor:
        """Read one whole tensor (CPU, the checkpoint's dtype) from its shard; ``KeyError`` if absent."""
        return self._handles[self._where[name]].get_tensor(name)

    def check_complete(self) -> None:
        """Raise naming the missing tensors, before any weight is loaded."""
        missing = [n for n in weight_map.hf_names(self.arch) if n not in self._where]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ArchError(f"{self.dir}: checkpoint is missing {len(missing)} tensors: "
                            f"{', '.join(missing[:5])}{more}")


def load_hf_weights(model, ckpt: HFCheckpoint, with_output_layer: bool = True) -> None:
    """Copy this rank's shard of ``ckpt`` into ``model`` (built by ``build_gpt`` for ``ckpt.arch``);
    ``with_output_layer=False`` loads the trunk only (the critic)."""
    ckpt.check_complete()
    layout = current_layout()
    state = weight_map.to_megatron(ckpt.get, ckpt.arch, layout.tp_rank, layout.tp, layout.pp_rank, layout.pp,
                                   with_output=with_output_layer, ep_rank=layout.ep_rank, ep=layout.ep)
    own = {k: v for k, v in weight_map.model_state(model).items()
           if with_output_layer or not k.startswith("output_layer.")}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    assert not missing and not unexpected, f"weight map out of sync: missing {missing}, unexpected {unexpected}"
    with torch.no_grad():
        for name, tensor in state.items():
            if own[name].shape != tensor.shape:
                raise ArchError(f"{ckpt.dir}: tensor for {name} has shape {tuple(tensor.shape)}, "
                                f"model expects {tuple(own[name].shape)}")
            own[name].copy_(tensor)
