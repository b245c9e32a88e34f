"""The header of a safetensors file, read without torch and without trusting it.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
mapping each key to {"dtype", "shape", "data_offsets": [begin, end]}, then the
data. safetensors' own rules for a valid file are the ones checked here, so a
damaged or hostile header is refused before anything maps the data: N fits in
the file and under MAX_HEADER_BYTES, the JSON is bounded and well-formed, every
dtype code is known, every byte span is shape x itemsize long, and the spans
tile the data exactly (sorted, no overlap, no hole, ending at the end of the
file). verify and inspect use this instead of safetensors' reader, which needs
torch; `expect` is the one comparison of a header entry with what the index says.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfsdp.ckpt.format.dtypes import CODE_ITEMSIZE
from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.models.safe_json import JsonError, loads

#: safetensors refuses larger headers too.
MAX_HEADER_BYTES = 100 << 20
METADATA = "__metadata__"


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors file: dtype code, shape and its byte span in the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: Path) -> dict[str, HeaderEntry]:
    """The tensors of the safetensors file at `path`, by key; CheckpointError naming the file if it is not valid."""
    return read_header_at(path)[0]


def read_header_at(path: Path) -> tuple[dict[str, HeaderEntry], int]:
    """`read_header`, and the file offset of the data section (each entry's span is relative to it)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _invalid(path, f"it has {size} bytes, fewer than the 8 of the header length")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise _invalid(path, f"its header length {length} exceeds the file ({size} bytes) or the limit")
            raw = f.read(length)
    except OSError as err:
        raise CheckpointError(
            f"{path} cannot be read ({err.strerror or err}); check the file and its rights."
        ) from None
    if not raw.startswith(b"{"):
        raise _invalid(path, "its header is not a JSON object")
    try:
        header = loads(raw, max_depth=4)
    except JsonError as err:
        raise _invalid(path, f"its header is not valid: {err}") from None
    return _entries(path, header, size - 8 - length), 8 + length


def _entries(path: Path, header: Any, data_bytes: int) -> dict[str, HeaderEntry]:
    if not isinstance(header, dict):
        raise _invalid(path, "its header is not a JSON object")
    metadata = header.get(METADATA, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _invalid(path, f"its {METADATA} is not a map of strings")
    out: dict[str, HeaderEntry] = {}
    for key, info in header.items():
        if key == METADATA:
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _invalid(path, f"the entry of tensor {key!r} does not have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in CODE_ITEMSIZE:
            raise _invalid(path, f"tensor {key!r} has dtype {str(dtype)[:20]!r}, which hfsdp does not know")
        if not (isinstance(shape, list) and all(_whole(d) for d in shape)):
            raise _invalid(path, f"tensor {key!r} has a shape that is not a list of whole numbers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) for o in offsets)):
            raise _invalid(path, f"tensor {key!r} has data_offsets that are not two whole numbers")
        numel = 1
        for d in shape:
            numel *= d
        if offsets[1] - offsets[0] != numel * CODE_ITEMSIZE[dtype]:
            raise _invalid(path, f"tensor {key!r} spans bytes {offsets[0]}..{offsets[1]}, not shape x itemsize")
        out[key] = HeaderEntry(dtype, tuple(shape), offsets[0], offsets[1])
    position = 0
    for key, entry in sorted(out.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            problem = "overlaps another" if entry.begin < position else "leaves a hole before it"
            raise _invalid(path, f"tensor {key!r} {problem} (bytes {entry.begin}..{entry.end})")
        position = entry.end
    if position != data_bytes:
        raise _invalid(path, f"its tensors cover {position} bytes of data, but the file holds {data_bytes}")
    return out


@dataclass(frozen=True)
class Expected:
    """What the index says a key of a file holds: its dtype code, its element count (None: any), and what it is."""

    key: str
    dtype: str
    numel: int | None
    what: str


def expect(path: Path, header: dict[str, HeaderEntry], expected: Expected) -> HeaderEntry:
    """The header entry of `expected.key`, after checking it is 1-D with the index's dtype and length."""
    entry = header.get(expected.key)
    if entry is None:
        raise CheckpointError(
            f"{path} has no tensor '{expected.key}', but the index says it holds {expected.what} there: the index "
            "disagrees with the files. Restore the checkpoint from a copy."
        )
    numel = entry.shape[0] if len(entry.shape) == 1 else None
    if numel is None or (expected.numel is not None and numel != expected.numel):
        length = "a 1-D tensor" if expected.numel is None else f"{expected.numel} elements"
        raise CheckpointError(
            f"In {path}, tensor '{expected.key}' has shape {list(entry.shape)}, but the index puts {expected.what} "
            f"there ({length}): the index disagrees with the files. Restore the checkpoint from a copy."
        )
    if entry.dtype != expected.dtype:
        raise CheckpointError(
            f"In {path}, tensor '{expected.key}' has dtype {entry.dtype} but the index records {expected.dtype} for "
            f"{expected.what}: the index disagrees with the files. Restore the checkpoint from a copy."
        )
    return entry


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _invalid(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a valid safetensors file: {problem}. It is truncated, damaged or not written by hfsdp; "
        "restore it from a good copy."
    )
