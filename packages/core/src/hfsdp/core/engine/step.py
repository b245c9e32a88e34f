"""Where the model is in an optimizer step: the one context every unit reads and the model drives.

    IDLE --backward of a microbatch before the last--> ACCUMULATING
         --backward of the last microbatch--> GRADS_READY (reduced over every axis; the optimizer may step)
    GRADS_READY --every parameter's gradient consumed (stepped or zeroed)--> IDLE

Two ways to declare gradient accumulation, one per model, since they disagree on who scales the loss:

- hfsdp's `set_microbatch(index, count)` says which microbatch the next backward is; the engine
  scales: gradients are summed unscaled and multiplied once, on the last microbatch, by
  `grad_scale` = 1 / (count x dp), so every layout computes the gradient of the mean loss over the
  global batch (the user does not divide the loss by the microbatch count);
- FSDP2's `set_requires_gradient_sync(flag)` (and `set_requires_all_reduce(flag)`, FSDP1's
  `no_sync()`) says whether the next backward reduces over every axis; the user scales the loss
  (`(loss / M).backward()`, as with FSDP2) and the engine divides by dp alone, FSDP2's mean over
  the data-parallel ranks.

Without either every backward is the last of its step (count 1). Mixing them on one model would
leave the loss's scale to chance (divided by M twice, or not at all), so the second is refused.

The context also queues the engine's end-of-backward callback once per backward: units call
`enter_backward` from their pre-backward hooks, and the first call of a backward does the
engine's `begin_backward` and queues its `end_backward` with autograd.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from torch.autograd import Variable


class StepPhase(Enum):
    IDLE = "idle"  # no gradients held
    ACCUMULATING = "accumulating"  # microbatches before the last have run backward
    GRADS_READY = "grads ready"  # the last microbatch was reduced over every axis: the optimizer may step


class Accumulation(Enum):
    """Which API declared gradient accumulation, and so who scales the loss."""

    UNDECLARED = "undeclared"  # every backward is the last of its step
    MICROBATCHES = "set_microbatch"  # the engine divides by the microbatch count
    SYNC_FLAGS = "set_requires_gradient_sync"  # FSDP2's flags: the user divides the loss


class StepContext:
    def __init__(
        self, dp: int, begin_backward: Callable[[], None], end_backward: Callable[[], None], outer_axis: bool = False
    ):
        self.dp = dp
        self.outer_axis = outer_axis  # an outer axis reduces every step (HSDP/HFSDP): what requires_all_reduce skips
        self.index, self.count = 0, 1
        self.accumulation = Accumulation.UNDECLARED
        self.gradient_sync = True  # FSDP2's requires_gradient_sync
        self.all_reduce = True  # FSDP2's requires_all_reduce (HSDP/HFSDP: the reduction over the outer axis)
        self.phase = StepPhase.IDLE
        self._begin, self._end = begin_backward, end_backward
        self._queued = False  # the end-of-backward callback of the running backward is queued

    @property
    def is_last(self) -> bool:
        """Whether the next backward reduces over every axis (the step's gradients are then ready)."""
        if self.accumulation is Accumulation.SYNC_FLAGS:  # FSDP2: without an outer axis there is no all-reduce to skip
            return self.gradient_sync and (self.all_reduce or not self.outer_axis)
        return self.index == self.count - 1

    @property
    def grad_scale(self) -> float:
        if self.accumulation is Accumulation.SYNC_FLAGS:
            return 1.0 / self.dp  # the user scaled the loss by the microbatch count
        return 1.0 / (self.count * self.dp)

    def set_microbatch(self, index: int, count: int) -> None:
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (index, count)):
            raise TypeError(f"set_microbatch(index, count) takes two whole numbers, got {index!r}, {count!r}")
        if not 0 <= index < count:
            raise ValueError(f"microbatch index {index} is outside 0..{count - 1}")
        self._declare(Accumulation.MICROBATCHES, "set_microbatch")
        self.index, self.count = index, count

    def set_sync_flag(self, name: str, value: bool) -> None:
        """FSDP2's `set_requires_gradient_sync` / `set_requires_all_reduce` / `set_is_last_backward`."""
        if not isinstance(value, bool):
            raise TypeError(f"{name} takes True or False, got {value!r}")
        self._declare(Accumulation.SYNC_FLAGS, name)
        if name == "set_requires_gradient_sync":
            self.gradient_sync = value
        elif name == "set_requires_all_reduce":
            self.all_reduce = value
        # set_is_last_backward only declares: hfsdp finishes every backward's reductions whatever it says

    def _declare(self, accumulation: Accumulation, name: str) -> None:
        if self.accumulation in (Accumulation.UNDECLARED, accumulation):
            self.accumulation = accumulation
            return
        first, second = self.accumulation.value, name
        raise RuntimeError(
            f"gradient accumulation on this model was declared with {first}(), and now {second}() is called: the two "
            "disagree on who scales the loss (set_microbatch(index, count) has hfsdp divide by the microbatch count, "
            "so the loss is not divided; FSDP2's set_requires_gradient_sync(flag) and no_sync() leave it to you, "
            "(loss / M).backward()). Mixing them would divide by M twice or not at all; use one of them throughout."
        )

    def enter_backward(self) -> None:
        """Called by every unit whose backward begins: the first of a backward starts it and queues its end."""
        if not self._queued:
            self._begin()
            self._queued = True
            Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self._queued = False
        self._end()
        self.phase = StepPhase.GRADS_READY if self.is_last else StepPhase.ACCUMULATING
