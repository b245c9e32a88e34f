"""Megatron's indexed dataset format (`PREFIX.bin` + `PREFIX.idx`), and its tokens read without loading them.

This is the format megatron-core's `IndexedDataset` reads, `hfsdp data prepare` writes and `hfsdp train
--data-path` trains on. The `.bin` file is every sequence's tokens back to back, in one dtype. The `.idx` file,
all little-endian:

    magic   9 bytes  b"MMIDIDX\\x00\\x00"
    version uint64   1
    dtype   uint8    the tokens' dtype code (`DTYPE_CODES`)
    S       uint64   the number of sequences
    D       uint64   the number of document boundaries (documents + 1)
    sizes   int32[S] tokens per sequence
    pointers int64[S] byte offset of each sequence in the .bin
    documents int64[D] sequence index where each document starts, then S

Training reads the dataset as one stream of tokens, documents in order. Where the sequences lie back to back from
the start of the .bin (as every Megatron and hfsdp writer lays them), that stream is the .bin itself, memory-mapped:
a run touches only the pages its batches read, so a corpus larger than the host's memory trains as well as a small
one.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
#: megatron-core's `DType` codes (megatron/core/datasets/indexed_dataset.py).
DTYPE_CODES = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}
HEADER = struct.Struct("<9sQBQQ")
#: Index entries checked at a time (8 MiB of pointers).
CHUNK = 1 << 20


class IndexedFormatError(ValueError):
    """A `.bin`/`.idx` pair that is not a Megatron indexed dataset this reader can stream."""


def token_stream(prefix: str | Path) -> np.ndarray:
    """Every token of `prefix.bin`, documents in order, as a read-only memory map (nothing is loaded)."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    with open(idx, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        raise IndexedFormatError(f"{idx}: {len(head)} bytes, shorter than the indexed format's header; remake it.")
    magic, version, code, sequences, _ = HEADER.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise IndexedFormatError(
            f"{idx} is not a Megatron indexed dataset index (magic {magic!r}, version {version}); make it with "
            "`hfsdp data prepare` or Megatron-LM's preprocess_data.py."
        )
    dtype = next((d for d, c in DTYPE_CODES.items() if c == code), None)
    if dtype is None:
        raise IndexedFormatError(f"{idx}: unknown token dtype code {code}; remake the dataset.")
    if dtype.kind not in "iu":
        raise IndexedFormatError(
            f"{idx} says its tokens are {dtype.name}, which are not token ids (the format also stores other data); "
            "tokenize the text again into an integer dtype (hfsdp data prepare, or preprocess_data.py)."
        )
    expected = HEADER.size + sequences * (4 + 8)
    if idx.stat().st_size < expected:
        raise IndexedFormatError(
            f"{idx} is cut short ({idx.stat().st_size:,} bytes, its {sequences:,} sequences need {expected:,})."
        )
    total = _check_back_to_back(idx, sequences, dtype.itemsize)
    if bin_.stat().st_size != total * dtype.itemsize:
        raise IndexedFormatError(
            f"{bin_} holds {bin_.stat().st_size:,} bytes but its index describes {total:,} {dtype.name} tokens "
            f"({total * dtype.itemsize:,} bytes); the pair does not belong together: remake it."
        )
    if total == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(bin_, dtype=dtype, mode="r", shape=(total,))


def _check_back_to_back(idx: Path, sequences: int, itemsize: int) -> int:
    """The total token count, after checking, a chunk at a time, that sequence i starts where i - 1 ends."""
    if sequences == 0:
        return 0
    sizes = np.memmap(idx, dtype=np.int32, mode="r", offset=HEADER.size, shape=(sequences,))
    pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=HEADER.size + 4 * sequences, shape=(sequences,))
    offset = 0
    for start in range(0, sequences, CHUNK):
        chunk = np.asarray(sizes[start : start + CHUNK], dtype=np.int64)
        if chunk.size and chunk.min() < 0:
            at = start + int(np.argmin(chunk))
            raise IndexedFormatError(f"{idx}: sequence {at:,} has {int(chunk.min()):,} tokens; remake the dataset.")
        starts = offset + np.concatenate(([0], np.cumsum(chunk[:-1]))) * itemsize
        wrong = np.flatnonzero(np.asarray(pointers[start : start + CHUNK]) != starts)
        if wrong.size:
            at = start + int(wrong[0])
            raise IndexedFormatError(
                f"{idx}: sequence {at:,} starts at byte {int(pointers[at]):,} of the .bin, not where the one before "
                "it ends; hfsdp trains on datasets whose sequences lie back to back (what preprocess_data.py and "
                "`hfsdp data prepare` write): remake it with either."
            )
        offset = int(starts[-1]) + int(chunk[-1]) * itemsize
    return offset // itemsize
