"""Where work runs: the compute stream and one side stream each for gathers and reductions.

On CUDA, all-gathers run on the "gather" stream and reduce-scatters on the
"reduce" stream, ordered against compute by events alone (no `record_stream`):

- memory is always allocated on the compute stream, and a side stream waits on an
  event recorded right after the allocation before it writes, so it never
  overtakes the previous user of a recycled block;
- compute waits on a gather's event before it reads the gathered parameters, and
  a gathered buffer is freed only after that wait;
- a reduction's input stays referenced until compute has waited on the
  reduction's event (see `FlatParamGroup.release_reduction`);
- an optimizer step on the "optim" stream (`FusedAdamW(overlap_next_forward=True)`)
  is waited for by the next forward's gather and compute of its group, and the
  gradient buffer it reads is freed only after compute has waited on it.

On CPU (gloo is synchronous) `SyncStreams` runs everything in order and every
method is a no-op; `TracingStreams` keeps that behaviour but records the
ordering calls, so tests can check the CUDA path's ordering logic without a GPU.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

KINDS = ("compute", "gather", "reduce", "host", "optim")


class SyncStreams:
    """Everything on one stream, in program order."""

    overlaps = False

    def side(self, kind: str):
        return nullcontext()

    def record(self, kind: str):
        return None

    def wait(self, kind: str, event) -> None:
        return None


class CudaStreams:
    """The compute stream plus high-priority side streams for gathers and reductions, one for copies of
    offloaded gradients to host memory (so they never queue in front of a reduction), and one for an optimizer
    step that overlaps the next forward (at compute's priority: it fills what compute leaves idle)."""

    overlaps = True

    def __init__(self, device: torch.device):
        self.streams = {
            "compute": torch.cuda.current_stream(device),
            "gather": torch.cuda.Stream(device, priority=-1),
            "reduce": torch.cuda.Stream(device, priority=-1),
            "host": torch.cuda.Stream(device),
            "optim": torch.cuda.Stream(device),
        }

    def side(self, kind: str):
        return torch.cuda.stream(self.streams[kind])

    def record(self, kind: str):
        event = torch.cuda.Event()
        event.record(self.streams[kind])
        return event

    def wait(self, kind: str, event) -> None:
        if event is not None:
            self.streams[kind].wait_event(event)


class TracingStreams(SyncStreams):
    """Synchronous like `SyncStreams`, but logs (op, stream, event id) for ordering tests."""

    overlaps = True

    def __init__(self):
        self.trace: list[tuple[str, str, int | None]] = []
        self._next = 0
        self._current = "compute"

    @contextmanager
    def side(self, kind: str):
        previous, self._current = self._current, kind
        self.trace.append(("enter", kind, None))
        try:
            yield
        finally:
            self.trace.append(("exit", kind, None))
            self._current = previous

    def record(self, kind: str):
        self._next += 1
        self.trace.append(("record", kind, self._next))
        return self._next

    def wait(self, kind: str, event) -> None:
        self.trace.append(("wait", kind, event))

    def mark(self, what: str, unit: int) -> None:
        """Test hook: note that compute of `unit` is about to be enqueued."""
        self.trace.append((what, "compute", unit))


def streams_for(device: torch.device):
    return CudaStreams(device) if device.type == "cuda" else SyncStreams()
