"""`verify`: is this checkpoint exactly what its index says? `inspect`: what does it hold?

verify checks every file's size and checksum, then that the index agrees with the
files and with itself: each piece names a file and key that exist, with the
index's dtype and the piece's length; the pieces of every tensor cover it
exactly once; every state kind holds the same tensors; the group structure
lists exactly those tensors with their shapes; the unsharded module tensors
(buffers, frozen parameters) are whole and in place. It reads headers, not data,
beyond the checksums.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hfsdp.ckpt.errors import CheckpointError
from hfsdp.ckpt.index import MAIN, UNSHARDED, CheckpointIndex, read_index
from hfsdp.ckpt.reader import CheckpointReader
from hfsdp.ckpt.store import check_files, resolve
from hfsdp.ckpt.writer import torch_dtype


def verify(path: str | Path, io_threads: int = 4) -> dict[str, Any]:
    """Raise CheckpointError on the first problem found; return a short summary when there is none."""
    ckpt_dir = resolve(path)
    index = read_index(ckpt_dir)
    checked = check_files(ckpt_dir, index, threads=io_threads)
    _check_consistency(ckpt_dir, index)
    return {
        "path": str(ckpt_dir),
        "files": len(index.files),
        "bytes": checked,
        "tensors": len(index.tensors.get(MAIN, {})),
        "kinds": index.kinds,
    }


def _check_consistency(ckpt_dir: Path, index: CheckpointIndex) -> None:
    where = f"The index of {ckpt_dir}"
    group_shapes = {name: shape for g in index.groups for name, shape in g.members}
    if len(group_shapes) != sum(len(g.members) for g in index.groups):
        raise CheckpointError(f"{where} lists a parameter in more than one group. {FIX}")
    if set(group_shapes) & set(index.unsharded):
        both = sorted(set(group_shapes) & set(index.unsharded))[0]
        raise CheckpointError(f"{where} lists '{both}' both as a sharded parameter and as an unsharded tensor. {FIX}")
    if index.order and sorted(index.order) != sorted([*group_shapes, *index.unsharded]):
        raise CheckpointError(f"{where} records a tensor order that does not list exactly its tensors. {FIX}")
    with CheckpointReader(ckpt_dir, index) as reader:
        for kind, entries in index.tensors.items():
            if set(entries) != set(group_shapes):
                odd = sorted(set(entries) ^ set(group_shapes))[0]
                raise CheckpointError(
                    f"{where} disagrees with itself: '{kind}' tensor '{odd}' is in the tensors or the group "
                    f"structure but not both. {FIX}"
                )
            for name, entry in entries.items():
                if tuple(entry.shape) != tuple(group_shapes[name]):
                    raise CheckpointError(
                        f"{where} gives '{kind}' tensor '{name}' shape {list(entry.shape)} but its group lists "
                        f"{list(group_shapes[name])}. {FIX}"
                    )
                _check_pieces(where, index, reader, kind, name)
        for name in index.unsharded:
            _check_pieces(where, index, reader, UNSHARDED, name)


FIX = "Restore the checkpoint from a copy or re-save it."


def _check_pieces(where: str, index: CheckpointIndex, reader: CheckpointReader, kind: str, name: str) -> None:
    """The pieces of one tensor cover it exactly once, in files the index lists, as keys the files hold."""
    entry = index.entries(kind)[name]
    position = 0
    for piece in sorted(entry.pieces, key=lambda p: p.start):
        if piece.file not in index.files:
            raise CheckpointError(
                f"{where} puts a piece of '{kind}' tensor '{name}' in {piece.file}, which it lists no checksum for. "
                f"{FIX}"
            )
        if piece.start != position or piece.stop <= piece.start:
            problem = "overlap" if piece.start < position else "leave a gap"
            problem = "include an empty one" if piece.stop <= piece.start else problem
            raise CheckpointError(
                f"{where}: the pieces of '{kind}' tensor '{name}' {problem} at element {position} "
                f"(piece {piece.start}..{piece.stop} in {piece.file}). {FIX}"
            )
        position = piece.stop
    if position != entry.numel:
        raise CheckpointError(
            f"{where}: the pieces of '{kind}' tensor '{name}' cover {position} of its {entry.numel} elements. {FIX}"
        )
    reader.locate(kind, name, 0, entry.numel)
    reader.close()  # headers only: keep nothing mapped


def inspect(path: str | Path) -> dict[str, Any]:
    """What a checkpoint holds: layout, step, optimizer, tensors (shapes, dtypes, bytes) and files."""
    ckpt_dir = resolve(path)
    index = read_index(ckpt_dir)
    try:
        layout_name = index.config().layout_name
    except Exception:  # an index with an invalid layout is still worth inspecting
        layout_name = "invalid layout"
    tensors = []
    for name, main in index.tensors.get(MAIN, {}).items():
        dtypes = {kind: entries[name].dtype for kind, entries in index.tensors.items() if name in entries}
        itemsizes = sum(torch_dtype(d).itemsize for d in dtypes.values())
        tensors.append(
            {
                "name": name,
                "shape": list(main.shape),
                "numel": main.numel,
                "dtypes": dtypes,
                "bytes": main.numel * itemsizes,  # all kinds together
                "pieces": len(main.pieces),
            }
        )
    return {
        "path": str(ckpt_dir),
        "step": index.step,
        "layout": {**index.layout, "name": layout_name},
        "meshes": index.meshes,
        "optimizer": index.optimizer,
        "extra": index.extra,
        "kinds": index.kinds,
        "groups": len(index.groups),
        "tensors": tensors,
        "parameters": sum(t["numel"] for t in tensors),
        "unsharded": [
            {"name": name, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.numel * torch_dtype(t.dtype).itemsize}
            for name, t in index.unsharded.items()
        ],
        "files": [{"name": n, "bytes": f.bytes, "checksum": f.checksum} for n, f in index.files.items()],
        "total_bytes": sum(f.bytes for f in index.files.values()),
    }
