"""Who holds which flat range, and who writes it: pure functions of a layout and the group structure.

The online save, the offline reshard and the load all answer their questions
here, through the same `MeshLayout` the engine shards with, so a checkpoint can
never disagree with the engine about who holds what.

- A rank's optimizer range of a group is `layout.shard_range(OPTIM, coord,
  padded)`; intersected with each member it gives the flat sub-range of that
  parameter the rank holds (padding is never stored).
- Ranks with the same optimizer piece are replicas. Each piece of each parameter
  is written once, by the replica that has written the fewest elements so far
  (ties to the lowest rank): round-robin weighted by size, so a layer's large
  weight and small bias do not all land on the same replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfsdp.ckpt.format.index import GroupSpec
from hfsdp.core.config import LayoutConfig
from hfsdp.core.expert_naming import expert_index
from hfsdp.core.layout import MeshLayout, dense_layout, expert_layout
from hfsdp.core.placement_names import State


@dataclass(frozen=True)
class WriteItem:
    """Elements [start, stop) of the flattened parameter `name`."""

    name: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def group_layout(cfg: LayoutConfig, group: GroupSpec) -> MeshLayout:
    return expert_layout(cfg) if group.is_expert else dense_layout(cfg)


def group_ranks(cfg: LayoutConfig, group: GroupSpec) -> list[tuple[int, tuple[int, ...]]]:
    """(global rank, mesh coordinate) of every rank that holds `group`.

    Dense: every rank, at `dense_layout(cfg).coords()[r]`. Experts follow
    megatron's order (expert-parallel index fastest): rank r has ep rank
    `r % ep` and expert coordinate `expert_layout(cfg).coords()[r // ep]`.
    """
    if not group.is_expert:
        return list(enumerate(dense_layout(cfg).coords()))
    coords = expert_layout(cfg).coords()
    ep_rank = group.ep_rank or 0
    return [(r, coords[r // cfg.ep]) for r in range(cfg.world_size) if r % cfg.ep == ep_rank]


def member_ranges(group: GroupSpec, flat_range: tuple[int, int]) -> list[WriteItem]:
    """The parts of each member that fall inside `flat_range` of the group's (padded) buffer, in member order."""
    out = []
    for name, offset, numel in group.offsets():
        hit = intersect((offset, offset + numel), flat_range)
        if hit is not None:
            out.append(WriteItem(name, hit[0] - offset, hit[1] - offset))
    return out


def optim_range(cfg: LayoutConfig, group: GroupSpec, coord: tuple[int, ...]) -> tuple[int, int]:
    layout = group_layout(cfg, group)
    return layout.shard_range(State.OPTIM, coord, layout.padded_numel(group.numel))


def plan_writes(cfg: LayoutConfig, groups: list[GroupSpec]) -> dict[int, list[WriteItem]]:
    """Every rank's file contents: which flat range of which parameter it writes, in write order.

    Groups are walked in the given order (the canonical one: model order, expert
    groups by ep rank), so every process that plans the same structure gets the
    same answer, and an offline reshard writes exactly what an online save of the
    target layout would.
    """
    plan: dict[int, list[WriteItem]] = {r: [] for r in range(cfg.world_size)}
    load = dict.fromkeys(range(cfg.world_size), 0)
    for group in groups:
        layout = group_layout(cfg, group)
        padded = layout.padded_numel(group.numel)
        replicas: dict[tuple[int, int], list[int]] = {}
        for rank, coord in group_ranks(cfg, group):
            replicas.setdefault(layout.shard_range(State.OPTIM, coord, padded), []).append(rank)
        for flat_range in sorted(replicas):
            for item in member_ranges(group, flat_range):
                writer = min(replicas[flat_range], key=lambda r: (load[r], r))
                plan[writer].append(item)
                load[writer] += item.numel
    return plan


def unsharded_owner(cfg: LayoutConfig, name: str) -> int:
    """The rank whose file holds the unsharded module tensor `name` (a global name).

    A dense tensor is the same on every rank, and rank 0 writes it. An expert's
    tensor lives on the ranks of the expert-parallel rank that owns the expert
    (ranks r with r % ep = e); rank e, the first of them, writes it.
    """
    index = expert_index(name)
    if index is None or cfg.ep == 1 or not cfg.num_moe_experts:
        return 0
    return index // (cfg.num_moe_experts // cfg.ep)


def file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def tensor_key(kind: str, name: str) -> str:
    return f"{kind}/{name}"
