"""Write aside, then publish: the hidden directories results are written in, and what killed runs leave.

Every result (a saved step, a reshard, an export) is written into a hidden
`.tmp-<label>-<8 hex digits>/` next to its final path, fsynced, and renamed
into place in one step; on a failure the hidden directory is removed, so no
half-written result is ever visible under the final name, and a reshard or
export refuses a destination inside its source (or the reverse), so it never
writes into the checkpoint it reads (`check_apart`).

A run that is killed cannot remove its hidden directory. The next run of the
same kind into the same place does (`clean_stale`): it removes only entries
whose names hfsdp gives its own staging there (for a reshard into DST,
`.tmp-reshard-<DST's name>-<8 hex digits>`), and of those only the ones no
live process holds. A writer holds an exclusive flock(2) on its staging
directory while it writes, so one whose lock can be taken belongs to a dead
run. Where the file system has no flock, the kind and destination alone
decide, as a second concurrent run into one destination is not supported.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.store import TMP_PREFIX, fsync_dir

NONCE_HEX = 8


class Staging:
    """A hidden directory being written, locked (flock on an open descriptor) for as long as its writer lives."""

    def __init__(self, path: Path, lock_fd: int | None):
        self.path, self._lock_fd = path, lock_fd

    @classmethod
    def create(cls, parent: Path, label: str) -> Staging:
        """A fresh `parent/.tmp-{label}-{nonce}`, locked; OSError when it cannot be made."""
        parent.mkdir(parents=True, exist_ok=True)
        path = parent / f"{TMP_PREFIX}{label}-{secrets.token_hex(NONCE_HEX // 2)}"
        path.mkdir()
        return cls(path, _lock(path))

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the lock
            self._lock_fd = None


def staging_pattern(label_regex: str) -> re.Pattern:
    """The names of hfsdp's staging entries whose label matches `label_regex` (a regular expression)."""
    return re.compile(rf"{re.escape(TMP_PREFIX)}{label_regex}-[0-9a-f]{{{NONCE_HEX}}}")


def clean_stale(parent: Path, pattern: re.Pattern) -> list[Path]:
    """Remove the entries of `parent` whose whole name matches `pattern` and that no live writer holds."""
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return []
    removed = []
    for entry in entries:
        if not pattern.fullmatch(entry.name):
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            if not _is_stale(path):
                continue
            remove_quietly(path)
        elif entry.is_file(follow_symlinks=False):  # a temporary `latest` of a killed save
            path.unlink(missing_ok=True)
        else:
            continue
        removed.append(path)
    return removed


def _lock(path: Path) -> int | None:
    """An open descriptor of directory `path` holding an exclusive flock; None where there is no flock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _is_stale(path: Path) -> bool:
    """Whether no live writer holds the staging directory `path` (True where the file system has no flock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False  # gone meanwhile, or not a plain directory
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


@contextmanager
def staged_dir(final: Path, kind: str):
    """A hidden directory next to `final` to write into: renamed to `final` when the block succeeds, removed
    when it fails, so no half-written result is ever left (an OSError names `final`). Stale staging of the
    same kind for `final` left by a killed run is removed first."""
    label = f"{kind}-{final.name[:100]}"
    clean_stale(final.parent, staging_pattern(re.escape(label)))
    try:
        stage = Staging.create(final.parent, label)
    except OSError as err:
        raise write_failed(final, err) from None
    try:
        yield stage.path
        publish_dir(stage.path, final)
    except OSError as err:
        remove_quietly(stage.path)
        raise write_failed(final, err) from None
    except BaseException:
        remove_quietly(stage.path)
        raise
    finally:
        stage.release()


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` directory to `final` (which must not exist, or be an empty directory: the rename
    replaces it atomically, and fails if anything was put there meanwhile) and make the rename durable."""
    fsync_dir(tmp)
    if os.path.lexists(final) and not _empty_dir(final):
        raise CheckpointError(
            f"{final} appeared while it was being written; another process writes there. Nothing was overwritten; "
            f"the finished result was removed. Choose another destination."
        )
    os.rename(tmp, final)
    fsync_dir(final.parent)


def write_failed(dst: Path, err: OSError) -> CheckpointError:
    """The error for a file-system failure while writing `dst` (whose hidden directory was removed)."""
    return CheckpointError(
        f"Writing {dst} failed ({err.strerror or err}{f': {err.filename}' if err.filename else ''}); nothing was left "
        "there and the source is unchanged. Check free space and rights, then run again."
    )


def remove_quietly(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def ensure_absent(path: Path, what: str) -> None:
    """Refuse a destination that exists, unless it is an empty directory (not a link): `mkdir out` first is what
    people do, and an empty directory holds nothing to overwrite (the finished result is renamed over it)."""
    if os.path.lexists(path) and not _empty_dir(Path(path)):
        raise CheckpointError(
            f"The destination {path} already exists; {what} never overwrites anything. "
            "Remove it or choose another destination (an empty directory is fine)."
        )


def _empty_dir(path: Path) -> bool:
    try:
        return not path.is_symlink() and path.is_dir() and next(os.scandir(path), None) is None
    except OSError:
        return False


def check_apart(sources: Iterable[Path], dst: Path, what: str) -> None:
    """Refuse a destination that is a source, lies inside one, or contains one (symlinks and `..` resolved)."""
    try:
        target = Path(dst).resolve()
        resolved = [(Path(s), Path(s).resolve()) for s in sources]
    except (OSError, RuntimeError) as err:
        raise CheckpointError(f"Cannot resolve {dst} or its source ({err}); check the paths.") from None
    for given, source in resolved:
        if target == source or source in target.parents:
            where = "is the source" if target == source else "lies inside the source"
            raise CheckpointError(
                f"The destination {dst} {where} {given}; {what} would write into the checkpoint it reads. "
                "Choose a destination outside the source."
            )
        if target in source.parents:
            raise CheckpointError(
                f"The source {given} lies inside the destination {dst}; {what} must not write around the checkpoint "
                "it reads. Choose a destination that does not contain the source."
            )
