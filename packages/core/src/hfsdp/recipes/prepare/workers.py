"""The tokenizing processes: N spawned workers, batches in order, a bounded number in flight.

Order is kept (batch k's documents are written before batch k+1's), so the dataset is the same whatever
`--workers` is. At most `2 * N + 1` batches are in flight, so a corpus of any size needs memory for a few
batches only. The workers are spawned (a fresh interpreter: nothing of the parent's threads or its imported torch),
never get SIGINT (it is blocked while they start, and they ignore it), and get SIGKILL when the parent dies; a
worker that dies (the out-of-memory killer) is a PrepareError, not a hang; leaving the block by an exception or a
signal terminates them all at once.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace

from hfsdp.recipes.prepare import encode
from hfsdp.recipes.prepare.errors import PrepareError
from hfsdp.recipes.prepare.signals import held
from hfsdp.recipes.prepare.sources import Batch


class Workers:
    def __init__(self, count: int, job: encode.Job):
        self.count = count
        spawn = multiprocessing.get_context("spawn")
        self.pool = ProcessPoolExecutor(count, mp_context=spawn, initializer=encode.start, initargs=(job, os.getpid()))

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.pool.shutdown(wait=True)
            return
        self.terminate()

    def terminate(self) -> None:
        """Stop every worker now (SIGKILL), whatever it is doing, and wait for them to be gone."""
        processes = list((getattr(self.pool, "_processes", None) or {}).values())  # 3.11-3.13 keep them there
        with held(signal.SIGINT):
            for process in processes:
                with contextlib.suppress(OSError, ValueError):
                    process.kill()
            self.pool.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                with contextlib.suppress(OSError, ValueError, AssertionError):
                    process.join(5)

    def map(self, batches: Iterable[Batch]) -> Iterator[tuple[Batch, encode.Encoded]]:
        """(batch without its items, its tokens) for every batch, in order: only the pool holds a batch's text."""
        pending: deque = deque()
        for batch in batches:
            with held(signal.SIGINT):  # a worker spawned by this submit starts with SIGINT blocked
                future = self.pool.submit(encode.encode, batch)
            pending.append((replace(batch, items=[]), future))  # the pool pickles `batch` later, on its own thread
            if len(pending) > 2 * self.count:
                yield self._result(*pending.popleft())
        while pending:
            yield self._result(*pending.popleft())

    def _result(self, batch: Batch, future) -> tuple[Batch, encode.Encoded]:
        while True:
            try:
                return batch, future.result(timeout=0.5)  # short waits: a signal's handler runs at once
            except FutureTimeout:
                continue
            except BrokenProcessPool:
                raise PrepareError(
                    "a tokenizing worker process died (killed from outside, or by the out-of-memory killer); nothing "
                    "was written. Run again, with fewer --workers if memory is short."
                ) from None
