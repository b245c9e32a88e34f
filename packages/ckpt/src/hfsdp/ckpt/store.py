"""Where checkpoints live on disk, and the few file-system moves that make writing them atomic.

A root directory holds `step-N/` checkpoints and a `latest` file naming one.
Everything is written into a hidden temporary directory first, fsynced, and
renamed into place in one step; `latest` is replaced the same way afterwards.
So at any moment a crash leaves either the old state or the new one: a
directory without an index is never a checkpoint, and `latest` only ever names
a directory that was complete before it was written.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from hfsdp.ckpt.checksum import file_checksum, short, split
from hfsdp.ckpt.errors import CheckpointError
from hfsdp.ckpt.index import INDEX_NAME, CheckpointIndex, FileEntry

LATEST = "latest"
STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-"


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def resolve(path: str | Path) -> Path:
    """The checkpoint directory `path` means: itself, the one `latest` names, or the newest complete step."""
    path = Path(path)
    if (path / INDEX_NAME).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint: no such directory. Check the path.")
    latest = path / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        target = path / name
        if not (target / INDEX_NAME).is_file():
            raise CheckpointError(
                f"{latest} names '{name}', but {target} is not a complete checkpoint (no {INDEX_NAME}); the "
                "directory was removed or damaged after it was saved. Restore it, or point 'latest' at another step."
            )
        return target
    steps = sorted(
        (int(m[1]), p) for p in path.iterdir() if (m := STEP_DIR.match(p.name)) and (p / INDEX_NAME).is_file()
    )
    if steps:
        return steps[-1][1]
    raise CheckpointError(
        f"{path} is not a checkpoint: it has no {INDEX_NAME}, no '{LATEST}' file and no complete step-N directory. "
        "Pass a checkpoint directory or a root that hfsdp saved into."
    )


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that readers see the old content or the new, never a mix."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{secrets.token_hex(4)}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def temp_dir_for(final: Path, label: str) -> Path:
    """A fresh hidden directory next to `final`, so the closing rename stays on one file system."""
    tmp = final.parent / f"{TMP_PREFIX}{label}-{secrets.token_hex(4)}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as err:
        raise write_failed(final, err) from None
    return tmp


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` directory to `final` (which must not exist) and make the rename durable."""
    fsync_dir(tmp)
    if final.exists():
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


@contextmanager
def staged_dir(final: Path, label: str):
    """A hidden directory next to `final` to write into: renamed to `final` when the block succeeds,
    removed when it fails, so no half-written result is ever left (an OSError names `final`)."""
    tmp = temp_dir_for(final, label)
    try:
        yield tmp
        publish_dir(tmp, final)
    except OSError as err:
        remove_quietly(tmp)
        raise write_failed(final, err) from None
    except BaseException:
        remove_quietly(tmp)
        raise


def remove_quietly(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def ensure_absent(path: Path, what: str) -> None:
    if path.exists():
        raise CheckpointError(
            f"The destination {path} already exists; {what} never overwrites anything. "
            "Remove it or choose another destination."
        )


def checksum_like(path: Path, expected: FileEntry, chunk: int = 8 << 20) -> FileEntry:
    """The size and checksum of the file at `path`, computed with the algorithm `expected` records."""
    algorithm, _ = split(expected.checksum)
    return FileEntry(*file_checksum(path, algorithm, chunk))


def check_files(
    ckpt_dir: Path, index: CheckpointIndex, names: Iterable[str] | None = None, threads: int = 1, chunk: int = 8 << 20
) -> int:
    """Check size and checksum of `names` (default: every file of the index), reading `chunk` bytes at a time."""
    names = sorted(index.files if names is None else set(names))
    check_sizes(ckpt_dir, index, names)

    def digest(name: str) -> tuple[str, FileEntry]:
        return name, checksum_like(ckpt_dir / name, index.files[name], chunk)

    with ThreadPoolExecutor(max(1, threads)) as pool:
        for name, got in pool.map(digest, names):
            if got.checksum != index.files[name].checksum:
                raise CheckpointError(
                    f"{ckpt_dir / name} does not match its checksum in the index ({short(got.checksum)} instead "
                    f"of {short(index.files[name].checksum)}): its contents changed after it was written (a flipped "
                    "bit, a partial copy, an edit). Restore it from a good copy."
                )
    return sum(index.files[n].bytes for n in names)


def check_sizes(ckpt_dir: Path, index: CheckpointIndex, names: Iterable[str] | None = None) -> None:
    """Every file of `names` (default: all the index lists) exists with the recorded size: no shard is missing."""
    for name in sorted(index.files if names is None else names):
        if name not in index.files:
            raise CheckpointError(
                f"The index of {ckpt_dir} refers to '{name}' but lists no checksum for it; the index disagrees "
                "with itself. Restore the checkpoint from a copy or re-save it."
            )
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing: the index of {ckpt_dir} lists it, so the checkpoint is incomplete (a shard was "
                "deleted or not copied). Restore the file from the machine or copy that wrote it."
            )
        expected = index.files[name]
        size = path.stat().st_size
        if size != expected.bytes:
            raise CheckpointError(
                f"{path} has {size} bytes but the index of {ckpt_dir} records {expected.bytes}: the file is "
                f"{'truncated' if size < expected.bytes else 'longer than written'}. Restore it from a good copy."
            )
