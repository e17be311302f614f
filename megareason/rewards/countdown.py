"""Countdown reward: combine the given numbers with + - * / to hit a target.

Inputs: ``ground_truth`` is the target (an integer string) and
``extra_info["numbers"]`` the available integers; a missing or non-integer
list is a ``ValueError``.  The candidate expression is the content of the
last ``<answer>...</answer>`` block, else of the last ``\\boxed{}``, else the
last arithmetic-looking run of text on the last line that has one.  It may
contain only integers, ``+ - * /``, parentheses and whitespace, plus an
optional trailing ``= <number>`` that is ignored.

The expression is parsed with ``ast`` and evaluated by walking an allow-list
of nodes with exact ``Fraction`` arithmetic -- model output is never
``eval``-ed.  Correct iff no number is used more often than it is available
and the value equals the target.  Score: 1.0 correct, 0.1 for a well-formed
but wrong expression (including division by zero), 0.0 otherwise.
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from fractions import Fraction

from megareason.rewards.math import last_boxed
from megareason.rewards.registry import RewardOutput, register

FORMAT_SCORE = 0.1
# Real answers are a few numbers long; the cap bounds parse/recursion cost.
MAX_EXPRESSION_CHARS = 300

_BIN_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_ALLOWED_CHARS = re.compile(r"[0-9\s+\-*/()]+")
_TRAILING_RESULT = re.compile(r"=\s*-?[0-9]+(?:\.[0-9]+)?\s*\.?\s*$")
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HAS_BINARY_OP = re.compile(r"[0-9)]\s*[-+*/]\s*[-0-9(]")


def _validate_numbers(extra_info: Mapping) -> list[int]:
    numbers = extra_info.get("numbers") if isinstance(extra_info, Mapping) else None
    if numbers is None:
        raise ValueError("countdown requires extra_info['numbers'] (list of available integers)")
    invalid = ValueError(f"countdown extra_info['numbers'] must be a list of ints, got {numbers!r}")
    if isinstance(numbers, (str, bytes, Mapping)) or not isinstance(numbers, Iterable):
        raise invalid
    result = []
    for n in numbers:
        if isinstance(n, bool):
            raise invalid
        try:
            # operator.index accepts numpy ints (parquet-loaded data) but not floats.
            result.append(operator.index(n))
        except TypeError:
            raise invalid from None
    return result


def extract_expression(response: str) -> str | None:
    """Candidate expression text per the module contract, or None if none is found."""
    blocks = _ANSWER_BLOCK.findall(response)
    if blocks:
        return blocks[-1].strip()
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    for line in reversed(response.splitlines()):
        runs = [r.strip() for r in _ALLOWED_CHARS.findall(line) if _HAS_BINARY_OP.search(r)]
        if runs:
            return runs[-1]
    return None


def _evaluate(node: ast.AST, used: Counter) -> Fraction:
    """Exact value of a tree accepted by ``_check_nodes``; counts integer literals in ``used``."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN_OPS:
        return _BIN_OPS[type(node.op)](_evaluate(node.left, used), _evaluate(node.right, used))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used[node.value] += 1
        return Fraction(node.value)
    raise ValueError(f"disallowed syntax: {type(node).__name__}")


def parse_expression(expr: str) -> ast.expr | None:
    """AST of ``expr`` if it is a well-formed countdown expression, else None."""
    expr = _TRAILING_RESULT.sub("", expr).strip()
    if not expr or len(expr) > MAX_EXPRESSION_CHARS or not _ALLOWED_CHARS.fullmatch(expr):
        return None
    try:
        tree = ast.parse(expr, mode="eval").body
        # Checked up front so a division by zero during evaluation cannot hide
        # a disallowed node (e.g. ``**``) elsewhere in the tree.
        _check_nodes(tree)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return tree


def _check_nodes(node: ast.AST) -> None:
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN_OPS:
        _check_nodes(node.left)
        _check_nodes(node.right)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        _check_nodes(node.operand)
    elif not (isinstance(node, ast.Constant) and type(node.value) is int):
        raise ValueError(f"disallowed syntax: {type(node).__name__}")


@register("countdown")
def countdown_reward(response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
    """1.0 for a valid expression hitting the target, 0.1 for a well-formed miss, else 0.0."""
    numbers = _validate_numbers(extra_info)
    try:
        target = Fraction(int(ground_truth.strip()))
    except (ValueError, AttributeError):
        raise ValueError(f"countdown ground_truth must be an integer target, got {ground_truth!r}") from None
    expr = extract_expression(response)
    tree = parse_expression(expr) if expr is not None else None
    if tree is None:
        return RewardOutput(score=0.0, correct=False)
    used: Counter = Counter()
    try:
        value = _evaluate(tree, used)
    except (ZeroDivisionError, RecursionError):
        return RewardOutput(score=FORMAT_SCORE, correct=False)
    available = Counter(numbers)
    correct = value == target and all(count <= available[n] for n, count in used.items())
    return RewardOutput(score=1.0 if correct else FORMAT_SCORE, correct=correct)
