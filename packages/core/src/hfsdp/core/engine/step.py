"""Where the model is in an optimizer step: the one context every unit reads and the model drives.

    IDLE --backward of a microbatch before the last--> ACCUMULATING
         --backward of the last microbatch--> GRADS_READY (reduced over every axis; the optimizer may step)
    GRADS_READY --every parameter's gradient consumed (stepped or zeroed)--> IDLE

`set_microbatch(index, count)` declares which microbatch the next backward is; without it every
backward is the last of its step (count 1). Gradients are summed unscaled and scaled once, on the
last microbatch, by `grad_scale` = 1 / (count x dp): every layout then computes the gradient of the
mean loss over the global batch.

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


class StepContext:
    def __init__(self, dp: int, begin_backward: Callable[[], None], end_backward: Callable[[], None]):
        self.dp = dp
        self.index, self.count = 0, 1
        self.phase = StepPhase.IDLE
        self._begin, self._end = begin_backward, end_backward
        self._queued = False  # the end-of-backward callback of the running backward is queued

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def grad_scale(self) -> float:
        return 1.0 / (self.count * self.dp)

    def set_microbatch(self, index: int, count: int) -> None:
        if not 0 <= index < count:
            raise ValueError(f"microbatch index {index} is outside 0..{count - 1}")
        self.index, self.count = index, count

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
