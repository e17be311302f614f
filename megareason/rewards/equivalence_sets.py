"""LaTeX -> sympy for the equivalence layer: single expressions, and subsets of the reals written as
intervals (``(2,5]``, unions with ``\\cup``), inequalities (``2 < t \\le 5``, ``x \\ne 0``, joined by
``or``/``and``), set-builder notation (``\\{x \\mid 0<x<2\\}``), ``x \\in (1,4]`` and ``\\mathbb{R}``.

``real_set`` returns a ``sympy.Set`` or None when the text is none of these; ``sets_equal`` compares
two such sets component by component (same brackets, endpoints equal to 1e-9).
"""

from __future__ import annotations

import math
import re
import threading
from functools import lru_cache

import sympy
from latex2sympy2_extended import NormalizationConfig, latex2sympy
from math_verify.utils import timeout

from megareason.rewards.equivalence_forms import split_top

_PARSE_TIMEOUT_S = 5  # as the math reward's math-verify calls; SIGALRM, main thread only
_NORMALIZE = NormalizationConfig(basic_latex=True, units=False, malformed_operators=True, nits=True, boxed="none")


@lru_cache(maxsize=4096)
def to_sympy(tex: str) -> sympy.Basic | None:
    """``tex`` parsed by latex2sympy (no unit stripping: ``3t`` stays ``3*t``), or None if unreadable."""

    def _parse() -> sympy.Basic:
        return latex2sympy(tex, is_real=True, normalization_config=_NORMALIZE)

    in_main = threading.current_thread() is threading.main_thread()
    try:
        expr = timeout(_PARSE_TIMEOUT_S)(_parse)() if in_main else _parse()
    except Exception:  # unreadable LaTeX, or a parse that timed out
        return None
    return expr if isinstance(expr, sympy.Basic) else None


def real_number(tex: str) -> sympy.Expr | None:
    """``tex`` as a real constant (``\\frac{\\pi}{2}``, ``-\\infty``), or None."""
    expr = to_sympy(tex.strip())
    if not isinstance(expr, sympy.Expr) or expr.free_symbols:
        return None
    if expr in (sympy.oo, -sympy.oo):
        return expr
    try:
        value = complex(expr.evalf())
    except (TypeError, ValueError):
        return None
    return expr if value.imag == 0 and math.isfinite(value.real) else None


# --- interval notation -------------------------------------------------------------------------

_REALS = re.compile(r"\\mathbb\s*\{?R\}?|\(-\\infty\s*,\s*\\infty\)|all real numbers|\\mathbb\{R\}")


def interval(s: str) -> sympy.Set | None:
    """``(2,5]`` / ``[\\frac12, \\infty)`` -> ``sympy.Interval`` (start < end), else None."""
    s = s.strip()
    if len(s) < 5 or s[0] not in "([" or s[-1] not in ")]":
        return None
    ends = split_top(s[1:-1], (",",))
    if len(ends) != 2:
        return None
    lo, hi = real_number(ends[0]), real_number(ends[1])
    if lo is None or hi is None or not bool(lo < hi):
        return None
    return sympy.Interval(lo, hi, left_open=s[0] == "(", right_open=s[-1] == ")")


def interval_union(s: str) -> sympy.Set | None:
    """Intervals joined by ``\\cup`` (or ``U``) -> their union, else None."""
    parts = split_top(s, ("\\cup", " U "))
    sets = [interval(p) for p in parts]
    return sympy.Union(*sets) if all(x is not None for x in sets) else None


# --- inequalities and set-builder notation ------------------------------------------------------

_RELATION = re.compile(r"(\\le(?![a-zA-Z])|\\ge(?![a-zA-Z])|\\ne(?![a-zA-Z])|<|>)")
_VARIABLE = re.compile(r"(?:[a-zA-Z]|\\(?:theta|alpha|beta|phi|lambda|mu|omega|varphi))(?:_\{?\w+\}?)?")
_FLIP = {"<": ">", ">": "<", "\\le": "\\ge", "\\ge": "\\le", "\\ne": "\\ne"}


def _half_line(op: str, c: sympy.Expr) -> sympy.Set:
    """``{x : x op c}`` for one relation ``op`` (``<``, ``>``, ``\\le``, ``\\ge``, ``\\ne``)."""
    return {
        "<": sympy.Interval.open(-sympy.oo, c),
        "\\le": sympy.Interval(-sympy.oo, c),
        ">": sympy.Interval.open(c, sympy.oo),
        "\\ge": sympy.Interval(c, sympy.oo),
        "\\ne": sympy.Union(sympy.Interval.open(-sympy.oo, c), sympy.Interval.open(c, sympy.oo)),
    }[op]


_ABS = re.compile(r"^\|\s*(?:" + _VARIABLE.pattern + r")\s*(?:(?P<sign>[+-])(?P<shift>[^|]+))?\|$")


