"""The launcher's hang detector (`--step-timeout`): a thread of another process, so never the stuck one.

Every rank beats its heartbeat file (`heartbeat.py`) whenever it starts a step, a save or a
load. This thread reads them about once a second; when a rank's current phase is older than
the timeout, the run is hung. It then

1. names the rank: a stopped process (`T` in /proc, as after SIGSTOP), else one in
   uninterruptible I/O (`D`), else the rank whose phase began first (the others went on to
   the next collective and wait there for it); when every rank waits in the same phase of the
   same step, it says so;
2. dumps every rank's Python stack: SIGUSR1, which faulthandler handles in C even while the
   rank's main thread waits in a collective; a stopped rank is continued (SIGCONT) just long
   enough to handle it;
3. stops the group: SIGKILL to every rank. The elastic agent then sees the ranks gone and the
   launcher restarts them if restarts are left (`restarts.py`).

A rank that has not beaten yet (importing, joining the rendezvous, building its model) is not
watched: the timeout bounds steps, saves and loads, not start-up. Once a rank's process is gone
the watchdog stands down: that is a failure the elastic agent is already handling, and the
other ranks, unwinding from their lost peer, are not hung.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

from hfsdp.cli.launcher.failures import Hang
from hfsdp.cli.rank.run_dir import heartbeat_file, read_json

#: How long the dumps may take before the ranks are killed anyway.
DUMP_WAIT_S = 5.0
STATES = {"T": "stopped, as by SIGSTOP", "t": "stopped by a debugger", "D": "in uninterruptible I/O"}


class HangWatch:
    """Watches one attempt's heartbeats; `hang` is what it found (None while all is well)."""

    def __init__(self, run_dir: Path, world: int, timeout: float, stacks: Path | None):
        self.run_dir, self.world, self.timeout, self.stacks = run_dir, world, timeout, stacks
        self.hang: Hang | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hfsdp-hang-watch", daemon=True)

    def __enter__(self) -> HangWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        interval = min(1.0, self.timeout / 4)
        while not self._stop.wait(interval):
            beats = {r: read_json(heartbeat_file(self.run_dir, r)) for r in range(self.world)}
            live = {r: b for r, b in beats.items() if b.get("phase") not in (None, "done") and "since" in b}
            now = time.monotonic()
            if not any(now - b["since"] > self.timeout for b in live.values()):
                continue
            if any(_state(b["pid"]) in (None, "Z", "X") for b in beats.values() if "pid" in b):
                return  # a rank is gone: a failure, which the elastic agent is handling (the others unwind), not a hang
            self.hang = self._stop_group(live, now)
            return

    def _stop_group(self, beats: dict[int, dict], now: float) -> Hang:
        states = {r: _state(b["pid"]) for r, b in beats.items()}
        odd = [r for r, s in sorted(states.items()) if s in STATES]
        oldest = min(beats, key=lambda r: (beats[r]["since"], r))
        rank = odd[0] if odd else oldest
        same = len({(b["phase"], b["step"]) for b in beats.values()}) == 1
        sizes = self._stack_sizes(beats)
        for r, beat in beats.items():
            _signal(beat["pid"], signal.SIGUSR1)
            if states[r] in ("T", "t"):
                _signal(beat["pid"], signal.SIGCONT)
        deadline = time.monotonic() + DUMP_WAIT_S
        while time.monotonic() < deadline and any(a == b for a, b in zip(self._stack_sizes(beats), sizes, strict=True)):
            time.sleep(0.1)
        time.sleep(0.2)  # let the last dumps finish writing
        for beat in beats.values():
            _signal(beat["pid"], signal.SIGKILL)
        beat = beats[rank]
        return Hang(
            rank=rank,
            pid=int(beat["pid"]),
            step=int(beat["step"]),
            phase=str(beat["phase"]),
            seconds=now - beat["since"],
            state=STATES.get(states[rank]),
            stacks=self.stacks,
            alone=bool(odd) or not same,
        )

    def _stack_sizes(self, beats: dict[int, dict]) -> list[int]:
        if self.stacks is None:
            return []
        sizes = []
        for r in beats:
            try:
                sizes.append((self.stacks / f"rank-{r}.txt").stat().st_size)
            except OSError:
                sizes.append(-1)
        return sizes


def _state(pid: int) -> str | None:
    """A process's state letter from /proc (R, S, D, T, ...), None when it is gone or unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
