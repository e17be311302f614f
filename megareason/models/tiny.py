"""Tiny random Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral checkpoints with a working tokenizer and chat
template, for tests.

Built entirely in code (no download): a byte-level BPE tokenizer trained on a small built-in corpus,
a ChatML chat template, and a randomly initialised model saved as float32 safetensors, so vLLM,
transformers and (later) megatron-core can all load the same directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "You are a helpful assistant. Think step by step, then give the final answer inside \\boxed{}.",
    "What is 12 + 7 * 3? First 7 * 3 = 21, then 12 + 21 = 33. The answer is \\boxed{33}.",
    "Using the numbers 3, 5, 7 make 22: <answer>3 * 5 + 7</answer>",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. #### 72",
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 + - * / = ( ) { } [ ] . , ? !",
    "user assistant system question answer solution think reasoning final result number total",
]


def build_tokenizer(vocab_size: int = 384):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def build_tiny_model(
    out_dir: str | Path,
    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"] = "qwen2",
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    num_experts: int = 4,
    top_k: int = 2,
    moe_intermediate_size: int | None = None,
    norm_topk_prob: bool = True,
) -> Path:
    """Write a random tiny ``family`` checkpoint plus tokenizer to ``out_dir`` and return it.

    The head size (``head_dim``, default ``hidden_size / num_heads``) must be one vLLM-CPU supports
    (32, 64, 80, ...). GQA when ``num_kv_heads < num_heads``; Qwen2 gets QKV biases and Qwen3 per-head
    q/k norms as in the real families. Weights are initialised with a larger std than the default so the
    logits are not near-uniform (greedy decoding then has clear winners, which makes token-for-token
    comparisons meaningful). Qwen3's norm weights are random too (1 + N(0, 0.2^2), where transformers
    puts ones), so a q norm mapped to k, or a norm left out, changes the output.

    MoE families (``qwen3_moe``, ``mixtral``): every layer is ``num_experts`` experts of
    ``moe_intermediate_size`` (default ``intermediate_size / 2``; Mixtral's experts are
    ``intermediate_size`` wide), ``top_k`` per token; ``norm_topk_prob`` is Qwen3-MoE's (Mixtral always
    renormalises). The router weights get the larger std too, so routing differs clearly between tokens.
    """
    import torch
    import transformers as tf

    tokenizer = build_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if head_dim is not None:
        common["head_dim"] = head_dim
    if family == "llama":
        config = tf.LlamaConfig(**common, rope_theta=10000.0)
    elif family == "qwen2":
        config = tf.Qwen2Config(**common, rope_theta=1000000.0)
    elif family == "qwen3":
        config = tf.Qwen3Config(**common, rope_theta=1000000.0)
    elif family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(**common, rope_theta=1000000.0, num_experts=num_experts, num_experts_per_tok=top_k,
                                moe_intermediate_size=moe_intermediate_size or intermediate_size // 2,
                                norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.001)
    elif family == "mixtral":
        if moe_intermediate_size is not None:
            common["intermediate_size"] = moe_intermediate_size
        config = tf.MixtralConfig(**common, rope_theta=1000000.0, num_local_experts=num_experts,
                               num_experts_per_tok=top_k, router_jitter_noise=0.0)
    else:
        raise ValueError(f"family must be 'llama', 'qwen2', 'qwen3', 'qwen3_moe' or 'mixtral', got {family!r}")
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family in ("qwen3", "qwen3_moe"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.2 * torch.randn_like(p))
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
