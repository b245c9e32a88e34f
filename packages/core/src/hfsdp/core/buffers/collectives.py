"""The collectives, alone: every byte hfsdp sends goes through these four functions.

Keeping them in one place lets a `CommLog` count what each rank sends under the
ring model (docs/formulas.md), which is how the tests check the communication
formulas against real traffic rather than against themselves.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch >= 2.12 renamed the flat-tensor collectives; older builds (the GPU image) have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CommRecord:
    op: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "all_to_all"
    axis: str
    group_size: int
    numel: int  # elements of the full (unsharded) side of the collective
    element_size: int

    @property
    def bytes_sent(self) -> float:
        """Bytes this rank sends under the ring model: α(n)·size, twice that for all-reduce (an all-to-all sends
        every chunk but its own: α(n)·size too)."""
        alpha = (self.group_size - 1) / self.group_size
        factor = 2 if self.op == "all_reduce" else 1
        return factor * alpha * self.numel * self.element_size


@dataclass
class CommLog:
    records: list[CommRecord] = field(default_factory=list)

    def bytes_sent(self, axis: str | None = None, op: str | None = None) -> float:
        return sum(
            r.bytes_sent for r in self.records if (axis is None or r.axis == axis) and (op is None or r.op == op)
        )

    def count(self, axis: str | None = None, op: str | None = None) -> int:
        return sum(1 for r in self.records if (axis is None or r.axis == axis) and (op is None or r.op == op))


_active_log: CommLog | None = None


@contextmanager
def record_comms():
    """Count every collective issued inside the block (on this rank)."""
    global _active_log
    previous, _active_log = _active_log, CommLog()
    try:
        yield _active_log
    finally:
        _active_log = previous


def _record(op: str, axis: str, group: dist.ProcessGroup, full: torch.Tensor) -> None:
    if _active_log is not None:
        size = dist.get_world_size(group)
        _active_log.records.append(CommRecord(op, axis, size, full.numel(), full.element_size()))


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, axis: str) -> None:
    """Gather equal `shard`s of every rank of `group` into `output`, in rank order."""
    _record("all_gather", axis, group, output)
    if dist.get_world_size(group) == 1:
        output.copy_(shard)
        return
    _all_gather(output, shard, group=group)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, axis: str) -> None:
    """Sum `full` over `group` and keep this rank's equal piece in `output`."""
    _record("reduce_scatter", axis, group, full)
    if dist.get_world_size(group) == 1:
        output.copy_(full)
        return
    _reduce_scatter(output, full, group=group)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, axis: str, op=dist.ReduceOp.SUM) -> None:
    """Sum `tensor` over `group` (or reduce it by `op`), in place."""
    _record("all_reduce", axis, group, tensor)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def all_to_all(output: torch.Tensor, chunks: torch.Tensor, group: dist.ProcessGroup, axis: str) -> None:
    """Send equal chunk j of `chunks` (split along dim 0) to the rank of `group` at position j; `output` gets the
    chunk each rank sent here, in rank order. What a reduce-scatter does before it sums: a caller that sums the
    received chunks itself does it in a fixed order and precision, and may send them compressed."""
    _record("all_to_all", axis, group, chunks)
    if dist.get_world_size(group) == 1:
        output.copy_(chunks)
        return
    dist.all_to_all_single(output, chunks, group=group)
