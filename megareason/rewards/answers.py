"""Where a response commits to an answer, and the policy for several of them (every rule family).

A response **commits** to an answer with a box (``\\boxed{..}``/``\\fbox{..}``, or LaTeX's one-token
form ``\\boxed 5``), an answer line (a line, or a sentence after a sentence, a box or a formula on its
line, that starts with ``Answer:`` or ``Final answer:``, bold or not, as DAPO's prompts and the Minerva /
lm-eval ``Final Answer: The final answer is X`` format ask), or, in GSM8K's format, a ``#### X`` line.
Prose ("so we get 13") commits to nothing.

The policy, the same for ``math``, ``math_dapo``, ``gsm8k`` and ``arithmetic``:

- the **final answer** is the last commitment of the kinds the family reads (box or answer line,
  whichever comes last; ``####`` for GSM8K);
- a response that commits to **two different answers** (any two of its commitments, whatever their
  kind, that the family's comparison says differ) is **not paid**, even when the last one is right:
  a shotgun of boxes, or a box followed by a different ``Final answer:`` line, is a hedge, and in RL
  a paid hedge is reinforced.  Repeating the same answer (``\\boxed{1/2}`` then ``\\boxed{0.5}``) is fine.

Where others differ: verl's ``math`` reward (``last_boxed_only_string``) and math-verify's
``parse`` read only the last box (math-verify: the last match of its highest-priority pattern), so
both pay a shotgun whose last box is right and ignore a different answer line after the box; verl's
``math_dapo`` reads only the last ``Answer:`` line and verl's ``gsm8k`` only the last ``#### N``.
This policy trades recall for precision: a response that boxes a wrong value, retracts it in prose and
boxes the right one is not paid either.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
# LaTeX reads an unbraced argument as one token (``\boxed 5`` boxes 5; ``\boxed 12`` boxes only the 1).
_BOX_TOKEN = re.compile(r"\\(?:boxed|fbox)\s+([^\s{}$\\])")
# At a line's start, or after the end of a sentence, a box or a formula on its line ("\boxed{5}. Answer: 6").
_ANSWER_LINE = re.compile(
    r"(?:^|(?<=[.!?}$])[ \t]+)[ \t>#*_]*(?:the\s+)?(?:final\s+answer|answer)[ \t*_]*(?:is)?[ \t*_]*[:：][ \t*_]*"
    r"(?P<rest>.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_MINERVA = re.compile(r"^the final answer is\s*", re.IGNORECASE)
_HOPE = re.compile(r"\s*I hope it is correct\.?\s*$", re.IGNORECASE)
_GSM8K_MARK = re.compile(r"####[ \t]*(?P<rest>[^\n]*)")


@dataclass(frozen=True)
class Commitment:
    """One answer a response commits to: ``kind`` ``box``, ``line`` or ``####``, its text, where it starts."""

    kind: str
    text: str
    pos: int


def braced_content(text: str, start: int) -> str | None:
    """Content from ``start`` (just after an opening brace) to its match, or None (escaped braces skipped)."""
    depth, i = 1, start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def boxes(response: str) -> list[Commitment]:
    """Every well-formed box of ``response``, in order (an unclosed box is skipped)."""
    out = []
    for m in _BOX_START.finditer(response):
        content = braced_content(response, m.end())
        if content is not None:
            out.append(Commitment("box", content.strip(), m.start()))
    out += [Commitment("box", m.group(1), m.start()) for m in _BOX_TOKEN.finditer(response)]
    return sorted(out, key=lambda c: c.pos)


_MATH_SEGMENT = re.compile(r"\$([^$]+)\$|\\\((.+?)\\\)")
_PROSE_IS = re.compile(r"^[A-Za-z][^$]*?\b(?:is|equals|are)\s+(?P<value>[^\s].*)$")


def _line_answer(rest: str) -> str:
    """The value an answer line gives: its last ``$..$`` (or ``\\(..\\)``) segment when it has one,
    else what follows its last ``is`` in a sentence (``The number of ways is 5``), else the line."""
    rest = _HOPE.sub("", _MINERVA.sub("", rest.strip())).strip().strip("*_").strip()
    segments = _MATH_SEGMENT.findall(rest)
    if segments:
        return next(g for g in segments[-1] if g).strip()
    while (m := _PROSE_IS.match(rest)) is not None:
        rest = m.group("value")
    return rest.rstrip(".").strip()


def answer_lines(response: str, prefix: str | None = None) -> list[Commitment]:
    """``Answer: X`` / ``**Final Answer:** X`` lines (and lines with the row's ``prefix``) that hold no
    box (a boxed answer line is its box); empty ones are skipped."""
    found = [(m.start(), m.group("rest")) for m in _ANSWER_LINE.finditer(response)]
    if prefix:
        found += [(m.start(), response[m.end():].split("\n", 1)[0])
                  for m in re.finditer(re.escape(prefix), response, re.IGNORECASE)]
    out, seen = [], set()
    for pos, rest in sorted(found):
        line_end = response.find("\n", pos)
        if line_end in seen or _BOX_START.search(rest) or _BOX_TOKEN.search(rest):
            continue
        seen.add(line_end)
        text = _line_answer(rest)
        if text:
            out.append(Commitment("line", text, pos))
    return out


def gsm8k_marks(response: str) -> list[Commitment]:
    """``#### X`` answers (the rest of the line; an empty ``####`` is no answer, as verl reads it)."""
    return [Commitment("####", m.group("rest").strip(), m.start())
            for m in _GSM8K_MARK.finditer(response) if m.group("rest").strip()]


def commitments(response: str, prefix: str | None = None, gsm8k: bool = False) -> list[Commitment]:
    """Every answer ``response`` commits to, in order of position."""
    found = boxes(response) + answer_lines(response, prefix)
    if gsm8k:
        found += gsm8k_marks(response)
    return sorted(found, key=lambda c: c.pos)


def consistent(found: list[Commitment], final: str, same: Callable[[str, str], bool]) -> bool:
    """True iff every commitment in ``found`` is the answer ``final`` by ``same(answer, final)``
    (each distinct text compared once)."""
    texts = {c.text for c in found} - {final}
    return all(same(text, final) for text in texts)
