"""Competition-math reward: the committed final answer checked with math-verify and the equivalence layer.

Contract: the answer is the last one the response commits to, a ``\\boxed{...}``/``\\fbox{...}``
(nested braces balanced; ``\\boxed 5``) or an answer line (``Final Answer: ...``), whichever comes
last (``answers.py``); a response must box an answer, or with ``extra_info["answer_prefix"]`` set
(e.g. ``"Answer:"``, the form DAPO's prompts ask for) may give it on that line instead.  No answer,
or two different committed answers -> score 0.0, incorrect.  Otherwise the answer is correct if it
equals the gold answer after light string normalisation, or if one of the checks that settle a pair
(``equivalence_checks.decide``: choice letters, words, compound quantities, hedges, numbers compared
relatively) says so, or -- when none applies and the layer's ``contradicts`` does not veto it (a
labelled list in the wrong order, another label, another unit, a matrix of another shape, a
percentage of another value, one solution of several) -- if math-verify judges the two equivalent
(fractions, LaTeX, sets, intervals, ...), or the equivalence layer (``megareason.rewards.equivalence``)
does: rounded decimals, percentages, units, inequalities vs intervals, a function's renamed argument,
labelled lists, vectors, ``\\pm``, degrees, unicode.  Score is 1.0 when correct, else 0.0.
"""

from __future__ import annotations

import re
import threading

from math_verify import parse, verify

from megareason.rewards.answers import boxes, commitments, consistent
from megareason.rewards.equivalence import contradicts, equivalent, rounds_to
from megareason.rewards.equivalence_checks import decide, rewrite_notation
from megareason.rewards.registry import RewardOutput, register

# math-verify's timeouts use SIGALRM, which only works in the main thread.
# Without them an adversarial answer like 10^{10^{10}} can hang sympy, so we
# keep them wherever signals are available.
_MAIN_THREAD_TIMEOUT_S = 5
# Longer "answers" are almost surely not answers; skip sympy for them.
_MAX_VERIFY_CHARS = 1000


def last_boxed(text: str) -> str | None:
    """Return the content of the last well-formed ``\\boxed{}``/``\\fbox{}`` (or one-token
    ``\\boxed 5``), or None.

    Braces are matched by depth; escaped braces (``\\{``, ``\\}``) do not count,
    so set answers like ``\\boxed{\\{1, 2\\}}`` extract correctly.  An unclosed
    trailing box is skipped in favour of an earlier complete one.
    """
    found = boxes(text)
    return found[-1].text if found else None


_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\left|\\right|\\displaystyle")


def normalize_answer(answer: str) -> str:
    """Canonical string form for exact comparison: LaTeX cosmetics and blanks dropped, except blanks
    between two digits or two letters (``1 2`` is not ``12``); case kept (``E`` is not ``e``)."""
    s = _TEXT_CMD.sub(r"\1", answer)
    s = _SPACING.sub(" ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "")
    s = re.sub(r"(?<=[0-9a-zA-Z])\s+(?=[0-9a-zA-Z])", "\x00", s.strip())
    s = re.sub(r"\s+", "", s).strip("$").rstrip(".")
    return s.replace("\x00", " ")


def _as_math(answer: str) -> str:
    """Wrap in ``$...$`` unless already delimited: bare gold strings parse badly
    (math-verify reads a bare ``1,2`` as 1.2 and bare ``\\frac12`` not at all)."""
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"


def math_equal(pred: str, gold: str) -> bool:
    """True iff ``pred`` and ``gold`` are the same answer (string, the checks that settle a pair
    (``equivalence_checks.decide``), math-verify, equivalence layer)."""
    pred, gold = rewrite_notation(pred), rewrite_notation(gold)
    if normalize_answer(pred) == normalize_answer(gold):
        return True
    if len(pred) > _MAX_VERIFY_CHARS:
        return False
    try:
        verdict = decide(pred, gold, rounds_to)
    except Exception:  # a grader crash must not kill training; the later checks still run
        verdict = None
    if verdict is not None:
        return verdict
    if contradicts(pred, gold):
        return False
    return math_verify_equal(_join_letters(pred), _join_letters(gold)) or equivalent(pred, gold)


_SPACED_LETTERS = re.compile(r"(?<![\\a-zA-Z])([a-zA-Z])\s+(?=[a-zA-Z](?![a-zA-Z]))")


def _join_letters(s: str) -> str:
    """``b h`` -> ``bh``: math-verify's parser reads the written product ``\\frac{1}{2} b h`` as
    something else than ``\\frac{1}{2}bh``; one-letter factors side by side are a product either way."""
    return _SPACED_LETTERS.sub(r"\1", s)


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


def final_answer(response: str, prefix: str | None = None) -> str | None:
    """The answer ``response`` commits to last (``answers``' policy), None without one or when it
    commits to two different answers.  Without ``prefix`` a response must box an answer."""
    found = commitments(response, prefix)
    if not found or (not prefix and not any(c.kind == "box" for c in found)):
        return None
    final = found[-1].text
    return final if consistent(found, final, math_equal) else None


@register("math", "gsm_symbolic", "competition_math", "champ")
def math_reward(response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
    """1.0 iff the answer ``response`` commits to (``final_answer``) equals ``ground_truth``."""
    answer = final_answer(response, extra_info.get("answer_prefix"))
    if answer is None:
        return RewardOutput(score=0.0, correct=False)
    correct = math_equal(answer, ground_truth)
    return RewardOutput(score=1.0 if correct else 0.0, correct=correct)
