"""SmolLM2-135M-Instruct (the offline real model) through HF -> megatron-core -> HF, then served."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from megareason.config.schema import Config, ModelConfig, RolloutConfig
from megareason.models.hub import resolve_model_path
from megareason.rollout.engine import VLLMEngine
from megareason.rollout.records import Sampling
from megareason.settings import engine_settings

QUESTIONS = ["What is 7 + 5?", "Name a prime number larger than 10.", "Write one word about the sea."]


def _cli(*args):
    result = subprocess.run([sys.executable, "-m", "megareason.cli", *args], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_smollm2_converts_both_ways_and_generates_identically(tmp_path):
    original = resolve_model_path("smollm2-135m-instruct")
    _cli("convert", "hf-to-megatron", "smollm2-135m-instruct", str(tmp_path / "ckpt"))
    _cli("convert", "megatron-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"))

    before, after = load_file(original / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert set(after) == set(before)
    assert all(torch.equal(after[n], t) for n, t in before.items())

    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in QUESTIONS]
    reference = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = reference.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
            expected.append(out[0, len(ids):].tolist())
    engine = VLLMEngine(engine_settings(Config(model=ModelConfig(path=str(tmp_path / "hf")),
                                               rollout=RolloutConfig(dtype="float32", max_model_len=512))))
    try:
        got = engine.generate(prompts, Sampling(n=1, temperature=0.0, max_tokens=24), use_tqdm=False)
    finally:
        engine.shutdown()
    assert [g[0].token_ids for g in got] == expected
