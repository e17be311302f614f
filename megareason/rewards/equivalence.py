"""Answer equivalence beyond math-verify, for the math reward.

Contract: ``equivalent(pred, gold)`` is True when the two answers are the same answer written in
forms math-verify does not relate; the math reward asks it only after math-verify said "not equal".
``contradicts(pred, gold)`` is True when the answers differ in a way math-verify overlooks (it
compares bare lists as sets, drops unit words and percent signs); the math reward asks it BEFORE
math-verify, so none of these is ever paid: a labelled list in the wrong order, a quantity in the
wrong unit, a percentage of another value, one solution of several.  Both are pure and never raise.

Refused, as competition graders mark them wrong (each rule is one check in ``contradicts`` or
``rounds_to``):
- part of a multi-solution reference: ``5`` for ``5 \\text{ or } 7`` (or ``5 \\text{ and } 7``,
  ``5 \\text{ or more}``); the answer must list every solution, in any order or list style;
- two different units, whatever their length (``5 s`` vs ``5 ms``, ``5 km`` vs ``5 m``); common
  symbols and spellings match (``5 m`` vs ``5 meters``); a unit written on one side only is not
  compared (``5`` vs ``5 m`` is accepted: answer keys often drop the unit the question names);
- a percentage read as anything but its value: ``p%`` is the number p/100 on either side (ISO
  80000-1), so ``50%`` equals 0.5 and 1/2, and a percent sign is never dropped (``0.5%`` is not
  0.5, ``50`` is not ``50%``); a plain answer to a percentage gold is settled before this layer
  (``equivalence_checks``: ``50`` for ``50%`` is paid);
- another label (``y = 5`` for ``x = 5``, ``a = 2b`` for ``b = 2a``) and a matrix of another shape
  (2x2 vs 1x4 vs a 4-tuple), which math-verify pays;
- a rounded decimal of fewer than ``MIN_ROUNDED_SIGNIFICANT_DIGITS`` significant digits, or of a
  value with an exact decimal (``3.1`` for pi, ``0.13`` for 1/8).

Accepted, besides what math-verify accepts (each form is one function in ``equivalence_forms``):
- a decimal that is the exact value rounded to the decimal's own precision, for a value without an
  exact decimal (12.86 vs 90/7, 3.14 vs pi; at least 3 significant digits and 1 decimal place:
  12.87, 12.85, 13 and 3.1 are rejected);
- percentages (27.5% vs 11/40), mixed numbers (3\\frac{1}{8}), ratios (15:4 vs 15/4, 2:3:4 vs 4:6:8);
- numbers with units, ordinals or currency (42.5 grams, 7th day, \\$1,234.50);
- intervals vs inequalities vs set-builder notation, unions and "or" (``equivalence_sets``);
- a function's renamed argument (g(t)=3t vs g(x)=3x, or vs 3x), an equation vs its right-hand side
  (k_{min}=2n+1); no other variable is renamed (2a is not 2b: precision, without the question the
  roles of the letters are unknown);
- labelled answers vs bare lists in order (p=4, q=9 vs 4,9; one-letter labels in the letters' order,
  y=3, x=2 vs (2,3); labels matched by name when both are labelled), tuples vs column vectors
  (pmatrix) and \\langle\\rangle, unordered sets and lists, the \\pm shorthand ((\\pm 1, 2) vs {(1,2),(-1,2)});
- degrees vs radians (45° vs \\pi/4), unicode math, \\text{} wrappers, \\left/\\right.
"""

from __future__ import annotations

import re
import threading

import sympy
from math_verify import verify

from megareason.rewards.equivalence_forms import (
    Labelled,
    RealSet,
    Scalar,
    Seq,
    clean,
    decimal_places,
    expand_pm,
    mentions_text,
    significant_digits,
    structure,
    written_unit,
)
from megareason.rewards.equivalence_sets import real_set, sets_equal, to_sympy

_MAX_CHARS = 1000  # as the math reward: longer "answers" are not answers
_MAX_ITEMS = 10  # unordered matching is a search; longer lists are compared in order only
# A decimal stands for a value without an exact decimal (pi, sqrt 3 / 2, 1/3) only at this many
# significant digits: 3.14 is pi, 3.1 is not (two digits also fit too many wrong answers).
MIN_ROUNDED_SIGNIFICANT_DIGITS = 3
_VERIFY_TIMEOUT_S = 5
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_LETTER = re.compile(r"[a-zA-Z]")
_PERCENT_SIGN = re.compile(r"%|percent")
_COMMAND = re.compile(r"\\(?!text|mathrm|mbox)[a-zA-Z]+")


