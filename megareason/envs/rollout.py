"""Multi-turn rollout: drive a batch of environments with the rollout engine, turn by turn.

Each turn generates one message for every unfinished episode in a single engine call (vLLM batches
them), hands each message to its environment, and appends the environment's observation. The
episode's tokens are kept exactly as generated and as fed back: the response is the model's
messages interleaved with the observation tokens, and ``mask_T`` is 1 only on the model's tokens, so
the trainer computes log-probs over the whole context but trains on (and measures KL over) the
model's own tokens only.

Observations are rendered by the tokenizer's chat template as a ``tool`` message, followed by the
template's header for the next assistant message. Templates that reject the ``tool`` role get the
result as a ``user`` message in ``<tool_response>`` tags.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from megareason.envs.base import Environment, StepResult
from megareason.envs.tools import describe_tools, template_renders_tools, tool_schema
from megareason.rollout.records import Completion, Sampling

log = logging.getLogger(__name__)

# (contexts as token ids, sampling with n=1) -> one completion list per context
GenerateFn = Callable[[list[list[int]], Sampling], list[list[Completion]]]

_MARK = "\x00MR\x00"  # a placeholder no tokenizer merges with its neighbours
_MIN_TURN_TOKENS = 8  # an observation is only shown if the model has at least this many tokens left to answer
_SEED_STRIDE = 1_000_003  # turn t samples context i with seed + t * stride + i


@dataclass
class Episode:
    """One finished episode: its prompt, the whole response (as a ``Completion`` with ``mask_T``) and result."""

    prompt_ids: list[int]
    completion: Completion
    messages: list[dict[str, str]]  # the transcript (prompt messages, then model and tool messages)
    result: StepResult
    turns: int
    end: str  # "done" (the environment ended it), "turn_limit" or "context_limit"
    info: dict[str, Any] = field(default_factory=dict)


class ChatFormat:
    """How one tokenizer's chat template frames prompts with tools and tool results."""

    def __init__(self, tokenizer, tools: Sequence[Callable]):
        self.tokenizer, self.tools = tokenizer, list(tools)
        self.native_tools = bool(self.tools) and template_renders_tools(tokenizer, self.tools)
        self.tool_role = "tool"
        try:
            self._before, self._after, self._end_of_turn = self._observation_frame("tool")
        except Exception:  # the template rejects the role (raises, or renders nothing for it)
            self.tool_role = "user"
            self._before, self._after, self._end_of_turn = self._observation_frame("user")

    def _observation_frame(self, role: str) -> tuple[str, str, str]:
        chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}]
        base = self.tokenizer.apply_chat_template(chat, tokenize=False)
        end_of_turn = base[base.rindex(_MARK) + len(_MARK):]
        content = _MARK if role == "tool" else f"<tool_response>\n{_MARK}\n</tool_response>"
        full = self.tokenizer.apply_chat_template(chat + [{"role": role, "content": content}], tokenize=False,
                                                  add_generation_prompt=True)
        if not full.startswith(base) or full.count(_MARK) != 2:
            raise ValueError(f"the chat template does not render a {role!r} message after an assistant one")
        before, after = full[len(base):].split(_MARK)
        return before, after, end_of_turn

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The opening messages with the tools described (natively, or in the system prompt) and the
        assistant header."""
        if self.tool_role != "tool":  # tool results already in the opening messages
            messages = [{"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
                        if m["role"] == "tool" else m for m in messages]
        kwargs = {}
        if self.native_tools:
            kwargs["tools"] = [tool_schema(t) for t in self.tools]
        elif self.tools:
            messages = _with_system(messages, describe_tools(self.tools))
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def observation_ids(self, generated_ids: list[int], observation: str) -> list[int]:
        """The tokens after the model's message: the rest of its end-of-turn marker (an EOS the model
        emitted is already in ``generated_ids``), the tool message, the next assistant header."""
        written = self.tokenizer.decode(generated_ids, skip_special_tokens=False)
        overlap = max((k for k in range(len(self._end_of_turn) + 1) if written.endswith(self._end_of_turn[:k])),
                      default=0)
        text = self._end_of_turn[overlap:] + self._before + observation + self._after
        return self.tokenizer.encode(text, add_special_tokens=False)


def _with_system(messages: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def run_episodes(envs: Sequence[Environment], generate: GenerateFn, tokenizer, sampling: Sampling, *,
                 max_turns: int, max_model_len: int) -> list[Episode]:
    """Run every environment to its end; episodes in ``envs`` order.

    ``sampling.max_tokens`` bounds each message; ``max_turns`` the model's messages per episode;
    ``max_model_len`` the whole context (prompt, messages and observations).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    formats: dict[tuple, ChatFormat] = {}
    states = []
    for env in envs:
        key = tuple(t.__qualname__ for t in env.tools)
        fmt = formats.setdefault(key, ChatFormat(tokenizer, env.tools))
        messages = env.reset()
        prompt = fmt.prompt_ids(messages)
        if len(prompt) + _MIN_TURN_TOKENS > max_model_len:
            raise ValueError(f"an episode's prompt has {len(prompt)} tokens; max_model_len={max_model_len} leaves "
                             f"no room for a message")
        states.append(_State(env, fmt, prompt, list(messages)))

    for turn in range(max_turns):
        active = [s for s in states if s.end is None]
        if not active:
            break
        contexts = [s.prompt + s.ids for s in active]
        per_turn = [replace(sampling, n=1, max_tokens=min(sampling.max_tokens, max_model_len - len(c)),
                            seed=None if sampling.seed is None else sampling.seed + turn * _SEED_STRIDE)
                    for c in contexts]
        completions = _generate_grouped(generate, contexts, per_turn)
        for s, c in zip(active, completions, strict=True):
            s.add(c.token_ids, c.logprobs_T, trained=True)
            s.messages.append({"role": "assistant", "content": c.text})
            s.truncated = c.truncated
            s.turns += 1
            result = s.env.step(c.text)
            if result.done:
                s.close(result, "done")
                continue
            obs = s.fmt.observation_ids(c.token_ids, result.observation)
            if turn == max_turns - 1:
                s.close(s.env.finish(), "turn_limit")
            elif len(s.prompt) + len(s.ids) + len(obs) + _MIN_TURN_TOKENS > max_model_len:
                s.close(s.env.finish(), "context_limit")
            else:
                s.add(obs, None, trained=False)
                s.messages.append({"role": s.fmt.tool_role, "content": result.observation})
    return [s.episode(tokenizer) for s in states]


