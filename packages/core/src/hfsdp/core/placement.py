"""The placement rules: one table per axis, one function that composes axes.

Every layout hfsdp supports falls out of `PLACEMENT_TABLE` applied axis by axis;
there is no HSDP or HFSDP special case anywhere. The engine derives all of its
collectives from these placements (see `plan.py`), so the table is the single
source of truth for what is communicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from hfsdp.core.strategy import Strategy


class State(StrEnum):
    """The three kinds of model state a strategy may shard."""

    PARAM = "param"
    GRAD = "grad"
    OPTIM = "optim"


@dataclass(frozen=True)
class AxisPlacements:
    """What one mesh axis does to each kind of state."""

    param: Placement
    grad: Placement
    optim: Placement

    def of(self, state: State) -> Placement:
        return getattr(self, State(state).value)


PLACEMENT_TABLE: dict[Strategy, AxisPlacements] = {
    Strategy.NO_SHARD: AxisPlacements(Replicate(), Partial(), Replicate()),
    Strategy.OPTIM: AxisPlacements(Replicate(), Partial(), Shard(0)),
    Strategy.OPTIM_GRADS: AxisPlacements(Replicate(), Shard(0), Shard(0)),
    Strategy.OPTIM_GRADS_PARAMS: AxisPlacements(Shard(0), Shard(0), Shard(0)),
}


@dataclass(frozen=True)
class Placements:
    """The placements of each kind of state on a mesh, one entry per axis, outer axis first."""

    param: tuple[Placement, ...]
    grad: tuple[Placement, ...]
    optim: tuple[Placement, ...]

    def of(self, state: State) -> tuple[Placement, ...]:
        return getattr(self, State(state).value)


def compose(strategies: Sequence[Strategy]) -> Placements:
    """Placements on a mesh whose axes (outer first) take `strategies`."""
    per_axis = [PLACEMENT_TABLE[Strategy.parse(s)] for s in strategies]
    return Placements(
        param=tuple(a.param for a in per_axis),
        grad=tuple(a.grad for a in per_axis),
        optim=tuple(a.optim for a in per_axis),
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
    return "Replicate()"
