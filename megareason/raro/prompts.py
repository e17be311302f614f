"""RARO's two system prompts (policy and critic), the critic's user message, and how the policy's
answer is cut out of its response. Both prompts are overridable from config (``raro.*_system_prompt``).
"""

from __future__ import annotations

import re

POLICY_SYSTEM_PROMPT = (
    "You are a careful problem solver. Think through the problem step by step inside <think> </think>, "
    "then give only your final answer inside <answer> </answer>."
)

CRITIC_SYSTEM_PROMPT = (
    "You are an expert judge. You are given a question and two answers to it. One answer was written by "
    "an expert; the other by a student imitating the expert. Compare the two answers carefully (check "
    "whether each one actually answers the question correctly), reason briefly, and decide which answer "
    "is the expert's. End your reply with exactly one line: 'Verdict: A' if answer A is the expert's, "
    "'Verdict: B' if answer B is the expert's, or 'Verdict: Tie' if you cannot tell them apart."
)

# Answers longer than this (characters) are cut from the front: the end holds the conclusion.
MAX_ANSWER_CHARS = 2000

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)


def policy_answer(response: str) -> str:
    """What the critic is shown of a policy response: its last ``<answer>`` block, else the response
    without its ``<think>`` blocks (an unclosed ``<think>`` hides nothing), stripped and capped."""
    blocks = _ANSWER_BLOCK.findall(response)
    text = blocks[-1] if blocks else _THINK_BLOCK.sub("", response)
    text = text.strip() or "(empty answer)"
    return text[-MAX_ANSWER_CHARS:]


def render(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """A chat as the engine is given it: (text with the generation prompt, its token ids)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def critic_messages(system_prompt: str, question: str, answer_a: str, answer_b: str) -> list[dict[str, str]]:
    """The critic's chat: its system prompt, then the question and the two answers labelled A and B."""
    user = (f"Question:\n{question.strip()}\n\n"
            f"Answer A:\n{answer_a.strip()}\n\n"
            f"Answer B:\n{answer_b.strip()}\n\n"
            "Which answer is the expert's? End with 'Verdict: A', 'Verdict: B' or 'Verdict: Tie'.")
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}]
