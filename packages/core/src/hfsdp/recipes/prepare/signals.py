"""Signals held back for a block of work that must not be cut in two (a rename sequence, a cleanup, a spawn)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

STOPS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def held(*signals: signal.Signals) -> Iterator[None]:
    """`signals` (default: SIGINT and SIGTERM) blocked in this thread, and in what it starts, for the block; one that
    arrives meanwhile is delivered right after it."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(signals or STOPS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
