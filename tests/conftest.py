"""What every test gets: pytest's own signal handlers back after a test that ran `hfsdp train` in-process."""

from __future__ import annotations

import signal

import pytest


@pytest.fixture(autouse=True)
def _keep_signal_handlers():
    """`hfsdp train` installs SIGINT/SIGTERM handlers for its quiet Ctrl-C (and SIGALRM's, which raises a signal that
    came inside an import once it is over); a test that calls it in-process must not leave them, or a pending
    recheck, to the tests after it."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    yield
    if signal.getsignal(signal.SIGALRM) is not saved[signal.SIGALRM]:
        signal.setitimer(signal.ITIMER_REAL, 0)
    for sig, handler in saved.items():
        signal.signal(sig, handler)
