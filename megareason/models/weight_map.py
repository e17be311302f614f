"""HF <-> megatron-core weight names and layouts, as a declarative table per family.

Each ``Rule`` says which HF tensors make one megatron-core tensor and how it is split over tensor-parallel
ranks; layers are split evenly over pipeline stages (megatron numbers them from 0 on every stage).
``to_megatron`` builds one rank's shard and ``to_hf`` merges all shards back; both are pure functions of
tensors, used by the live loader, the converters and (later) the weight sync's naive reference.

TransformerEngine layers fuse each pre-norm into the linear layer after it: the same tensor under another
name (``TE_NAMES``); ``model_state`` shows a model of either spec under the local names the rules use.

Layouts (megatron-core local and TransformerEngine specs alike):
* ``qkv``: rows grouped per query group g: [q heads of g; k_g; v_g]; TP splits whole groups.
* ``gate_up``: ``linear_fc1`` holds [gate; up]; each TP rank holds [gate_r; up_r].
* ``vocab``: rows (vocab entries) split over TP after padding the vocab to a multiple of TP.
* ``row``: columns split over TP (row-parallel linear). ``replicated``: the same on every rank.

Mixture-of-experts layers (Qwen3-MoE, Mixtral): one rule per expert tensor, ``{e}`` in its names. Expert
parallelism gives each of the EP ranks ``num_experts / EP`` consecutive experts, numbered from 0 on every
rank by megatron-core (``{e}`` in the megatron name is that local number, in the HF names the global one);
within an EP rank each expert is split over TP like a dense MLP. The router is replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from megareason.models.arch import ModelArch


@dataclass(frozen=True)
class Rule:
    """One megatron-core tensor, the HF tensors it is made of (in the order ``split`` combines them; see
    the layouts above) and the pipeline stages that hold it (``where``)."""

    megatron: str  # "{i}": the layer index local to the pipeline stage
    hf: tuple[str, ...]  # "{i}": the global layer index
    split: str  # "replicated" | "vocab" | "row" | "qkv" | "gate_up"
    where: str = "layer"  # "layer" | "first" (first pipeline stage) | "last" (last stage)

    @property
    def per_expert(self) -> bool:
        """Whether this rule is one tensor per expert (``{e}`` in its names)."""
        return "{e}" in self.megatron


_L = "model.layers.{i}."
_M = "decoder.layers.{i}."
LLAMA = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "first"),
    Rule(_M + "input_layernorm.weight", (_L + "input_layernorm.weight",), "replicated"),
    Rule(_M + "self_attention.linear_qkv.weight",
         tuple(_L + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    Rule(_M + "self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",), "row"),
    Rule(_M + "pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",), "replicated"),
    Rule(_M + "mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), "gate_up"),
    Rule(_M + "mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",), "row"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", "last"),
)
QKV_BIAS = Rule(_M + "self_attention.linear_qkv.bias", tuple(_L + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv")
# Qwen3's per-head norms: one weight of head_dim shared by every head, so every TP rank holds all of it.
QK_NORM = (
    Rule(_M + "self_attention.q_layernorm.weight", (_L + "self_attn.q_norm.weight",), "replicated"),
    Rule(_M + "self_attention.k_layernorm.weight", (_L + "self_attn.k_norm.weight",), "replicated"),
)
_E = _M + "mlp.experts.local_experts.{e}."
QWEN3_MOE_MLP = (
    Rule(_M + "mlp.router.weight", (_L + "mlp.gate.weight",), "replicated"),
    Rule(_E + "linear_fc1.weight", (_L + "mlp.experts.{e}.gate_proj.weight", _L + "mlp.experts.{e}.up_proj.weight"),
         "gate_up"),
    Rule(_E + "linear_fc2.weight", (_L + "mlp.experts.{e}.down_proj.weight",), "row"),
)
MIXTRAL_MLP = (  # w1 = gate, w3 = up, w2 = down
    Rule(_M + "mlp.router.weight", (_L + "block_sparse_moe.gate.weight",), "replicated"),
    Rule(_E + "linear_fc1.weight", (_L + "block_sparse_moe.experts.{e}.w1.weight",
                                    _L + "block_sparse_moe.experts.{e}.w3.weight"), "gate_up"),
    Rule(_E + "linear_fc2.weight", (_L + "block_sparse_moe.experts.{e}.w2.weight",), "row"),
)
MOE_MLP = {"qwen3_moe": QWEN3_MOE_MLP, "mixtral": MIXTRAL_MLP}
UNTIED_OUTPUT = Rule("output_layer.weight", ("lm_head.weight",), "vocab", "last")
# Tied embeddings with PP > 1: the last stage holds its own copy of the embedding as the output layer.
TIED_OUTPUT = Rule("output_layer.weight", ("model.embed_tokens.weight",), "vocab", "last")


# local-spec suffix -> TransformerEngine-spec suffix of the same tensor
TE_NAMES = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}


def local_name(name: str) -> str:
    """``name`` under megatron-core's local-spec naming (unchanged if it already is)."""
    for local, te in TE_NAMES.items():
        if name.endswith(te):
            return name.removesuffix(te) + local
    return name


