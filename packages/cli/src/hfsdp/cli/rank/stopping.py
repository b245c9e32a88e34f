"""Ctrl-C and SIGTERM: a run stops with one line and exit code 128 + signal, never a traceback.

Schedulers send SIGTERM, a terminal sends SIGINT to every process of the job, and
torchrun's elastic agent forwards the signal it gets to its workers. So both sides
handle both signals:

- The launcher (`hfsdp train` before and around torch's elastic agent) raises
  `Interrupted` from its handler; once the agent runs, its own handler raises
  `SignalException` instead, after which the agent stops the workers. `launch.py`
  turns either into the one-line report.
- A worker (one rank) stops at a step boundary: the first signal only sets a flag, the
  loop adds it to the step's all-reduce, and every rank leaves after the same step, so
  none is left waiting in a collective and a save in progress completes. Before the loop
  starts (imports, rendezvous, loading) there is nothing to finish, so the handler raises
  `Interrupted` at once.
"""

from __future__ import annotations

import contextlib
import signal

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):  # a BaseException, like KeyboardInterrupt: no `except Exception` swallows it
    """The run was asked to stop by `signum`; `step` is the last completed step when known."""

    def __init__(self, signum: int, step: int | None = None):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum
        self.step = step

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_requested: int | None = None
_defer = False


def requested() -> int | None:
    """The signal that asked this process to stop, or None."""
    return _requested


def _handler(signum: int, frame) -> None:
    global _requested
    if _requested is None:
        _requested = signum
    if not _defer:
        raise Interrupted(signum)


def install() -> None:
    """Handle SIGINT and SIGTERM in this process: raise `Interrupted`, or only record it inside `deferred()`."""
    for sig in SIGNALS:
        signal.signal(sig, _handler)


@contextlib.contextmanager
def deferred():
    """Inside this block a signal only sets `requested()`; the training loop stops at its next step boundary.

    Left by an exception (a peer failed, say), the block keeps deferring: the process is on its way out, and
    the signal the agent then sends its ranks could otherwise land in a finalizer run by the unwinding, where
    Python prints an "Exception ignored" traceback and drops the exception.
    """
    global _defer
    before, _defer = _defer, True
    yield  # an exception here skips the line below: deferring stays on
    _defer = before


def hold() -> None:
    """From now on a signal only sets `requested()`: the process is already on its way out (handling an error)."""
    global _defer
    _defer = True


def ignore() -> None:
    """Ignore further SIGINT/SIGTERM (the launcher, while it writes its last line)."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def stopped_line(signum: int, step: int | None, save: str | None, resumed_from: str | None) -> str:
    """The one line a stopped run prints: where it stopped and which checkpoint to resume from."""
    at = f"interrupted at step {step}" if step is not None else "interrupted before the first step"
    return f"{at} ({signal.Signals(signum).name}); {last_checkpoint(save, resumed_from)}"


def last_checkpoint(save: str | None, resumed_from: str | None) -> str:
    """'last checkpoint DIR/step-K', read from disk (`latest`), or why there is none."""
    from hfsdp.ckpt import CheckpointError, resolve

    if save is not None:
        try:
            return f"last checkpoint {resolve(save)}"
        except (CheckpointError, OSError):
            pass
    if resumed_from is not None:
        return f"last checkpoint {resumed_from} (the one this run resumed from; nothing saved since)"
    return "no checkpoint saved" + ("" if save is not None else " (no --save)")
