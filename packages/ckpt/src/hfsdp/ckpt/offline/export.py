"""Export: the consolidated model weights as standard, size-split safetensors files.

The output is what the Hugging Face ecosystem expects: files
`model-0000k-of-0000n.safetensors` holding whole tensors and
`model.safetensors.index.json` mapping each name to its file, in one of two
formats:

- `megatron`: the model's own state-dict names (experts by global index, i.e.
  the names with ep = 1), no config.json: what any loader of that model's
  state dict reads;
- `hf`: a directory `transformers.AutoModelForCausalLM.from_pretrained` loads:
  config.json plus the weights under transformers' names, from the checkpoint's
  model record (`hf_export.py`: identity for a transformers model, the Llama
  adapter for a Llama-style megatron GPT).

`auto` (the default) is `hf` when the checkpoint records a model that maps to a
transformers architecture, and `megatron` when it records none, or a megatron-core
GPT no transformers architecture matches (a LayerNorm/GELU GPT); the result says
which it wrote and why. An explicit `hf` that cannot be written is an error.
Weights come from the fp32 main weights, cast to the requested dtype (by
default the model's own, as `save_pretrained` keeps it: the dtype its
transformers config records, else the compute dtype it was trained in)
chunk by chunk, so memory stays within the budget however large a tensor is
(an HF tensor split off a fused one, such as q_proj of QKV, is read as flat
ranges of it); buffers and frozen parameters from their own whole copy
(integer ones keep their dtype). The source passes every reader's checks first
(index, headers, checksums), OUT must not exist and must lie apart from the
source; the files are written into a hidden directory next to OUT, each read
back and checksummed after writing, and the directory is renamed into place
only when complete.
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

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.files import check_files
from hfsdp.ckpt.format.groups import model_order
from hfsdp.ckpt.format.index import TRANSFORMERS, UNSHARDED, CheckpointIndex
from hfsdp.ckpt.format.index_file import read_index
from hfsdp.ckpt.format.staging import check_apart, ensure_absent, staged_dir
from hfsdp.ckpt.format.store import resolve
from hfsdp.ckpt.hf.export_plan import config_json, hf_plan
from hfsdp.ckpt.tensors.build import Progress, reverify, slice_bytes
from hfsdp.ckpt.tensors.reader import CheckpointReader
from hfsdp.ckpt.tensors.writer import TensorFileWriter, dtype_name, torch_dtype

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHORT = {dtype: name for name, dtype in DTYPES.items()}
FORMATS = ("auto", "hf", "megatron")
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class ExportResult:
    destination: Path
    bytes_written: int
    files: int
    tensors: int
    seconds: float
    format: str  # "hf" or "megatron": what was written ("auto" resolved)
    note: str | None = None  # why "auto" wrote megatron though the checkpoint records its model
    dtype: str = "bf16"  # what the weights were written as ("bf16", "fp16", "fp32"): the request or the model's own


def export(
    src: str | Path,
    out: str | Path,
    dtype: str | torch.dtype | None = None,
    *,
    format: str = "auto",
    max_shard_bytes: int = 5 << 30,
    io_threads: int = 4,
    memory_budget_bytes: int = 256 << 20,
    progress: Progress | None = None,
) -> ExportResult:
    """Write the model weights of checkpoint `src` to the new directory `out` as `dtype` safetensors, in `format`
    ("hf", "megatron", or "auto": hf when the checkpoint records its model, megatron otherwise). `dtype` None is
    the model's own (`model_dtype`)."""
    started = time.perf_counter()
    out = Path(out)
    target = _dtype(dtype) if dtype is not None else None
    if format not in FORMATS:
        raise CheckpointError(f"Export format '{format}' is not supported; use one of {', '.join(FORMATS)}.")
    src_dir = resolve(src)
    check_apart([Path(src), src_dir], out, "export")
    ensure_absent(out, "export")
    index = read_index(src_dir)
    if target is None:
        target = model_dtype(index)
    note = None
    if format == "auto":
        format, note = _auto_format(index, src_dir)
    config, tensors = _plan(index, src_dir, format, target)
    piece = slice_bytes(memory_budget_bytes, io_threads)
    check_files(src_dir, index, threads=io_threads, chunk=min(8 << 20, piece))
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
                    for start, stop in t.ranges:
                        for chunk in reader.chunks(t.kind, t.source, start, stop, chunk_elems):
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
        _write_synced(
            tmp / INDEX_FILE, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
        if config is not None:
            _write_synced(tmp / CONFIG_FILE, config)
    seconds = time.perf_counter() - started
    return ExportResult(out, total, len(names), len(tensors), seconds, format, note, SHORT[target])


def model_dtype(index: CheckpointIndex) -> torch.dtype:
    """The model's own dtype, what an export writes unless told otherwise: the dtype its transformers config records
    (`dtype`, or `torch_dtype` before transformers 5: an imported fp32 model exports fp32, as save_pretrained would),
    else the compute dtype its groups record (the training run's --dtype), else fp32."""
    if index.model is not None and index.model["format"] == TRANSFORMERS:
        config = index.model["config"]
        for key in ("dtype", "torch_dtype"):
            name = config.get(key)
            if isinstance(name, str) and getattr(torch, name.removeprefix("torch."), None) in SHORT:
                return getattr(torch, name.removeprefix("torch."))
    compute = {group.dtype for group in index.groups}
    if len(compute) == 1 and getattr(torch, next(iter(compute)), None) in SHORT:
        return getattr(torch, next(iter(compute)))
    return torch.float32


def _auto_format(index: CheckpointIndex, src_dir: Path) -> tuple[str, str | None]:
    """hf where the recorded model maps to transformers; megatron (with the reason) for a GPT that does not."""
    if index.model is None:
        return "megatron", None
    if index.model["format"] != "megatron-gpt":
        return "hf", None
    from hfsdp.models.megatron.hf_adapter import UnmappableModel, llama_mapping

    try:
        llama_mapping(index.model["config"])
    except UnmappableModel as err:
        return "megatron", str(err).split(", so it is not a Llama")[0].removeprefix("The checkpoint's ")
    return "hf", None


def _plan(index: CheckpointIndex, src_dir: Path, format: str, target: torch.dtype):
    """(config.json text or None, the exported tensors in file order) for `format`."""
    if format == "megatron":
        return None, [
            _exported(index, name, shape, name, ((0, math.prod(shape)),), target) for name, shape in model_order(index)
        ]
    model, mapped = hf_plan(index, src_dir)
    tensors = [_exported(index, m.name, m.shape, m.source, m.ranges, target) for m in mapped]
    return config_json(model, target), tensors


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"Export dtype '{dtype}' is not supported; use one of {', '.join(DTYPES)}.")
    return DTYPES[dtype]


@dataclass(frozen=True)
class _Exported:
    """One tensor of the export: what it is written as (name, shape, dtype), and where its elements come from:
    the flat `ranges` of tensor `source` of a kind of the checkpoint, concatenated."""

    name: str
    shape: tuple[int, ...]
    kind: str
    source: str
    ranges: tuple[tuple[int, int], ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _exported(index, name: str, shape: tuple[int, ...], source: str, ranges, target: torch.dtype) -> _Exported:
    """Parameters come from the fp32 main weights, cast to `target`; unsharded module tensors from their own
    copy, floating ones cast to `target` and the others (counters, masks) kept as they are."""
    if source not in index.unsharded:  # with DiLoCo state: the global weights
        return _Exported(name, shape, index.weights_kind, source, tuple(ranges), target)
    own = torch_dtype(index.unsharded[source].dtype)
    return _Exported(name, shape, UNSHARDED, source, tuple(ranges), target if own.is_floating_point else own)


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
