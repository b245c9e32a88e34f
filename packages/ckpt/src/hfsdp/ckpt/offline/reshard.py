"""Offline reshard: rewrite a checkpoint for another layout, in one process, without torch.distributed.

The target's groups come from the source index (`groups.retarget_groups`), its
files from the same plan an online save of the target would make
(`pieces.plan_writes`), and their bytes from lazy slices of the source
(`reader.py`), streamed by a thread pool within a memory budget
(`build.write_layout`). Before a byte is written, the source passes every
reader's checks (its index through `index_file.read_index`, its files through
`files.check_files`: headers and checksums), the destination must not exist and
must lie apart from the source. The result is written into a hidden directory
next to DST, read back and checksummed again, and renamed into place only when
complete, so no failure leaves a DST behind and the source is never written.

DiLoCo state: the outer kinds are one copy over all instances and reshard like
any tensor; each target instance o' takes the per-instance kinds of source
instance o' mod R (its weights and inner optimizer state: with R unchanged,
instance for instance; at a sync boundary every instance holds the global
weights, so only the inner optimizer state is duplicated or dropped). A target
without DiLoCo is one instance, instance 0, and drops the outer state; a source
without it gives a target without it, whose load starts the outer step fresh.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.files import check_files
from hfsdp.ckpt.format.groups import retarget_groups
from hfsdp.ckpt.format.index import OUTER_KINDS, CheckpointIndex, meshes_of
from hfsdp.ckpt.format.index_file import read_index, write_index
from hfsdp.ckpt.format.pieces import source_range
from hfsdp.ckpt.format.staging import check_apart, ensure_absent, staged_dir
from hfsdp.ckpt.format.store import resolve
from hfsdp.ckpt.live import rng as rng_states
from hfsdp.ckpt.tensors.build import Progress, slice_bytes, write_layout
from hfsdp.ckpt.tensors.reader import CheckpointReader
from hfsdp.core.rules.config import LayoutConfig


@dataclass(frozen=True)
class ReshardResult:
    source: Path
    destination: Path
    bytes_written: int
    files: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes_written / 1e9 / max(self.seconds, 1e-9)


def reshard(
    src: str | Path,
    dst: str | Path,
    target: LayoutConfig,
    *,
    io_threads: int = 4,
    memory_budget_bytes: int = 256 << 20,
    progress: Progress | None = None,
    verify_result: bool = True,
) -> ReshardResult:
    """Write the checkpoint `src` (a checkpoint or a root) as a checkpoint of layout `target` at `dst`."""
    started = time.perf_counter()
    dst = Path(dst)
    src_dir = resolve(src)
    check_apart([Path(src), src_dir], dst, "reshard")
    ensure_absent(dst, "reshard")
    index = read_index(src_dir)
    _check_target(src_dir, index, target)
    piece = slice_bytes(memory_budget_bytes, io_threads)
    check_files(src_dir, index, threads=io_threads, chunk=min(8 << 20, piece))
    groups = retarget_groups(index.groups, index.layout.get("num_moe_experts"), target.ep)
    outer = index.outer is not None and target.outer.value == "diloco"
    kinds = [k for k in index.kinds if outer or k not in OUTER_KINDS]
    numel = {name: math.prod(shape) for g in groups for name, shape in g.members}

    with staged_dir(dst, "reshard") as tmp:
        tensors, unsharded, files = write_layout(
            tmp,
            target,
            groups,
            kinds,
            {(k, n): t.dtype for k, entries in index.tensors.items() for n, t in entries.items()},
            lambda: _InstanceSource(CheckpointReader(src_dir, index, max_mapped_bytes=piece), index, numel),
            rng=_same_rank_rng(src_dir, index, target),
            unsharded=index.unsharded,
            io_threads=io_threads,
            memory_budget_bytes=memory_budget_bytes,
            progress=progress,
            verify_written=verify_result,
            outer=outer,
        )
        out = CheckpointIndex(
            step=index.step,
            layout=target.to_dict(),
            meshes=meshes_of(target),
            extra=dict(index.extra),
            optimizer=index.optimizer,
            groups=groups,
            tensors=tensors,
            files=files,
            rng=dict(index.rng) if index.layout["world_size"] == target.world_size else {},
            order=list(index.order),
            unsharded=unsharded,
            model=index.model,
            outer=dict(index.outer) if outer else None,
        )
        write_index(tmp, out)
    total = sum(f.bytes for f in files.values())
    return ReshardResult(src_dir, dst, total, len(files), time.perf_counter() - started)


class _InstanceSource:
    """The source checkpoint asked for a target's ranges: instance o' of a per-instance kind reads source instance
    o' mod R (`pieces.source_range`); everything else as it is."""

    def __init__(self, reader: CheckpointReader, index: CheckpointIndex, numel: dict[str, int]):
        self.reader, self.index, self.numel = reader, index, numel

    def chunks(self, kind: str, name: str, start: int, stop: int, max_elems: int):
        if name in self.numel:
            start, stop = source_range(self.index, kind, name, self.numel[name], start, stop)
        return self.reader.chunks(kind, name, start, stop, max_elems)

    def close(self) -> None:
        self.reader.close()


def _check_target(src_dir: Path, index: CheckpointIndex, target: LayoutConfig) -> None:
    has_experts = any(g.is_expert for g in index.groups)
    source_experts = index.layout.get("num_moe_experts")
    if has_experts and target.num_moe_experts != source_experts:
        raise CheckpointError(
            f"The checkpoint {src_dir} has {source_experts} experts but the target layout says num_moe_experts = "
            f"{target.num_moe_experts}; resharding cannot change the model. Set num_moe_experts to {source_experts}."
        )


def _same_rank_rng(src_dir: Path, index: CheckpointIndex, target: LayoutConfig):
    """Rank r keeps rank r's RNG state when the world size is unchanged; otherwise there is no sensible mapping."""
    if index.layout["world_size"] != target.world_size or not index.rng:
        return None
    return {int(rank): rng_states.read_tensors(src_dir, meta) for rank, meta in index.rng.items()}
