"""Chat templating and prompt-length policy."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

from megareason.data.records import DataError, PromptRecord, TokenizedPrompt

log = logging.getLogger(__name__)


def tokenize_prompts(
    records: Sequence[PromptRecord],
    tokenizer,
    max_prompt_length: int,
    truncation: Literal["filter", "error"] = "filter",
) -> list[TokenizedPrompt]:
    """Apply the tokenizer's chat template (with the generation prompt) to every record.

    Prompts longer than ``max_prompt_length`` tokens are dropped with a logged count
    (``truncation="filter"``) or rejected with an error naming the record (``"error"``).
    """
    if tokenizer.chat_template is None:
        raise DataError("the tokenizer has no chat template; use an instruct/chat model")
    out, dropped = [], 0
    for rec in records:
        text = tokenizer.apply_chat_template(rec.prompt, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_length:
            if truncation == "error":
                raise DataError(
                    f"prompt {rec.extra_info.get('index', '?')} ({rec.data_source}) has {len(ids)} tokens, "
                    f"more than data.max_prompt_length={max_prompt_length} (set data.truncation=filter "
                    f"to drop such prompts)"
                )
            dropped += 1
            continue
        out.append(TokenizedPrompt(record=rec, text=text, token_ids=ids))
    if dropped:
        log.warning("dropped %d of %d prompts longer than data.max_prompt_length=%d",
                    dropped, len(records), max_prompt_length)
    if not out:
        raise DataError(f"every prompt is longer than data.max_prompt_length={max_prompt_length}")
    return out
