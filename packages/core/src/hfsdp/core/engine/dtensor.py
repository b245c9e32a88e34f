"""Flat buffer pieces as DTensors with the rule table's placements.

A group's padded flat buffer is the global tensor; each rank's piece is its
local tensor. When both axes shard a buffer, hfsdp splits the inner shard again
over the outer axis (piece `i*R + o`), i.e. the inner mesh dim shards first.
DTensor states that with `shard_order`; torch builds without it (before 2.10)
express the same layout with `_StridedShard` on the outer axis.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from hfsdp.core.rules.placement import State

try:  # torch >= 2.10
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
except ImportError:  # pragma: no cover - older torch
    ShardOrderEntry = None
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


def flat_dtensor(local: torch.Tensor, group, state: State) -> DTensor:
    """Wrap this rank's piece of `group`'s buffer for `state` as a 1-D DTensor of the padded size.

    Along an axis whose coordinates train apart (diloco) each instance's buffer is its own tensor,
    which no DTensor placement says: the view is a DTensor of this instance, on the mesh of the
    other axes."""
    placements = group.layout.placements.of(state)
    sharded = group.layout.sharded_axes(state)
    apart = group.layout.independent_axes()
    mesh = group.mesh
    if apart and state is not State.OUTER:
        kept = [k for k in range(len(group.layout.axes)) if k not in apart]
        names = tuple(group.layout.names[k] for k in kept)
        mesh = group.mesh[names if len(names) > 1 else names[0]]
        placements = tuple(placements[k] for k in kept)
        sharded = tuple(kept.index(k) for k in sharded)
    meta = TensorMeta(torch.Size([group.padded]), (1,), local.dtype)
    if len(sharded) > 1 and ShardOrderEntry is None:  # pragma: no cover - older torch
        from torch.distributed.tensor.placement_types import _StridedShard

        inner_size = mesh.size(sharded[-1])
        placements = tuple(
            _StridedShard(0, split_factor=inner_size) if k in sharded[:-1] else p for k, p in enumerate(placements)
        )
        spec = DTensorSpec(mesh, placements, tensor_meta=meta)
    elif len(sharded) > 1:
        order = (ShardOrderEntry(tensor_dim=0, mesh_dims=tuple(reversed(sharded))),)
        spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta, shard_order=order)
    else:
        spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)