def absolute_inequality(operands: list[str], ops: list[str]) -> sympy.Set | None:
    """``|x| \\le 1``, ``|x - 2| > 3`` (also written ``c > |x|``) -> the set of x, else None."""
    if len(ops) != 1:
        return None
    (left, right), op = operands, ops[0]
    if _ABS.match(right):
        left, right, op = right, left, _FLIP[op]
    m, c = _ABS.match(left), real_number(right)
    if m is None or c is None or op == "\\ne":
        return None
    shift = real_number(m.group("shift")) if m.group("shift") else sympy.Integer(0)
    if shift is None:
        return None
    center = -shift if m.group("sign") == "+" else shift
    inside = sympy.Interval(center - c, center + c, left_open=op == "<", right_open=op == "<")
    return inside if op in ("<", "\\le") else sympy.Complement(sympy.Reals, inside)


def inequality_chain(s: str) -> sympy.Set | None:
    """``a < x``, ``x \\ge 4``, ``5 \\ge x``, ``2 < t \\le 5``, ``x \\ne 0`` -> the set of x, else None.

    Exactly one operand must be a variable, the others real constants (or ``|x - a| < c``).
    """
    tokens = [t.strip() for t in _RELATION.split(s)]
    operands, ops = tokens[::2], tokens[1::2]
    if not ops or len(operands) > 3:
        return None
    var_at = [i for i, t in enumerate(operands) if _VARIABLE.fullmatch(t)]
    if len(var_at) != 1:
        return absolute_inequality(operands, ops)
    v = var_at[0]
    result = sympy.Reals
    for i, op in enumerate(ops):
        left, right = operands[i], operands[i + 1]
        if i + 1 == v:  # c op x  ==  x flip(op) c
            c, op = real_number(left), _FLIP[op]
        elif i == v:
            c = real_number(right)
        else:
            return None
        if c is None:
            return None
        result = sympy.Intersection(result, _half_line(op, c))
    return result


def conditions(s: str) -> sympy.Set | None:
    """Inequality chains joined by ``or`` (union) and ``and``/``,`` (intersection), else None."""
    union = []
    for alternative in split_top(s, (" or ", "\\cup", "\\vee")):
        parts = [inequality_chain(p) for p in split_top(alternative, (" and ", ",", "\\wedge", "\\land"))]
        if not parts or any(p is None for p in parts):
            return None
        union.append(sympy.Intersection(*parts) if len(parts) > 1 else parts[0])
    return sympy.Union(*union)


_SET_BUILDER = re.compile(
    r"^\\\{\s*(?:" + _VARIABLE.pattern + r")\s*(?:\\in\s*\\mathbb\s*\{?R\}?\s*)?(?:\\mid|\||:)(.+)\\\}$"
)
_MEMBERSHIP = re.compile(r"^(?:" + _VARIABLE.pattern + r")\s*\\in\s*(.+)$")


def real_set(s: str) -> sympy.Set | None:
    """The subset of the reals a cleaned answer writes, in any notation above, else None."""
    s = s.strip()
    if _REALS.fullmatch(s):
        return sympy.Reals
    m = _SET_BUILDER.match(s)
    if m:
        return conditions(m.group(1))
    m = _MEMBERSHIP.match(s)
    if m:
        inner = m.group(1).strip()
        return sympy.Reals if _REALS.fullmatch(inner) else interval_union(inner)
    if s[:1] in "([":
        return interval_union(s)
    if _RELATION.search(s):
        return conditions(s)
    return None


def _components(s: sympy.Set) -> list[tuple[float, float, bool, bool]] | None:
    """``s`` as sorted (start, end, left_open, right_open) pieces; points are closed pieces."""
    pieces = s.args if isinstance(s, sympy.Union) else (s,)
    out = []
    for p in pieces:
        if isinstance(p, sympy.Interval):
            out.append((float(p.start), float(p.end), bool(p.left_open), bool(p.right_open)))
        elif isinstance(p, sympy.FiniteSet) and all(x.is_real for x in p):
            out.extend((float(x), float(x), False, False) for x in p)
        elif p == sympy.Reals:
            out.append((-math.inf, math.inf, True, True))
        else:
            return None
    return sorted(out)


def sets_equal(a: sympy.Set, b: sympy.Set) -> bool:
    """Same pieces, same brackets, endpoints equal to a relative 1e-9."""
    if a == b:
        return True
    ca, cb = _components(a), _components(b)
    if ca is None or cb is None or len(ca) != len(cb):
        return False
    close = lambda x, y: x == y or math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)  # noqa: E731
    return all(
        close(x[0], y[0]) and close(x[1], y[1]) and x[2:] == y[2:] for x, y in zip(ca, cb, strict=True)
    )
