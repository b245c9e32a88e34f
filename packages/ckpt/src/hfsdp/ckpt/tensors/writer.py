"""A streaming safetensors writer: header first, then the bytes, hashed on the way out.

`safetensors.torch.save_file` needs every tensor in memory at once. A rank's
file, or a reshard's target file, can be larger than the memory we allow, so
this writer takes the list of tensors (key, dtype, shape) up front, writes the
header, and then accepts each tensor's bytes in any number of consecutive
chunks. The checksum is computed from the same buffers as they are written, so
checksumming costs no second read, and writeback to disk starts while the file
is still being written, so the final fsync finds little left to do. The result
is a plain safetensors file that any reader opens.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import sys
from pathlib import Path

import torch

from hfsdp.ckpt.format.checksum import ALGORITHM, new_hasher, render
from hfsdp.ckpt.format.dtypes import DTYPES, safetensors_code
from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.index import FileEntry

#: Every this many bytes written, the writer asks the kernel to start writing them to disk.
WRITEBACK_BYTES = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range():
    """Linux's sync_file_range(2) through libc, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return function


_sync_range = _sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start (not wait for) writing a byte range of `fd` to disk.

    Every file is fsynced before it is published. Without this, the kernel
    writes the dirty pages only then, so the disk idles while we copy and the
    copy idles while fsync waits; started early, the disk writes while the
    next chunks are produced and fsync has little left to do. A hint only:
    pages stay cached, errors are left to fsync, and elsewhere it does nothing.
    """
    if _sync_range is not None:
        _sync_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name of the index (the schema allows only the names of `dtypes.DTYPES`)."""
    dtype = getattr(torch, name, None) if name in DTYPES else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"The checkpoint names dtype '{name}', which this hfsdp and torch do not know.")
    return dtype


class TensorFileWriter:
    """Writes one safetensors file whose tensors are declared up front and streamed in order."""

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict | None = None):
        self.path = Path(path)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self._sizes: list[tuple[str, int]] = []
        offset = 0
        for key, dtype, shape in entries:
            nbytes = math.prod(shape) * torch_dtype(dtype).itemsize
            code = safetensors_code(dtype)
            header[key] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._sizes.append((key, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # align the data to 8 bytes, as safetensors itself does
        self.data_bytes = offset
        self._hash = new_hasher(ALGORITHM)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in finish/abort
        self._entry, self._left = -1, 0
        self._written = self._flushed = 0
        self._emit(struct.pack("<Q", len(raw)) + raw)
        self._next_entry()

    def _emit(self, data) -> None:
        self._hash.update(data)
        self._file.write(data)
        self._written += len(data) if isinstance(data, bytes) else data.nbytes
        if self._written - self._flushed >= WRITEBACK_BYTES:
            self._file.flush()
            start_writeback(self._file.fileno(), self._flushed, self._written - self._flushed)
            self._flushed = self._written

    def _next_entry(self) -> None:
        while self._left == 0 and self._entry + 1 < len(self._sizes):
            self._entry += 1
            self._left = self._sizes[self._entry][1]

    def write(self, chunk: torch.Tensor) -> None:
        """Append `chunk`'s bytes to the current tensor (and move on to the next one when it is full)."""
        data = memoryview(chunk.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # GPU shards too
        if data.nbytes > self._left:
            key = self._sizes[self._entry][0] if self._entry >= 0 else "?"
            raise CheckpointError(
                f"Internal error while writing {self.path}: {data.nbytes} bytes offered for '{key}', which has "
                f"{self._left} bytes left; please report this as an hfsdp bug."
            )
        if data.nbytes:
            self._emit(data)
            self._left -= data.nbytes
            self._next_entry()

    def finish(self) -> FileEntry:
        """Flush and fsync the file; return its checksum and size."""
        if self._left or self._entry + 1 < len(self._sizes):
            self.abort()
            raise CheckpointError(
                f"Internal error: {self.path} was closed before all its tensors were written; "
                "please report this as an hfsdp bug."
            )
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.tell()
        self._file.close()
        return FileEntry(render(ALGORITHM, self._hash), size)

    def abort(self) -> None:
        self._file.close()
