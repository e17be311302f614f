"""Competition-math reward: last ``\\boxed{}`` answer checked with math-verify.

Contract: the answer is the content of the LAST ``\\boxed{...}`` or
``\\fbox{...}`` in the response (nested braces balanced).  No boxed answer ->
score 0.0, incorrect.  Otherwise the answer is correct if it equals the gold
answer after light string normalisation, or if math-verify judges the two
mathematically equivalent (fractions, LaTeX, sets, intervals, ...), or -- asked
only when math-verify says no -- if the equivalence layer
(``megareason.rewards.equivalence``) does: rounded decimals, percentages,
units, inequalities vs intervals, renamed variables, labelled lists, vectors,
``\\pm``, degrees, unicode.  With ``extra_info["answer_prefix"]`` set (e.g.
``"Answer:"``, the form DAPO's prompts ask for), a response without a boxed
answer is read from the rest of the line after the last occurrence of the
prefix (case ignored).  Before math-verify, the layer's ``contradicts``
vetoes what math-verify overlooks: a labelled list in the wrong order, a
quantity in the wrong unit, a percentage of another value (``p%`` is p/100),
one solution of several.  Score is 1.0 when correct, else 0.0.
"""

from __future__ import annotations

import re
import threading

from math_verify import parse, verify

from megareason.rewards.equivalence import contradicts, equivalent
from megareason.rewards.registry import RewardOutput, register

_BOX_COMMANDS = ("\\boxed", "\\fbox")
# math-verify's timeouts use SIGALRM, which only works in the main thread.
# Without them an adversarial answer like 10^{10^{10}} can hang sympy, so we
# keep them wherever signals are available.
_MAIN_THREAD_TIMEOUT_S = 5
# Longer "answers" are almost surely not answers; skip sympy for them.
_MAX_VERIFY_CHARS = 1000


def last_boxed(text: str) -> str | None:
    """Return the content of the last well-formed ``\\boxed{}``/``\\fbox{}``, or None.

    Braces are matched by depth; escaped braces (``\\{``, ``\\}``) do not count,
    so set answers like ``\\boxed{\\{1, 2\\}}`` extract correctly.  An unclosed
    trailing box is skipped in favour of an earlier complete one.
    """
    starts = sorted(
        (m.end() for cmd in _BOX_COMMANDS for m in re.finditer(re.escape(cmd) + r"\s*\{", text)),
        reverse=True,
    )
    for start in starts:
        content = _braced_content(text, start)
        if content is not None:
            return content.strip()
    return None


def _braced_content(text: str, start: int) -> str | None:
    """Content from ``start`` (just after an opening brace) to its match, or None."""
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


def answer_after(text: str, prefix: str) -> str | None:
    """The rest of the line after the last ``prefix`` (case ignored), stripped; None if absent or empty."""
    last = None
    for last in re.finditer(re.escape(prefix), text, re.IGNORECASE):  # noqa: B007  (the last match)
        pass
    if last is None:
        return None
    answer = text[last.end():].split("\n", 1)[0].strip()
    return answer or None


_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\left|\\right|\\displaystyle")


def normalize_answer(answer: str) -> str:
    """Canonical string form for exact comparison (whitespace/LaTeX-cosmetic agnostic)."""
    s = _TEXT_CMD.sub(r"\1", answer)
    s = _SPACING.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "")
    s = re.sub(r"\s+", "", s).strip("$").rstrip(".")
    return s.lower()


def _as_math(answer: str) -> str:
    """Wrap in ``$...$`` unless already delimited: bare gold strings parse badly
    (math-verify reads a bare ``1,2`` as 1.2 and bare ``\\frac12`` not at all)."""
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"


def math_equal(pred: str, gold: str) -> bool:
    """True iff ``pred`` and ``gold`` are the same answer (string, math-verify, equivalence layer)."""
    if normalize_answer(pred) == normalize_answer(gold):
        return True
    if len(pred) > _MAX_VERIFY_CHARS or contradicts(pred, gold):
        return False
    return math_verify_equal(pred, gold) or equivalent(pred, gold)


def math_verify_equal(pred: str, gold: str) -> bool:
    """True iff math-verify judges ``pred`` equal to ``gold`` (False on any grader error)."""
    timeout = _MAIN_THREAD_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed = parse(_as_math(gold), parsing_timeout=timeout)
        pred_parsed = parse(_as_math(pred), parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # a grader crash must not kill training; the string check already ran
        return False


@register("math", "gsm_symbolic", "competition_math", "champ")
def math_reward(response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
    """1.0 iff the last boxed answer in ``response`` equals ``ground_truth``."""
    answer = last_boxed(response)
    prefix = extra_info.get("answer_prefix")
    if answer is None and prefix:
        answer = answer_after(response, prefix)
    if answer is None:
        return RewardOutput(score=0.0, correct=False)
    correct = math_equal(answer, ground_truth)
    return RewardOutput(score=1.0 if correct else 0.0, correct=correct)