def interpret(s: str) -> list[object]:
    """Every structure the answer ``s`` may mean (a ``(2,5)`` is an interval and a pair), best first.

    ``s`` is cleaned here; ``\\pm`` expands to the set of its sign choices.
    """
    from_text = mentions_text(s)
    s = clean(s)
    expanded = expand_pm(s)
    if expanded is not None:
        values = [structure(e, from_text) for e in expanded]
        values = [v.values[0] if isinstance(v, Labelled) and len(v.values) == 1 else v for v in values]
        return [Seq("set", tuple(values))] if all(v is not None for v in values) else []
    out: list[object] = []
    reals = real_set(s)
    if reals is not None:
        out.append(RealSet(reals))
    value = structure(s, from_text)
    if value is not None:
        out.append(value)
    return out


def equivalent(pred: str, gold: str) -> bool:
    """True iff ``pred`` and ``gold`` are the same answer in any form listed in the module docstring."""
    if len(pred) > _MAX_CHARS or len(gold) > _MAX_CHARS:
        return False
    try:
        preds, golds = interpret(pred), interpret(gold)
        if preds == [Scalar(pred.strip())] and golds == [Scalar(gold.strip())]:
            return plain_pair_equal(pred.strip(), gold.strip())
        return any(values_equal(p, g) for g in golds for p in preds)
    except Exception:  # a grader crash must not kill training; "not shown equal" is the safe answer
        return False


def contradicts(pred: str, gold: str) -> bool:
    """True iff the answers are labelled lists (or lists against one) that differ in order or value,
    quantities in different units, a single value against several solutions, or percentages whose
    values (p% = p/100) differ.  Cheap when neither has an ``=`` or a ``%`` and ``gold`` no letter."""
    if len(pred) > _MAX_CHARS or len(gold) > _MAX_CHARS:
        return False
    if _PERCENT_SIGN.search(pred) or _PERCENT_SIGN.search(gold):
        return not equivalent(pred, gold)  # math-verify drops the sign: 0.5% would equal 0.5
    has_label = "=" in pred or "=" in gold
    has_words = _LETTER.search(_COMMAND.sub("", gold))  # units, solutions joined by words
    if not (has_label or has_words):
        return False
    try:
        preds, golds = interpret(pred), interpret(gold)
        p, g = _structure(preds), _structure(golds)
        if p is None or g is None:
            return False
        if isinstance(p, Labelled) and isinstance(g, Labelled) and len(p.labels) == len(g.labels) == 1:
            return not values_equal(p, g)  # y = 5 is not x = 5 (math-verify compares the right-hand sides)
        if any(isinstance(v, Seq) and v.kind == "matrix" for v in (p, g)):
            return not values_equal(p, g)  # math-verify flattens a matrix's shape away
        if isinstance(p, Scalar) and isinstance(g, Scalar):
            units = [v.unit or written_unit(clean(s), mentions_text(s)) for v, s in ((p, pred), (g, gold))]
            return bool(units[0] and units[1] and units[0] != units[1])
        single = isinstance(p, Scalar) or (isinstance(p, Labelled) and len(p.values) == 1)
        several = (isinstance(g, Seq) and g.kind in ("list", "set")) or isinstance(g, Labelled)
        if has_words and single and several and _length(g) > 1 and not any(isinstance(c, RealSet) for c in golds):
            return True  # one solution of several joined by words (math-verify reads "5 or more" as 5)
        labelled = [v for v in (p, g) if isinstance(v, Labelled) and len(v.labels) > 1]
        other = g if p in labelled else p
        if labelled and isinstance(other, Labelled | Seq) and _length(other) == len(labelled[0].labels):
            return not values_equal(p, g)
        return False
    except Exception:  # never veto on a crash: math-verify decides
        return False


def _structure(candidates: list[object]) -> object | None:
    """The non-interval reading of an answer (the last candidate), if any."""
    rest = [c for c in candidates if not isinstance(c, RealSet)]
    return rest[-1] if rest else None


def _length(v: Labelled | Seq) -> int:
    return len(v.labels) if isinstance(v, Labelled) else len(v.items)


# --- comparing structures -------------------------------------------------------------------------


