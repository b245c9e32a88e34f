"""Flat ranges of the tensors of a Hugging Face directory, cast on the way: the source `import_hf` writes from.

`build.write_layout` asks a source for elements [start, stop) of a tensor's
flattened data, in chunks of at most `max_elems`. A checkpoint's pieces are 1-D,
so `reader.py` gets them through safetensors' lazy slices; a Hugging Face
tensor is N-D, and a flat range of it is generally not a slice along its
dimensions. But a safetensors tensor is one contiguous, row-major,
little-endian span of its file at an offset its header gives (`hf_dir.py`
checked the header), so any flat range is one `pread` of exactly its bytes:
reading costs what is read, and memory holds one chunk, whatever the tensor's
size. Each chunk is cast to the dtype the target declares for it (fp32 for
"main", the compute dtype for "model"), bf16 and fp16 files included.
"""

from __future__ import annotations

import math
import os

import torch

from hfsdp.ckpt.format.dtypes import DTYPES
from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.hf.directory import HFDir, HFTensor
from hfsdp.ckpt.hf.experts import HFConcat
from hfsdp.ckpt.tensors.writer import torch_dtype

#: safetensors dtype code -> torch dtype name
_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}


class HFSource:
    """Reads flat ranges of the tensors of one Hugging Face directory (one per writer thread)."""

    def __init__(self, hf: HFDir, dtypes: dict[tuple[str, str], str]):
        self.hf, self.dtypes = hf, dtypes  # target dtype name by (kind, name); kind UNSHARDED for buffers
        self._fds: dict[str, int] = {}

    def chunks(self, kind: str, name: str, start: int, stop: int, max_elems: int):
        tensor = self.hf.tensors[name]
        target = torch_dtype(self.dtypes[kind, name])
        # A fused expert tensor (hf_experts.py) is its parts one after the other; a plain tensor is one part.
        parts = tensor.parts if isinstance(tensor, HFConcat) else (tensor,)
        base = 0
        for part in parts:
            numel = math.prod(part.shape)
            lo, hi = max(start, base), min(stop, base + numel)
            for first in range(lo, hi, max_elems):
                yield self._read(part, name, first - base, min(max_elems, hi - first)).to(target)
            base += numel

    def _read(self, tensor: HFTensor, name: str, first: int, count: int) -> torch.Tensor:
        """Elements [first, first + count) of one tensor of the directory, in its file's dtype."""
        source = torch_dtype(_BY_CODE[tensor.dtype])
        data = bytearray(count * source.itemsize)
        if os.preadv(self._open(tensor.file), [data], tensor.offset + first * source.itemsize) != len(data):
            raise CheckpointError(
                f"{self.hf.path / tensor.file} ended while reading tensor {name!r} (elements {first}.."
                f"{first + count}): the file was cut short or changed while it was read. Nothing was written; "
                "check the file and run again."
            )
        return torch.frombuffer(data, dtype=source)

    def _open(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(self.hf.path / file, os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
