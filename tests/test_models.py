"""Model provisioning: tiny checkpoints built in code, and the offline SmolLM2 conversion."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from megareason.models import hub
from megareason.models.tiny import build_tokenizer


def test_tiny_tokenizer_round_trip_and_chat_template():
    tok = build_tokenizer()
    text = "Compute 12 * (3 + 4) = 84, then \\boxed{84}."
    assert tok.decode(tok(text)["input_ids"]) == text
    rendered = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
                                       add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"


def _tensor_names(model_dir):
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_tiny_qwen2_is_gqa_with_bias_and_untied(tiny_qwen2):
    cfg = json.loads((tiny_qwen2 / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == ("qwen2", 4, 2)
    names = _tensor_names(tiny_qwen2)
    assert "model.layers.0.self_attn.q_proj.bias" in names and "lm_head.weight" in names
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 32, 128)  # kv heads x head_dim


def test_tiny_llama_is_tied_without_bias(tiny_llama):
    names = _tensor_names(tiny_llama)
    assert "lm_head.weight" not in names
    assert not any(n.endswith(".bias") for n in names)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_unknown_and_unprovisioned_models_explain_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAREASON_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="unknown model 'gpt-9'; known: smollm2-135m-instruct"):
        hub.fetch("gpt-9")
    with pytest.raises(FileNotFoundError, match="megareason models fetch smollm2-135m-instruct"):
        hub.resolve_model_path("smollm2-135m-instruct")
    with pytest.raises(FileNotFoundError, match="neither a known model"):
        hub.resolve_model_path(str(tmp_path / "nowhere"))


@pytest.mark.slow
def test_fetch_smollm2_matches_the_gguf_it_came_from(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAREASON_CACHE", str(tmp_path))
    out = hub.fetch("smollm2-135m-instruct")
    assert out == tmp_path / "models" / "smollm2-135m-instruct"
    assert [p.name for p in out.parent.iterdir()] == ["smollm2-135m-instruct"]  # no temp dirs left
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert hub.fetch("smollm2-135m-instruct") == out and (out / "model.safetensors").stat().st_mtime_ns == mtime

    gguf = hub._gguf_path(hub.KNOWN_MODELS["smollm2-135m-instruct"])
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]).startswith("<|im_start|>")
    with torch.inference_mode():
        diff = (reference(ids).logits - converted(ids).logits).abs().max().item()
    assert diff < 1e-4
