"""Per-file checksums, written as "<algorithm>:<hex digest>".

A checksum here guards against accidental damage (a flipped bit, a truncated
copy, a file swapped for another), not against an adversary: the index that
holds the digests sits next to the files and could be rewritten just as
easily. So the hash only has to be a good 128-bit mix, and it should be fast,
because a reshard hashes every byte three times (the source before reading,
the target while writing, the target again after writing). xxh3-128 runs at
~16 GB/s per core where sha256 runs at ~1.5 GB/s (measured on the 2-core CI
box), which is the difference between a reshard near copy speed and one at
2.5x of it (docs/benchmarks.md).

Checkpoints written by hfsdp 0.1 with index version 1 carry sha256 digests;
they are still verified, with sha256.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import xxhash

#: The algorithm new checkpoints are written with.
ALGORITHM = "xxh3_128"
#: Every algorithm a checkpoint index may name, with a constructor of incremental hashers.
HASHERS: dict[str, Callable] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
#: Hex digits of each algorithm's digest.
DIGEST_HEX = {"xxh3_128": 32, "sha256": 64}
_HEX = frozenset("0123456789abcdef")


class UnknownChecksum(ValueError):
    """The index names a checksum algorithm this hfsdp does not know."""


def split(checksum: str) -> tuple[str, str]:
    """("xxh3_128", "ab12...") from "xxh3_128:ab12..."."""
    algorithm, sep, digest = checksum.partition(":")
    if not sep or algorithm not in HASHERS:
        raise UnknownChecksum(
            f"checksum {checksum[:40]!r} is not '<algorithm>:<hex>' with an algorithm out of {sorted(HASHERS)}"
        )
    if len(digest) != DIGEST_HEX[algorithm] or not set(digest) <= _HEX:
        raise UnknownChecksum(
            f"checksum {checksum[:80]!r} does not end in the {DIGEST_HEX[algorithm]} lowercase hex digits of a "
            f"{algorithm} digest"
        )
    return algorithm, digest


def new_hasher(algorithm: str = ALGORITHM):
    return HASHERS[algorithm]()


def render(algorithm: str, hasher) -> str:
    return f"{algorithm}:{hasher.hexdigest()}"


def short(checksum: str) -> str:
    """The checksum cut to the algorithm and 16 hex digits, for messages and listings."""
    algorithm, _, digest = checksum.partition(":")
    return f"{algorithm}:{digest[:16]}..."


def bytes_checksum(data: bytes, algorithm: str = ALGORITHM) -> str:
    """The checksum of `data` held in memory (the index, which is hashed as the bytes that were parsed)."""
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return render(algorithm, hasher)


def file_checksum(path: Path, algorithm: str = ALGORITHM, window: int = 8 << 20) -> tuple[str, int]:
    """(checksum, size in bytes) of the file at `path`, hashed through memory maps of `window` bytes.

    Hashing a mapped window reads the page cache in place; `read` into a buffer
    would copy every byte first, which on the CI box costs 5x the hash itself.
    One window is mapped at a time, so the pages this adds to the process stay
    within `window`.
    """
    hasher = new_hasher(algorithm)
    window = max(mmap.ALLOCATIONGRANULARITY, window - window % mmap.ALLOCATIONGRANULARITY)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for offset in range(0, size, window):
            with mmap.mmap(f.fileno(), min(window, size - offset), offset=offset, access=mmap.ACCESS_READ) as view:
                hasher.update(view)
    return render(algorithm, hasher), size
