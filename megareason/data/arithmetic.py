"""Checks and worked solutions for reasoning-gym's ``basic_arithmetic`` items.

reasoning-gym 0.1.25 writes a wrong answer for every ``/`` of its simple (no-parentheses) generator: the
question is written with the drawn divisor, then the answer is computed with another one (or with a
multiplication when no divisor fits) — ``Calculate 4 / 1.`` has the answer ``2``. About a quarter of a
four-operator set is affected. :func:`expression_value` computes what the question asks, exactly, so the
loader can keep only the items whose answer is their question's.

The generator gives no worked solution either; :func:`worked_solution` writes the computation an expert
would write for a two-term sum, difference or product (one place-value split), the demonstration that
SFT imitates and that RARO's critic is shown as the expert's answer.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def expression_value(expression: str) -> Fraction | None:
    """The exact value of an integer ``+ - * /`` expression (parentheses and unary minus allowed);
    None when it is not one or divides by zero."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return _value(tree.body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return None


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError(f"not an integer arithmetic expression: {ast.dump(node)}")


def answer_matches(expression: str, answer: str) -> bool:
    """Whether ``answer`` (an integer as text) is the exact value of ``expression``."""
    value = expression_value(expression)
    try:
        return value is not None and value == int(answer)
    except ValueError:
        return False


def worked_solution(expression: str, answer: str) -> str:
    """The computation written out: ``57 * 47 = 57 * 40 + 57 * 7 = 2280 + 399 = 2679`` for a two-term
    ``+ - *`` whose second term has two digits, ``a op b = answer`` otherwise."""
    parts = expression.split()
    plain = f"{expression} = {answer}"
    if len(parts) != 3 or parts[1] not in "+-*" or not (parts[0].isdigit() and parts[2].isdigit()):
        return plain
    a, op, b = int(parts[0]), parts[1], int(parts[2])
    tens, units = b - b % 10, b % 10
    if tens == 0 or units == 0:
        return plain
    if op == "+":
        steps = [f"{a} + {tens} + {units}", f"{a + tens} + {units}"]
    elif op == "-":
        steps = [f"{a} - {tens} - {units}", f"{a - tens} - {units}"]
    else:
        steps = [f"{a} * {tens} + {a} * {units}", f"{a * tens} + {a * units}"]
    return " = ".join([expression, *steps, answer])