def model_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors (parameters and buffers, no ``_extra_state``) by local-spec name, detached
    views that share storage with the model (copying into them loads the model)."""
    return {local_name(k): v.detach() for k, v in model.state_dict(keep_vars=True).items()
            if not k.endswith("_extra_state")}


def rules_for(arch: ModelArch, pp: int = 1, with_output: bool = True) -> tuple[Rule, ...]:
    """The rules of ``arch`` split over ``pp`` stages; ``with_output=False`` leaves out the LM head
    (the critic replaces it with a value head)."""
    rules = LLAMA + ((QKV_BIAS,) if arch.qkv_bias else ()) + (QK_NORM if arch.qk_norm else ())
    if arch.is_moe:
        rules = tuple(r for r in rules if ".mlp.linear_fc" not in r.megatron) + MOE_MLP[arch.family]
    if not with_output:
        return rules
    if not arch.tie_word_embeddings:
        rules += (UNTIED_OUTPUT,)
    elif pp > 1:
        rules += (TIED_OUTPUT,)
    return rules


def hf_names(arch: ModelArch) -> list[str]:
    """Every HF tensor a checkpoint of ``arch`` must contain."""
    names = []
    for rule in rules_for(arch):
        layers = range(arch.num_layers) if rule.where == "layer" else [None]
        names += [n.format(i=i, e=e) for i in layers for e in _experts(rule, arch) for n in rule.hf]
    return names


def _experts(rule: Rule, arch: ModelArch) -> range:
    """The global expert numbers of ``rule`` (one ``range(1)`` pass for a rule that is not per expert)."""
    return range(arch.num_experts) if rule.per_expert else range(1)


def _local_experts(rule: Rule, arch: ModelArch, ep_rank: int, ep: int) -> list[tuple[int, int]]:
    """(local, global) expert numbers of ``rule`` on expert-parallel rank ``ep_rank``; [(0, 0)] for a
    rule that is not per expert."""
    if not rule.per_expert:
        return [(0, 0)]
    per_rank = arch.num_experts // ep
    return [(e, ep_rank * per_rank + e) for e in range(per_rank)]


def expert_owner(arch: ModelArch, expert: int, ep: int) -> tuple[int, int]:
    """(EP rank, local number) of global expert ``expert``."""
    per_rank = arch.num_experts // ep
    return expert // per_rank, expert % per_rank


def _stage_layers(arch: ModelArch, pp_rank: int, pp: int) -> range:
    per_stage = arch.num_layers // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def _on_stage(rule: Rule, pp_rank: int, pp: int) -> bool:
    return rule.where == "layer" or (rule.where == "first" and pp_rank == 0) or (
        rule.where == "last" and pp_rank == pp - 1)


def to_megatron(get: Callable[[str], torch.Tensor], arch: ModelArch, tp_rank: int, tp: int,
                pp_rank: int, pp: int, with_output: bool = True, ep_rank: int = 0,
                ep: int = 1) -> dict[str, torch.Tensor]:
    """The megatron-core state of rank (``tp_rank``, ``pp_rank``, ``ep_rank``), reading HF tensors
    through ``get``."""
    out = {}
    for rule in rules_for(arch, pp, with_output):
        if not _on_stage(rule, pp_rank, pp):
            continue
        layers = _stage_layers(arch, pp_rank, pp) if rule.where == "layer" else [None]
        for local, i in enumerate(layers):
            for e_local, e in _local_experts(rule, arch, ep_rank, ep):
                tensors = [get(n.format(i=i, e=e)) for n in rule.hf]
                out[rule.megatron.format(i=local, e=e_local)] = _shard(rule.split, tensors, arch, tp_rank, tp)
    return out


def _shard(split: str, ts: list[torch.Tensor], arch: ModelArch, r: int, tp: int) -> torch.Tensor:
    if split == "replicated":
        return ts[0].clone()
    if split == "row":
        return ts[0].chunk(tp, dim=1)[r].clone()
    if split == "vocab":
        w = ts[0]
        pad = arch.padded_vocab_size(tp) - w.shape[0]
        if pad:
            w = torch.cat([w, w.new_zeros(pad, *w.shape[1:])])
        return w.chunk(tp, dim=0)[r].clone()
    if split == "gate_up":
        gate, up = (t.chunk(tp, dim=0)[r] for t in ts)
        return torch.cat([gate, up]).clone()
    if split == "qkv":
        q, k, v = ts
        g, hd = arch.num_kv_heads, arch.head_dim
        rest = q.shape[1:]
        grouped = torch.cat([q.reshape(g, -1, hd, *rest).flatten(1, 2), k.reshape(g, hd, *rest),
                             v.reshape(g, hd, *rest)], dim=1)
        return grouped.chunk(tp, dim=0)[r].reshape(-1, *rest).clone()
    raise AssertionError(f"unknown split {split!r}")


def to_hf(shards: Mapping[tuple[int, ...], Mapping[str, torch.Tensor]], arch: ModelArch, tp: int,
          pp: int, with_output: bool = True, ep: int = 1) -> dict[str, torch.Tensor]:
    """Merge the megatron-core states of all ranks, keyed by (tp_rank, pp_rank) — (tp_rank, pp_rank,
    ep_rank) when ``ep`` > 1 — into HF tensors.

    A tied model's output layer copy on the last stage is dropped (it is the embedding).
    """
    out: dict[str, torch.Tensor] = {}
    for rule in rules_for(arch, pp, with_output):
        if rule is TIED_OUTPUT:
            continue
        for pp_rank in range(pp):
            if not _on_stage(rule, pp_rank, pp):
                continue
            layers = _stage_layers(arch, pp_rank, pp) if rule.where == "layer" else [None]
            for local, i in enumerate(layers):
                for e in _experts(rule, arch):
                    ep_rank, e_local = expert_owner(arch, e, ep) if rule.per_expert else (0, 0)
                    name = rule.megatron.format(i=local, e=e_local)
                    parts = [shards[(r, pp_rank, ep_rank) if ep > 1 else (r, pp_rank)][name] for r in range(tp)]
                    for hf_name, t in zip(rule.hf, unshard(rule.split, parts, arch), strict=True):
                        out[hf_name.format(i=i, e=e)] = t
    return out


def unshard(split: str, parts: list[torch.Tensor], arch: ModelArch) -> list[torch.Tensor]:
    """The HF tensors that the TP ``parts`` of one megatron-core tensor make. Where no re-layout is
    needed (replicated tensors, and anything at TP=1 but QKV) the result is a view of ``parts``."""
    if split == "replicated":
        return [parts[0]]
    if split == "row":
        return [parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)]
    if split == "vocab":
        full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return [full[: arch.vocab_size]]
    if split == "gate_up":
        halves = [p.chunk(2, dim=0) for p in parts]
        if len(parts) == 1:
            return list(halves[0])
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if split == "qkv":
        g, hd = arch.num_kv_heads, arch.head_dim
        q_per_group = arch.num_heads // g
        rest = parts[0].shape[1:]
        grouped = torch.cat(parts).reshape(g, (q_per_group + 2) * hd, *rest)
        q, k, v = grouped.split([q_per_group * hd, hd, hd], dim=1)
        return [t.reshape(-1, *rest).clone() for t in (q, k, v)]
    raise AssertionError(f"unknown split {split!r}")


def hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor of ``arch``, in the order ``hf_names`` lists them."""
    h, f, hd = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    by_suffix = {
        "embed_tokens.weight": (arch.vocab_size, h), "lm_head.weight": (arch.vocab_size, h),
        "norm.weight": (h,), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
        "q_norm.weight": (hd,), "k_norm.weight": (hd,),
        "gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f),
    }
    fm = arch.moe_ffn_hidden_size
    expert = {"gate_proj.weight": (fm, h), "up_proj.weight": (fm, h), "down_proj.weight": (h, fm),
              "w1.weight": (fm, h), "w3.weight": (fm, h), "w2.weight": (h, fm)}
    by_suffix["gate.weight"] = (arch.num_experts, h)  # the router

    def shape(name: str) -> tuple[int, ...]:
        suffix = ".".join(name.split(".")[-2:])
        return expert[suffix] if ".experts." in name else by_suffix[suffix]

    return {name: shape(name) for name in hf_names(arch)}
