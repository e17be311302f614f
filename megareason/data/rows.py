"""The checks every loader applies to one JSON row, with one wording.

Each error names where the row is (``where``: the file and row, e.g. ``data.jsonl row 3``, plus the
sub-object such as ``paragraphs[2]``), the field, what was expected and what was found:
``<where>: missing field 'answer'; expected text or a number`` or ``<where>: field 'idx' must be an
integer, got "5"``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from megareason.data.records import DataError

# What a field may hold: its description (the error's "expected ...") -> the test of a value.
EXPECTED: dict[str, Callable[[Any], bool]] = {
    "a string": lambda v: isinstance(v, str),
    "non-empty text": lambda v: isinstance(v, str) and bool(v.strip()),
    "text or a number": lambda v: (isinstance(v, str) and bool(v.strip()))
    or (isinstance(v, int | float) and not isinstance(v, bool)),
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),  # JSON true is not an integer
    "true or false": lambda v: isinstance(v, bool),
    "an object": lambda v: isinstance(v, dict),
    "a non-empty list": lambda v: isinstance(v, list) and bool(v),
    "a list of strings": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
}
_REQUIRED = object()


def shown(value: Any) -> str:
    """A value as an error message quotes it: its JSON, cut to 80 characters."""
    return json.dumps(value, default=repr)[:80]


def json_object(value: Any, where: str) -> dict:
    """``value`` when it is an object (a row must be one), else a ``DataError``."""
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def check(value: Any, name: str, where: str, expected: str) -> Any:
    """``value`` (field ``name``) when it is what ``expected`` (a key of ``EXPECTED``) describes."""
    if not EXPECTED[expected](value):
        raise DataError(f"{where}: field '{name}' must be {expected}, got {shown(value)}")
    return value


def field(row: dict, name: str, where: str, expected: str, default: Any = _REQUIRED) -> Any:
    """``row[name]``, checked by ``check``; ``name`` may be dotted (``reward_model.ground_truth``). An
    absent field is ``default`` when given, else a ``DataError``."""
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            if default is not _REQUIRED:
                return default
            raise DataError(f"{where}: missing field '{name}'; expected {expected}")
        value = value[part]
    return check(value, name, where, expected)
