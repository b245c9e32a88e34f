"""The collectives of one group over the axes of its mesh, in terms of the group's flat layout.

Every byte still goes through `collectives.py` (which counts it); this adds only what a group
knows: which process group and axis name each mesh dimension is, and how an all-gather over
several axes grows a piece in place inside a larger buffer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hfsdp.core.buffers import collectives as comm
from hfsdp.core.buffers.flat_layout import FlatLayout


class GroupComms:
    def __init__(self, mesh: DeviceMesh, flat: FlatLayout):
        self.flat = flat
        self.names = flat.layout.names
        self.groups: list[dist.ProcessGroup] = [mesh.get_group(name) for name in self.names]

    def gather(
        self, piece: torch.Tensor, sharded: tuple[int, ...], axes: tuple[int, ...], out: torch.Tensor, out_start: int
    ) -> None:
        """All-gather `piece` over `axes`, outer first, growing it inside `out` (which starts at `out_start`).

        `sharded` are the axes that shard `piece` now; each gather removes one. Each
        step's input already sits in its own slot of the step's output, which is the
        in-place all-gather both NCCL and gloo support.
        """
        remaining = list(sharded)
        for k in axes:
            remaining.remove(k)
            start, stop = self.flat.range_over(tuple(remaining))
            target = out[start - out_start : stop - out_start]
            comm.all_gather(target, piece, self.groups[k], self.names[k])
            piece = target

    def reduce_scatter(self, k: int, out: torch.Tensor, full: torch.Tensor) -> None:
        comm.reduce_scatter(out, full, self.groups[k], self.names[k])

    def all_reduce(self, k: int, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        comm.all_reduce(tensor, self.groups[k], self.names[k], op)

    def all_gather(self, k: int, out: torch.Tensor, piece: torch.Tensor) -> None:
        comm.all_gather(out, piece, self.groups[k], self.names[k])

    def all_to_all(self, k: int, out: torch.Tensor, chunks: torch.Tensor) -> None:
        comm.all_to_all(out, chunks, self.groups[k], self.names[k])
