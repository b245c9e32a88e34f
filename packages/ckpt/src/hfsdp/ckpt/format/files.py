"""Do a checkpoint's files hold what its index says?

After `index_file.read_index` has checked the index against itself, this checks
it against the files, reading headers and checksums but no tensor data as such:
every file the index lists is a regular file of the directory (not a symlink)
with the recorded size (`check_present`); and, for the files a reader is about
to read (`check_files`), the safetensors header is valid and holds every piece
and RNG state the index puts there, with its dtype and length, and the bytes
match the recorded checksum. Readers run these before they read a byte of data,
so a damaged file is refused before anything is written or loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hfsdp.ckpt.format.checksum import file_checksum, short, split
from hfsdp.ckpt.format.dtypes import safetensors_code
from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.headers import Expected, expect, read_header
from hfsdp.ckpt.format.index import UNSHARDED, CheckpointIndex, FileEntry, Piece
from hfsdp.ckpt.format.names import entry_kind, refuse_link


def shard_path(ckpt_dir: Path, name: str) -> Path:
    """The path of the shard `name` the index lists, after checking that it exists and is no symlink."""
    path = ckpt_dir / name
    kind = entry_kind(path)
    if kind is None:
        raise CheckpointError(
            f"{path} is missing: the index of {ckpt_dir} lists it, so the checkpoint is incomplete (a shard was "
            "deleted or not copied). Restore the file from the machine or copy that wrote it."
        )
    refuse_link(path, kind, "shard")
    return path


def check_present(ckpt_dir: Path, index: CheckpointIndex, names: Iterable[str] | None = None) -> None:
    """Every file of `names` (default: all the index lists) is a regular file with the recorded size."""
    for name in sorted(index.files if names is None else set(names)):
        path = shard_path(ckpt_dir, name)
        expected = index.files[name]
        size = path.stat().st_size
        if size != expected.bytes:
            raise CheckpointError(
                f"{path} has {size} bytes but the index of {ckpt_dir} records {expected.bytes}: the file is "
                f"{'truncated' if size < expected.bytes else 'longer than written'}. Restore it from a good copy."
            )


def check_files(
    ckpt_dir: Path,
    index: CheckpointIndex,
    names: Iterable[str] | None = None,
    *,
    checksums: bool = True,
    threads: int = 1,
    chunk: int = 8 << 20,
) -> int:
    """Check `names` (default: every file of the index): present with their size, headers holding what the index
    says, and (with `checksums`) the recorded checksum. Returns the bytes checked."""
    names = sorted(index.files if names is None else set(names))
    check_present(ckpt_dir, index, names)
    expected = expected_keys(index)
    for name in names:
        header = read_header(ckpt_dir / name)
        for item in expected.get(name, ()):
            expect(ckpt_dir / name, header, item)
    if checksums:

        def digest(name: str) -> tuple[str, FileEntry]:
            return name, checksum_like(ckpt_dir / name, index.files[name], chunk)

        with ThreadPoolExecutor(max(1, threads)) as pool:
            for name, got in pool.map(digest, names):
                if got.checksum != index.files[name].checksum:
                    raise CheckpointError(
                        f"{ckpt_dir / name} does not match its checksum in the index ({short(got.checksum)} instead "
                        f"of {short(index.files[name].checksum)}): its contents changed after it was written (a "
                        "flipped bit, a partial copy, an edit). Restore it from a good copy."
                    )
    return sum(index.files[n].bytes for n in names)


def expected_keys(index: CheckpointIndex) -> dict[str, list[Expected]]:
    """Per file, every key the index puts there: the pieces of every kind and the RNG states."""
    out: dict[str, list[Expected]] = {}
    for kind in [*index.kinds, UNSHARDED]:
        for name, entry in index.entries(kind).items():
            for piece in entry.pieces:
                out.setdefault(piece.file, []).append(expected_piece(kind, name, entry.dtype, piece))
    for rank, meta in index.rng.items():
        for key in meta["keys"]:
            out.setdefault(meta["file"], []).append(Expected(key, "U8", None, f"the RNG state of rank {rank}"))
    return out


def expected_piece(kind: str, name: str, dtype: str, piece: Piece) -> Expected:
    what = f"elements {piece.start}..{piece.stop} of '{kind}' tensor '{name}'"
    return Expected(piece.key, safetensors_code(dtype), piece.stop - piece.start, what)


def checksum_like(path: Path, expected: FileEntry, chunk: int = 8 << 20) -> FileEntry:
    """The size and checksum of the file at `path`, computed with the algorithm `expected` records."""
    algorithm, _ = split(expected.checksum)
    return FileEntry(*file_checksum(path, algorithm, chunk))
