"""Where one group's parameters live in its flat padded buffer, and which range of it each state holds here.

A `FlatLayout` is fixed when the group is built: the parameters' slots (offset and shape in the
buffer), the padded length (every piece on every axis equal), this rank's coordinate on the
group's mesh, the ranges of the buffer this rank holds for parameters, gradients and the
optimizer, and the collectives the placements ask for (`comm_plan.py`). The parameter and gradient
sides of a group (`FlatParamGroup`, `GradBuffer`) share one, so they can never disagree about it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hfsdp.core.rules.comm_plan import CommPlan, plan_for
from hfsdp.core.rules.layout import MeshLayout
from hfsdp.core.rules.placement_names import State

Range = tuple[int, int]


@dataclass(frozen=True, eq=False)
class ParamSlot:
    """Where one parameter lives in its group's flat buffer. `param` is the module's own parameter object: the
    tensor forward and backward compute with (its data is a view into the unsharded buffer)."""

    name: str  # the parameter's name in the module (local, for experts)
    global_name: str  # the layout-independent name (experts by global index): checkpoints and state dicts
    param: nn.Parameter
    shape: torch.Size
    offset: int
    dtype: torch.dtype  # the parameter's dtype when it was sharded: what a full state dict gives back

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def stop(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatLayout:
    layout: MeshLayout
    plan: CommPlan
    coord: tuple[int, ...]
    slots: tuple[ParamSlot, ...]
    numel: int
    padded: int
    param_range: Range
    grad_range: Range  # what this rank accumulates between microbatches (after the per-microbatch reduction)
    optim_range: Range
    outer_range: Range  # the outer optimizer's piece (DiLoCo); the optimizer's own where no axis trains apart

    @classmethod
    def build(cls, named_params, global_names, layout: MeshLayout, coord: tuple[int, ...]) -> FlatLayout:
        slots, offset = [], 0
        for (name, param), global_name in zip(named_params, global_names, strict=True):
            slots.append(ParamSlot(name, global_name, param, param.shape, offset, param.dtype))
            offset += param.numel()
        padded = layout.padded_numel(offset)
        plan = plan_for(layout)
        return cls(
            layout=layout,
            plan=plan,
            coord=coord,
            slots=tuple(slots),
            numel=offset,
            padded=padded,
            param_range=layout.shard_range(State.PARAM, coord, padded),
            grad_range=layout.range_over(plan.microbatch_reduce, coord, padded),
            optim_range=layout.shard_range(State.OPTIM, coord, padded),
            outer_range=layout.shard_range(State.OUTER, coord, padded),
        )

    def range_over(self, sharded_axes: tuple[int, ...]) -> Range:
        """This rank's range of the padded buffer when `sharded_axes` shard it."""
        return self.layout.range_over(sharded_axes, self.coord, self.padded)

    @staticmethod
    def within(outer: Range, inner: Range) -> slice:
        """`inner` as a slice of a tensor that holds `outer`."""
        return slice(inner[0] - outer[0], inner[1] - outer[0])
