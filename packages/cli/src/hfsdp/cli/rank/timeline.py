"""`--timeline FILE`: timestamped events of a run as JSON lines, for measuring recovery (bench/bench_resilience.py).

The launcher notes each attempt's start and how it ended; rank 0 notes when it started, when its model
was built, how long the checkpoint took to load and when the first step finished. Times are
`time.time()` (comparable across processes); appends of one short line are atomic on Linux.
"""

from __future__ import annotations

import json
import os
import time


def note(path: str | None, event: str, **fields) -> None:
    if path is None:
        return
    line = json.dumps({"time": time.time(), "event": event, "pid": os.getpid(), **fields}) + "\n"
    with open(path, "a") as f:
        f.write(line)
