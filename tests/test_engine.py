"""The vLLM engine against transformers on the same tiny weights (float32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megareason.config.schema import Config, ModelConfig, RolloutConfig
from megareason.rollout.engine import VLLMEngine
from megareason.rollout.records import Sampling
from megareason.settings import engine_settings

QUESTIONS = ["What is 12 + 7 * 3?", "Using 3, 5, 7 make 22.", "Natalia sold 48 clips.", "Hello there"]
MAX_TOKENS = 24

pytestmark = pytest.mark.slow


def _prompt_ids(tokenizer):
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        for q in QUESTIONS
    ]


def _hf_greedy(model_dir, prompts):
    """transformers' greedy continuation and the log-prob of each chosen token, one prompt at a time."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)
            new = gen[0, len(ids):].tolist()
            logits = model(gen).logits[0, len(ids) - 1 : len(ids) - 1 + len(new)]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(new)[:, None])[:, 0]
            out.append((new, logp.tolist()))
    return out


def _bad_updates(engine, model_dir) -> list[str]:
    from safetensors.torch import load_file

    weights = load_file(model_dir / "model.safetensors")
    misnamed = {**weights, "model.layers.0.self_attn.qkv.weight": torch.zeros(4, 4)}
    misshaped = {**weights, "model.layers.1.mlp.down_proj.weight": torch.zeros(128, 255)}
    missing = {k: v for k, v in weights.items() if k != "model.embed_tokens.weight"}
    messages = []
    for bad in (misnamed, misshaped, missing):
        with pytest.raises(Exception) as e:
            engine.update_weights(bad.items(), bucket_bytes=1 << 16)
        messages.append(str(e.value))
    return messages


# One family: the engine's own mechanics do not depend on it. vLLM's Llama (GQA, tied embeddings) generating
# what transformers does: test_weight_sync.py (the tiny Llama, after a sync) and test_smollm2_roundtrip.py
# (SmolLM2-135M); Qwen3 and the MoE families: test_weight_sync.py and test_moe.py.
@pytest.mark.parametrize("family", ["tiny_qwen2"])
def test_greedy_matches_transformers_and_bad_weights_fail_loudly(family, request, monkeypatch):
    """Also: a generate told to stop after two engine steps (``should_stop``, asked at every step here)
    aborts its requests and raises, and the engine's later calls answer as if it had never run."""
    from megareason.rollout import engine as engine_module
    from megareason.rollout.records import GenerationStopped

    model_dir = request.getfixturevalue(family)
    prompts = _prompt_ids(AutoTokenizer.from_pretrained(model_dir))
    expected = _hf_greedy(model_dir, prompts)
    assert sum(len(t) for t, _ in expected) > 2 * len(prompts)  # long enough to be a real comparison
    engine = VLLMEngine(engine_settings(Config(model=ModelConfig(path=str(model_dir)),
                                               rollout=RolloutConfig(dtype="float32", max_model_len=256))))
    try:
        got = engine.generate(prompts, Sampling(n=1, temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        sampled = engine.generate(prompts, Sampling(n=3, temperature=1.0, max_tokens=8), use_tqdm=False)
        asked = []
        monkeypatch.setattr(engine_module, "STOP_POLL_S", 0.0)
        engine.should_stop = lambda: asked.append(1) or len(asked) > 2
        with pytest.raises(GenerationStopped, match="generation of 4 prompts stopped"):
            engine.generate(prompts, Sampling(n=1, temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        engine.should_stop = None
        assert not engine.llm.llm_engine.has_unfinished_requests() and len(asked) == 3
        errors = _bad_updates(engine, model_dir)
        # A full update with the original weights restores the engine after the failed ones.
        from safetensors.torch import load_file

        engine.update_weights(load_file(model_dir / "model.safetensors").items(), bucket_bytes=1 << 16)
        again = engine.generate(prompts, Sampling(n=1, temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    finally:
        engine.shutdown()
    assert [g[0].token_ids for g in again] == [g[0].token_ids for g in got]
    misnamed, misshaped, missing = errors
    assert "unknown tensor 'model.layers.0.self_attn.qkv.weight'" in misnamed
    assert ("tensor 'model.layers.1.mlp.down_proj.weight' has shape (128, 255), the served model expects (128, 256)"
            in misshaped)
    assert "tensors were not sent: model.embed_tokens.weight" in missing
    for (hf_tokens, hf_logp), (completion,) in zip(expected, got, strict=True):
        assert completion.token_ids == hf_tokens
        assert len(completion.logprobs_T) == len(hf_tokens)
        assert max(abs(a - b) for a, b in zip(completion.logprobs_T, hf_logp, strict=True)) < 1e-4
    assert [len(group) for group in sampled] == [3] * len(prompts)
    for group in sampled:
        for c in group:
            assert 1 <= len(c.token_ids) <= 8 and len(c.logprobs_T) == len(c.token_ids)
            assert c.finish_reason in ("stop", "length")
            assert c.truncated == (c.finish_reason == "length")
            assert all(lp <= 0 for lp in c.logprobs_T)
