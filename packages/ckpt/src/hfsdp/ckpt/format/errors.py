"""The one exception every checkpoint operation raises.

A checkpoint problem is almost never a bug in the caller's code: a file was cut
short by a full disk, a copy flipped a bit, a directory holds another model. So
the message, not a traceback, is the interface: one paragraph that names the
file, says what is wrong with it and what to do. The CLI prints it and exits.

Messages quote names read from the checkpoint's own files, so the text is made
printable here, once: an escape sequence in a tensor name shows as `\\x1b`
instead of reaching the terminal, and a line break cannot split the paragraph.
"""

from __future__ import annotations

from hfsdp.ckpt.format.text import printable


class CheckpointError(Exception):
    """A checkpoint cannot be read, written or converted; `str(err)` says which file, why, and what to do."""

    def __init__(self, message: str):
        message = printable(message)
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message
