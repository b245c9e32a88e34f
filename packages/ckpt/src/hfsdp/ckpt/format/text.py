"""Text that came from a file, made safe to print on a terminal.

A tensor name, a key or a path read from a checkpoint is data, not text we
wrote: it may hold escape sequences that move the cursor or recolour the
terminal, or line breaks that forge a second line of output. Everything hfsdp
prints from a file goes through `printable`, which leaves printable characters
alone and writes every other one as a Python escape (\\x1b, \\n, \\u202e).
"""

from __future__ import annotations


def printable(text: str) -> str:
    """`text` with every non-printable character (controls, line breaks, format and unassigned code points, lone
    surrogates) written as a backslash escape."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
