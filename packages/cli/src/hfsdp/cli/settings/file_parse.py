"""A config file's bytes to plain data (dicts, lists, scalars), safely: bounded in every direction.

Config files come from anywhere (a CI checkout, a generated sweep, a typo'd path), so
reading one must never crash, hang or eat memory, whatever the bytes. Four bounds do it:
size (`MAX_BYTES`, checked while reading; a FIFO or device is refused before it is opened), nesting
(`MAX_DEPTH`), values after YAML alias expansion (`MAX_VALUES`: a 500-byte "billion
laughs" is refused at once instead of expanding), and digits (`MAX_DIGITS`: Python's
4300-digit guard is lifted for parsing only, so an absurd integer becomes an invalid
*value* the checks can name, `HugeInt`, rather than a syntax error).

YAML is read with PyYAML's safe loader (no arbitrary objects), plus merge keys (`<<:`),
YAML 1.2 floats (`1e-4` is a number, not text) and an error for a key written twice.
Everything that stops a file from being read raises `ParseError`; the caller names the file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
import tomllib
from collections.abc import Hashable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_VALUES = 100_000
MAX_DIGITS = 100_000
#: Integers beyond 64 bits are no setting's value; they are kept as `HugeInt` so checks can say so.
INT_BITS = 64
FORMATS = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML", ".json": "JSON"}
_MERGE = "tag:yaml.org,2002:merge"
TOO_DEEP = f"it nests more than {MAX_DEPTH} levels deep; a config is sections of key: value pairs."


class ParseError(Exception):
    """The bytes cannot be read as a config; `reason` finishes the sentence "Cannot read FILE: ..."."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class HugeInt:
    """An integer literal wider than 64 bits, kept by size only: no setting can take it."""

    digits: int
    negative: bool = False

    def __repr__(self) -> str:
        return f"a {self.digits}-digit integer"


def read_bounded(path: Path) -> bytes:
    """At most MAX_BYTES of `path`; ParseError when there is more, or when it is no regular file (opening a FIFO
    blocks until someone writes to it; a device never ends). OSError propagates to the caller."""
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not stat.S_ISREG(mode):
        raise ParseError("it is not a regular file (a FIFO, device or socket); give the path of a config file.")
    with open(path, "rb") as f:
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise ParseError(
            f"it is larger than {MAX_BYTES // (1 << 20)} MiB, the most hfsdp reads; a config is a few hundred "
            "bytes, so check that this is the right file."
        )
    return raw


def parse(raw: bytes, suffix: str) -> Any:
    """Parse `raw` as the format `suffix` names and return plain data, or raise ParseError."""
    kind = FORMATS[suffix.lower()]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ParseError(
            f"it is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); save it as UTF-8."
        ) from None
    if match := re.search(rf"\d{{{MAX_DIGITS + 1}}}", text):
        raise ParseError(
            f"it holds a run of more than {MAX_DIGITS} digits at offset {match.start()}; no setting takes such a "
            "number, so fix or remove it."
        )
    try:
        with _digits_unlimited():
            if kind == "TOML":
                data = tomllib.loads(text)
            elif kind == "JSON":
                data = json.loads(text, object_pairs_hook=_unique_json_object)
            else:
                data = yaml.load(text, Loader=BoundedLoader)  # a SafeLoader subclass: no arbitrary objects
            return _plain(data)
    except ParseError:
        raise
    except RecursionError:
        raise ParseError(TOO_DEEP) from None
    except yaml.MarkedYAMLError as err:
        raise ParseError(f"it is not valid YAML ({_yaml_detail(err)}); fix the syntax and run again.") from None
    except Exception as err:  # untrusted input: every parser failure is a message, never a traceback
        detail = " ".join(str(err).split())[:300] or type(err).__name__
        raise ParseError(f"it is not valid {kind} ({detail}); fix the syntax and run again.") from None


@contextmanager
def _digits_unlimited():
    """Lift Python's guard on long integer literals while parsing; `parse` has bounded them already."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(before)


def _plain(data: Any) -> Any:
    """`data` with integers wider than 64 bits (values and keys) replaced by HugeInt; bounds depth and size.

    Iterative and memoised by identity, so neither deep nesting nor shared (aliased) values cost more than
    the bounds allow.
    """
    memo: dict[int, Any] = {}
    count = 0

    def leaf(x: Any) -> Any:
        if type(x) is int and x.bit_length() >= INT_BITS:
            return HugeInt(len(str(abs(x))), x < 0)  # str() is fine here: the digit guard is lifted
        return x

    def visit(x: Any, depth: int) -> Any:
        nonlocal count
        count += 1
        if count > MAX_VALUES:
            raise ParseError(f"it holds more than {MAX_VALUES} values; a config holds a few dozen.")
        if depth > MAX_DEPTH:
            raise ParseError(TOO_DEEP)
        if isinstance(x, dict | list):
            if id(x) not in memo:
                memo[id(x)] = {} if isinstance(x, dict) else []
                stack.append((x, memo[id(x)], depth))
            return memo[id(x)]
        return leaf(x)

    stack: list[tuple[Any, Any, int]] = []
    root = visit(data, 0)
    while stack:
        source, target, depth = stack.pop()
        if isinstance(source, dict):
            for key, value in source.items():
                target[leaf(key)] = visit(value, depth + 1)
        else:
            target.extend(visit(value, depth + 1) for value in source)
    return root


def _yaml_detail(err: yaml.MarkedYAMLError) -> str:
    """PyYAML's message without its multi-line source excerpt: 'expected ..., line 2, column 1'."""
    mark = err.problem_mark or err.context_mark
    where = f" at {_where(mark)}" if mark else ""
    return f"{err.problem or err.context}{where}"


def _where(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with bounds on depth and alias expansion, and an error for a repeated key.

    The composer computes each node's size with aliases expanded, bottom-up, so a bomb is refused as
    soon as one node would stand for more than MAX_VALUES values, before anything is constructed.
    """

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._sizes: dict[int, int] = {}

    def compose_node(self, parent, index):
        if self.check_event(AliasEvent):
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)
            if id(node) not in self._sizes:
                raise ParseError(f"an alias at {_where(mark)} refers to a node that contains it (a cycle); remove it.")
            return node
        mark = self.peek_event().start_mark
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise ParseError(f"{TOO_DEEP[:-1]} (at {_where(mark)}).")
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, SequenceNode):
            children = node.value
        elif isinstance(node, MappingNode):
            children = [n for pair in node.value for n in pair]
            self._check_unique_keys(node)
        else:
            children = []
        size = 1 + sum(self._sizes[id(c)] for c in children)
        if size > MAX_VALUES:
            raise ParseError(
                f"its aliases expand to more than {MAX_VALUES} values at {_where(mark)} (an 'alias bomb'); "
                "a config holds a few dozen, so write the values out."
            )
        self._sizes[id(node)] = size
        return node

    @staticmethod
    def _check_unique_keys(node: MappingNode) -> None:
        """A key written twice is an error, not a silent overwrite; keys merged in with `<<:` may be overridden."""
        seen: set[tuple[str, Hashable]] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == _MERGE:
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                message = f"the key '{key_node.value}' appears a second time"
                raise ComposerError(None, None, message, key_node.start_mark)
            seen.add(key)


# YAML 1.2 floats: PyYAML (YAML 1.1) reads `1e-4` and `3e5` (no dot) as text.
BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key '{key}' appears twice; keep one of them")
        out[key] = value
    return out
