"""Chat templating, prompt-length policy, and the demonstration a record stands for (SFT's response, RARO's
expert answer with ``raro.expert_template``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

from megareason.config.load import ConfigError
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


def demonstration(record: PromptRecord, template: str, where: str,
                  template_field: str = "sft.response_template") -> tuple[list[dict[str, str]], str]:
    """(prompt messages, response text) of one demonstration record: its last assistant message, else
    ``template`` (``sft.response_template`` or ``raro.expert_template``) filled with its extra_info solution
    and its expert_answer (else ground truth). Errors name the row (``where``) and the template's field."""
    if record.prompt and record.prompt[-1]["role"] == "assistant":
        if len(record.prompt) < 2:
            raise DataError(f"{where}: a chat demonstration needs a message before the assistant's answer")
        return record.prompt[:-1], record.prompt[-1]["content"]
    info = record.extra_info
    answer = str(info.get("expert_answer", record.ground_truth))
    if not answer.strip():
        raise DataError(f"{where}: no answer to imitate (empty ground truth / expert_answer)")
    try:
        return record.prompt, template.format(solution=str(info.get("solution", "")).strip(), answer=answer).strip()
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"{template_field} {template!r}: {e}; it may use {{solution}} and {{answer}} "
                          "(write {{ and }} for literal braces)") from None
