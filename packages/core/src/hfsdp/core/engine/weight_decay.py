"""Which parameters take weight decay: Megatron's rule, and the two optimizer parameter groups it gives a model.

Above `sharding` (it reads a sharded model's main params), so the main params themselves
(`buffers/main_params.py`) know nothing of the module they belong to.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch

from hfsdp.core.engine.sharding import sharding_of

NoDecay = Callable[[str, torch.Size], bool]


def megatron_no_decay(name: str, shape: torch.Size) -> bool:
    """Megatron's rule: no weight decay for biases and 1-D parameters (norms); embeddings likewise here."""
    return name.endswith(".bias") or len(shape) <= 1 or "embed" in name


def param_groups(model, weight_decay: float = 0.01, no_decay: NoDecay | Iterable[str] | None = None) -> list[dict]:
    """Two optimizer parameter groups of `model`'s parameters (its main params): with weight decay, and without.

    `no_decay` picks the parameters without decay: a function of (global name,
    full shape), or regular expressions matched against the name; default
    `megatron_no_decay`. The decision uses the whole parameter's shape and
    name, so every piece of a parameter lands in the same group on every rank,
    and every rank's optimizer has the same group structure.
    """
    rule = _no_decay_rule(no_decay)
    decay, plain = [], []
    for piece in sharding_of(model).main_params:
        (plain if rule(piece.name, piece.shape) else decay).append(piece.param)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": plain, "weight_decay": 0.0, "name": "no_decay"},
    ]


def _no_decay_rule(no_decay: NoDecay | Iterable[str] | None) -> NoDecay:
    if no_decay is None:
        return megatron_no_decay
    if callable(no_decay):
        return no_decay
    patterns = [re.compile(p) for p in no_decay]
    return lambda name, shape: any(p.search(name) for p in patterns)
