"""The run directory: where a launched run's ranks leave what the launcher reports.

The launcher creates a private directory per run and names it in `RUN_DIR_ENV`; rank 0 records
the last completed step there, and a rank that fails on a user's error leaves its one-paragraph
message. Both sides import this module and nothing of each other.
"""

from __future__ import annotations

from pathlib import Path

#: Set by the launcher: a private directory where rank 0 records its progress and ranks leave user-facing errors.
RUN_DIR_ENV = "HFSDP_RUN_DIR"


def error_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"error-rank-{rank}.txt"


def progress_file(run_dir: str | Path) -> Path:
    return Path(run_dir) / "progress.json"
