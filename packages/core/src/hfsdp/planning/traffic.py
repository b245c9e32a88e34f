"""Every collective one optimizer step issues, group by group, and the bytes each mesh axis carries.

This follows `FlatParamGroup` call for call, from the group's `CommPlan`:

- a parameter gather (`_gather`): one all-gather per axis of `plan.param_gather`, outer
  first, each growing the piece by that axis; once in a unit's forward and once in its
  backward, except the root when it keeps its parameters from forward to backward;
- per microbatch, a reduce-scatter of the whole padded gradient over the inner axis where it
  shards gradients (`plan.microbatch_reduce`);
- on the last microbatch, the once-per-step reductions (`plan.final_reduce`), each on the
  range the previous one left: an all-reduce, or a reduce-scatter that narrows it;
- after the optimizer step, the gather of the new weights over `plan.post_step_gather`.

A group of fp8 weights (`fully_shard(fp8_param_gather=True)`, `Group.gathers_fp8`) gathers its
parameters one byte per element, forward and backward alike, and once per optimizer step
max-reduces its weights' amaxes (one fp32 element per weight) with an all-reduce over each axis
that shards parameters (`Fp8Weights.refresh`, at the step's first gather). Its post-step gather
stays in the compute dtype: it carries the cast of the main weights each rank quantizes from.

Bytes are the ring model of `hfsdp.core.buffers.collectives.CommRecord` (α(n)·size, twice that for an
all-reduce), counted on the full side of each collective, so they equal what the
collectives counter records in a real run, padding included (tests/planning/test_plan_traffic.py;
with the fp8 gather, test_plan_traffic_fp8.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

from hfsdp.core.rules.layout import MeshLayout
from hfsdp.core.rules.placement_names import State
from hfsdp.planning.groups import Group, kinds, sharded_axes

FORWARD, BACKWARD, MICROBATCH, FINAL, POST_STEP = "forward", "backward", "microbatch", "final", "post_step"
AMAX = "amax"
#: Bytes per element of a parameter gathered in fp8, and of an amax.
FP8_BYTES, AMAX_BYTES = 1, 4


@dataclass(frozen=True)
class Collective:
    """One collective call as `CommRecord` records it, with the group and the phase of the step it belongs to."""

    group: int
    phase: str
    op: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    axis: str
    group_size: int
    numel: int  # elements of the full side
    element_size: int

    @property
    def bytes_sent(self) -> float:
        """What this rank sends under the ring model: α(n)·numel·element size, twice for an all-reduce."""
        alpha = (self.group_size - 1) / self.group_size
        return (2 if self.op == "all_reduce" else 1) * alpha * self.numel * self.element_size

    def record(self) -> tuple[str, str, int, int, int]:
        """The fields `hfsdp.core.buffers.collectives.CommRecord` has, for comparing with a counted run."""
        return (self.op, self.axis, self.group_size, self.numel, self.element_size)


def gathers(group: Group, index: int, phase: str, state: State, axes: tuple[int, ...], size: int) -> list[Collective]:
    """The all-gathers that grow a piece of `state` over `axes` (outer first), as `FlatParamGroup._gather` issues."""
    return [
        Collective(index, phase, "all_gather", axis, group_size, numel, size)
        for axis, group_size, numel in _gather_steps(group.layout, state, axes, group.padded)
    ]


@cache
def _gather_steps(layout: MeshLayout, state: State, axes: tuple[int, ...], padded: int) -> tuple:
    """(axis, group size, output elements) of each all-gather; the same for every unit of a size, so remembered."""
    origin = (0,) * len(layout.axes)
    sharded = list(sharded_axes(layout, state))
    out = []
    for k in axes:
        sharded.remove(k)
        start, stop = layout.range_over(tuple(sharded), origin, padded)
        out.append((layout.names[k], layout.axes[k].size, stop - start))
    return tuple(out)


def gather_bytes(group: Group, compute_bytes: int) -> int:
    """b_p of the group's parameter gathers: 1 for fp8 weights, else the compute dtype's bytes."""
    return FP8_BYTES if group.gathers_fp8 else compute_bytes


def parameter_gather(group: Group, index: int, phase: str, compute_bytes: int) -> list[Collective]:
    return gathers(group, index, phase, State.PARAM, group.plan.param_gather, gather_bytes(group, compute_bytes))


def amax_reduction(group: Group, index: int) -> list[Collective]:
    """An fp8 group's once-per-step max of its weights' amaxes: one fp32 per weight, all-reduced over each axis that
    shards the pieces it quantizes, outer first: the parameters', or, where the post-step gather moves fp8 too
    (HFSDP's outer axis), the optimizer's, right after the step (none for any other group)."""
    if not group.gathers_fp8:
        return []
    names, sizes = group.layout.names, group.layout.shape
    state = State.OPTIM if group.plan.post_step_gather else State.PARAM
    return [
        Collective(index, AMAX, "all_reduce", names[k], sizes[k], group.fp8_weights, AMAX_BYTES)
        for k in sharded_axes(group.layout, state)
    ]


def microbatch_reduction(group: Group, index: int, reduce_bytes: int) -> list[Collective]:
    """The per-microbatch reduce-scatter of the whole padded gradient over the inner axis, where it shards them."""
    names, sizes = group.layout.names, group.layout.shape
    return [
        Collective(index, MICROBATCH, "reduce_scatter", names[k], sizes[k], group.padded, reduce_bytes)
        for k in group.plan.microbatch_reduce
    ]


def final_reductions(group: Group, index: int, reduce_bytes: int) -> list[Collective]:
    """The once-per-step reductions of the last microbatch, each on the range the one before left."""
    layout, origin = group.layout, (0,) * len(group.layout.axes)
    length = group.grad_len
    sharded = list(group.plan.microbatch_reduce)
    out = []
    for k, op in group.plan.final_reduce:
        out.append(Collective(index, FINAL, op, layout.names[k], layout.axes[k].size, length, reduce_bytes))
        if op == "reduce_scatter":
            sharded.append(k)
            start, stop = layout.range_over(tuple(sharded), origin, group.padded)
            length = stop - start
    return out


def post_step_gather(group: Group, index: int, compute_bytes: int) -> list[Collective]:
    """The gather of the updated weights over axes that replicate parameters but shard the optimizer: in fp8 for an
    fp8 group (its optimizer piece quantized right after the step), else in the compute dtype."""
    size = gather_bytes(group, compute_bytes)
    return gathers(group, index, POST_STEP, State.OPTIM, group.plan.post_step_gather, size)


def gathers_per_microbatch(group: Group, root_resharded: bool, units_resharded: bool = True) -> int:
    """Forward and backward each gather a unit's parameters; a unit that keeps them from forward through backward
    (the root by default, every unit with `reshard_after_forward=False`) gathers once."""
    resharded = root_resharded if group.is_root else units_resharded
    return 2 if resharded else 1


def step_collectives(
    groups: list[Group],
    microbatches: int,
    compute_bytes: int,
    reduce_bytes: int = 4,
    root_resharded: bool = False,
    units_resharded: bool = True,
) -> list[Collective]:
    """Every collective of one optimizer step of `microbatches` microbatches (order within a phase not kept)."""
    out: list[Collective] = []
    for m in range(microbatches):
        for index, group in enumerate(groups):
            phases = (FORWARD, BACKWARD)[: gathers_per_microbatch(group, root_resharded, units_resharded)]
            for phase in phases:
                out += parameter_gather(group, index, phase, compute_bytes)
            out += microbatch_reduction(group, index, reduce_bytes)
            if m == microbatches - 1:
                out += final_reductions(group, index, reduce_bytes)
    for index, group in enumerate(groups):
        out += post_step_gather(group, index, compute_bytes)
        out += amax_reduction(group, index)
    return out


def step_bytes(
    groups: list[Group], microbatches: int, compute_bytes: int, reduce_bytes: int = 4, root_resharded: bool = False
) -> dict[str, float]:
    """`bytes_per_axis(step_collectives(...))`, computed once per kind of group (a plan's hot path)."""
    out: dict[str, float] = {}
    for group, count in kinds(groups):
        for axis, sent in bytes_per_axis(
            step_collectives([group], microbatches, compute_bytes, reduce_bytes, root_resharded)
        ).items():
            out[axis] = out.get(axis, 0.0) + count * sent
    return out


def bytes_per_axis(collectives: Iterable[Collective]) -> dict[str, float]:
    """Bytes this rank sends per step on each mesh axis (axes that carry nothing are left out)."""
    out: dict[str, float] = {}
    for c in collectives:
        out[c.axis] = out.get(c.axis, 0.0) + c.bytes_sent
    return out
