"""The run directory: where a launched run's ranks leave what the launcher reports and watches.

The launcher creates a private directory per run (one for all its attempts) and names it in
`RUN_DIR_ENV`; rank 0 records there the last completed step and the last step it printed, a
rank that fails on a user's error leaves its one-paragraph message, and with --step-timeout
every rank keeps a heartbeat file. Both sides import this module and nothing of each other.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: Set by the launcher: a private directory where rank 0 records its progress and ranks leave user-facing errors.
RUN_DIR_ENV = "HFSDP_RUN_DIR"
#: Set by the launcher: which attempt of the run this is (0, then one more per restart).
ATTEMPT_ENV = "HFSDP_ATTEMPT"
#: Text of the errors a collective raises when a peer process is gone.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Gloo", "NCCL", "timed out")


def error_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"error-rank-{rank}.txt"


def progress_file(run_dir: str | Path) -> Path:
    return Path(run_dir) / "progress.json"


def heartbeat_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"heartbeat-rank-{rank}.json"


def read_json(path: Path) -> dict:
    """A small JSON record another process replaces atomically; {} when absent or unreadable."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def write_json(path: Path, record: dict) -> None:
    """Replace `path` with `record`, so that a reader never sees it half-written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def attempt() -> int:
    """This process's attempt of the run: hfsdp's launcher's count, or torchrun's restart count."""
    return int(os.environ.get(ATTEMPT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
