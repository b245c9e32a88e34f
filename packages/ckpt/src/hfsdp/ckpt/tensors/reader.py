"""Read any flat range of a checkpoint tensor through safetensors' lazy slices.

`safe_open(...).get_slice(key)[a:b]` maps the file and hands back a view of just
those elements, so reading costs what is read, not what the file holds. Mapped
pages count towards the process's memory until the file is closed, so the
reader closes every open file once `max_mapped_bytes` have been read through
it: memory stays bounded by what is in flight, not by the model.

Before a file is mapped, its header is parsed and checked by `headers.py` (the
same check `files.check_files` runs), and every piece is compared with its
header entry before it is read, so a piece the file does not hold as the index
says is a CheckpointError naming the file, never a wrong read. A file must be a
regular file of the directory, not a symlink.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.files import expected_piece, shard_path
from hfsdp.ckpt.format.headers import HeaderEntry, expect, read_header
from hfsdp.ckpt.format.index import CheckpointIndex, Piece
from hfsdp.ckpt.format.pieces import intersect


class CheckpointReader:
    """Reads flat ranges of (kind, name) tensors of one checkpoint directory."""

    def __init__(self, ckpt_dir: Path, index: CheckpointIndex, max_mapped_bytes: int = 256 << 20):
        self.dir, self.index = Path(ckpt_dir), index
        self.max_mapped_bytes = max_mapped_bytes
        self._handles: dict[str, object] = {}
        self._headers: dict[str, dict[str, HeaderEntry]] = {}
        self._mapped = 0

    def entry(self, kind: str, name: str):
        try:
            return self.index.entries(kind)[name]
        except KeyError:
            raise CheckpointError(
                f"The checkpoint {self.dir} has no '{kind}' tensor '{name}'; it is a checkpoint of another model "
                "or optimizer. Load it into the model that saved it, or convert it first."
            ) from None

    def files_for(self, kind: str, name: str, start: int, stop: int) -> set[str]:
        return {p.file for p in self.entry(kind, name).pieces if intersect((p.start, p.stop), (start, stop))}

    def chunks(self, kind: str, name: str, start: int, stop: int, max_elems: int) -> Iterator[torch.Tensor]:
        """Consecutive 1-D chunks of at most `max_elems` elements covering [start, stop) of the flattened tensor."""
        entry = self.entry(kind, name)
        position = start
        for piece in sorted(entry.pieces, key=lambda p: p.start):
            hit = intersect((piece.start, piece.stop), (position, stop))
            if hit is None:
                continue
            if hit[0] != position:
                break
            self._check(kind, name, entry.dtype, piece)
            for lo in range(hit[0], hit[1], max_elems):
                hi = min(lo + max_elems, hit[1])
                yield self._read(piece, lo - piece.start, hi - piece.start)
                position = hi
        if position != stop:
            raise CheckpointError(
                f"The index of {self.dir} covers elements {start}..{position} of '{kind}' tensor '{name}' but not "
                f"{position}..{stop}: the index is inconsistent. Run `hfsdp ckpt verify` and restore the checkpoint."
            )

    def read_into(self, kind: str, name: str, start: int, out: torch.Tensor) -> None:
        """Fill `out` (1-D) with elements [start, start + len(out)) of the flattened tensor."""
        done = 0
        for chunk in self.chunks(kind, name, start, start + out.numel(), 1 << 62):
            out[done : done + chunk.numel()].copy_(chunk)
            done += chunk.numel()

    def _check(self, kind: str, name: str, dtype: str, piece: Piece) -> None:
        """The file holds `piece` as the index says (dtype, length), by its header, before anything is mapped."""
        header = self._headers.get(piece.file)
        if header is None:
            header = self._headers[piece.file] = read_header(shard_path(self.dir, piece.file))
        expect(self.dir / piece.file, header, expected_piece(kind, name, dtype, piece))

    def _read(self, piece: Piece, lo: int, hi: int) -> torch.Tensor:
        path = self.dir / piece.file
        handle = self._open(path, piece.file)
        try:
            chunk = handle.get_slice(piece.key)[lo:hi]
        except SafetensorError as err:
            raise CheckpointError(
                f"{path} cannot be read at tensor '{piece.key}' ({err}); it is damaged. Restore it from a good copy."
            ) from None
        self._mapped += chunk.numel() * chunk.element_size()
        return chunk

    def _open(self, path: Path, name: str):
        if self._mapped >= self.max_mapped_bytes:
            self.close()
        handle = self._handles.get(name)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(
                    f"{path} is not a readable safetensors file ({err}); it is truncated or damaged. "
                    "Restore it from a good copy."
                ) from None
            self._handles[name] = handle
        return handle

    def close(self) -> None:
        """Drop every open file (and with it every mapping not still referenced by a chunk in flight)."""
        self._handles.clear()
        self._mapped = 0

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
