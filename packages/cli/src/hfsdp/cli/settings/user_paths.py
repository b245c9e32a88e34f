"""The one place a user's path meets the operating system's refusals: what no file system would open, and the
`OSError` a path raised anyway, both turned into one paragraph naming the flag (or config key) and the path.

A path the kernel refuses outright (a NUL byte, a component over 255 bytes, over 4,095 bytes in all, text that
cannot be encoded as a file name) used to surface wherever a command first touched it (`Path.is_file`, `os.stat`,
`tempfile`) as `OSError: [Errno 36] File name too long` or `ValueError: embedded null byte`, with a traceback. These
refusals are the same on every machine (Linux's NAME_MAX and PATH_MAX, which every common file system keeps), so
they are checked from the text alone, before a command runs (`main.py` for every command's flags and arguments, the
`path` rule of the settings table for a config file's values). `blame` is the boundary behind that check: an
`OSError` that still escapes a command, about a path the user gave, is reported the same way (exit 2) instead of
as a traceback. Imports nothing heavy: `validate-config` and `--help` load it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from hfsdp.cli.settings.report import shown

#: The longest file name (one path component) and whole path, in bytes, Linux file systems take (NAME_MAX and
#: PATH_MAX less its terminating NUL).
NAME_MAX, PATH_MAX = 255, 4095


def refusal(value: str) -> str | None:
    """Why no file system would open `value`, finishing "the operating system refuses this path: ..."; None when
    the text alone gives no reason."""
    if "\0" in value:
        return "it holds a NUL byte (\\x00), which no path can contain"
    try:
        raw = os.fsencode(value)
    except UnicodeError:
        return f"it cannot be written as a file name in {sys.getfilesystemencoding()} (a lone surrogate?)"
    if len(raw) > PATH_MAX:
        return f"it is {len(raw):,} bytes long, over the {PATH_MAX:,} bytes a path may have"
    longest = max(len(part) for part in raw.split(b"/"))
    if longest > NAME_MAX:
        return (
            f"one of its names is {longest:,} bytes long, over the {NAME_MAX} bytes a file or directory name may have"
        )
    return None


def refused(name: str, value: str, reason: str) -> str:
    """The paragraph for a path the OS refuses, under the flag or key `name` that gave it."""
    return f"{name} {shown(value)}: the operating system refuses this path: {reason}; give a path it can open."


def first_refused(given: Iterable[tuple[str, str]]) -> str | None:
    """The paragraph for the first of `given` (flag or key, path) the OS refuses, or None."""
    for name, value in given:
        reason = refusal(value)
        if reason is not None:
            return refused(name, value, reason)
    return None


def blame(err: BaseException, given: list[tuple[str, str]]) -> str | None:
    """The paragraph for `err` when it is the OS refusing one of `given` (flag or key, path), else None.

    An `OSError` names the path it was about (`filename`, `filename2`): it belongs to the user's path when it is that
    path, lies under it (a file in `--save`) or above it (the parent of `--metrics`). Python's `ValueError` for a NUL
    byte names no path: it is the user's path that holds one.
    """
    if isinstance(err, ValueError) and "null byte" in str(err):
        found = next(((name, value) for name, value in given if "\0" in value), None)
        return refused(*found, "it holds a NUL byte (\\x00), which no path can contain") if found else None
    if not isinstance(err, OSError):
        return None
    for about in (err.filename, err.filename2):
        if not isinstance(about, str | bytes | os.PathLike):
            continue
        about = os.fsdecode(about)
        for name, value in given:
            if _related(about, value):
                what = err.strerror or type(err).__name__
                where = "" if about == value else f" (at {shown(about)})"
                return f"{name} {shown(value)}: {what}{where}; check the path and its permissions, or choose another."
    return None


def _related(a: str, b: str) -> bool:
    """Whether one path is the other or lies under it, as text (no file system is asked)."""
    a, b = os.path.normpath(a), os.path.normpath(b)
    shorter, longer = sorted((a, b), key=len)
    return longer == shorter or longer.startswith(shorter.rstrip(os.sep) + os.sep)
