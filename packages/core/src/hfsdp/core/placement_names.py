"""The placement table as names, without torch: what each strategy does to each kind of state.

`placement.py` builds torch's DTensor placements from this table, so the two can never
disagree. Code that only describes a layout (`hfsdp validate-config` in a CI job,
`MeshLayout`'s shard arithmetic) reads the names here and never imports torch, which
costs seconds and hundreds of MB per process.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from hfsdp.core.strategy import Strategy


class State(StrEnum):
    """The three kinds of model state a strategy may shard."""

    PARAM = "param"
    GRAD = "grad"
    OPTIM = "optim"


REPLICATE, PARTIAL, SHARD0 = "Replicate()", "Partial()", "Shard(0)"

#: What one mesh axis of each strategy does to (param, grad, optim), as DTensor placements are written.
PLACEMENT_NAMES: dict[Strategy, dict[State, str]] = {
    Strategy.NO_SHARD: {State.PARAM: REPLICATE, State.GRAD: PARTIAL, State.OPTIM: REPLICATE},
    Strategy.OPTIM: {State.PARAM: REPLICATE, State.GRAD: PARTIAL, State.OPTIM: SHARD0},
    Strategy.OPTIM_GRADS: {State.PARAM: REPLICATE, State.GRAD: SHARD0, State.OPTIM: SHARD0},
    Strategy.OPTIM_GRADS_PARAMS: {State.PARAM: SHARD0, State.GRAD: SHARD0, State.OPTIM: SHARD0},
}


def names_of(strategies: Sequence[Strategy | str], state: State | str) -> tuple[str, ...]:
    """The placement names of `state` on a mesh whose axes (outer first) take `strategies`."""
    return tuple(PLACEMENT_NAMES[Strategy.parse(s)][State(state)] for s in strategies)


def is_shard_name(name: str) -> bool:
    return name.startswith("Shard(")


def describe_names(names: Sequence[str]) -> str:
    """`("Replicate()", "Shard(0)")` as people write it: `(Replicate(), Shard(0))`."""
    return "(" + ", ".join(names) + ")"
