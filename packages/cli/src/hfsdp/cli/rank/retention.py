"""`--save-keep N`: keep the newest N checkpoints of a save root, delete the older ones.

Called by rank 0 right after a save was published (its `latest` written), so a crash at
any moment leaves at least the newest checkpoint whole. A step directory is first renamed
to a hidden `.tmp-step-*` name, which no reader takes for a checkpoint and the next save
clears away, then deleted: a deletion cut short never leaves a half-empty `step-K` behind.
The directory `latest` names is never deleted, whatever its age.
"""

from __future__ import annotations

import re
import secrets
import shutil
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints(root: Path) -> list[Path]:
    """The complete step directories under `root` (they hold an index), oldest first."""
    found = [(int(m[1]), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / "index.json").is_file()]
    return [p for _, p in sorted(found)]


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints under `root`, never the one `latest` names; return the deleted."""
    root = Path(root)
    latest_file = root / "latest"
    latest = latest_file.read_text().strip() if latest_file.is_file() else None
    doomed = [p for p in checkpoints(root)[:-keep] if p.name != latest]
    for path in doomed:
        hidden = root / f".tmp-{path.name}-pruned-{secrets.token_hex(4)}"
        path.rename(hidden)
        shutil.rmtree(hidden, ignore_errors=True)
    return doomed
