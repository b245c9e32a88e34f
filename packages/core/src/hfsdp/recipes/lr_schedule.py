"""Megatron's learning-rate schedule as a `torch.optim.lr_scheduler.LambdaLR`.

Megatron (`OptimizerParamScheduler`) counts optimizer steps from 1 and gives step n
the learning rate

- warmup, n <= W: `lr * n / W`;
- decay, W < n <= D: `min_lr + c * (lr - min_lr)`, with `r = (n - W) / (D - W)` and
  c = 1 (constant), 1 - r (linear) or (1 + cos(pi r)) / 2 (cosine);
- after D: `min_lr` (constant: `lr`).

A LambdaLR multiplies each group's base rate by `factor(e)`, where e is the number of
steps already taken, so `factor(e)` is Megatron's rate of step e + 1 over `lr`. Built
this way the schedule is a plain torch scheduler: it works with any optimizer, and a
resume at step s is `LambdaLR(opt, factor, last_epoch=s - 1)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class Schedule:
    lr: float
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int | None = None  # None: no decay after warmup
    style: str = "constant"

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"lr decay style '{self.style}' is not one of {', '.join(STYLES)}")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (1-based, as Megatron counts)."""
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.lr * step / self.warmup_iters
        if self.style == "constant" or self.decay_iters is None:
            return self.lr
        if step > self.decay_iters:
            return self.min_lr
        ratio = (step - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def factor(self) -> Callable[[int], float]:
        """LambdaLR's multiplier: after `e` steps, the next step's rate over `lr`."""
        return lambda taken: self.lr_at(taken + 1) / self.lr


def scheduler(optimizer: torch.optim.Optimizer, schedule: Schedule, start_step: int = 0):
    """A LambdaLR driving every group of `optimizer` by `schedule`, positioned after `start_step` steps.

    Each group's base rate becomes `schedule.lr` (its `initial_lr`), so a resumed run
    follows the schedule it was given, whatever rate the checkpoint's groups held.
    """
    for group in optimizer.param_groups:
        group["initial_lr"] = schedule.lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor(), last_epoch=start_step - 1)
