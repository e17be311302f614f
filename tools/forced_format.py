"""Forced-format decoding (``tools/compare_methods_measures.py``'s ``forced`` measure): each held-out prompt
of a run's validation dump, the model's own greedy response to it, then ``The final answer is \\boxed{``,
continued greedily for at most a few tokens by the run's final weights through the project's vLLM engine
(``megareason.rollout.engine.VLLMEngine``). The number it boxes is what the model computed, however it had
chosen to end its answer.

    .venv/bin/python tools/forced_format.py MODEL VAL_DUMP.jsonl OUT.jsonl [--max-model-len 512]

MODEL: an HF folder (a run's exported final checkpoint) or a known model name; VAL_DUMP: a run's
``rollouts/val_step_N.jsonl``; OUT: one row per held-out prompt, ``{"index", "continuation"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_methods_measures import FORCED_PREFIX, FORCED_TOKENS  # noqa: E402


def forced_inputs(val_rows: list[dict], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The token ids to continue, in held-out order: the prompt's ids as the model was asked (the dump's
    ``prompt_token_ids``), then ``encode`` (the tokenizer, no special tokens) of the response with its
    trailing whitespace dropped followed by ``FORCED_PREFIX``."""
    rows = sorted(val_rows, key=lambda r: r["index"])
    return [list(r["prompt_token_ids"]) + encode(r["response"].rstrip() + FORCED_PREFIX) for r in rows]


def decode(generate: Callable[[Sequence[list[int]]], list[str]], inputs: list[list[int]]) -> list[str]:
    """Each input's greedy continuation (``generate``: token-id prompts -> one text each, in order)."""
    out = generate(inputs)
    assert len(out) == len(inputs), "the engine returned another number of continuations"
    return out


def vllm_generate(model: str, max_model_len: int):
    """(tokenizer's encode, generate) of a greedy vLLM engine on ``model``, at most ``FORCED_TOKENS`` tokens,
    stopping at the box's ``}``."""
    from megareason.rollout.engine import VLLMEngine
    from megareason.rollout.records import Sampling
    from megareason.settings import one_engine_settings

    engine = VLLMEngine(one_engine_settings(model, max_model_len))
    sampling = Sampling(n=1, temperature=0.0, max_tokens=FORCED_TOKENS, stop=("}",))

    def encode(text: str) -> list[int]:
        return engine.tokenizer.encode(text, add_special_tokens=False)

    def generate(prompts: Sequence[list[int]]) -> list[str]:
        return [c[0].text for c in engine.generate(prompts, sampling)]

    return encode, generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("dump", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--max-model-len", type=int, default=512)
    a = ap.parse_args()
    rows = sorted((json.loads(x) for x in a.dump.read_text().splitlines() if x.strip()), key=lambda r: r["index"])
    encode, generate = vllm_generate(a.model, a.max_model_len)
    texts = decode(generate, forced_inputs(rows, encode))
    tmp = a.out.with_name(a.out.name + ".tmp")
    tmp.write_text("".join(json.dumps({"index": r["index"], "continuation": t}) + "\n"
                           for r, t in zip(rows, texts, strict=True)))
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
