"""What `prepare` refuses: one paragraph each, naming the file (and line) or the setting, and saying what to do.

Two kinds, because a command exits differently for them: the data or a setting is wrong (`PrepareError`,
the user edits the corpus or the flag), or a path cannot be used at all (`PathError`: missing, unreadable,
not a regular file, taken). Neither ever leaves a half-written output behind.
"""

from __future__ import annotations


class PrepareError(Exception):
    """The corpus, the tokenizer or a setting is refused; nothing was written."""


class PathError(PrepareError):
    """An input, the tokenizer or the output is a path that cannot be used; nothing was written."""
