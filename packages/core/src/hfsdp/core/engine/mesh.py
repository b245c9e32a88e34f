"""The device meshes: the dense hybrid mesh and the expert mesh.

The dense mesh is `arange(dp).reshape(instances, inner)`: row i holds the ranks of
instance i, where the fast links are. The expert mesh follows megatron-core's rank
order (expert-parallel rank fastest), so each expert-parallel rank gets the column
of ranks holding the same experts. When process groups already exist (megatron-core's
`parallel_state`), `check_axis` compares them with the mesh and fails loudly on a
mismatch instead of silently mis-mapping shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hfsdp.core.rules.config import LayoutConfig
from hfsdp.core.rules.layout import MeshLayout, dense_layout, expert_layout


class MeshMismatchError(RuntimeError):
    """The mesh and an existing process group disagree about which ranks belong together."""


@dataclass(frozen=True)
class HybridMeshes:
    """The two meshes a model's parameters live on, with their layouts."""

    dense: DeviceMesh
    dense_layout: MeshLayout
    expert: DeviceMesh | None
    expert_layout: MeshLayout


def build_mesh(layout: MeshLayout, device_type: str, expert_parallel: int = 1) -> DeviceMesh:
    """A DeviceMesh for `layout`; with `expert_parallel` > 1 the ep index is the fastest rank digit."""
    world = layout.size * expert_parallel
    ranks = torch.arange(world).reshape(*layout.shape, expert_parallel)
    if expert_parallel == 1:
        return DeviceMesh(device_type, ranks.reshape(layout.shape), mesh_dim_names=layout.names)
    full = DeviceMesh(device_type, ranks, mesh_dim_names=(*layout.names, "ep"))
    return full[layout.names if len(layout.names) > 1 else layout.names[0]]


def build_meshes(cfg: LayoutConfig, device_type: str) -> HybridMeshes:
    """Build the dense mesh, and the expert mesh when the model has experts (collective)."""
    if dist.get_world_size() != cfg.world_size:
        raise MeshMismatchError(
            f"the config says world_size {cfg.world_size} but {dist.get_world_size()} processes were started; "
            "start as many processes as the config's world size."
        )
    dense, expert = dense_layout(cfg), expert_layout(cfg)
    dense_mesh = build_mesh(dense, device_type)
    expert_mesh = build_mesh(expert, device_type, cfg.ep) if cfg.num_moe_experts else None
    return HybridMeshes(dense_mesh, dense, expert_mesh, expert)


def check_axis(mesh: DeviceMesh, axis: str, group_ranks: Sequence[int], group_name: str) -> None:
    """Raise unless this rank's neighbours along `axis` are exactly `group_ranks`."""
    mesh_ranks = sorted(dist.get_process_group_ranks(mesh.get_group(axis)))
    if mesh_ranks != sorted(group_ranks):
        raise MeshMismatchError(
            f"rank {dist.get_rank()}: mesh axis '{axis}' holds ranks {mesh_ranks}, but the existing "
            f"{group_name} group holds {sorted(group_ranks)}; the mesh would mis-map shards. Build the "
            "process groups with the same instance count and rank order as the config "
            "(instances are consecutive blocks of ranks)."
        )
