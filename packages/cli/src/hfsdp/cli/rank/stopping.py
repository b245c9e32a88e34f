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

Except inside an import: raised in the middle of a module's import (torch's, numpy's, transformers', which start
lazily inside commands and ranks), the exception leaves the module half-initialised, where a later import fails
("cannot load module more than once per process": a traceback instead of the line), or a C extension's init
swallows it and the signal is lost (a SIGTERM that the run ignores). So a signal that arrives inside an import is
recorded, and raised as soon as the import is over: the handler re-checks on a 20 ms SIGALRM timer, and raises
from the first frame that is not inside `importlib`'s machinery.
"""

from __future__ import annotations

import contextlib
import signal

SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: How soon a signal that arrived inside an import is looked at again (seconds).
RECHECK_S = 0.02
_IMPORT_FILES = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")


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
    _raise_unless_importing(frame)


def _recheck(signum: int, frame) -> None:
    """SIGALRM: a signal recorded inside an import is raised once the import is over."""
    _raise_unless_importing(frame)


def _raise_unless_importing(frame) -> None:
    if _requested is None or _defer:
        return
    if _importing(frame):
        signal.setitimer(signal.ITIMER_REAL, RECHECK_S)  # look again once this import may be done
        return
    raise Interrupted(_requested)


def _importing(frame) -> bool:
    """Whether `frame` runs inside an import (a module's body, or importlib itself, anywhere up its stack)."""
    while frame is not None:
        if frame.f_code.co_filename in _IMPORT_FILES:
            return True
        frame = frame.f_back
    return False


def install() -> None:
    """Handle SIGINT and SIGTERM in this process: raise `Interrupted` (after the import in progress, if any), or
    only record it inside `deferred()`."""
    for sig in SIGNALS:
        signal.signal(sig, _handler)
    signal.signal(signal.SIGALRM, _recheck)


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
    signal.setitimer(signal.ITIMER_REAL, 0)  # no recheck pending either
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
