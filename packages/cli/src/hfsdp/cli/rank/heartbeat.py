"""A rank's heartbeat and stack dumps: what hang detection (`--step-timeout`) watches, and what it shows.

A hung rank cannot be trusted to notice its own hang: the thread that is stuck (in a
collective whose peer is gone, in a read from a dead file server, or the whole process
stopped) is the one that would have to look. So each rank only *records* what it is doing
(`beat(phase, step)`, a few times per step), and someone else looks:

- under hfsdp's launcher, the launcher's watchdog (`watchdog.py`), another process, reads the
  heartbeat files of the run directory; it sees a stopped process too, and can dump its stack;
- under torchrun there is no hfsdp launcher, so a thread of the rank watches its own
  heartbeat, and faulthandler's watchdog (a C thread that needs no interpreter lock) backs it
  up in case the interpreter itself is stuck. A stopped rank cannot watch itself: its peers,
  stuck in a collective with it, time out and leave, and torchrun stops it.

Every rank also registers faulthandler for SIGUSR1: the signal writes every thread's Python
stack to its stacks file (the watchdog sends it to all ranks of a hung run; `kill -USR1 PID`
works too). Heartbeats use `time.monotonic()`, one clock for every process of a machine.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time
from pathlib import Path

from hfsdp.cli.rank.run_dir import attempt, heartbeat_file, write_json
from hfsdp.cli.settings.report import say

#: Exit code of a rank that stopped itself because it made no progress (as timeout(1) exits).
EXIT_HUNG = 124
#: How much longer than --step-timeout faulthandler's own watchdog waits before it ends a stuck process.
BACKSTOP_S = 30.0


def doing(phase: str, step: int) -> str:
    """What a rank was doing, in words, from its heartbeat's phase and step."""
    return {
        "load": "loading its checkpoint",
        "step": f"step {step}",
        "publish": f"publishing the checkpoint written in the background, after step {step}",
        "save": f"the save after step {step}",
    }.get(phase, f"{phase} at step {step}")


def stacks_dir(save: str | None, run_dir: str | None, attempt_number: int) -> Path | None:
    """Where this attempt's stack dumps go: `--save`'s `hangs/attempt-K` (it outlives the run, and every node of a
    cluster can write it), else the run directory's (which the launcher then keeps); None: to stderr."""
    if save is not None:
        return Path(save) / "hangs" / f"attempt-{attempt_number}"
    if run_dir is not None:
        return Path(run_dir) / "hangs" / f"attempt-{attempt_number}"
    return None


class Heartbeat:
    """This rank's record of what it is doing; a no-op without --step-timeout."""

    def __init__(self, timeout: float | None, rank: int, save: str | None, run_dir: str | None):
        self.timeout, self.rank = timeout, rank
        self.phase, self.step, self.since = "starting", 0, time.monotonic()
        self._file = heartbeat_file(run_dir, rank) if run_dir is not None and timeout else None
        self._stacks = None
        self._stop = threading.Event()
        if not timeout:
            return
        directory = stacks_dir(save, run_dir, attempt())
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self._stacks = open(directory / f"rank-{rank}.txt", "w")  # noqa: SIM115 - closed in close()
        self.stacks_path = directory / f"rank-{rank}.txt" if directory is not None else None
        faulthandler.register(signal.SIGUSR1, file=self._stacks or 2, all_threads=True)
        if run_dir is None:  # torchrun: watch ourselves
            threading.Thread(target=self._watch, name="hfsdp-watchdog", daemon=True).start()

    def beat(self, phase: str, step: int) -> None:
        """Record that this rank now does `phase` of step `step` (the step in progress, counted from 1)."""
        if not self.timeout:
            return
        self.phase, self.step, self.since = phase, step, time.monotonic()
        if self._file is not None:
            record = {"pid": os.getpid(), "rank": self.rank, "phase": phase, "step": step, "since": self.since}
            write_json(self._file, record)
        elif phase != "done":
            faulthandler.dump_traceback_later(self.timeout + BACKSTOP_S, exit=True, file=self._stacks or 2)

    def close(self) -> None:
        if not self.timeout:
            return
        self.beat("done", self.step)
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        faulthandler.unregister(signal.SIGUSR1)
        if self._stacks is not None:
            self._stacks.close()
            path = Path(self._stacks.name)
            if path.stat().st_size == 0:  # nothing was dumped: leave no empty file (and no empty directory) behind
                path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    path.parent.rmdir()
                    path.parent.parent.rmdir()

    def _watch(self) -> None:
        interval = min(1.0, self.timeout / 4)
        while not self._stop.wait(interval):
            idle = time.monotonic() - self.since
            if self.phase == "done" or idle <= self.timeout:
                continue
            faulthandler.dump_traceback(file=self._stacks or 2, all_threads=True)
            if self._stacks is not None:
                self._stacks.flush()
            where = f"in {self.stacks_path}" if self.stacks_path else "above"
            say(
                f"error: rank {self.rank} made no progress for {idle:.0f} s (--step-timeout {self.timeout:g}) in "
                f"{doing(self.phase, self.step)}; its threads' stacks are {where}. Stopping it, so that torchrun "
                "stops the group and, with restarts left, restarts it.",
                err=True,
            )
            os._exit(EXIT_HUNG)
