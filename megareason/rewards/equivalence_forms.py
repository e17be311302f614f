"""Written forms of a math answer, for the math reward's equivalence layer (``equivalence.py``).

Pure string functions, each handling one way of writing an answer, and ``structure`` which turns a
cleaned answer into the ``Value`` structure it may mean (a plain expression, a tuple, an unordered set,
a labelled list, a ratio).  Nothing here calls sympy; sets of reals (``real_set``) are
``equivalence_sets.py``'s, and ``equivalence.interpret`` gathers both; comparison lives there too.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

# --- cosmetic normalisation -----------------------------------------------------------------

_UNICODE = {
    "∞": r"\infty ", "∪": r"\cup ", "∩": r"\cap ", "≤": r"\le ", "≥": r"\ge ", "≠": r"\ne ",
    "π": r"\pi ", "θ": r"\theta ", "−": "-", "–": "-", "×": r"\times ", "·": r"\cdot ", "±": r"\pm ",
    "∓": r"\mp ", "∈": r"\in ", "ℝ": r"\mathbb{R}", "°": r"^\circ", "²": "^2", "³": "^3",
    "½": r"\frac{1}{2}", "¼": r"\frac{1}{4}", "¾": r"\frac{3}{4}", "⅓": r"\frac{1}{3}", "⅔": r"\frac{2}{3}",
    "∣": r"\mid ", "⟨": r"\langle ", "⟩": r"\rangle ",
}
_UNICODE_SQRT = re.compile(r"√\s*(\d+(?:\.\d+)?|[a-zA-Z]|\([^()]*\)|\{[^{}]*\})")
_LATEX_ALIASES = [
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\\(?:leq|leqslant|leqq)(?![a-zA-Z])"), r"\\le"),
    (re.compile(r"\\(?:geq|geqslant|geqq)(?![a-zA-Z])"), r"\\ge"),
    (re.compile(r"\\(?:neq)(?![a-zA-Z])"), r"\\ne"),
    (re.compile(r"\\lt(?![a-zA-Z])"), "<"),
    (re.compile(r"\\gt(?![a-zA-Z])"), ">"),
    (re.compile(r"<="), r"\\le "),
    (re.compile(r">="), r"\\ge "),
    (re.compile(r"!="), r"\\ne "),
    (re.compile(r"\\colon(?![a-zA-Z])"), ":"),
    (re.compile(r"\\lbrace(?![a-zA-Z])"), r"\\{"),
    (re.compile(r"\\rbrace(?![a-zA-Z])"), r"\\}"),
    (re.compile(r"\\vert(?![a-zA-Z])|\\lvert|\\rvert"), "|"),
]
_SIZING = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|big|Big|bigg|Bigg)(?![a-zA-Z])\s*\.?")
_SPACING = re.compile(r"(?<!\\)\\[,;:! ]|\\q?quad(?![a-zA-Z])|~|\\displaystyle|\\textstyle")
_TEXT = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox)\s*\{([^{}]*)\}")


def replace_unicode(s: str) -> str:
    """Unicode math (``∞ ∪ ≤ ≥ ≠ π √2 ² ½ ° −``) -> the LaTeX commands math-verify reads."""
    s = _UNICODE_SQRT.sub(lambda m: r"\sqrt{" + m.group(1).strip("(){}") + "}", s)
    return "".join(_UNICODE.get(ch, ch) for ch in s)


def strip_wrappers(s: str) -> str:
    """``$..$``, ``\\(..\\)``, ``\\left``/``\\right`` (and ``\\big``), spacing commands, a trailing period."""
    s = s.strip().rstrip(".").strip()
    for start, end in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(start) and s.endswith(end) and len(s) > len(start) + len(end):
            s = s[len(start):-len(end)]
    s = _SIZING.sub("", s)
    s = _SPACING.sub(" ", s)
    return s.strip().rstrip(".").strip()


def alias_commands(s: str) -> str:
    """Spellings of one command -> one spelling: ``\\dfrac``->``\\frac``, ``\\leq``/``<=``->``\\le``, ..."""
    for pattern, repl in _LATEX_ALIASES:
        s = pattern.sub(repl, s)
    return s


def unwrap_text(s: str) -> str:
    """``\\text{..}``/``\\mathrm{..}``/``\\textbf{..}`` -> their content, space-padded (innermost first)."""
    while True:
        new = _TEXT.sub(lambda m: " " + m.group(1) + " ", s)
        if new == s:
            return re.sub(r"\s+", " ", s).strip()
        s = new


def clean(s: str) -> str:
    """All cosmetic steps above, in order: the form every structural step below starts from."""
    return unwrap_text(alias_commands(strip_wrappers(replace_unicode(s))))


# --- numbers with units, currency, percentages, degrees, ordinals, mixed numbers, ratios -------

_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)")
_DECIMAL = re.compile(r"-?\d*\.\d+")
_NUMERIC = (
    r"-?\s*(?:\\frac\{[^{}]+\}\{[^{}]+\}|\d+\s*/\s*\d+|\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
    r"(?:\s*\\sqrt\{[^{}]+\}|\s*\\pi)?"
)
_QUANTITY = re.compile(
    r"^(?:(?:the|about|approximately|only|day|week)\s+)?(?P<cur>\\?\$)?\s*(?P<num>" + _NUMERIC + r")"
    r"(?P<ord>st|nd|rd|th)?(?P<unit>\s*[a-zA-Z][a-zA-Z\s/^\d.]*)?$"
)
_PERCENT = re.compile(r"^(?P<num>.+?)\s*(?:\\%|%|\bpercent)$")
_DEGREES = re.compile(r"^(?P<num>.+?)\s*(?:\^\s*\{?\s*\\circ\s*\}?|\bdegrees?)$")
_MIXED = re.compile(
    r"^(?P<sign>-?)\s*(?P<whole>\d+)\s*(?:\\frac\{(?P<n1>\d+)\}\{(?P<d1>\d+)\}|\s(?P<n2>\d+)/(?P<d2>\d+))$"
)


def decimal_places(tex: str) -> int | None:
    """Digits after the point of a plain decimal literal like ``-12.86`` (None for anything else)."""
    return len(tex.split(".")[1]) if _DECIMAL.fullmatch(tex.strip()) else None


def significant_digits(tex: str) -> int:
    """Significant digits of a plain decimal literal: ``0.033`` -> 2, ``12.86`` -> 4."""
    return len(tex.replace("-", "").replace(".", "").lstrip("0"))


_TEMPERATURE = re.compile(r"\s*\^\s*\{?\s*\\circ\s*\}?\s*([CF])\b")
_UNIT_FRACTION = re.compile(r"\\frac\s*\{\s*([a-zA-Z ]+?)\s*\}\s*\{\s*([a-zA-Z ]+?)\s*\}")


def unit_words(s: str) -> str:
    """A unit written as a fraction or with a degree sign -> words: ``5 \\frac{m}{s}`` -> ``5 m/s``,
    ``25^\\circ C`` -> ``25 degC``."""
    return _UNIT_FRACTION.sub(r" \1/\2", _TEMPERATURE.sub(r" deg\1", s))


def split_quantity(s: str, from_text: bool) -> tuple[str, str] | None:
    """``42.5 grams``, ``7th day``, ``\\$1,234.50``, ``250/3 seconds`` -> (number, unit); None if not one.

    Thousands commas are read as such only beside a currency sign, a unit or decimals (a bare
    ``1,234`` may be a list).  A one-letter unit counts only where it came from ``\\text``/
    ``\\mathrm`` (``2 x`` is a product, ``100\\,\\mathrm{m}`` is 100 metres).  Words that join or
    qualify answers (``5 or 7``, ``3 but not 5``, ``5 or more``) are no unit (``is_unit``).
    """
    m = _QUANTITY.match(unit_words(s))
    if not m:
        return None
    num, unit = m.group("num").replace(" ", ""), (m.group("unit") or "").strip()
    if unit and not is_unit(unit):
        return None
    if "," in num:
        if not (m.group("cur") or unit or "." in num):
            return None
        num = num.replace(",", "")
    if unit and not m.group("ord") and len(re.sub(r"[^a-zA-Z]", "", unit)) < 2 and not from_text:
        return None
    if unit and not m.group("ord") and not m.group("unit")[0].isspace() and not from_text:
        return None  # "2ab" is a product, "2 cm" a quantity
    if not (unit or m.group("cur") or m.group("ord")):
        return None
    num = re.sub(r"^(-?)(\d+)/(\d+)$", r"\1\\frac{\2}{\3}", num)
    return num, unit


_CONNECTIVE = re.compile(r"\b(?:or|and|but|not|nor|except|than|unless|either|neither)\b", re.IGNORECASE)
_EXPONENT = re.compile(r"\^\s*\{?\s*-?\d+\s*\}?")


def is_unit(words: str) -> bool:
    """True iff the words after a number can be its unit: no number except an exponent (``cm^2``,
    ``s^{-1}``) and no word that joins or qualifies answers (``or 7``, ``but not 5``, ``or more``)."""
    return not re.search(r"\d", _EXPONENT.sub("", words)) and not _CONNECTIVE.search(words)


# Spellings of one unit -> one name, looked up after lower-casing (and again after dropping a plural s).
_UNIT_NAMES = {
    "m": "meter", "metre": "meter", "km": "kilometer", "kilometre": "kilometer", "cm": "centimeter",
    "centimetre": "centimeter", "mm": "millimeter", "millimetre": "millimeter", "mi": "mile", "ft": "foot",
    "feet": "foot", "yd": "yard", "g": "gram", "kg": "kilogram", "mg": "milligram", "lb": "pound",
    "oz": "ounce", "s": "second", "sec": "second", "ms": "millisecond", "min": "minute", "h": "hour",
    "hr": "hour", "l": "liter", "litre": "liter", "ml": "milliliter", "millilitre": "milliliter",
    "in": "inch", "inches": "inch", "\\$": "dollar", "$": "dollar", "¢": "cent",
    "celsius": "celsius", "degc": "celsius", "degreescelsius": "celsius", "degreecelsius": "celsius",
    "fahrenheit": "fahrenheit", "degf": "fahrenheit", "degreesfahrenheit": "fahrenheit",
    "degreefahrenheit": "fahrenheit", "mph": "mile/hour", "kph": "kilometer/hour", "kmh": "kilometer/hour",
}
_UNIT_NAMED = frozenset(_UNIT_NAMES.values())


def _unit_name(word: str) -> str:
    u = re.sub(r"\s+", "", word)
    power = re.search(r"\^(\d)$", u)
    u = u[:power.start()] if power else u
    if u not in _UNIT_NAMES:
        u = u[:-1] if u.endswith("s") and len(u) > 2 else u
    return _UNIT_NAMES.get(u, u) + (f"^{power.group(1)}" if power and power.group(1) != "1" else "")


def normalize_unit(unit: str) -> str:
    """Unit words compared loosely (SI brochure names; NIST SP 811's spellings): case, spaces and a
    plural ``s`` ignored (``Hours`` == ``hour``), a common symbol or spelling read as its name (``km``
    == ``kilometres``, ``s`` == ``seconds``; ``ms`` is milliseconds, not a plural), a quotient written
    with ``/``, ``per`` or ``\\frac`` (``mph`` == ``miles per hour`` == ``mi/hr``), ``square``/``cubic``
    as powers (``cm^2``), ``^\\circ C`` as Celsius.  No conversion: ``km`` is never ``1000 m``."""
    u = unit.lower().strip()
    u = re.sub(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"\1/\2", u)
    u = re.sub(r"\^\s*\{?\s*\\circ\s*\}?\s*", "deg", u)
    u = re.sub(r"\s*\^\s*\{?\s*(\d)\s*\}?", r"^\1", u)
    u = re.sub(r"\b(?:square|sq\.?)\s+([a-z]+)", r"\1^2", u)
    u = re.sub(r"\b(?:cubic|cu\.?)\s+([a-z]+)", r"\1^3", u)
    whole = re.sub(r"\s+", "", u)
    if whole in _UNIT_NAMES:
        return _UNIT_NAMES[whole]
    return "/".join(_unit_name(part) for part in re.split(r"\s*/\s*|\s+per\s+", u))


def written_unit(s: str, from_text: bool) -> str:
    """The unit after the number of a cleaned quantity, whatever its length (``5 s`` -> ``second``),
    else ``""``.  Letters written straight after the number count only when they name a unit
    (``5km``; ``3t`` is a product).  For refusing two different units only: a lone letter may be a
    variable (``2 x``), so it never makes two answers equal."""
    m = _QUANTITY.match(unit_words(s))
    if not m or not m.group("unit") or m.group("ord") or not is_unit(m.group("unit")):
        return ""
    unit = normalize_unit(m.group("unit"))
    return unit if from_text or m.group("unit")[0].isspace() or unit in _UNIT_NAMED else ""


def percent_to_fraction(s: str) -> str | None:
    """``27.5\\%`` / ``27.5 percent`` -> ``0.275`` (a decimal keeps its precision), else None."""
    m = _PERCENT.match(s)
    if not m:
        return None
    num = m.group("num").strip()
    if _PLAIN_NUMBER.fullmatch(num):
        try:
            return format((Decimal(num) / 100).normalize(), "f")
        except InvalidOperation:
            return None
    return rf"\frac{{{num}}}{{100}}"


def degrees_to_radians(s: str) -> str | None:
    """``45^\\circ`` / ``45°`` / ``45 degrees`` -> ``\\frac{45\\pi}{180}``, else None."""
    m = _DEGREES.match(s)
    if not m or not re.fullmatch(_NUMERIC, m.group("num").strip()):
        return None
    return rf"\frac{{({m.group('num').strip()})\pi}}{{180}}"


def mixed_number(s: str) -> str | None:
    """``3\\frac{1}{8}`` / ``3 1/8`` / ``-2\\frac{1}{3}`` -> an improper fraction, else None."""
    m = _MIXED.match(s)
    if not m:
        return None
    n, d = int(m.group("n1") or m.group("n2")), int(m.group("d1") or m.group("d2"))
    if not 0 < n < d:
        return None  # 2\frac{4}{3} is read as a product, not a mixed number
    return rf"{m.group('sign')}\frac{{{int(m.group('whole')) * d + n}}}{{{d}}}"


def ratio_parts(s: str) -> list[str] | None:
    """``15:4`` / ``2 : 3 : 4`` (``\\colon`` already aliased) -> its parts, else None.

    Every part must be a number or a short expression: no relations, no set braces, no words
    (``\\{x : x > 0\\}`` is no ratio; ``\\frac`` and ``\\sqrt`` are allowed).
    """
    if ":" not in s or any(c in s for c in "=<>|") or s.startswith("\\{"):
        return None
    parts = [p.strip() for p in s.split(":")]
    words = [re.sub(r"\\(?:frac|sqrt)", "", p) for p in parts]
    if not all(parts) or any(re.search(r"[a-zA-Z]{2,}", w) for w in words):
        return None
    return parts


# --- plus-minus shorthand ----------------------------------------------------------------------

_PM = re.compile(r"\\(pm|mp)(?![a-zA-Z])")
_MAX_PM = 3  # 2**3 expansions at most


def expand_pm(s: str) -> list[str] | None:
    """``(\\pm 1, 2)`` -> ``["(1, 2)", "(-1, 2)"]``: the answers a ``\\pm`` shorthand stands for.

    Several ``\\pm`` choose their signs independently (``(\\pm 1, \\pm 2)``: four points); with a
    ``\\mp`` present all signs are tied, ``\\mp`` taking the opposite one (``a \\pm b \\mp c``: two).
    """
    signs = _PM.findall(s)
    if not signs or len(signs) > _MAX_PM:
        return None
    pieces = _PM.split(s)[::2]
    tied = "mp" in signs
    choices = [(c,) * len(signs) for c in "+-"] if tied else itertools.product("+-", repeat=len(signs))
    out = []
    for choice in choices:
        text = pieces[0]
        for sign, kind, piece in zip(choice, signs, pieces[1:], strict=True):
            if kind == "mp":
                sign = "-" if sign == "+" else "+"
            text += sign + piece.lstrip()
        out.append(re.sub(r"([(\[,=]\s*)\+", r"\1", text.strip()).lstrip("+"))
    return out


# --- top-level splitting, labels -----------------------------------------------------------------

_OPENERS, _CLOSERS = "([{", ")]}"


def split_top(s: str, seps: tuple[str, ...]) -> list[str]:
    """Split ``s`` at separators outside any brackets (``(2,5]`` counts as one bracketed group)."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        ch = s[i]
        if s.startswith("\\langle", i) or s.startswith("\\begin", i):
            depth += 1
        elif s.startswith("\\rangle", i) or s.startswith("\\end", i):
            depth -= 1
        elif ch in _OPENERS:
            depth += 1
        elif ch in _CLOSERS:
            depth -= 1
        elif depth == 0:
            sep = next((sep for sep in seps if s.startswith(sep, i)), None)
            if sep is not None:
                parts.append(s[start:i].strip())
                start = i = i + len(sep)
                continue
        i += 1
    parts.append(s[start:].strip())
    return parts


_LABEL = re.compile(
    r"(?:[a-zA-Z]|\\[a-zA-Z]+|[A-Z][a-zA-Z]+)(?:_\{?[\w\\ ,]+\}?|_\w)?(?:\^\{?-1\}?)?'*(?:\s*\([^()=]*\))?"
)


def split_label(item: str) -> tuple[str, str] | None:
    """``p = 4`` / ``k_{min} = 2n+1`` / ``g(t) = 3t`` / ``Area = 24`` -> (label, value), else None."""
    parts = split_top(item, ("=",))
    if len(parts) != 2 or not _LABEL.fullmatch(parts[0].strip()) or not parts[1]:
        return None
    return parts[0].replace(" ", ""), parts[1]


# --- structures ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scalar:
    """One expression in LaTeX; ``unit`` is the unit word written after it (``""`` if none)."""

    tex: str
    unit: str = ""


@dataclass(frozen=True)
class Seq:
    """Several values.  ``kind``: ``tuple`` (ordered), ``list`` (bare comma list: unordered, but in
    order against labels or a tuple), ``set`` (unordered), ``ratio`` (equal up to a common factor) or
    ``matrix`` (rows, each a ``tuple``; only a matrix of the same shape equals it)."""

    kind: str
    items: tuple


@dataclass(frozen=True)
class Labelled:
    """``p=4, q=9``: values with their labels, in the order written."""

    labels: tuple[str, ...]
    values: tuple


@dataclass(frozen=True)
class RealSet:
    """A subset of the reals (``sympy.Set``) from interval, inequality or set-builder notation."""

    value: object


_MATRIX = re.compile(
    r"^\(?\s*\\begin\{([pbvBV]?matrix|array)\}(?:\{[lcr| ]*\})?(.*)\\end\{\1\}\s*\)?(?P<t>\^\{?T\}?)?$", re.S)
_LIST_SEPS = (",", ";", " and ", " or ", "\\text{ and }")


def _is_wrapped(s: str, left: str, right: str) -> bool:
    """True iff ``s`` is one group ``left .. right`` (the opening bracket closes only at the end)."""
    if not (s.startswith(left) and s.endswith(right)):
        return False
    inner = s[len(left):-len(right)]
    return len(split_top(inner + "\x00", ("\x00",))) == 2 and _balanced(inner)


def _balanced(s: str) -> bool:
    """Brackets never close below depth 0 in ``s``."""
    depth = 0
    for ch in s:
        depth += ch in _OPENERS
        depth -= ch in _CLOSERS
        if depth < 0:
            return False
    return depth == 0


def scalar(s: str, from_text: bool) -> Scalar:
    """One value, its written form (percent, degrees, mixed number, ratio, units) made plain LaTeX."""
    s = s.strip()
    for rewrite in (percent_to_fraction, degrees_to_radians, mixed_number):
        out = rewrite(s)
        if out is not None:
            return Scalar(out)
    quantity = split_quantity(s, from_text)
    if quantity is not None:
        num, unit = quantity
        inner = scalar(num, from_text)
        currency = "dollar" if re.match(r"^\s*\\?\$", s) else ""
        return Scalar(inner.tex, normalize_unit(unit) if unit else currency)
    return Scalar(s)


def structure(s: str, from_text: bool = False, depth: int = 0) -> object | None:
    """The ``Scalar``/``Seq``/``Labelled`` a cleaned answer spells, or None if unreadable."""
    s = s.strip()
    if not s or depth > 4:
        return None
    m = _MATRIX.match(s)
    if m:
        rows = [[c.strip() for c in row.split("&")] for row in m.group(2).split("\\\\") if row.strip()]
        cells = [[structure(c, from_text, depth + 1) for c in row] for row in rows]
        if len(rows) > 1 and len(rows[0]) > 1 and not m.group("t"):  # a matrix keeps its shape
            return Seq("matrix", tuple(Seq("tuple", tuple(row)) for row in cells))
        return Seq("tuple", tuple(c for row in cells for c in row))  # a vector: row or column
    if _is_wrapped(s, "\\langle", "\\rangle"):
        return Seq("tuple", tuple(structure(c, from_text, depth + 1) for c in split_top(s[7:-7], (",",))))
    if _is_wrapped(s, "\\{", "\\}") and "|" not in s and "\\mid" not in s and ":" not in s:
        return Seq("set", tuple(structure(c, from_text, depth + 1) for c in split_top(s[2:-2], _LIST_SEPS)))
    if split_quantity(s, from_text) is not None:  # before splitting at the commas of $1,234.50
        return scalar(s, from_text)
    items = split_top(s, _LIST_SEPS)
    if len(items) > 1:
        return _list(items, from_text, depth)
    if _is_wrapped(s, "(", ")") and len(split_top(s[1:-1], (",",))) > 1:
        return Seq("tuple", tuple(structure(c, from_text, depth + 1) for c in split_top(s[1:-1], (",",))))
    labelled = split_label(s)
    if labelled is not None:
        return Labelled((labelled[0],), (structure(labelled[1], from_text, depth + 1),))
    parts = ratio_parts(s)
    if parts is not None:
        if len(parts) == 2:
            return Scalar(rf"\frac{{{parts[0]}}}{{{parts[1]}}}")
        return Seq("ratio", tuple(Scalar(p) for p in parts))
    return scalar(s, from_text)


def _list(items: list[str], from_text: bool, depth: int) -> object | None:
    """Several items: all labelled -> ``Labelled`` (one label repeated -> a set), none -> a list."""
    labelled = [split_label(item) for item in items]
    if all(labelled):
        labels = [lab for lab, _ in labelled]
        values = tuple(structure(v, from_text, depth + 1) for _, v in labelled)
        if len(set(labels)) == 1:
            return Seq("set", values)
        return Labelled(tuple(labels), values)
    if any(labelled):
        return None
    return Seq("list", tuple(structure(i, from_text, depth + 1) for i in items))


def mentions_text(s: str) -> bool:
    """The answer wraps words in ``\\text{}`` (or a font command): labels and units may be words."""
    return bool(_TEXT.search(s))
