"""Typed field checks for JSON read from disk: each takes (value, where) and returns the value in its
Python form (lists become tuples, dicts become dataclasses) or raises FieldError, one line naming the
field, e.g. ``target.head_dim must be a positive integer, got "x"``.

Small combinators so that a record's validation is a table, one line per field (see
``MODEL_FIELDS`` in manifest.py). No numpy, no onnxruntime: pure Python.
"""

from __future__ import annotations

import json
import re


class FieldError(ValueError):
    """A field of a file read from disk has the wrong type or is out of range."""


def shown(value) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def fail(where: str, wanted: str, value):
    raise FieldError(f"{where} must be {wanted}, got {shown(value)}")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value, where):
    return value if is_int(value) and value > 0 else fail(where, "a positive integer", value)


def int_in(low: int, high: int):
    def check(value, where):
        return value if is_int(value) and low <= value <= high else fail(where, f"an integer in {low}..{high}", value)
    return check


def token_id(value, where):
    return value if is_int(value) and value >= 0 else fail(where, "a token id (an integer >= 0)", value)


def text(value, where):
    return value if isinstance(value, str) and value else fail(where, "a non-empty string", value)


def relative_path(value, where):
    """A path string; whether it stays inside the bundle is checked where it is opened (bundle.inside)."""
    return value if isinstance(value, str) and value else fail(where, "a path relative to the bundle", value)


def one_of(choices):
    def check(value, where):
        return value if isinstance(value, str) and value in choices else fail(where, f"one of {', '.join(choices)}", value)
    return check


def optional(check):
    def optional_check(value, where):
        return None if value is None else check(value, where)
    return optional_check


def tuple_of(check):
    def tuple_check(value, where):
        if not isinstance(value, (list, tuple)):
            fail(where, "a list", value)
        return tuple(check(item, f"{where}[{index}]") for index, item in enumerate(value))
    return tuple_check


def dimension(value, where):
    if (is_int(value) and value > 0) or (isinstance(value, str) and value):
        return value
    return fail(where, "a positive integer or a dimension name", value)


def record(cls, checks: dict):
    """A check building ``cls`` from a dict (or passing a ``cls`` through) whose every key is checked."""
    def check(value, where):
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            fail(where, "an object", value)
        unknown = sorted(set(value) - set(checks))
        if unknown:
            raise FieldError(f"{where} has unknown fields {unknown}")
        missing = [name for name in checks if name not in value]
        if missing:
            raise FieldError(f"{where}.{missing[0]} is missing")
        return cls(**{name: checks[name](value[name], f"{where}.{name}") for name in checks})
    return check


def sha256_hex(value, where):
    if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value):
        return value
    return fail(where, "a sha256 (64 lower-case hex digits)", value)


def mapping(key_check, value_check):
    def check(value, where):
        if not isinstance(value, dict):
            fail(where, "an object", value)
        return {key_check(k, f"{where} key"): value_check(v, f"{where}[{shown(k)}]") for k, v in value.items()}
    return check


def anything(value, where):
    return value
