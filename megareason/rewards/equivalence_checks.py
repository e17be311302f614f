"""Verdicts that settle a pair of answers before math-verify, for the math reward.

``decide(pred, gold)`` returns True or False where one of the rules below settles the pair, else None
(math-verify and the equivalence layer decide).  ``rewrite_notation`` turns notations math-verify
does not read into LaTeX it does.  Each rule names the grader or convention it follows; where a rule
trades recall for precision it says so.  Pure, never raises.

- **Choice letters** (the MATH / AMC answer keys, lm-eval's multiple-choice tasks): a gold that is
  one capital letter A-H, bare or in ``(..)``/``\\text{}``, is a choice; the answer's choice is its
  letter, bare or parenthesised, optionally followed by the choice's value (``\\textbf{(B) } 12``).
  Case counts: ``e`` is Euler's number, not choice E.
- **One letter against one letter**: compared as written, case included (``E`` is not ``e``).
- **Words** (``\\text{Alice}``, ``yes``): compared as words, case and spacing ignored (SQuAD's
  normalisation without its article and punctuation removal), never as products of letters
  (math-verify reads ``\\text{on}`` as ``o*n``, equal to ``n*o``).
- **Compound quantities** (``3 \\text{ hours } 20 \\text{ minutes}``): equal when the same numbers
  carry the same units in the same order.  No conversion (``200`` minutes is refused: precision).
- **Digits split by spaces** (``1 2``): no number unless the groups are thousands (SI's ``1\\,000``).
- **Hedges against one value** (Hendrycks MATH's graders mark them wrong): when the gold is a single
  value, an answer with a relation (``\\ge 3``, ``\\approx``), a joining or qualifying word (``or``,
  ``to``, ``more``, ``at least``), a trailing ``+``, a question mark or a second listed value is refused.
- **Numbers** (both sides numeric constants): equal when the values are equal exactly (rationals) or
  to a relative 1e-12 (irrationals), or when one is the other rounded to its own precision
  (``equivalence.rounds_to``); never by math-verify's absolute 6-decimal rounding, which pays
  ``1.6\\times10^{-20}`` for ``1.6\\times10^{-19}`` and ``0.1000004`` for ``0.1``.
- **A percentage gold, a plain answer**: ``25`` for ``25\\%`` is paid (math-verify's reading, which
  never pays a wrong value: the percent's number is the answer the question asks for), as is ``0.25``.
"""

from __future__ import annotations

import re
from fractions import Fraction

import sympy

from megareason.rewards.equivalence_forms import clean, decimal_places, mixed_number, normalize_unit
from megareason.rewards.equivalence_sets import to_sympy

# --- notations ----------------------------------------------------------------------------------

_OVERLINE = re.compile(r"(?<![\d.])(-?)(\d*)\.(\d*)\\overline\s*\{(\d+)\}")
_TRIG_DEGREES = re.compile(r"\\(sin|cos|tan|cot|sec|csc)\s*\(?\s*(\d+(?:\.\d+)?)\s*\^\s*\{?\s*\\circ\s*\}?\s*\)?")
_E_NOTATION = re.compile(r"(?<![\w.\\])(-?\d+(?:\.\d+)?)[eE]([-+]?\d+)(?![\w.])")


def _repeating(m: re.Match) -> str:
    """``0.1\\overline{6}`` -> ``\\frac{1}{6}``: the exact value of a repeating decimal."""
    sign, whole, fixed, period = m.groups()
    value = Fraction(int(whole or 0)) + (Fraction(int(fixed), 10 ** len(fixed)) if fixed else 0)
    value += Fraction(int(period), (10 ** len(period) - 1) * 10 ** len(fixed))
    return rf"{sign}\frac{{{value.numerator}}}{{{value.denominator}}}"


def rewrite_notation(s: str) -> str:
    """Repeating decimals (``0.\\overline{3}``), E-notation (``3.2e-3``, a calculator's and Python's)
    and a trigonometric function of degrees (``\\sin 30^\\circ``) -> ``\\frac{1}{3}``,
    ``3.2\\times10^{-3}``, ``\\sin(\\frac{30\\pi}{180})``."""
    s = _OVERLINE.sub(_repeating, s)
    s = _TRIG_DEGREES.sub(lambda m: rf"\{m.group(1)}(\frac{{{m.group(2)}\pi}}{{180}})", s)
    return _E_NOTATION.sub(lambda m: rf"{m.group(1)}\times10^{{{int(m.group(2))}}}", s)


