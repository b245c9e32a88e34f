"""Names read from a checkpoint must stay inside its directory.

The index names the files that hold the pieces and the RNG states, and
`latest` names a step directory. Both are data from disk: a name such as
`../other/rank-00000.safetensors` or an absolute path, or a file replaced by a
symlink, would make a reader open (and a reshard copy) something outside the
checkpoint. So every such name must be a plain name, one path component of
printable characters, and what it names must be a regular file (or, for a
step, a directory) of its own, not a symlink. `plain_name_problem` is the one
check of a name; `entry_kind` the one look at what a name points to.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hfsdp.ckpt.format.errors import CheckpointError

MAX_NAME_BYTES = 255  # what Linux file systems allow for one path component


def plain_name_problem(name: str) -> str | None:
    """Why `name` is not a plain name of a file inside a directory, or None when it is one."""
    if not name:
        return "is empty"
    if name in (".", ".."):
        return "names a directory, not a file inside the checkpoint"
    if "/" in name or "\\" in name or "\0" in name:
        return "contains a path separator, so it would leave its directory"
    if not name.isprintable():
        return "contains non-printable characters"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"is longer than {MAX_NAME_BYTES} bytes"
    return None


def entry_kind(path: Path) -> str | None:
    """'file', 'dir', 'symlink' or 'other' for what `path` itself is (links not followed); None if nothing."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as err:
        raise CheckpointError(f"Cannot look at {path} ({err.strerror or err}); check the path and rights.") from None
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISREG(mode):
        return "file"
    return "dir" if stat.S_ISDIR(mode) else "other"


def refuse_link(path: Path, kind: str | None, what: str) -> None:
    """Raise when `path` (of `entry_kind` `kind`) exists but is not a plain regular file."""
    if kind == "symlink":
        raise CheckpointError(
            f"{path} is a symbolic link; a checkpoint's {what} must be a regular file inside its directory, since a "
            "link could point anywhere. Replace the link by a copy of the file it points to, or restore the checkpoint."
        )
    if kind not in (None, "file"):
        raise CheckpointError(
            f"{path} is not a regular file, but a checkpoint's {what} must be one. Restore the checkpoint from a copy."
        )
