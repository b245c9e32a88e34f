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
- With DiLoCo state a checkpoint has two sections (`Section`): the per-instance
  kinds, where ranks of different instances are never replicas and instance o's
  piece sits at o * numel of a tensor with the instance count in front; and the
  outer kinds, planned over the outer state's pieces (`State.OUTER`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hfsdp.ckpt.format.index import GroupSpec
from hfsdp.core.rules.config import LayoutConfig
from hfsdp.core.rules.expert_naming import expert_index
from hfsdp.core.rules.layout import MeshLayout, dense_layout, expert_layout
from hfsdp.core.rules.placement_names import State


@dataclass(frozen=True)
class Section:
    """Kinds written with one plan: `plan` gives each rank's items; `instances` > 1 puts an instance dimension
    in front of every tensor (the items' ranges are in that larger flat tensor)."""

    kinds: tuple[str, ...]
    plan: dict[int, list[WriteItem]]
    instances: int = 1


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


def instance_of(layout: MeshLayout, coord: tuple[int, ...]) -> int:
    """Which instance the rank at `coord` is (its coordinate along the axes that train apart; 0 without any)."""
    index = 0
    for k in layout.independent_axes():
        index = index * layout.axes[k].size + coord[k]
    return index


def plan_writes(
    cfg: LayoutConfig,
    groups: list[GroupSpec],
    state: State = State.OPTIM,
    per_instance: bool = False,
    load: dict[int, int] | None = None,
) -> dict[int, list[WriteItem]]:
    """Every rank's file contents: which flat range of which parameter it writes, in write order.

    Groups are walked in the given order (the canonical one: model order, expert
    groups by ep rank), so every process that plans the same structure gets the
    same answer, and an offline reshard writes exactly what an online save of the
    target layout would. `state` says whose pieces are written (the optimizer's,
    or DiLoCo's outer state); `per_instance` writes each instance's own copy, at
    instance * numel. `load` (rank -> elements planned so far) carries the
    balance over from an earlier section.
    """
    plan: dict[int, list[WriteItem]] = {r: [] for r in range(cfg.world_size)}
    load = dict.fromkeys(range(cfg.world_size), 0) if load is None else load
    for group in groups:
        layout = group_layout(cfg, group)
        padded = layout.padded_numel(group.numel)
        replicas: dict[tuple[int, tuple[int, int]], list[int]] = {}
        for rank, coord in group_ranks(cfg, group):
            instance = instance_of(layout, coord) if per_instance else 0
            replicas.setdefault((instance, layout.shard_range(state, coord, padded)), []).append(rank)
        numel = {name: math.prod(shape) for name, shape in group.members}
        for instance, flat_range in sorted(replicas):
            for item in member_ranges(group, flat_range):
                writer = min(replicas[instance, flat_range], key=lambda r: (load[r], r))
                shift = instance * numel[item.name]
                plan[writer].append(WriteItem(item.name, item.start + shift, item.stop + shift))
                load[writer] += item.numel
    return plan


def sections(cfg: LayoutConfig, groups: list[GroupSpec], kinds: list[str], outer: bool) -> list[Section]:
    """The plans of a checkpoint's kinds: one plan for every kind, or with DiLoCo state (`outer`) the per-instance
    kinds and the outer kinds (`OUTER_KINDS`), planned one after the other."""
    from hfsdp.ckpt.format.index import OUTER_KINDS

    if not outer:
        return [Section(tuple(kinds), plan_writes(cfg, groups))]
    load = dict.fromkeys(range(cfg.world_size), 0)
    own = tuple(k for k in kinds if k not in OUTER_KINDS)
    shared = tuple(k for k in kinds if k in OUTER_KINDS)
    return [
        Section(own, plan_writes(cfg, groups, per_instance=True, load=load), cfg.instances),
        Section(shared, plan_writes(cfg, groups, State.OUTER, load=load)),
    ]


def source_range(index, kind: str, name: str, numel: int, start: int, stop: int) -> tuple[int, int]:
    """Where elements [start, stop) of `kind` tensor `name` of a target's instance are in the source checkpoint
    `index`: `start`/`stop` are in the target's flat tensor (instance o' at o' * numel when the target has an
    instance dimension). Instance o' reads source instance o' mod R (a source without instances: its one copy)."""
    target_instance, offset = divmod(start, numel)
    if not index.per_instance(kind):
        return offset, offset + stop - start
    shift = (target_instance % index.instances) * numel
    return shift + offset, shift + offset + stop - start


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
