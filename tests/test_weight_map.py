"""The declarative HF <-> megatron-core map: exact round trips and clear errors, no processes needed."""

from __future__ import annotations

import json

import pytest
import torch

from megareason.models import weight_map
from megareason.models.arch import ArchError, ModelArch
from megareason.models.build import HFCheckpoint


def _shards(ckpt, tp, pp):
    return {(t, p): weight_map.to_megatron(ckpt.get, ckpt.arch, t, tp, p, pp) for t in range(tp) for p in range(pp)}


@pytest.mark.parametrize("family", ["tiny_qwen2", "tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_byte_identical(family, tp, pp, request):
    ckpt = HFCheckpoint(request.getfixturevalue(family))
    back = weight_map.to_hf(_shards(ckpt, tp, pp), ckpt.arch, tp, pp)
    assert set(back) == ckpt.names()
    for name, tensor in back.items():
        assert torch.equal(tensor, ckpt.get(name)), name
    shapes = weight_map.hf_shapes(ckpt.arch)
    assert {n: tuple(t.shape) for n, t in back.items()} == shapes


def test_qwen3_norms_are_whole_on_every_tp_rank(tiny_qwen3):
    """q_norm/k_norm hold one head_dim weight shared by all heads: every TP rank gets all of it."""
    ckpt = HFCheckpoint(tiny_qwen3)
    arch = ckpt.arch
    assert (arch.family, arch.qk_norm, arch.qkv_bias, arch.head_dim) == ("qwen3", True, False, 32)
    assert arch.num_heads * arch.head_dim != arch.hidden_size  # head_dim is not hidden / heads
    for r in range(2):
        shard = weight_map.to_megatron(ckpt.get, arch, r, 2, 1, 2)  # last PP stage: global layer 1
        for hf, mc in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
            want = ckpt.get(f"model.layers.1.self_attn.{hf}.weight")
            assert torch.equal(shard[f"decoder.layers.0.self_attention.{mc}.weight"], want)
        qkv = shard["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert qkv.shape == ((arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim // 2, arch.hidden_size)


def test_untied_qwen3_round_trip(tmp_path):
    """Qwen3 with its own LM head (the 8B and larger), head_dim 64 over hidden 64: byte-identical at TP=2, PP=2."""
    from megareason.models.tiny import build_tiny_model

    ckpt = HFCheckpoint(build_tiny_model(tmp_path, "qwen3", hidden_size=64, head_dim=64, intermediate_size=64))
    assert not ckpt.arch.tie_word_embeddings and "lm_head.weight" in ckpt.names()
    back = weight_map.to_hf(_shards(ckpt, 2, 2), ckpt.arch, 2, 2)
    assert set(back) == ckpt.names() and all(torch.equal(t, ckpt.get(n)) for n, t in back.items())


def test_qkv_layout_by_hand():
    """2 query groups of 2 heads, head_dim 1: megatron rows are [q0 q1 k0 v0 | q2 q3 k1 v1]."""
    arch = ModelArch("llama", 8, 4, 4, 1, 4, 2, 1, 1e-6, 1e4, 0.0, 16, False, False)
    q, k, v = torch.tensor([[0.0], [1], [2], [3]]), torch.tensor([[10.0], [11]]), torch.tensor([[20.0], [21]])
    tensors = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
               "model.layers.0.self_attn.v_proj.weight": v}
    name = "decoder.layers.0.self_attention.linear_qkv.weight"

    def get(n):
        return tensors.get(n, torch.zeros(8 if "embed" in n or "lm_head" in n else 4, 4))

    full = weight_map.to_megatron(get, arch, 0, 1, 0, 1)[name]
    assert full[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert weight_map.to_megatron(get, arch, 1, 2, 0, 1)[name][:, 0].tolist() == [2, 3, 11, 21]


def test_gate_up_and_vocab_padding_by_hand():
    arch = ModelArch("llama", 5, 2, 4, 1, 2, 2, 1, 1e-6, 1e4, 0.0, 16, False, False)
    gate = torch.arange(8.0).reshape(4, 2)
    up = 100 + torch.arange(8.0).reshape(4, 2)
    embed = torch.arange(10.0).reshape(5, 2)

    def get(n):
        return {"model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up,
                "model.embed_tokens.weight": embed}.get(n, torch.zeros(2, 2))

    rank1 = weight_map.to_megatron(get, arch, 1, 2, 0, 1)
    assert rank1["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [4, 6, 104, 106]
    # vocab 5 padded to 6 over TP=2: rank 1 holds rows 3, 4 and a zero pad row
    assert rank1["embedding.word_embeddings.weight"][:, 0].tolist() == [6, 8, 0]
    assert arch.padded_vocab_size(2) == 6


def test_heads_not_divisible_by_tp(tiny_qwen2):
    arch = ModelArch.from_pretrained(tiny_qwen2)  # 4 heads, 2 kv heads, 2 layers
    with pytest.raises(ArchError, match="num_key_value_heads=2 is not divisible by TP=4"):
        arch.check_parallelism(4, 1)
    with pytest.raises(ArchError, match="num_hidden_layers=2 is not divisible by PP=3"):
        arch.check_parallelism(1, 3)


def _moe_shards(ckpt, tp, pp, ep):
    return {(t, p, e): weight_map.to_megatron(ckpt.get, ckpt.arch, t, tp, p, pp, ep_rank=e, ep=ep)
            for t in range(tp) for p in range(pp) for e in range(ep)}


@pytest.mark.parametrize("family", ["tiny_qwen3_moe", "tiny_mixtral"])
@pytest.mark.parametrize("tp, pp, ep", [(1, 1, 1), (2, 2, 1), (1, 1, 2), (2, 1, 4), (2, 2, 2)])
def test_moe_round_trip_is_byte_identical(family, tp, pp, ep, request):
    ckpt = HFCheckpoint(request.getfixturevalue(family))
    assert ckpt.arch.num_experts == 4 and ckpt.arch.moe_top_k == 2
    shards = _moe_shards(ckpt, tp, pp, ep)
    back = weight_map.to_hf(shards if ep > 1 else {k[:2]: v for k, v in shards.items()}, ckpt.arch, tp, pp, ep=ep)
    assert set(back) == ckpt.names()
    for name, tensor in back.items():
        assert torch.equal(tensor, ckpt.get(name)), name
    assert {n: tuple(t.shape) for n, t in back.items()} == weight_map.hf_shapes(ckpt.arch)
    # EP rank e holds experts e*4/EP ... (e+1)*4/EP - 1, numbered from 0; TP splits each like a dense MLP
    block = "mlp" if ckpt.arch.family == "qwen3_moe" else "block_sparse_moe"
    prefix = f"model.layers.1.{block}.experts"
    down = "down_proj" if ckpt.arch.family == "qwen3_moe" else "w2"
    last = shards[(tp - 1, pp - 1, ep - 1)][f"decoder.layers.{2 // pp - 1}.mlp.experts.local_experts.{4 // ep - 1}"
                                            ".linear_fc2.weight"]
    assert torch.equal(last, ckpt.get(f"{prefix}.3.{down}.weight").chunk(tp, dim=1)[tp - 1])
    assert sum(".local_experts." in n for n in shards[(0, 0, 0)]) == 2 * (2 // pp) * (4 // ep)


def test_moe_fields_are_read_and_checked():
    base = {"model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 4, "norm_topk_prob": False}
    arch = ModelArch.from_hf_config(base)
    assert (arch.family, arch.num_experts, arch.moe_top_k, arch.moe_ffn_hidden_size, arch.moe_norm_topk,
            arch.qk_norm) == ("qwen3_moe", 8, 2, 4, False, True)
    # by hand: embed 32*8*2 + final norm 8; per layer attention 8*4*(2*2+2*2)=256, q/k norms 2*4, 2 norms of 8,
    # router 8*8; experts 3*8*4 = 96 each (8 in all, 2 active)
    per_layer = 256 + 8 + 16 + 64
    assert arch.param_counts() == (512 + 8 + 2 * (per_layer + 8 * 96), 512 + 8 + 2 * (per_layer + 2 * 96))
    with pytest.raises(ArchError, match=r"mlp_only_layers=\[0\].*every layer must be MoE"):
        ModelArch.from_hf_config({**base, "mlp_only_layers": [0]})
    with pytest.raises(ArchError, match="num_experts=8 is not divisible by EP=3"):
        arch.check_parallelism(1, 1, 3)
    with pytest.raises(ArchError, match="moe_intermediate_size=4 is not divisible by TP=8"):
        arch.check_parallelism(8, 1, 1)
    dense = ModelArch.from_hf_config({**base, "model_type": "qwen3"})
    assert not dense.is_moe and dense.param_counts()[0] == dense.param_counts()[1]
    with pytest.raises(ArchError, match="expert_model_parallel_size=2 needs a mixture-of-experts model"):
        dense.check_parallelism(1, 1, 2)
    with pytest.raises(ArchError, match=r"multi-head latent attention \(MLA: kv_lora_rank=512"):
        ModelArch.from_hf_config({**base, "model_type": "deepseek_v3", "kv_lora_rank": 512})
    with pytest.raises(ArchError, match="MoE with shared experts .*'qwen2_moe'"):
        ModelArch.from_hf_config({**base, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 32})
    mixtral = {**base, "model_type": "mixtral", "num_local_experts": 8, "router_jitter_noise": 0.1}
    with pytest.raises(ArchError, match="router_jitter_noise=0.1 is not supported"):
        ModelArch.from_hf_config(mixtral)


def test_unsupported_architecture():
    with pytest.raises(ArchError, match="'gpt2'.*supported: llama, mistral, mixtral, qwen2, qwen3, qwen3_moe"):
        ModelArch.from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ArchError, match="rope_type='yarn' is not supported"):
        ModelArch.from_hf_config({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4}})
    with pytest.raises(ArchError, match="use_sliding_window=true .*is not supported"):
        ModelArch.from_hf_config({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 4096})
    with pytest.raises(ArchError, match=r"layer_types \['sliding_attention'\] are not supported"):
        ModelArch.from_hf_config({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]})
    with pytest.raises(ArchError, match="attention_bias=true"):
        ModelArch.from_hf_config({"model_type": "qwen3", "attention_bias": True})
    # Mistral v0.1 attends over a 4096-token window in every layer; a null window, or one covering every
    # position, is full attention; Qwen's sliding_window means nothing without use_sliding_window.
    mistral = {"model_type": "mistral", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
               "num_hidden_layers": 2, "num_attention_heads": 2, "rms_norm_eps": 1e-5,
               "max_position_embeddings": 32768}
    with pytest.raises(ArchError, match=r"sliding_window=4096 \(Mistral's sliding-window attention over 32768"):
        ModelArch.from_hf_config({**mistral, "sliding_window": 4096})
    for window in (None, 32768):
        assert ModelArch.from_hf_config({**mistral, "sliding_window": window}).family == "llama"
    qwen = {**mistral, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    assert ModelArch.from_hf_config(qwen).family == "qwen2"


def test_missing_tensors_are_named_before_loading(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((tiny_llama / f).read_bytes())
    tensors = load_file(tiny_llama / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ArchError, match="missing 2 tensors: model.layers.1.mlp.up_proj.weight, model.norm.weight"):
        HFCheckpoint(tmp_path).check_complete()


def test_llama3_rope_scaling_is_read():
    cfg = json.loads(json.dumps({
        "model_type": "llama", "vocab_size": 8, "hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }))
    arch = ModelArch.from_hf_config(cfg)
    assert (arch.rope_theta, arch.rope_scaling_factor, arch.head_dim, arch.qkv_bias) == (500000.0, 8.0, 2, False)


def test_transformer_engine_names_map_to_the_local_ones():
    """TransformerEngine fuses each pre-norm into the next linear layer: a model built with its spec
    shows the same tensors under other names, and ``model_state`` hands them back under the rules'."""
    te = "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert weight_map.local_name(te) == "decoder.layers.3.input_layernorm.weight"
    assert weight_map.local_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    for name in ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.input_layernorm.weight"):
        assert weight_map.local_name(name) == name

    class Fused(torch.nn.Module):  # the shape of TE's LayerNormColumnParallelLinear's parameters
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(6, 4))
            self.layer_norm_weight = torch.nn.Parameter(torch.full((4,), 2.0))

    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.decoder.layers[0].self_attention = torch.nn.Module()
    model.decoder.layers[0].self_attention.linear_qkv = Fused()
    state = weight_map.model_state(model)
    assert set(state) == {"decoder.layers.0.self_attention.linear_qkv.weight",
                          "decoder.layers.0.input_layernorm.weight"}
    state["decoder.layers.0.input_layernorm.weight"].copy_(torch.arange(4.0))  # a view: loading writes the model
    assert torch.equal(model.decoder.layers[0].self_attention.linear_qkv.layer_norm_weight.detach(), torch.arange(4.0))
