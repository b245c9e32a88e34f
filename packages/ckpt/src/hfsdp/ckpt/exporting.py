"""Export: the consolidated model weights as standard, size-split safetensors files.

The output is what the Hugging Face ecosystem expects: files
`model-0000k-of-0000n.safetensors` holding whole tensors under the model's own
state-dict names (experts by global index, i.e. the names with ep = 1), and
`model.safetensors.index.json` mapping each name to its file. Weights come from
the fp32 main weights, cast to the requested dtype chunk by chunk, so memory
stays within the budget however large a tensor is; buffers and frozen
parameters from their own whole copy (integer ones keep their dtype). The source
passes every reader's checks first (index, headers, checksums), OUT must not
exist and must lie apart from the source; the files are written into a hidden
directory next to OUT, each read back and checksummed after writing, and the
directory is renamed into place only when complete.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from hfsdp.ckpt.build import Progress, reverify, slice_bytes
from hfsdp.ckpt.errors import CheckpointError
from hfsdp.ckpt.files import check_files
from hfsdp.ckpt.groups import model_order
from hfsdp.ckpt.index import MAIN, UNSHARDED
from hfsdp.ckpt.index_file import read_index
from hfsdp.ckpt.reader import CheckpointReader
from hfsdp.ckpt.staging import check_apart, ensure_absent, staged_dir
from hfsdp.ckpt.store import resolve
from hfsdp.ckpt.writer import TensorFileWriter, dtype_name, torch_dtype

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class ExportResult:
    destination: Path
    bytes_written: int
    files: int
    tensors: int
    seconds: float


def export(
    src: str | Path,
    out: str | Path,
    dtype: str | torch.dtype = "bf16",
    *,
    max_shard_bytes: int = 5 << 30,
    io_threads: int = 4,
    memory_budget_bytes: int = 256 << 20,
    progress: Progress | None = None,
) -> ExportResult:
    """Write the model weights of checkpoint `src` to the new directory `out` as `dtype` safetensors."""
    started = time.perf_counter()
    out = Path(out)
    target = _dtype(dtype)
    src_dir = resolve(src)
    check_apart([Path(src), src_dir], out, "export")
    ensure_absent(out, "export")
    index = read_index(src_dir)
    piece = slice_bytes(memory_budget_bytes, io_threads)
    check_files(src_dir, index, threads=io_threads, chunk=min(8 << 20, piece))
    tensors = [_exported(index, name, shape, target) for name, shape in model_order(index)]
    shards = _split(tensors, max_shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(t.nbytes for t in tensors)
    chunk_elems = piece // (8 + target.itemsize)  # a source chunk (8-byte elements at most) and its cast copy
    done, lock = [0], threading.Lock()

    def write_shard(job, tmp: Path) -> None:
        file, members = job
        entries = [(t.name, dtype_name(t.dtype), t.shape) for t in members]
        writer = TensorFileWriter(tmp / file, entries, metadata={"format": "pt"})
        try:
            with CheckpointReader(src_dir, index, max_mapped_bytes=chunk_elems * 8) as reader:
                for t in members:
                    for chunk in reader.chunks(t.kind, t.name, 0, math.prod(t.shape), chunk_elems):
                        writer.write(chunk.to(t.dtype))
                        with lock:
                            done[0] += chunk.numel() * t.dtype.itemsize
                            if progress is not None:
                                progress(done[0], total)
            written = writer.finish()
        except BaseException:
            writer.abort()
            raise
        reverify(tmp / file, written, chunk_elems * 8)

    with staged_dir(out, "export") as tmp:
        with ThreadPoolExecutor(max(1, io_threads)) as pool:
            list(pool.map(lambda job: write_shard(job, tmp), zip(names, shards, strict=True)))
        weight_map = {t.name: file for file, members in zip(names, shards, strict=True) for t in members}
        with open(tmp / INDEX_FILE, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
    return ExportResult(out, total, len(names), len(tensors), time.perf_counter() - started)


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"Export dtype '{dtype}' is not supported; use one of {', '.join(DTYPES)}.")
    return DTYPES[dtype]


@dataclass(frozen=True)
class _Exported:
    """One tensor of the export: where it comes from (a kind of the checkpoint) and what it is written as."""

    name: str
    shape: tuple[int, ...]
    kind: str
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _exported(index, name: str, shape: tuple[int, ...], target: torch.dtype) -> _Exported:
    """Parameters come from the fp32 main weights, cast to `target`; unsharded module tensors from their own
    copy, floating ones cast to `target` and the others (counters, masks) kept as they are."""
    if name not in index.unsharded:
        return _Exported(name, shape, MAIN, target)
    own = torch_dtype(index.unsharded[name].dtype)
    return _Exported(name, shape, UNSHARDED, target if own.is_floating_point else own)


def _split(tensors: list[_Exported], max_shard_bytes: int) -> list[list[_Exported]]:
    """Consecutive tensors per file, each file at most `max_shard_bytes` unless one tensor alone is larger."""
    shards: list[list] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards
