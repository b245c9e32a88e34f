"""The engine's parameter groups of a model on a layout, with the geometry `FlatParamGroup` gives each.

`fully_shard` cuts a model into units (the layers, then the root) and each unit into one
group per mesh (dense, expert) and dtype; every group is one flat buffer padded to a
multiple of its mesh's size (`MeshLayout.padded_numel`). All of a rank's pieces (parameter,
gradient, optimizer) are cut from that padded length by the layout's shard factors, and
every collective follows the group's `CommPlan`. The planner builds the same groups from
closed-form counts, so padding enters every figure exactly as the engine pays it. All
parameters of a run share one dtype (fp32 main weights), so a unit has at most two groups,
and one more with `fully_shard(fp8_param_gather=True)`: the weights of its fp8 Linear layers
(`UnitParams.fp8`), put apart on every layout (the engine buckets by fp8 before it looks at
the layout) and gathered one byte per element where the layout gathers parameters at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property

from hfsdp.core.rules.comm_plan import CommPlan, plan_for
from hfsdp.core.rules.config import LayoutConfig
from hfsdp.core.rules.layout import MeshLayout, dense_layout, expert_layout
from hfsdp.core.rules.placement_names import State
from hfsdp.planning.model_shape import ModelShape


@dataclass(frozen=True)
class Group:
    """One (unit, mesh) flat buffer: its elements, its padded length and the lengths of rank 0's pieces.

    Rank 0 holds piece 0 of every state, which is never short of real elements, so its
    optimizer state (Adam keeps state for real elements only) is the largest of any rank.
    `fp8_weights` is how many fp8 Linear weights the group holds when it is a unit's fp8 group
    (0 for every other group).
    """

    unit: int
    is_root: bool
    expert: bool
    numel: int
    layout: MeshLayout
    plan: CommPlan
    fp8_weights: int = 0

    @cached_property
    def padded(self) -> int:
        return self.layout.padded_numel(self.numel)

    @cached_property
    def param_len(self) -> int:
        """Elements of the rank's parameter piece (`FlatParamGroup.param_range`)."""
        return self.padded // shard_factor(self.layout, State.PARAM)

    @cached_property
    def grad_len(self) -> int:
        """Elements of the gradient buffer kept between microbatches: cut only by the per-microbatch reduction."""
        return self.layout.range_over(self.plan.microbatch_reduce, self._origin, self.padded)[1]

    @cached_property
    def optim_len(self) -> int:
        """Elements of the rank's optimizer piece, padding included (the fp32 main weights cover it)."""
        return self.padded // shard_factor(self.layout, State.OPTIM)

    @property
    def optim_real(self) -> int:
        """Real (unpadded) elements of rank 0's optimizer piece: what AdamW keeps state for."""
        return min(self.optim_len, self.numel)

    @property
    def kind(self) -> tuple:
        """Everything but the unit: groups of the same kind have the same buffers and collectives."""
        return (self.is_root, self.expert, self.numel, self.layout, self.plan, self.fp8_weights)

    @property
    def gathers_params(self) -> bool:
        return bool(self.plan.param_gather)

    @property
    def gathers_fp8(self) -> bool:
        """Whether its parameter gathers move fp8 (1 byte per element), with one amax all-reduce per step: an fp8
        group on a layout that gathers parameters (elsewhere `FlatParamGroup` keeps it in the compute dtype)."""
        return bool(self.fp8_weights) and self.gathers_params

    @property
    def _origin(self) -> tuple[int, ...]:
        return (0,) * len(self.layout.axes)


@cache
def sharded_axes(layout: MeshLayout, state: State) -> tuple[int, ...]:
    """`layout.sharded_axes(state)`, remembered: a plan asks it of the same few layouts thousands of times."""
    return layout.sharded_axes(state)


@cache
def shard_factor(layout: MeshLayout, state: State) -> int:
    return layout.shard_factor(state)


def kinds(groups: list[Group]) -> list[tuple[Group, int]]:
    """One group of each kind with how many there are: a model's identical layers are counted, not repeated."""
    counts: dict[tuple, list] = {}
    for g in groups:
        counts.setdefault(g.kind, [g, 0])[1] += 1
    return [(g, n) for g, n in counts.values()]


def groups_for(shape: ModelShape, cfg: LayoutConfig, fp8_param_gather: bool = False) -> list[Group]:
    """The groups `fully_shard` builds for `shape` on `cfg`, in the engine's order (unit by unit, root last; within
    a unit the fp8 weights first, as a Hugging Face layer's projections come before its norms)."""
    dense, expert = dense_layout(cfg), expert_layout(cfg)
    dense_plan, expert_plan = plan_for(dense), plan_for(expert)
    out = []
    last = len(shape.units) - 1
    for index, unit in enumerate(shape.units):
        fp8 = unit.fp8 if fp8_param_gather else 0
        if fp8:
            out.append(Group(index, index == last, False, fp8, dense, dense_plan, unit.fp8_weights))
        if unit.dense - fp8:
            out.append(Group(index, index == last, False, unit.dense - fp8, dense, dense_plan))
        if unit.expert:
            out.append(Group(index, index == last, True, unit.expert // cfg.ep, expert, expert_plan))
    return out