# --- the rules ----------------------------------------------------------------------------------

_GOLD_CHOICE = re.compile(r"^\(?\s*([A-H])\s*\)?$")
_PRED_CHOICE = re.compile(r"^(?:\(\s*([A-H])\s*\)(?:\s*\S.*)?|([A-H]))$")
_LETTER = re.compile(r"^[a-zA-Z]$")
_WORDS = re.compile(r"^[A-Za-z][A-Za-z' -]*$")
_NUMBER = r"-?\d+(?:\.\d+)?(?:\\frac\{\d+\}\{\d+\})?"
_UNIT_WORD = r"[a-zA-Z][a-zA-Z.]*(?:\s*\^\s*\{?\d\}?)?"
_PART = re.compile(r"\s*(" + _NUMBER + r")\s+(" + _UNIT_WORD + r")\s*(?:,|\band\b)?")
_SPLIT_DIGITS = re.compile(r"\d(?:\s|\\[ ,;:!]|~)+\d(?!\d*\s*/)")  # 3 1/8 is a mixed number
_THOUSANDS_SPACED = re.compile(r"\d{1,3}(?:(?:\s|\\[ ,;:!]|~)+\d{3})+")
_THOUSANDS_COMMA = re.compile(r"\d{1,3}(?:(?:,|\{,\})\d{3})+(?!\d)")
_RELATION = re.compile(r"\\(?:le|ge|ne|approx|sim|lt|gt|leq|geq|neq|in)(?![a-zA-Z])|[<>≤≥≈]")
_HEDGE_WORD = re.compile(
    r"\b(?:or|and|to|more|less|fewer|least|most|between|maybe|perhaps|possibly|either|than)\b",
    re.IGNORECASE,
)
_MULTI = re.compile(r"[,;&]|\\cup|\\pm|\\mp|\\begin|\\\\")
_NUMERIC = re.compile(r"[\d\s.+\-*/^{}()]*")
_NUMERIC_COMMANDS = re.compile(r"\\(?:times|cdot|frac|sqrt|pi)(?![a-zA-Z])")
_PERCENT = re.compile(r"^(.+?)\s*(?:\\%|%)$")
_SET_SYMBOL = re.compile(r"\\(?:mathbb|emptyset|varnothing)(?![a-zA-Z])")
_RELATIVE = sympy.Rational(1, 10**12)


def choice_letter(s: str, gold: bool) -> str | None:
    """The choice letter ``s`` names (see the module docstring), else None."""
    m = (_GOLD_CHOICE if gold else _PRED_CHOICE).match(clean(s))
    return next((g for g in m.groups() if g), None) if m else None


def word_answer(s: str, bare: bool = False) -> str | None:
    """``s`` as words (lower case, single spaces) if it is words and nothing else: a ``\\text{}``
    answer, or with ``bare`` a word of three letters or more written without one; else None."""
    c = clean(s)
    if not _WORDS.match(c) or "\\" in c:
        return None
    written_as_text = re.search(r"\\(?:text|textbf|textit|textrm|mathrm|mbox)\s*\{", s)
    if not written_as_text and not (bare and re.fullmatch(r"[A-Za-z]{3,}", c)):
        return None
    return re.sub(r"\s+", " ", c).strip().lower()


def compound(s: str) -> list[tuple[Fraction, str]] | None:
    """``3 hours 20 minutes`` / ``5 ft, 3 in`` -> [(3, hour), (20, minute)] when two parts or more."""
    c = clean(s)
    parts, pos = [], 0
    while pos < len(c):
        m = _PART.match(c, pos)
        if not m or m.end() == pos:
            return None
        num = m.group(1)
        frac = re.match(r"(-?\d+(?:\.\d+)?)(?:\\frac\{(\d+)\}\{(\d+)\})?$", num)
        value = Fraction(frac.group(1)) + (Fraction(int(frac.group(2)), int(frac.group(3))) if frac.group(2) else 0)
        parts.append((value, normalize_unit(m.group(2))))
        pos = m.end()
    return parts if len(parts) > 1 else None


