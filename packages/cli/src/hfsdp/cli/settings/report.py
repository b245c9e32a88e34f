"""How the CLI shows users' values and prints its messages: bounded, printable, one paragraph.

A value quoted in an error comes from the user's file or flags and can be anything:
a megabyte of text, a structure nested thirty deep, a lone UTF-16 surrogate, a terminal
escape sequence. `shown` quotes it in a bounded way and `printable` makes any text safe
to write to a terminal or a log encoded as UTF-8, so reporting a bad input can never
fail in turn.
"""

from __future__ import annotations

import reprlib
import sys

from hfsdp.cli.settings.file_parse import HugeInt

_repr = reprlib.Repr()
_repr.maxlevel = 3
_repr.maxstring = 80
_repr.maxother = 80
_repr.maxlist = _repr.maxdict = _repr.maxtuple = _repr.maxset = 6

_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)] if chr(c) not in "\n\t"}


def shown(value: object) -> str:
    """`value` as a message quotes it: short, as the user wrote it (text in quotes, true/false), saying "the
    text" only where it could be mistaken for what was meant ('8' in quotes is text, not a number)."""
    if isinstance(value, HugeInt):
        return repr(value)
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return str(value).lower()
    text = printable(_repr.repr(value))
    return f"the text {text}" if isinstance(value, str) and _looks_like_a_value(value) else text


def _looks_like_a_value(text: str) -> bool:
    """Whether quoted text reads like a number or a switch, which the user probably meant unquoted."""
    if text.strip().lower() in ("true", "false", "yes", "no", "on", "off", "null", "none"):
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True


def problem_text(field: str, message: str) -> str:
    """One problem as a line says it: its message alone when that starts with the field's name already
    ("--outer is 'optm' ..."), else "field: message"; so no flag is named twice."""
    return message if message.startswith((f"{field} ", f"{field}:")) else f"{field}: {message}"


def printable(text: str) -> str:
    """`text` with control characters and lone surrogates escaped, so printing it cannot fail or garble."""
    return text.translate(_CONTROL).encode("utf-8", "backslashreplace").decode("utf-8")


def say(text: str = "", err: bool = False) -> None:
    """Print one line (stdout, or stderr with err=True) and flush, so logs interleave in order."""
    stream = sys.stderr if err else sys.stdout
    encoding = getattr(stream, "encoding", None) or "utf-8"
    stream.write(printable(text).encode(encoding, "backslashreplace").decode(encoding) + "\n")
    stream.flush()
