"""The placement table as names, without torch: what each strategy does to each kind of state.

`placement.py` builds torch's DTensor placements from this table, so the two can never
disagree. Code that only describes a layout (`hfsdp validate-config` in a CI job,
`MeshLayout`'s shard arithmetic) reads the names here and never imports torch, which
costs seconds and hundreds of MB per process.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from hfsdp.core.rules.strategy import Strategy


class State(StrEnum):
    """The kinds of model state a strategy places: the three of every training step, and the outer optimizer's."""

    PARAM = "param"
    GRAD = "grad"
    OPTIM = "optim"
    OUTER = "outer"  # the outer optimizer's state (DiLoCo's global weights and outer momentum)


#: The kinds of state every training step has (what the four sharding strategies are about).
STEP_STATES = (State.PARAM, State.GRAD, State.OPTIM)

REPLICATE, PARTIAL, SHARD0 = "Replicate()", "Partial()", "Shard(0)"
#: Each coordinate along the axis holds its own value, which no per-step collective reads or writes: DiLoCo's
#: instances between two outer steps. DTensor has no such placement (a DTensor view leaves the axis out).
INDEPENDENT = "Independent()"

#: What one mesh axis of each strategy does to (param, grad, optim, outer), as DTensor placements are written.
#: The outer optimizer's state lives where the inner optimizer's does (it is a slice of the same weights), except
#: along a diloco axis, which shards it: each instance holds 1/R of it.
PLACEMENT_NAMES: dict[Strategy, dict[State, str]] = {
    Strategy.NO_SHARD: {State.PARAM: REPLICATE, State.GRAD: PARTIAL, State.OPTIM: REPLICATE, State.OUTER: REPLICATE},
    Strategy.OPTIM: {State.PARAM: REPLICATE, State.GRAD: PARTIAL, State.OPTIM: SHARD0, State.OUTER: SHARD0},
    Strategy.OPTIM_GRADS: {State.PARAM: REPLICATE, State.GRAD: SHARD0, State.OPTIM: SHARD0, State.OUTER: SHARD0},
    Strategy.OPTIM_GRADS_PARAMS: {State.PARAM: SHARD0, State.GRAD: SHARD0, State.OPTIM: SHARD0, State.OUTER: SHARD0},
    Strategy.DILOCO: {State.PARAM: INDEPENDENT, State.GRAD: INDEPENDENT, State.OPTIM: INDEPENDENT, State.OUTER: SHARD0},
}


def names_of(strategies: Sequence[Strategy | str], state: State | str) -> tuple[str, ...]:
    """The placement names of `state` on a mesh whose axes (outer first) take `strategies`."""
    return tuple(PLACEMENT_NAMES[Strategy.parse(s)][State(state)] for s in strategies)


def is_shard_name(name: str) -> bool:
    return name.startswith("Shard(")


def is_independent_name(name: str) -> bool:
    return name == INDEPENDENT


def describe_names(names: Sequence[str]) -> str:
    """`("Replicate()", "Shard(0)")` as people write it: `(Replicate(), Shard(0))`."""
    return "(" + ", ".join(names) + ")"