def values_equal(a: object, b: object) -> bool:
    """Structural equality of two ``interpret`` results (``a`` the prediction, ``b`` the reference)."""
    if a is None or b is None:
        return False
    if isinstance(a, Scalar) and isinstance(b, Scalar):
        return scalars_equal(a, b)
    if isinstance(a, RealSet) and isinstance(b, RealSet):
        return sets_equal(a.value, b.value)
    if isinstance(a, Labelled) or isinstance(b, Labelled):
        return _labelled_equal(a, b)
    if isinstance(a, Seq) and isinstance(b, Seq):
        return _seqs_equal(a, b)
    return False


def _labelled_equal(a: object, b: object) -> bool:
    """Labelled vs labelled: by label when both carry the same labels, else in order.  One value
    with its label vs anything: the value (``x = 5`` vs ``5``).  Several vs a tuple/list: in order."""
    if isinstance(a, Labelled) and isinstance(b, Labelled):
        if len(a.labels) != len(b.labels):
            return False
        if len(a.labels) > 1 and sorted(a.labels) == sorted(b.labels):
            by_label = dict(zip(b.labels, b.values, strict=True))
            return all(values_equal(v, by_label[lab]) for lab, v in zip(a.labels, a.values, strict=True))
        if len(a.labels) > 1:
            return False  # different labels: x = 2, y = 3 is not a = 2, b = 3
        match = labels_match(a.labels[0], b.labels[0])
        if isinstance(match, tuple):
            return renamed_argument_equal(a.values[0], b.values[0], *match)
        return bool(match) and values_equal(a.values[0], b.values[0])
    lab, other = (a, b) if isinstance(a, Labelled) else (b, a)
    if len(lab.values) == 1:
        if values_equal(lab.values[0], other) if lab is a else values_equal(other, lab.values[0]):
            return True
        return _unlabelled_function(lab, other, lab is a)
    if isinstance(other, Seq) and other.kind in ("tuple", "list") and len(other.items) == len(lab.values):
        values = lab.values
        if all(re.fullmatch(r"[a-zA-Z]", x) for x in lab.labels):  # (x, y), (a, b, c): the letters' order
            values = tuple(v for _, v in sorted(zip(lab.labels, lab.values, strict=True), key=lambda lv: lv[0]))
        pairs = zip(values, other.items, strict=True)
        return all(values_equal(x, y) if lab is a else values_equal(y, x) for x, y in pairs)
    return False


def _seqs_equal(a: Seq, b: Seq) -> bool:
    """Ratios up to a common factor; anything against a tuple in order; sets and lists as multisets."""
    if "matrix" in (a.kind, b.kind):  # rows of a matrix: the same shape, cell by cell
        return a.kind == b.kind and len(a.items) == len(b.items) and all(
            _seqs_equal(x, y) for x, y in zip(a.items, b.items, strict=True))
    if a.kind == "ratio" or b.kind == "ratio":
        if a.kind != b.kind or len(a.items) != len(b.items):
            return False
        scaled = lambda s: [Scalar(rf"\frac{{{x.tex}}}{{{s.items[0].tex}}}") for x in s.items[1:]]  # noqa: E731
        return all(scalars_equal(x, y) for x, y in zip(scaled(a), scaled(b), strict=True))
    if len(a.items) != len(b.items):
        return False
    if "tuple" in (a.kind, b.kind):
        if "set" in (a.kind, b.kind):
            return False
        return all(values_equal(x, y) for x, y in zip(a.items, b.items, strict=True))
    if len(a.items) > _MAX_ITEMS:
        return all(values_equal(x, y) for x, y in zip(a.items, b.items, strict=True))
    return _match_unordered(list(a.items), list(b.items))


def _match_unordered(xs: list, ys: list) -> bool:
    """True iff each of ``xs`` equals a distinct one of ``ys`` (same length; backtracking search)."""
    if not xs:
        return not ys
    for j, y in enumerate(ys):
        if values_equal(xs[0], y) and _match_unordered(xs[1:], ys[:j] + ys[j + 1:]):
            return True
    return False


# --- comparing single expressions -------------------------------------------------------------------


def scalars_equal(a: Scalar, b: Scalar) -> bool:
    """Same value (math-verify on the rewritten forms) or a rounded decimal;
    never when both carry a unit and the units differ."""
    if a.unit and b.unit and a.unit != b.unit:
        return False
    return expressions_equal(a.tex, b.tex)


def expressions_equal(pred: str, gold: str) -> bool:
    """``pred`` equals ``gold`` as sympy expressions (math-verify's ``verify``), or as a rounding of it."""
    if re.sub(r"\s+", "", pred) == re.sub(r"\s+", "", gold):
        return True
    if rounds_to(pred, gold) or rounds_to(gold, pred):
        return True
    p, g = to_sympy(pred), to_sympy(gold)
    if p is None or g is None:
        return False
    return _verify(g, p)


