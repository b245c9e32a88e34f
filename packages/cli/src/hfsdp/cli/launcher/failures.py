"""How an attempt of a run failed: which rank, how, at which step, and what to print about it.

The elastic agent reports every rank that exited badly; most of them only lost a peer (their
collective failed because another rank was gone). The one to report is the root cause: a
rank's own user-facing error (a checkpoint or file-system problem, left in the run directory),
else a rank the watchdog found hung, else a rank killed by a signal (SIGKILL, out of memory),
else the earliest failure that is not a lost peer. A user-facing error is not restarted (the
same checkpoint or the same full disk would fail again); everything else is.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

from hfsdp.cli.rank.heartbeat import doing
from hfsdp.cli.rank.run_dir import PEER_GONE, error_file


@dataclass(frozen=True)
class Hang:
    """What the watchdog found: the rank that made no progress, where, for how long, and where the stacks are."""

    rank: int
    pid: int
    step: int
    phase: str
    seconds: float
    state: str | None  # "stopped", "in uninterruptible I/O", or None (running, waiting)
    stacks: Path | None
    alone: bool  # False: every rank was waiting in the same step; `rank` is only the first of them


@dataclass(frozen=True)
class Failure:
    """One failed attempt: `short` for the restart summary, `lines` to print when it ends the run."""

    rank: int | None
    kind: str  # "killed", "failed", "hung", "exited", "error"
    step: int | None  # the step in progress, counted from 1; None: before this attempt's first step
    short: str
    lines: tuple[str, ...]
    restartable: bool = True
    pid: int | None = None


def at(step: int | None) -> str:
    return f"at step {step}" if step is not None else "before its first step"


def read_failure(err, run_dir: Path, step: int | None, hang: Hang | None) -> Failure:
    """The Failure of an attempt that raised `err` (ChildFailedError); `step` is the step in progress."""
    failures = err.failures
    for rank in sorted(failures):
        path = error_file(run_dir, rank)
        if path.is_file():
            message = path.read_text().strip()
            return Failure(rank, "error", step, f"rank {rank}: {message}", (f"error: {message}",), False, None)
    if hang is not None:
        return _hung(hang)
    rank, failure = min(
        failures.items(), key=lambda item: (_collateral(item[1]), item[1].exitcode >= 0, item[1].timestamp, item[0])
    )
    if failure.exitcode < 0:
        name = signal_name(-failure.exitcode)
        line = (
            f"error: rank {rank} was killed by signal {-failure.exitcode} ({name}) {at(step)}, by the system (out of "
            "memory?) or by someone; every other rank was stopped. It left no traceback."
        )
        return Failure(rank, "killed", step, f"rank {rank} killed ({name}) {at(step)}", (line,), pid=failure.pid)
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    message = data.get("message", {}) if isinstance(data.get("message"), dict) else {}
    callstack = (message.get("extraInfo") or {}).get("py_callstack", "")
    reason = message.get("message") or f"exit code {failure.exitcode}"
    if callstack:
        last = f"error: rank {rank} failed ({reason}); every other rank was stopped. Its traceback is above."
        short = f"rank {rank} failed ({_first_line(reason)}) {at(step)}"
        return Failure(rank, "failed", step, short, (*callstack.rstrip().splitlines(), last), pid=failure.pid)
    line = f"error: rank {rank} exited with code {failure.exitcode} without a message; every other rank was stopped."
    short = f"rank {rank} exited with code {failure.exitcode} {at(step)}"
    return Failure(rank, "exited", step, short, (line,), pid=failure.pid)


def _hung(hang: Hang) -> Failure:
    state = f"; its process was {hang.state}" if hang.state else ""
    who = f"rank {hang.rank}" if hang.alone else f"every rank (rank {hang.rank} first)"
    stacks = f"every rank's stack is in {hang.stacks}" if hang.stacks else "the stacks went to stderr"
    line = (
        f"error: {who} made no progress for {hang.seconds:.0f} s in {doing(hang.phase, hang.step)}{state} "
        f"(--step-timeout); {stacks}. Every rank was stopped."
    )
    short = f"rank {hang.rank} hung in {doing(hang.phase, hang.step)}" + (f" ({hang.state})" if hang.state else "")
    return Failure(hang.rank, "hung", hang.step, short, (line,), pid=hang.pid)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= 80 else line[:77] + "..."


def _collateral(failure) -> bool:
    """A failure caused by another rank's death (a collective lost its peer): not the one to report."""
    text = json.dumps(failure.error_file_data) if failure.error_file_data else str(failure.message)
    return any(needle in text for needle in PEER_GONE)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"
