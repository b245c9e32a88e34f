"""Write a checkpoint of any layout from full tensors held by one process.

This is the offline writer fed from memory instead of from another checkpoint:
the same plan, the same files, the same index as an online save of that layout.
It turns an unsharded model (or a synthetic one, for benchmarks and tests) into
an hfsdp checkpoint without starting a process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.index import MAIN, UNSHARDED, CheckpointIndex, GroupSpec, TensorEntry, meshes_of
from hfsdp.ckpt.format.index_file import write_index
from hfsdp.ckpt.format.model_record import checked_record
from hfsdp.ckpt.format.staging import ensure_absent, staged_dir
from hfsdp.ckpt.tensors.build import MemorySource, write_layout
from hfsdp.ckpt.tensors.writer import dtype_name
from hfsdp.core.rules.config import LayoutConfig


def write_from_tensors(
    dst: str | Path,
    cfg: LayoutConfig,
    groups: list[GroupSpec],
    tensors: dict[str, dict[str, torch.Tensor]],
    *,
    step: int = 0,
    extra: dict[str, Any] | None = None,
    optimizer: dict[str, Any] | None = None,
    unsharded: dict[str, torch.Tensor] | None = None,
    order: list[str] | None = None,
    model_record: dict[str, Any] | None = None,
    io_threads: int = 4,
) -> Path:
    """Write `tensors` (kind -> global name -> full tensor) as the checkpoint directory `dst` of layout `cfg`.

    `groups` is the structure of layout `cfg` (expert groups per ep rank);
    `optimizer` the index's optimizer record ({"type", "step_count", "hyper",
    "states"}), or None for weights only; `unsharded` the module's tensors the
    engine does not shard (persistent buffers, frozen parameters) by global
    name; `order` every global name in the consolidated model's state-dict order;
    `model_record` the model the weights belong to (see `model_record.py`).
    """
    dst = Path(dst)
    record = checked_record(model_record)
    ensure_absent(dst, "writing a checkpoint")
    shapes = {name: shape for g in groups for name, shape in g.members}
    for kind, entries in tensors.items():
        for name, shape in shapes.items():
            if name not in entries or tuple(entries[name].shape) != tuple(shape):
                raise CheckpointError(
                    f"Tensor '{name}' of kind '{kind}' is missing or does not have shape {list(shape)}; "
                    "pass one full tensor per kind for every member of the groups."
                )
    if MAIN not in tensors:
        raise CheckpointError("A checkpoint needs the fp32 'main' weights; pass them under tensors['main'].")
    dtypes = {(k, n): dtype_name(t.dtype) for k, entries in tensors.items() for n, t in entries.items()}
    unsharded = unsharded or {}
    specs = {name: TensorEntry(tuple(t.shape), dtype_name(t.dtype)) for name, t in unsharded.items()}
    in_memory = {k: {n: t.detach().cpu().contiguous() for n, t in e.items()} for k, e in tensors.items()}
    in_memory[UNSHARDED] = {n: t.detach().cpu().contiguous() for n, t in unsharded.items()}
    with staged_dir(dst, "write") as tmp:
        source = MemorySource(in_memory)
        written, written_unsharded, files = write_layout(
            tmp, cfg, groups, list(tensors), dtypes, lambda: source, unsharded=specs, io_threads=io_threads
        )
        index = CheckpointIndex(
            step=step,
            layout=cfg.to_dict(),
            meshes=meshes_of(cfg),
            extra=dict(extra or {}),
            optimizer=optimizer,
            groups=list(groups),
            tensors=written,
            files=files,
            order=list(order or []),
            unsharded=written_unsharded,
            model=record,
        )
        write_index(tmp, index)
    return dst
