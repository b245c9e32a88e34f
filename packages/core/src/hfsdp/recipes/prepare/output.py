"""The files an output prefix names, written aside and renamed into place, or not at all.

`PREFIX.bin`, `PREFIX.idx` and the sidecar `PREFIX.meta.json`, with `--validation-fraction` also the held-out
`PREFIX_val.bin` and `PREFIX_val.idx`. They are written in a hidden directory beside them
(`.NAME.prepare-<8 hex digits>/`), fsynced, and renamed into place one by one with SIGINT and SIGTERM held back,
the sidecar last; on any failure, Ctrl-C included, the hidden directory is removed, so the prefix shows the old
files or the new ones, never part of a run. A run killed outright (SIGKILL) cannot remove its hidden directory:
the next run into the same prefix does, once no live process holds it (the writer holds an flock on its lock file).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import stat
from pathlib import Path

from hfsdp.recipes.prepare.errors import PathError
from hfsdp.recipes.prepare.signals import held
from hfsdp.recipes.prepare.sources import Source, same_file

SUFFIXES = (".bin", ".idx")
SIDECAR = ".meta.json"
VALIDATION = "_val"
LOCK = ".lock"


def validation_prefix(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + VALIDATION)


def names(prefix: Path) -> list[str]:
    """Every file name a prefix may hold, in the order they are published (the sidecar last)."""
    val = validation_prefix(prefix).name
    return [val + s for s in SUFFIXES] + [prefix.name + s for s in SUFFIXES] + [prefix.name + SIDECAR]


def check(prefix_text: str, overwrite: bool, sources: list[Source]) -> Path:
    """The output prefix as a Path, or PathError: a directory, a taken name (without --overwrite), an input."""
    prefix = Path(prefix_text)
    if prefix_text.endswith(("/", os.sep)) or prefix.is_dir():
        raise PathError(
            f"--output {prefix_text} is a directory; give a prefix in it, e.g. --output {prefix / 'corpus'} writes "
            f"{prefix / 'corpus.bin'} and {prefix / 'corpus.idx'}."
        )
    if prefix.suffix in SUFFIXES:
        raise PathError(
            f"--output {prefix_text} ends in {prefix.suffix}; give the prefix alone (--output "
            f"{prefix.with_suffix('')}), to which .bin and .idx are added."
        )
    parent = prefix.parent
    if parent.exists() and not parent.is_dir():
        raise PathError(f"--output {prefix_text}: {parent} is a file, not a directory; choose another --output.")
    taken = []
    for name in names(prefix):
        path = parent / name
        if any(same_file(path, s.path) for s in sources):
            raise PathError(f"--output {prefix_text} would write {path}, which is an input; choose another --output.")
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            continue
        except OSError as err:
            raise PathError(f"--output {prefix_text}: {path} cannot be checked ({err.strerror or err}).") from None
        if not stat.S_ISREG(mode):
            raise PathError(
                f"--output {prefix_text}: {path} exists and is not a regular file (a directory, a link, a FIFO or a "
                "device); prepare writes and replaces only regular files. Remove it or choose another --output."
            )
        taken.append(str(path))
    if taken and not overwrite:
        raise PathError(
            f"--output {prefix_text}: {', '.join(taken)} already exist; prepare replaces a dataset only with "
            "--overwrite. Remove them, choose another --output, or pass --overwrite."
        )
    return prefix


class Staged:
    """The hidden directory a run writes its files in; `publish()` renames them into place."""

    def __init__(self, prefix: Path):
        self.prefix = prefix
        self.parent = prefix.parent
        self.pattern = f".{prefix.name}.prepare-"
        self.path = self.parent / f"{self.pattern}{secrets.token_hex(4)}"
        self._lock = None
        self._made: list[Path] = []  # the directories of --output this run created: removed again on failure

    def file(self, name: str) -> Path:
        return self.path / name

    def __enter__(self) -> Staged:
        try:
            self._made = [d for d in (self.parent, *self.parent.parents) if not d.exists()]
            self.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale(self.parent, self.pattern)
            self.path.mkdir()
        except OSError as err:
            raise PathError(
                f"--output {self.prefix}: cannot write in {self.parent} ({err.strerror or err}); check its rights or "
                "choose another --output."
            ) from None
        self._lock = _hold(self.path)
        return self

    def __exit__(self, kind, value, tb) -> None:
        with held():
            shutil.rmtree(self.path, ignore_errors=True)  # after a publish, only the lock file is left
            if self._lock is not None:
                self._lock.close()
            for directory in self._made if kind is not None else []:  # deepest first; only if still empty
                with contextlib.suppress(OSError):
                    directory.rmdir()

    def publish(self) -> list[Path]:
        """Rename every staged file into place (the sidecar last), drop stale files of the prefix this run did not
        write (an older held-out set), and make it durable; the published paths."""
        published = []
        with held():
            for name in names(self.prefix):
                staged, final = self.file(name), self.parent / name
                if staged.exists():
                    with open(staged, "rb") as f:
                        os.fsync(f.fileno())
                    os.replace(staged, final)
                    published.append(final)
                elif final.exists():
                    final.unlink()
            _durable(self.parent)
        return published


def _durable(directory: Path) -> None:
    """fsync a directory: the renames into it survive a power cut once it is."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    with contextlib.ExitStack() as close:
        close.callback(os.close, fd)
        os.fsync(fd)


def _hold(directory: Path):
    """The lock file of a staging directory (made if missing), open and exclusively flocked: None where another
    process holds it or the file system has no flock."""
    try:
        lock = open(directory / LOCK, "rb+" if (directory / LOCK).exists() else "xb")  # noqa: SIM115 (held open)
    except OSError:
        return None
    with contextlib.suppress(OSError):
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return lock
    lock.close()
    return None


def _remove_stale(parent: Path, pattern: str) -> None:
    """Remove the hidden directories of runs into this prefix that were killed: those whose lock no one holds."""
    for entry in os.scandir(parent):
        if not entry.name.startswith(pattern) or not entry.is_dir(follow_symlinks=False):
            continue
        if not (Path(entry.path) / LOCK).exists():
            continue  # a writer that has not locked it yet
        lock = _hold(Path(entry.path))
        if lock is not None:  # nobody holds it: its writer is dead
            shutil.rmtree(entry.path, ignore_errors=True)
            lock.close()
