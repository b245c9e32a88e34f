"""The loop every engine test runs: a step's microbatches, each told to the engine, summed into one loss."""

from __future__ import annotations

from collections.abc import Callable

import torch


def accumulate(sharded, count: int, loss_of: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Forward and backward `count` microbatches (`loss_of(index)` is one's loss); this rank's summed loss. The
    engine is told each microbatch's index, so it reduces gradients once, after the last."""
    total = torch.zeros(())
    for index in range(count):
        sharded.set_microbatch(index, count)
        loss = loss_of(index)
        loss.backward()
        total += loss.detach()
    return total
