"""The placement rules: one table per axis, one function that composes axes.

Every layout hfsdp supports falls out of `PLACEMENT_TABLE` applied axis by axis;
there is no HSDP or HFSDP special case anywhere. The engine derives all of its
collectives from these placements (see `plan.py`), so the table is the single
source of truth for what is communicated. The table is built from the torch-free
`placement_names.PLACEMENT_NAMES`, which tools that only describe a layout read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from hfsdp.core.rules.placement_names import INDEPENDENT, PARTIAL, PLACEMENT_NAMES, REPLICATE, SHARD0, State
from hfsdp.core.rules.strategy import Strategy

__all__ = [
    "PLACEMENT_TABLE",
    "AxisPlacements",
    "Independent",
    "Placements",
    "State",
    "compose",
    "describe",
    "is_shard",
]


class Independent(Placement):
    """Each coordinate along the axis holds its own value (DiLoCo's instances between outer steps).

    DTensor has no placement for this, and none of its operations accept this one: it only
    describes a layout. The engine's DTensor views leave such an axis out (`dtensor.py`).
    """

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Independent)

    def __hash__(self) -> int:
        return hash(INDEPENDENT)

    def __repr__(self) -> str:
        return INDEPENDENT


@dataclass(frozen=True)
class AxisPlacements:
    """What one mesh axis does to each kind of state."""

    param: Placement
    grad: Placement
    optim: Placement
    outer: Placement

    def of(self, state: State) -> Placement:
        return getattr(self, State(state).value)


_FROM_NAME = {REPLICATE: Replicate(), PARTIAL: Partial(), SHARD0: Shard(0), INDEPENDENT: Independent()}

PLACEMENT_TABLE: dict[Strategy, AxisPlacements] = {
    strategy: AxisPlacements(**{state.value: _FROM_NAME[name] for state, name in row.items()})
    for strategy, row in PLACEMENT_NAMES.items()
}


@dataclass(frozen=True)
class Placements:
    """The placements of each kind of state on a mesh, one entry per axis, outer axis first."""

    param: tuple[Placement, ...]
    grad: tuple[Placement, ...]
    optim: tuple[Placement, ...]
    outer: tuple[Placement, ...]

    def of(self, state: State) -> tuple[Placement, ...]:
        return getattr(self, State(state).value)


def compose(strategies: Sequence[Strategy]) -> Placements:
    """Placements on a mesh whose axes (outer first) take `strategies`."""
    per_axis = [PLACEMENT_TABLE[Strategy.parse(s)] for s in strategies]
    return Placements(
        param=tuple(a.param for a in per_axis),
        grad=tuple(a.grad for a in per_axis),
        optim=tuple(a.optim for a in per_axis),
        outer=tuple(a.outer for a in per_axis),
    )


def is_shard(placement: Placement) -> bool:
    return isinstance(placement, Shard)


def describe(placements: Sequence[Placement]) -> str:
    """`(Replicate(), Shard(0))` as people write it."""
    return "(" + ", ".join(_name(p) for p in placements) + ")"


def _name(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Partial):
        return "Partial()"
    if isinstance(p, Independent):
        return INDEPENDENT
    return "Replicate()"
