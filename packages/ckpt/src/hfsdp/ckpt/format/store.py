"""Which checkpoint a path means: a root's `step-N/` directories and the `latest` file that publishes one.

The rules (docs/checkpoints.md, "Guarantees"):

- `latest` names the newest *published* step. A save replaces it atomically,
  and only after the step's directory is complete and renamed into place, so
  it never names a partial checkpoint.
- A reader given a root follows `latest`, and nothing else: pointing `latest`
  at an older step is how to roll back, and no reader second-guesses it.
- Without `latest` (the very first save crashed between its rename and
  writing `latest`, or the root was assembled by hand) the newest complete
  `step-N` is used.
- A `step-M` above the step `latest` names (any step, without `latest`) is
  unpublished: the orphan of a save that crashed after its rename. Readers of
  the root do not use it (it can still be read by naming it directly), and a
  later save of step M replaces it (`save.py`); a published step is never
  replaced.
- `latest` is data from disk, so it must hold exactly `step-<N>` (no path,
  nothing that could lead out of the root), and the step it names must be a
  directory of the root, not a symlink.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.index import INDEX_NAME
from hfsdp.ckpt.format.names import entry_kind, refuse_link

LATEST = "latest"
STEP_DIR = re.compile(r"step-(0|[1-9][0-9]{0,18})")
TMP_PREFIX = ".tmp-"
MAX_LATEST_BYTES = 64


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def resolve(path: str | Path) -> Path:
    """The checkpoint directory `path` means: itself, the step `latest` names, or (no `latest`) the newest one."""
    path = Path(path)
    if entry_kind(path / INDEX_NAME) is not None:
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint: no such directory. Check the path.")
    step = latest_step(path)
    if step is not None:
        return _published(path, step)
    newest = newest_complete(path)
    if newest is not None:
        return newest
    raise CheckpointError(
        f"{path} is not a checkpoint: it has no {INDEX_NAME}, no '{LATEST}' file and no complete step-N directory. "
        "Pass a checkpoint directory or a root that hfsdp saved into."
    )


def latest_step(root: Path) -> int | None:
    """The step `root/latest` names; None when there is no `latest`; CheckpointError when it is damaged."""
    latest = Path(root) / LATEST
    kind = entry_kind(latest)
    if kind is None:
        return None
    refuse_link(latest, kind, f"'{LATEST}' file")
    try:
        with open(latest, "rb") as f:
            raw = f.read(MAX_LATEST_BYTES + 1)
    except OSError as err:
        raise CheckpointError(f"{latest} cannot be read ({err.strerror or err}); check its rights.") from None
    text = raw.decode("utf-8", "replace").strip()
    match = STEP_DIR.fullmatch(text) if len(raw) <= MAX_LATEST_BYTES else None
    if match is None:
        newest = newest_complete(Path(root))
        hint = f"the newest complete one is {newest.name}" if newest else "there is no complete one"
        raise CheckpointError(
            f"{latest} holds {text[:80]!r}, which is not the name of a step directory of {root} ('step-<N>'); a path "
            f"such as '../x' or '/x' would lead out of the root. Write the name of a complete step into it ({hint}), "
            "or remove it."
        )
    return int(match[1])


def is_unpublished(root: Path, step: int) -> bool:
    """Whether `root/step-{step}` is not (yet) published: above the step `latest` names, or there is no `latest`."""
    latest = latest_step(root)
    return latest is None or step > latest


def save_conflict(root: str | Path, step: int) -> Path | None:
    """The published checkpoint that a save of `step` into `root` would have to overwrite, or None.

    A save never overwrites a published step. A `step-N` above the step `latest` names (left by a crash
    after the step was renamed into place and before `latest` moved) is an orphan, not a published
    checkpoint: saving step N again replaces it, so it is no conflict.
    """
    root = Path(root)
    target = root / step_dir_name(step)
    if entry_kind(target) is None or is_unpublished(root, step):
        return None
    return target


def newest_complete(root: Path) -> Path | None:
    """The `step-N` directory of `root` with the highest N that has an index; a symlinked one is refused."""
    try:
        entries = [(int(m[1]), e) for e in os.scandir(root) if (m := STEP_DIR.fullmatch(e.name))]
    except OSError as err:
        raise CheckpointError(f"Cannot list {root} ({err.strerror or err}); check the path and rights.") from None
    for _, entry in sorted(entries, key=lambda item: item[0], reverse=True):
        path = Path(entry.path)
        if entry.is_symlink():
            _refuse_linked_step(path)
        if entry.is_dir(follow_symlinks=False) and entry_kind(path / INDEX_NAME) is not None:
            return path
    return None


def _published(root: Path, step: int) -> Path:
    target = root / step_dir_name(step)
    kind = entry_kind(target)
    if kind == "symlink":
        _refuse_linked_step(target)
    if kind != "dir" or entry_kind(target / INDEX_NAME) is None:
        newest = newest_complete(root)
        hint = f" (the newest complete one is {newest.name})" if newest and newest != target else ""
        raise CheckpointError(
            f"{root / LATEST} names '{target.name}', but {target} is not a complete checkpoint (no {INDEX_NAME}); the "
            f"directory was removed or damaged after it was saved. Restore it, or point '{LATEST}' at another "
            f"step{hint}."
        )
    return target


def _refuse_linked_step(path: Path) -> None:
    raise CheckpointError(
        f"{path} is a symbolic link; a step directory must be a directory of its root, since a link could point "
        "anywhere. Replace the link by the directory itself, or point 'latest' at another step."
    )


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that readers see the old content or the new, never a mix."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{secrets.token_hex(4)}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
