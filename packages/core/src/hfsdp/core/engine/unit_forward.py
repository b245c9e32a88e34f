"""What may wrap a unit's forward: activation recomputation and torch.compile.

Both replace the unit's bound `forward` and leave the module itself alone: its
parameter names (which checkpoints use), its place in the model, and hfsdp's
hooks, which stay outside around `__call__`. So the unit is gathered before the
wrapped forward runs and freed after, exactly as without it; and when backward
recomputes a checkpointed forward, the unit's parameters are already gathered,
because its pre-backward hook fires on the gradient of its outputs, before any
node inside it runs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def recompute(units: Iterable[nn.Module]) -> None:
    """Keep only each unit's inputs in forward and recompute its activations in backward (non-reentrant)."""
    for unit in units:
        inner = unit.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        unit.forward = forward


def compile_units(units: Iterable[nn.Module], **options) -> None:
    """torch.compile each unit's forward (`options` go to torch.compile); hfsdp's hooks stay eager."""
    for unit in units:
        unit.forward = torch.compile(unit.forward, **options)
