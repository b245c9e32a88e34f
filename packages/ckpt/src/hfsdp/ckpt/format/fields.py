"""Checks of single JSON fields read from an untrusted file: each returns the value or raises SchemaError.

The index schema (`schema.py`) is written in these: a field is whole and within bounds, a finite number,
a bounded string, a known dtype, a file name that stays inside the directory, a shape whose element
count fits in int64. Each message names the field by its path in the document.
"""

from __future__ import annotations

import math
from typing import Any

from hfsdp.ckpt.format.dtypes import DTYPES
from hfsdp.ckpt.format.index import UNSHARDED
from hfsdp.ckpt.format.names import plain_name_problem

INT64_MAX = 2**63 - 1
#: Longest tensor name, safetensors key, kind or optimizer type.
MAX_TEXT = 4096
MAX_NDIM = 64


class SchemaError(ValueError):
    """The index is not what the format allows; `str(err)` names the field and the problem.

    `fix` replaces the usual advice (restore or re-save) when there is a better one.
    """

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.fix = fix


def an_object(value: Any, path: str, required: tuple[str, ...] = (), optional: tuple[str, ...] | None = None) -> dict:
    """A JSON object; with `optional` given, exactly the keys `required` (all present) and `optional` (any)."""
    if not isinstance(value, dict):
        raise SchemaError(f"{path} is {kind_of(value)}, where the format has an object")
    missing = [k for k in required if k not in value]
    if missing:
        raise SchemaError(f"{path} lacks the field {missing[0]!r}")
    if optional is not None:
        unknown = sorted(set(value) - set(required) - set(optional))
        if unknown:
            raise SchemaError(f"{path} has the field {unknown[0][:100]!r}, which the format does not define")
    return value


def a_list(value: Any, path: str, length: int | None = None, exact: bool = False) -> list:
    """A JSON list, of exactly `length` items when `exact`, else of at most `length` when given."""
    if not isinstance(value, list):
        raise SchemaError(f"{path} is {kind_of(value)}, where the format has a list")
    if length is not None and (len(value) != length if exact else len(value) > length):
        raise SchemaError(f"{path} has {len(value)} items, where the format has {'' if exact else 'at most '}{length}")
    return value


def whole(value: Any, path: str, maximum: int = INT64_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(f"{path} is {show(value)}, where the format has a whole number")
    if not 0 <= value <= maximum:
        raise SchemaError(f"{path} is {show(value)}, outside 0..{maximum}")
    return value


def finite(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SchemaError(f"{path} is {show(value)}, where the format has a finite number")
    if isinstance(value, int) and abs(value) > INT64_MAX:
        raise SchemaError(f"{path} is {show(value)}, which is out of range")
    return value


def true_or_false(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise SchemaError(f"{path} is {show(value)}, where the format has true or false")
    return value


def text(value: Any, path: str, max_len: int = MAX_TEXT) -> str:
    if not isinstance(value, str):
        raise SchemaError(f"{path} is {kind_of(value)}, where the format has a string")
    if not value or len(value) > max_len:
        raise SchemaError(f"{path} is a string of {len(value)} characters, where the format has 1 to {max_len}")
    return value


def state_kind(value: Any, path: str) -> str:
    """A state kind ("main", "exp_avg"): an identifier, since it prefixes safetensors keys."""
    kind = text(value, path, 64)
    if not kind.isidentifier() or not kind.isascii() or kind == UNSHARDED:
        raise SchemaError(f"{path} names the state kind {kind!r}, which is not a plain identifier (or is reserved)")
    return kind


def dtype(value: Any, path: str) -> str:
    if not isinstance(value, str) or value not in DTYPES:
        raise SchemaError(
            f"{path} is {show(value)}, which is not a dtype hfsdp knows ({', '.join(DTYPES)}); the file was written "
            "by another tool or damaged"
        )
    return value


def file_name(value: Any, path: str) -> str:
    name = text(value, path, 1024)
    problem = plain_name_problem(name)
    if problem:
        raise SchemaError(f"{path} names the file {name!r}, which {problem}; a checkpoint only names its own files")
    return name


def shape(value: Any, path: str) -> tuple[int, ...]:
    """A list of dimensions whose product (the element count) still fits in int64."""
    dims = tuple(whole(d, f"{path}[{i}]") for i, d in enumerate(a_list(value, path, MAX_NDIM)))
    numel = 1
    for d in dims:
        numel *= d
        if numel > INT64_MAX:
            raise SchemaError(f"{path} is {list(dims)}, more elements than int64 can count")
    return dims


def kind_of(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "true/false", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}[
        type(value)
    ]


def show(value: Any) -> str:
    """A short rendering of a bad value for a message (containers by kind: they may be huge)."""
    if isinstance(value, dict | list):
        return kind_of(value)
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
