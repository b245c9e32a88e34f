"""Writing a layout's files from any source of flat ranges: the shared back half of save, reshard and import.

`file_entries` fixes what one rank's file holds and in which order (every kind of
each planned piece, section by section, then the unsharded module tensors it owns,
then the rank's RNG state); `index_tensors` and `index_unsharded` turn a plan into
the index's piece lists. The online save and the offline writer below both
use them, which is why a reshard writes exactly what an online save of the
target layout would.

`write_layout` streams every target file from a source (another checkpoint, or
tensors in memory), one file per worker thread, in chunks bounded by the memory
budget; each chunk is a lazy slice of the source, written and hashed straight
away.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch

from hfsdp.ckpt.format.checksum import short
from hfsdp.ckpt.format.dtypes import itemsize
from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.files import checksum_like
from hfsdp.ckpt.format.index import UNSHARDED, FileEntry, GroupSpec, Piece, TensorEntry
from hfsdp.ckpt.format.pieces import Section, file_name, sections, tensor_key, unsharded_owner
from hfsdp.ckpt.tensors.writer import TensorFileWriter
from hfsdp.core.rules.config import LayoutConfig

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
#: dtype of every tensor, by (kind, name)
Dtypes = dict[tuple[str, str], str]


class RangeSource(Protocol):
    def chunks(self, kind: str, name: str, start: int, stop: int, max_elems: int): ...


def file_entries(
    rank: int,
    planned: list[Section],
    dtypes: Dtypes,
    rng: dict[str, torch.Tensor] | None,
    unsharded: dict[str, TensorEntry] | None = None,
):
    """(key, dtype, shape) of everything rank `rank`'s file holds, in file order.

    `unsharded` are the whole module tensors this rank writes, stored flat.
    """
    entries = [
        (tensor_key(k, it.name), dtypes[k, it.name], (it.numel,))
        for section in planned
        for k in section.kinds
        for it in section.plan[rank]
    ]
    entries += [(tensor_key(UNSHARDED, name), t.dtype, (t.numel,)) for name, t in (unsharded or {}).items()]
    entries += [(key, "uint8", (t.numel(),)) for key, t in (rng or {}).items()]
    return entries


def plan_unsharded(cfg: LayoutConfig, unsharded: dict[str, TensorEntry]) -> dict[int, dict[str, TensorEntry]]:
    """Which rank writes which unsharded module tensor (see `pieces.unsharded_owner`)."""
    plan: dict[int, dict[str, TensorEntry]] = {}
    for name, entry in unsharded.items():
        plan.setdefault(unsharded_owner(cfg, name), {})[name] = entry
    return plan


def index_unsharded(cfg: LayoutConfig, unsharded: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """The index's unsharded tensors: each one whole, in its owner's file."""
    return {
        name: TensorEntry(
            entry.shape,
            entry.dtype,
            [Piece(file_name(unsharded_owner(cfg, name)), tensor_key(UNSHARDED, name), 0, entry.numel)],
        )
        for name, entry in unsharded.items()
    }


def index_tensors(
    planned: list[Section], groups: list[GroupSpec], dtypes: Dtypes, has_file: set[int]
) -> dict[str, dict[str, TensorEntry]]:
    """The index's tensors: per kind and global name, shape (the instances in front, for a per-instance section),
    dtype and pieces sorted by flat start."""
    shapes = {name: shape for g in groups for name, shape in g.members}
    tensors = {}
    for section in planned:
        lead = (section.instances,) if section.instances > 1 else ()
        for k in section.kinds:
            tensors[k] = {name: TensorEntry((*lead, *shape), dtypes[k, name]) for name, shape in shapes.items()}
        for rank, items in section.plan.items():
            if rank not in has_file:
                continue
            for k in section.kinds:
                for it in items:
                    key = tensor_key(k, it.name)
                    tensors[k][it.name].pieces.append(Piece(file_name(rank), key, it.start, it.stop))
    for entries in tensors.values():
        for entry in entries.values():
            entry.pieces.sort(key=lambda p: p.start)
    return tensors


def slice_bytes(memory_budget_bytes: int, io_threads: int) -> int:
    """The most one thread holds in one buffer: a quarter of its share of the budget.

    A thread holds one chunk in flight plus up to as much again of mapped source
    pages before its reader closes them; a quarter each keeps every thread under
    half its share, leaving the rest for hashing buffers and the interpreter.
    """
    return max(1 << 16, memory_budget_bytes // (4 * max(1, io_threads)))


def write_layout(
    out_dir: Path,
    cfg: LayoutConfig,
    groups: list[GroupSpec],
    kinds: list[str],
    dtypes: Dtypes,
    open_source: Callable[[], RangeSource],
    *,
    rng: dict[int, dict[str, torch.Tensor]] | None = None,
    unsharded: dict[str, TensorEntry] | None = None,
    io_threads: int = 4,
    memory_budget_bytes: int = 256 << 20,
    progress: Progress | None = None,
    verify_written: bool = False,
    outer: bool = False,
) -> tuple[dict[str, dict[str, TensorEntry]], dict[str, TensorEntry], dict[str, FileEntry]]:
    """Write every rank's file of layout `cfg` into `out_dir`; return the index's tensors, unsharded and files.

    `unsharded` (global name -> shape and dtype) are the whole module tensors,
    read from the source under the kind UNSHARDED. `outer`: the target holds
    DiLoCo state (per-instance kinds and the outer kinds, `pieces.sections`); the
    source is asked for the target's ranges. With `verify_written`, each file is
    read back and checksummed as soon as it is complete, while other threads
    still write: the check overlaps the work.
    """
    planned = sections(cfg, groups, kinds, outer)
    unsharded = unsharded or {}
    owned = plan_unsharded(cfg, unsharded)
    rng = rng or {}
    jobs = []
    for rank in range(cfg.world_size):
        entries = file_entries(rank, planned, dtypes, rng.get(rank), owned.get(rank))
        if entries:
            jobs.append((rank, [(k, it) for sec in planned for k in sec.kinds for it in sec.plan[rank]], entries))
    total = sum(_nbytes(e) for _, _, e in jobs)
    chunk_bytes = slice_bytes(memory_budget_bytes, io_threads)
    done, lock = [0], threading.Lock()
    local = threading.local()

    def advance(nbytes: int) -> None:
        with lock:
            done[0] += nbytes
            if progress is not None:
                progress(done[0], total)

    def write_one(job) -> tuple[str, FileEntry]:
        rank, items, entries = job
        if not hasattr(local, "source"):
            local.source = open_source()
        source = local.source
        writer = TensorFileWriter(out_dir / file_name(rank), entries)

        def copy(chunks) -> None:
            for chunk in chunks:
                writer.write(chunk)
                advance(chunk.numel() * chunk.element_size())
                del chunk

        try:
            for kind, it in items:
                max_elems = max(1, chunk_bytes // itemsize(dtypes[kind, it.name]))
                copy(source.chunks(kind, it.name, it.start, it.stop, max_elems))
            for name, entry in owned.get(rank, {}).items():
                max_elems = max(1, chunk_bytes // itemsize(entry.dtype))
                copy(source.chunks(UNSHARDED, name, 0, entry.numel, max_elems))
            for tensor in rng.get(rank, {}).values():
                writer.write(tensor)
            written = writer.finish()
        except BaseException:
            writer.abort()
            raise
        finally:
            if hasattr(source, "close"):
                source.close()
        if verify_written:
            reverify(out_dir / file_name(rank), written, chunk_bytes)
        return file_name(rank), written

    jobs.sort(key=lambda j: -_nbytes(j[2]))
    with ThreadPoolExecutor(max(1, io_threads)) as pool:
        files = dict(pool.map(write_one, jobs))
    if progress is not None:
        progress(total, total)
    tensors = index_tensors(planned, groups, dtypes, {rank for rank, _, _ in jobs})
    return tensors, index_unsharded(cfg, unsharded), dict(sorted(files.items()))


def reverify(path: Path, written: FileEntry, chunk_bytes: int = 8 << 20) -> None:
    """Read a file just written back from disk: its size and checksum must be the ones computed while writing."""
    got = checksum_like(path, written, min(8 << 20, chunk_bytes))
    if got != written:
        raise CheckpointError(
            f"{path} reads back differently from what was written ({short(got.checksum)} instead of "
            f"{short(written.checksum)}, {got.bytes} bytes instead of {written.bytes}); the disk or another process "
            "changed it. Nothing was published; check the storage and run the command again."
        )


def _nbytes(entries) -> int:
    total = 0
    for _, dtype, shape in entries:
        n = itemsize(dtype)
        for s in shape:
            n *= s
        total += n
    return total


class MemorySource:
    """Full tensors in memory, by kind and global name: the source of `write_from_tensors`."""

    def __init__(self, tensors: dict[str, dict[str, torch.Tensor]]):
        self.tensors = tensors

    def chunks(self, kind: str, name: str, start: int, stop: int, max_elems: int):
        flat = self.tensors[kind][name].reshape(-1)  # kind UNSHARDED: the whole module tensors
        for lo in range(start, stop, max_elems):
            yield flat[lo : min(lo + max_elems, stop)]
