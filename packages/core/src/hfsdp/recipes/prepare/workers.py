"""The tokenizing processes: N spawned workers, batches in order, one batch per worker in flight, no thread.

Order is kept (batch k's documents are written before batch k+1's), so the dataset is the same whatever
`--workers` is: batch k goes to worker k mod N, and the parent reads the results in that order. Each worker holds
one batch at a time, so a corpus of any size needs memory for N batches (and their tokens) only.

Signals are the parent's alone, and nothing can leave it waiting. The workers are spawned (a fresh interpreter:
nothing of the parent's threads or its imported torch) ignoring SIGINT and SIGTERM from their first instruction
(`signals.ignored_by_children`): a terminal's Ctrl-C (sent to the whole process group) or a SIGTERM to the group
stops the parent alone, which then kills them. The parent talks to each worker over two pipes of its own and
reads them in its main thread: there is no result thread (as `concurrent.futures` has) that a killed worker could
leave blocked on half a message, to be joined at exit forever. A worker that dies (the out-of-memory killer) ends
its pipe, which the parent reads as a PrepareError; a worker gets SIGKILL when the parent dies (even by SIGKILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import replace
from multiprocessing import resource_tracker

from hfsdp.recipes.prepare import encode
from hfsdp.recipes.prepare.errors import PrepareError
from hfsdp.recipes.prepare.signals import STOPS, held, ignored_by_children
from hfsdp.recipes.prepare.sources import Batch

PR_SET_PDEATHSIG = 1
#: Seconds a worker has to leave after its last batch (its task pipe closed) before it is killed.
EXIT_WAIT = 5.0

DIED = (
    "a tokenizing worker process died (killed from outside, or by the out-of-memory killer); nothing was written. "
    "Run again, with fewer --workers if memory is short."
)


class Workers:
    """`with Workers(n, job) as pool: for batch, encoded in pool.map(batches): ...`; leaving the block by an
    exception or a signal kills every worker at once."""

    def __init__(self, count: int, job: encode.Job):
        self.count, self.job = count, job
        self._processes: list = []
        self._tasks: list = []  # the parent's end of each worker's task pipe
        self._results: list = []  # ... and of its result pipe

    def __enter__(self) -> Workers:
        spawn = multiprocessing.get_context("spawn")
        resource_tracker.ensure_running()  # started by the first spawn, it unblocks SIGINT and SIGTERM: start it first
        try:
            with ignored_by_children():
                for _ in range(self.count):
                    task_reader, task_writer = spawn.Pipe(duplex=False)
                    result_reader, result_writer = spawn.Pipe(duplex=False)
                    args = (self.job, os.getpid(), task_reader, result_writer)
                    process = spawn.Process(target=_serve, args=args, name="hfsdp-prepare-worker", daemon=True)
                    process.start()
                    task_reader.close()  # the worker holds these ends now: its death ends the pipe here
                    result_writer.close()
                    self._processes.append(process)
                    self._tasks.append(task_writer)
                    self._results.append(result_reader)
        except BaseException:
            self.terminate()
            raise
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            self.terminate()
            return
        with held():
            for tasks in self._tasks:
                tasks.close()  # the worker's next read ends: it leaves
            for process in self._processes:
                process.join(EXIT_WAIT)
            self.terminate()

    def terminate(self) -> None:
        """Kill every worker now (SIGKILL), whatever it is doing, and reap it; close every pipe unread."""
        with held():
            for process in self._processes:
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    process.kill()
            for process in self._processes:
                with contextlib.suppress(OSError, ValueError, AssertionError, AttributeError):
                    process.join()
            for connection in self._tasks + self._results:
                with contextlib.suppress(OSError):
                    connection.close()
            self._processes, self._tasks, self._results = [], [], []

    def map(self, batches: Iterable[Batch]) -> Iterator[tuple[Batch, encode.Encoded]]:
        """(batch without its items, its tokens) for every batch, in order: only a worker holds a batch's text."""
        batches = iter(batches)
        pending: deque = deque()  # (worker, batch without items), in the order the results are written
        for worker in range(self.count):
            if (batch := next(batches, None)) is None:
                break
            pending.append((worker, self._send(worker, batch)))
        upcoming = next(batches, None)  # read ahead, so that a worker waits for the pipe only
        while pending:
            worker, batch = pending.popleft()
            encoded = self._receive(worker)
            if upcoming is not None:
                pending.append((worker, self._send(worker, upcoming)))
                upcoming = next(batches, None)
            yield batch, encoded

    def _send(self, worker: int, batch: Batch) -> Batch:
        """Hand `batch` to an idle `worker` (it has returned its last result); the batch without its items."""
        try:
            self._tasks[worker].send(batch)
        except OSError:  # EPIPE: it died; a message it left first says why
            self._receive(worker)
            raise PrepareError(DIED) from None
        return replace(batch, items=[])

    def _receive(self, worker: int) -> encode.Encoded:
        """`worker`'s result for the batch it holds, or PrepareError if it died or failed."""
        try:
            kind, result = self._results[worker].recv()
        except (EOFError, OSError):  # the pipe ended, maybe half-way through a message
            raise PrepareError(DIED) from None
        if kind == "error":
            raise PrepareError(
                f"a tokenizing worker failed ({result}); nothing was written. This is a bug in hfsdp or in the "
                "tokenizer: please report it with the input that caused it."
            )
        return result


def _serve(job: encode.Job, parent: int, tasks, results) -> None:
    """A worker's life: leave signals to the parent, die with it, load the tokenizer, then encode every batch the
    task pipe brings (until it is closed) and send each result, or the error it raised, back."""
    for stop in STOPS:
        signal.signal(stop, signal.SIG_IGN)  # as they already are since the spawn (ignored_by_children)
    _die_with(parent)
    try:
        encode.start(job)
    except Exception as err:  # reported to the parent, which stops the run with it
        results.send(("error", f"loading the tokenizer: {type(err).__name__}: {err}"))
        return
    while True:
        try:
            batch = tasks.recv()
        except EOFError:  # the parent closed it: no batch left, or it is gone
            return
        try:
            reply = ("ok", encode.encode(batch))
        except Exception as err:  # a MemoryError, a tokenizer's error: the parent's message says which
            reply = ("error", f"{type(err).__name__}: {err}")
        results.send(reply)


def _die_with(parent: int) -> None:
    """Ask Linux to send SIGKILL when the parent dies (even by SIGKILL), so no worker outlives a killed run."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's shutdown still ends the workers
        return
    if os.getppid() != parent:  # the parent died before the request was made
        os._exit(1)