def _generate_grouped(generate: GenerateFn, contexts: list[list[int]], samplings: list[Sampling]) -> list[Completion]:
    """One engine call per distinct sampling (contexts near the length limit get fewer max_tokens)."""
    out: list[Completion | None] = [None] * len(contexts)
    by_sampling: dict[Sampling, list[int]] = {}
    for i, sp in enumerate(samplings):
        by_sampling.setdefault(sp, []).append(i)
    for sp, idx in by_sampling.items():
        groups = generate([contexts[i] for i in idx], sp)
        for i, group in zip(idx, groups, strict=True):
            out[i] = group[0]
    return out  # type: ignore[return-value]


class _State:
    def __init__(self, env: Environment, fmt: ChatFormat, prompt: list[int], messages: list[dict[str, str]]):
        self.env, self.fmt, self.prompt, self.messages = env, fmt, prompt, messages
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logp: list[float] = []
        self.turns, self.truncated = 0, False
        self.end: str | None = None
        self.result: StepResult | None = None

    def add(self, ids: list[int], logp: list[float] | None, trained: bool) -> None:
        self.ids += ids
        self.mask += [int(trained)] * len(ids)
        self.logp += list(logp) if logp else [0.0] * len(ids)

    def close(self, result: StepResult, end: str) -> None:
        self.result, self.end = result, end

    def episode(self, tokenizer) -> Episode:
        completion = Completion(token_ids=self.ids, text=tokenizer.decode(self.ids, skip_special_tokens=False),
                                logprobs_T=self.logp, finish_reason="length" if self.truncated else "stop",
                                mask_T=self.mask)
        return Episode(prompt_ids=self.prompt, completion=completion, messages=self.messages,
                       result=self.result, turns=self.turns, end=self.end)
