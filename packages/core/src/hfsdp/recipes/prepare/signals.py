"""Signals held back for a block of work that must not be cut in two (a rename sequence, a cleanup, a spawn), and
processes started so that they never see SIGINT or SIGTERM."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOPS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def held(*signals: signal.Signals) -> Iterator[None]:
    """`signals` (default: SIGINT and SIGTERM) blocked in this thread for the block; one that arrives meanwhile is
    delivered right after it."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(signals or STOPS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def ignored_by_children() -> Iterator[None]:
    """Processes started in this block ignore SIGINT and SIGTERM from their first instruction on; this one does not.

    A spawned child does not keep the parent's blocked signals (multiprocessing's exec resets the mask) but does keep
    an ignored one, and Python installs no handler for a signal ignored at its start. So for the block this process
    ignores both while holding them back: one that arrives meanwhile stays pending (a blocked signal is queued, not
    dropped) and reaches this process's own handler, restored before the mask is, when the block ends.
    Outside the main thread (where signal handlers cannot be set) the block changes nothing.
    """
    with held():
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {stop: signal.getsignal(stop) for stop in STOPS}
        changed = {stop: handler for stop, handler in previous.items() if handler is not None}  # None: set in C
        for stop in changed:
            signal.signal(stop, signal.SIG_IGN)
        try:
            yield
        finally:
            for stop, handler in changed.items():
                signal.signal(stop, handler)