def plain_pair_equal(pred: str, gold: str) -> bool:
    """``expressions_equal`` for two answers that no form rewrote, which math-verify has already
    compared as they stand: only a rounding can still relate them.  Two expressions in different
    letters are different answers (``2a`` is not ``2b``, ``\\pi h^2`` is not ``\\pi r^2``): a variable
    is renamed only as a function's argument (``_labelled_equal``)."""
    return rounds_to(pred, gold) or rounds_to(gold, pred)


def _verify(gold: sympy.Basic, pred: sympy.Basic) -> bool:
    """math-verify's comparison of two parsed expressions (its timeouts only in the main thread)."""
    in_main = threading.current_thread() is threading.main_thread()
    try:
        return bool(verify(gold, pred, timeout_seconds=_VERIFY_TIMEOUT_S if in_main else None))
    except Exception:
        return False


def rounds_to(decimal: str, exact: str) -> bool:
    """True iff ``decimal`` (a plain literal, >= ``MIN_ROUNDED_SIGNIFICANT_DIGITS`` significant
    digits, >= 1 decimal place) is the value of ``exact`` (not itself a plain number, and with no
    exact decimal: irrational, or a fraction whose denominator has a prime factor other than 2 and 5)
    rounded to the decimal's own precision.  1/8 is 0.125 exactly, so 0.13 is no answer for it."""
    places = decimal_places(decimal)
    if places is None or significant_digits(decimal) < MIN_ROUNDED_SIGNIFICANT_DIGITS:
        return False
    if _PLAIN_NUMBER.fullmatch(exact.strip()):
        return False
    value = to_sympy(exact)
    if not isinstance(value, sympy.Expr) or value.free_symbols or _has_exact_decimal(value):
        return False
    try:
        error = abs(sympy.N(value - sympy.Rational(decimal.strip()), 30))
        return bool(error.is_real) and bool(error <= sympy.Rational(1, 2 * 10**places) * (1 + sympy.Rational(1, 10**9)))
    except (TypeError, ValueError):
        return False


def _has_exact_decimal(value: sympy.Expr) -> bool:
    """True iff ``value`` is a rational whose decimal expansion ends (denominator 2^a 5^b)."""
    if not value.is_Rational:
        return False
    q = int(value.q)
    for prime in (2, 5):
        while q % prime == 0:
            q //= prime
    return q == 1


_FUNCTION_LABEL = re.compile(r"^(?P<head>.+)\((?P<arg>[a-zA-Z])\)$")


def renamed_argument_equal(pred: object, gold: object, arg_pred: str, arg_gold: str) -> bool:
    """``g(t)=3t`` vs ``g(x)=3x``: the two values equal after renaming the function's argument (a
    bound variable, so the name is the writer's choice; no other variable is ever renamed)."""
    if not (isinstance(pred, Scalar) and isinstance(gold, Scalar)):
        return False
    p, g = to_sympy(pred.tex), to_sympy(gold.tex)
    if p is None or g is None:
        return False
    return _verify(g, p.subs(sympy.Symbol(arg_pred, real=True), sympy.Symbol(arg_gold, real=True))
                   .subs(sympy.Symbol(arg_pred), sympy.Symbol(arg_gold)))


def _unlabelled_function(lab: Labelled, other: object, lab_is_pred: bool) -> bool:
    """``g(t) = 3t`` vs ``3x``: a function written without its name, in its own argument's letter."""
    f = _FUNCTION_LABEL.match(lab.labels[0])
    if not f or not isinstance(other, Scalar):
        return False
    expr = to_sympy(other.tex)
    symbols = expr.free_symbols if expr is not None else set()
    if len(symbols) != 1:
        return False
    name = str(next(iter(symbols)))
    if lab_is_pred:
        return renamed_argument_equal(lab.values[0], other, f.group("arg"), name)
    return renamed_argument_equal(other, lab.values[0], name, f.group("arg"))


def labels_match(a: str, b: str) -> tuple[str, str] | bool:
    """Same label (True), the same function of a renamed argument (the two argument names), else False."""
    if a == b:
        return True
    fa, fb = _FUNCTION_LABEL.match(a), _FUNCTION_LABEL.match(b)
    if fa and fb and fa.group("head") == fb.group("head"):
        return fa.group("arg"), fb.group("arg")
    return False
