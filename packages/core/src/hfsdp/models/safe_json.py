"""JSON from an untrusted file, parsed within bounds.

Python's json module accepts things a checkpoint must never hold, and fails on
others with exceptions no reader expects: the constants NaN and Infinity,
numbers like 1e999 that become inf, integers too long to convert (ValueError
past 4300 digits), nesting deep enough to raise RecursionError, duplicate keys
that silently keep the last value, and lone surrogates that break printing and
file names later. `loads` refuses every one of them with one exception,
JsonError, whose message says what was wrong. Callers bound the size before
they read the bytes.
"""

from __future__ import annotations

import json
import math
from typing import Any


class JsonError(ValueError):
    """The bytes are not JSON that hfsdp accepts; the message says why."""


def loads(raw: bytes, max_depth: int) -> Any:
    """Parse UTF-8 JSON `raw` nested at most `max_depth` levels, with finite numbers and unique keys only."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise JsonError(f"it is not UTF-8 text ({err.reason} at byte {err.start})") from None
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite, object_pairs_hook=_unique)
    except JsonError:
        raise
    except RecursionError:
        raise JsonError("it is nested too deeply to parse") from None
    except ValueError as err:  # json.JSONDecodeError, and integers past Python's digit limit
        raise JsonError(f"it is not valid JSON ({err})") from None
    _check_nesting(value, max_depth)
    return value


def _no_constant(name: str):
    raise JsonError(f"it holds the non-finite number {name}, which JSON does not allow")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonError(f"it holds the number {text[:40]}, which is out of range (a float must be finite)")
    return value


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JsonError(f"it holds the key {key[:100]!r} twice in one object")
        out[key] = value
    return out


def _check_nesting(value: Any, max_depth: int) -> None:
    """Refuse nesting beyond `max_depth` and strings that are not valid Unicode (lone surrogates), iteratively."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > max_depth:
            raise JsonError(f"it is nested deeper than {max_depth} levels")
        if isinstance(item, dict):
            for key, child in item.items():
                _check_text(key)
                stack.append((child, depth + 1))
        else:
            stack.extend((child, depth + 1) for child in item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise JsonError(f"it holds the string {text[:100]!r}, which is not valid Unicode (a lone surrogate)") from None
