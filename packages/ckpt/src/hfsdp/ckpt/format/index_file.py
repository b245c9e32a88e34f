"""index.json on disk: read through every check, and written only if it would pass them.

`read_index` is the one gate every checkpoint reader passes (verify, inspect,
load, reshard, export), in this order:

1. index.json is a regular file of the directory (not a symlink), at most
   MAX_INDEX_BYTES long;
2. its bytes match the checksum in `index.json.checksum`: an edited learning
   rate or step count, swapped pieces, a flipped bit that still parses, all
   stop here;
3. the bytes parse as bounded JSON (`safe_json`) and pass the schema
   (`schema.py`) and the structure check (`structure.py`).

Format versions 1 and 2 had no index checksum, so step 2 has nothing to compare
for them (docs/checkpoints.md says what that leaves unchecked); a version 3
index without its checksum file is refused. A checksum file that exists is
always compared, whatever the version says, so a flipped bit in "version"
cannot switch the check off.

`write_index` serialises the index, runs steps 3's checks on the very bytes it
is about to write (hfsdp never writes an index it would refuse: a NaN in
`extra`, say), then writes index.json and, last, its checksum, each fsynced.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hfsdp.ckpt.format.checksum import UnknownChecksum, bytes_checksum, short, split
from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.index import INDEX_NAME, CheckpointIndex
from hfsdp.ckpt.format.names import entry_kind, refuse_link
from hfsdp.ckpt.format.schema import SchemaError, parse_index
from hfsdp.ckpt.format.structure import check_structure
from hfsdp.models.safe_json import JsonError, loads

INDEX_CHECKSUM_NAME = f"{INDEX_NAME}.checksum"
#: No index hfsdp writes comes near this (a model of 10^5 tensors on 10^4 ranks stays far below).
MAX_INDEX_BYTES = 256 << 20
MAX_CHECKSUM_BYTES = 256
#: Nesting of the whole index; the format itself uses 6 levels, the rest is for `extra`.
MAX_DEPTH = 64
FIX = "Restore the checkpoint from a copy or re-save it."


def read_index(ckpt_dir: str | Path) -> CheckpointIndex:
    """Read and check `ckpt_dir/index.json`; a directory without one is not a (complete) checkpoint."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / INDEX_NAME
    if entry_kind(path) is None:
        raise CheckpointError(
            f"{ckpt_dir} is not a checkpoint: it has no {INDEX_NAME} (a save that did not finish leaves no index). "
            "Pass a checkpoint directory, or a root directory whose 'latest' file names one."
        )
    raw = _read_bounded(path, MAX_INDEX_BYTES, "index")
    sealed = _check_checksum(ckpt_dir, raw)
    index = _parse(raw, str(path))
    if index.version >= 3 and not sealed:
        raise CheckpointError(
            f"{path} has format version {index.version} but no {INDEX_CHECKSUM_NAME} beside it, so it cannot be "
            f"told apart from a damaged or edited index. {FIX}"
        )
    return index


def write_index(directory: Path, index: CheckpointIndex) -> None:
    """Write `directory/index.json` and then its checksum file, after checking the index reads back."""
    directory = Path(directory)
    try:
        raw = json.dumps(index.to_json(), indent=1, allow_nan=False).encode()
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"The index for {directory} cannot be written ({err}); `extra` must be plain JSON data: dicts with "
            "string keys, lists, strings, booleans and finite numbers. Nothing was saved."
        ) from None
    problem = f"it is {len(raw)} bytes, over the limit of {MAX_INDEX_BYTES}" if len(raw) > MAX_INDEX_BYTES else None
    if problem is None:
        try:
            index_from(raw)
        except (JsonError, SchemaError) as err:
            problem = str(err)
    if problem:
        raise CheckpointError(
            f"The index for {directory} would not pass hfsdp's own checks when read back ({problem}); nothing was "
            f"saved. If `extra` is the cause, keep it to plain JSON data at most {MAX_DEPTH - 2} levels deep; "
            "otherwise report this as an hfsdp bug."
        )
    _write_synced(directory / INDEX_NAME, raw)
    _write_synced(directory / INDEX_CHECKSUM_NAME, f"{bytes_checksum(raw)}\n".encode())


def index_from(raw: bytes) -> CheckpointIndex:
    """The index in `raw` after the JSON, schema and structure checks (JsonError or SchemaError otherwise)."""
    index = parse_index(loads(raw, MAX_DEPTH))
    check_structure(index)
    return index


def _parse(raw: bytes, source: str) -> CheckpointIndex:
    try:
        return index_from(raw)
    except JsonError as err:
        raise CheckpointError(
            f"The checkpoint index {source} cannot be read: {err}. The file is damaged. {FIX}"
        ) from None
    except SchemaError as err:
        raise CheckpointError(
            f"The checkpoint index {source} is invalid: {err}. It was damaged or written by another tool. "
            f"{err.fix or FIX}"
        ) from None


def _check_checksum(ckpt_dir: Path, raw: bytes) -> bool:
    """Compare the index bytes with `index.json.checksum`; False when there is no checksum file."""
    path = ckpt_dir / INDEX_CHECKSUM_NAME
    if entry_kind(path) is None:
        return False
    text = _read_bounded(path, MAX_CHECKSUM_BYTES, "index checksum").decode("ascii", "replace").strip()
    try:
        algorithm, _ = split(text)
    except UnknownChecksum as err:
        raise CheckpointError(f"{path} does not hold a checksum ({err}); the file is damaged. {FIX}") from None
    got = bytes_checksum(raw, algorithm)
    if got != text:
        raise CheckpointError(
            f"{ckpt_dir / INDEX_NAME} does not match the checksum in {path} ({short(got)} instead of {short(text)}): "
            f"the index changed after it was written (an edit, a flipped bit, a partial copy). {FIX}"
        )
    return True


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    refuse_link(path, entry_kind(path), what)
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as err:
        raise CheckpointError(f"The checkpoint {what} {path} cannot be read ({err.strerror or err}). {FIX}") from None
    if len(raw) > limit:
        raise CheckpointError(
            f"The checkpoint {what} {path} is larger than {limit} bytes, which no checkpoint hfsdp writes comes near: "
            f"it is damaged or not an hfsdp file. {FIX}"
        )
    return raw


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
