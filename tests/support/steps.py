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


def causal_lm_steps(model, opt, ids: torch.Tensor, steps: int, ranks: int = 1) -> list[float]:
    """`steps` optimizer steps of a causal LM on `ids` (its own labels): each step's loss, averaged over `ranks`
    ranks (an all-reduce, collective) where a sharded model runs on several, each rank on its share of the batch."""
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().clone()
        if ranks > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / ranks)
    return losses
