"""Tools the model can call: described from Python functions, parsed from the model's text, executed.

Description: ``transformers.utils.get_json_schema`` turns a function's signature and Google-style
docstring into the JSON schema chat templates take (``apply_chat_template(..., tools=...)``).

Format: the Hermes / Qwen2.5 convention, the one most open chat templates use and vLLM's ``hermes``
parser reads: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the assistant's message,
results returned in a ``tool`` message. A model whose template has no tool support (SmolLM2) gets
the same description in its system prompt (``describe_tools``).

Execution never raises on the model's behalf: a malformed call, an unknown tool or bad arguments
become an error observation the model reads on its next turn (``ToolCall.error``).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. ``error`` is set (and name/arguments may be empty) when the call is unusable."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def tool_schema(fn: Callable) -> dict:
    """The OpenAI-style ``{"type": "function", "function": {...}}`` schema of ``fn``."""
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


def describe_tools(tools: Sequence[Callable]) -> str:
    """The tool instructions for a system prompt, for chat templates that do not render ``tools``."""
    schemas = "\n".join(json.dumps(tool_schema(t)["function"]) for t in tools)
    return ("You can call these tools:\n<tools>\n" + schemas + "\n</tools>\n"
            'To call one, write <tool_call>{"name": <tool name>, "arguments": <arguments as JSON>}</tool_call> '
            "and stop; its result comes back in the next message.")


def template_renders_tools(tokenizer, tools: Sequence[Callable]) -> bool:
    """Whether the tokenizer's chat template shows ``tools`` to the model (if not, describe them ourselves)."""
    messages = [{"role": "user", "content": "x"}]
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    with_tools = tokenizer.apply_chat_template(messages, tokenize=False, tools=[tool_schema(t) for t in tools])
    return plain != with_tools


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>`` block of ``text``, in order. An unclosed block at the end is parsed too
    (generation may stop on ``</tool_call>``); its JSON must still be complete."""
    calls = []
    for body, _ in TOOL_CALL.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            calls.append(ToolCall(error=f"malformed tool call (not JSON: {e.msg} at char {e.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(error='malformed tool call: expected {"name": <string>, "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(name=obj["name"], error="malformed tool call: arguments must be a JSON object"))
            continue
        calls.append(ToolCall(name=obj["name"], arguments=args))
    return calls


def call_tool(call: ToolCall, tools: dict[str, Callable]) -> str:
    """Run ``call`` and return its result as text, or an ``Error: ...`` text the model can act on."""
    if call.error:
        return f"Error: {call.error}"
    fn = tools.get(call.name)
    if fn is None:
        return f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(tools))}"
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as e:
        return f"Error: bad arguments for {call.name}: {e}"
    try:
        return str(fn(**call.arguments))
    except Exception as e:  # the tool's own failure is the model's observation, not a crash
        return f"Error: {call.name} failed: {type(e).__name__}: {e}"