def split_digits(s: str) -> bool:
    """Digits separated by blanks that are not a thousands grouping (``1 2``, ``10 00``)."""
    return bool(_SPLIT_DIGITS.search(_THOUSANDS_SPACED.sub("0", s)))


def single_value(gold: str) -> bool:
    """The gold is one value: no list, union, ``\\pm``, relation, or joining word."""
    c = clean(_THOUSANDS_COMMA.sub("0", gold))
    return not (_MULTI.search(c) or _SET_SYMBOL.search(c) or _RELATION.search(c) or _HEDGE_WORD.search(c))


def hedged(pred: str) -> bool:
    """A relation, a joining or qualifying word, a trailing ``+``, a question mark, or a second listed value."""
    c = clean(_THOUSANDS_COMMA.sub("0", pred))
    return bool(_MULTI.search(c) or _RELATION.search(c) or _HEDGE_WORD.search(c) or re.search(r"\d\s*\+$|\?", c))


def number(s: str) -> sympy.Expr | None:
    """``s`` as a real constant if it is written with digits and arithmetic only (no letters but
    ``\\times \\cdot \\frac \\sqrt \\pi``), else None."""
    c = clean(_THOUSANDS_COMMA.sub(lambda m: re.sub(r"\D", "", m.group(0)), s))
    c = mixed_number(c) or c  # 3 1/8 is 25/8, not 3/8
    if not re.search(r"\d", c) or not _NUMERIC.fullmatch(_NUMERIC_COMMANDS.sub(" ", c)):
        return None
    expr = to_sympy(c)
    if not isinstance(expr, sympy.Expr) or expr.free_symbols or not expr.is_real:
        return None
    return expr


def numbers_equal(p: sympy.Expr, g: sympy.Expr) -> bool:
    """Exactly equal (rationals), else equal to a relative 1e-12."""
    if p.is_Rational and g.is_Rational:
        return bool(p == g)
    try:
        diff, scale = abs(sympy.N(p - g, 40)), max(abs(sympy.N(p, 40)), abs(sympy.N(g, 40)))
        return bool(diff <= _RELATIVE * scale)
    except (TypeError, ValueError):
        return False


def decide(pred: str, gold: str, rounds_to) -> bool | None:
    """The verdict of the first rule of the module docstring that applies to the pair, else None.
    ``rounds_to(decimal, exact)`` is the equivalence layer's rounding rule."""
    gold_choice = choice_letter(gold, gold=True)
    if gold_choice is not None:
        return choice_letter(pred, gold=False) == gold_choice
    cp, cg = clean(pred), clean(gold)
    if _LETTER.match(cp) and _LETTER.match(cg):
        return cp == cg
    wp, wg = word_answer(pred), word_answer(gold)
    if wp is not None or wg is not None:  # a bare word (``Bob``) is read as one only against a \\text word
        return (wp or word_answer(pred, bare=True)) == (wg or word_answer(gold, bare=True))
    kp, kg = compound(pred), compound(gold)
    if kp is not None or kg is not None:
        return kp == kg
    if split_digits(pred) and not split_digits(gold):
        return False
    if single_value(gold) and hedged(pred):
        return False
    percent = _PERCENT.match(cg)
    if percent and "%" not in cp and "percent" not in cp:
        p, g = number(pred), number(percent.group(1))
        if p is not None and g is not None and numbers_equal(p, g):
            return True
        return None
    p, g = number(pred), number(gold)
    if p is None or g is None:
        return None
    return numbers_equal(p, g) or rounds_to(pred, gold) or _gold_rounds(gold, p, rounds_to(gold, pred))


def _gold_rounds(gold: str, p: sympy.Expr, rounded: bool) -> bool:
    """A gold decimal read as the rounding of an exact answer: an irrational one, or a fraction p/q
    that the decimal singles out (2 q^2 <= 10^places: two fractions of such denominators differ by
    more than the rounding, so ``0.333`` names 1/3 but ``0.000125``, 1/8000 exactly, not 1/8001)."""
    if not rounded:
        return False
    places = decimal_places(clean(gold))
    return not p.is_Rational or (places is not None and 2 * int(p.q) ** 2 <= 10**places)
