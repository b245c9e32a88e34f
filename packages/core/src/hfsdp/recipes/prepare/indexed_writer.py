"""Megatron's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), written in bounded memory.

The format (`hfsdp.recipes.indexed_format`) is written here from its specification, without importing
megatron-core (an optional extra of hfsdp-core). Every document is one sequence (as Megatron-LM's
`preprocess_data.py` writes it without sentence splitting), so the document indices are 0, 1, ..., S. The writer
streams tokens to the .bin as they come and spills the sizes to a side file, so memory stays bounded by a chunk
however large the corpus: the index is assembled chunk by chunk at `finish()`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from hfsdp.recipes.indexed_format import DTYPE_CODES, HEADER, MAGIC, VERSION
from hfsdp.recipes.prepare.errors import PrepareError

#: The dtypes tokens are written in, smallest first: the first whose range holds every id of the vocabulary.
TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.int32))
#: Entries of the sizes side file copied into the index per write (4 MiB of int32).
CHUNK = 1 << 20


def token_dtype(vocab_size: int, tokenizer: str) -> np.dtype:
    """uint16 when every id of a `vocab_size` vocabulary fits (at most 65,536 tokens), else int32; refused beyond."""
    for dtype in TOKEN_DTYPES:
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return dtype
    most = np.iinfo(TOKEN_DTYPES[-1]).max + 1
    raise PrepareError(
        f"the tokenizer {tokenizer} has a vocabulary of {vocab_size:,} tokens, more than the {most:,} ids the "
        f"indexed format's largest token dtype ({TOKEN_DTYPES[-1].name}) can hold; use a tokenizer with a smaller "
        "vocabulary."
    )


class IndexedWriter:
    """Appends documents to `prefix.bin`, spills their sizes beside it, and writes `prefix.idx` at `finish()`."""

    def __init__(self, prefix: Path, dtype: np.dtype):
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        self.documents = self.tokens = 0
        self._bin = open(self.prefix.with_name(self.prefix.name + ".bin"), "wb")  # noqa: SIM115 (closed in finish)
        self._sizes = open(self.prefix.with_name(self.prefix.name + ".sizes"), "w+b")  # noqa: SIM115

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: `tokens` back to back (already in the writer's dtype), `lengths` tokens each."""
        if len(lengths) == 0:
            return
        if int(lengths.max()) > np.iinfo(np.int32).max:
            raise PrepareError(
                f"a document of {int(lengths.max()):,} tokens is longer than the indexed format's sizes (int32) can "
                "record; split it (one document per line: --split-lines)."
            )
        self._bin.write(memoryview(np.ascontiguousarray(tokens, dtype=self.dtype)))
        self._sizes.write(memoryview(lengths.astype(np.int32)))
        self.documents += len(lengths)
        self.tokens += int(tokens.size)

    def finish(self) -> None:
        """Close the .bin, write the .idx from the spilled sizes, drop the side file (publishing makes them durable)."""
        self._bin.close()
        sizes = self._sizes
        with open(self.prefix.with_name(self.prefix.name + ".idx"), "wb") as idx:
            idx.write(HEADER.pack(MAGIC, VERSION, DTYPE_CODES[self.dtype], self.documents, self.documents + 1))
            for chunk in _chunks(sizes):
                idx.write(memoryview(chunk))
            offset = 0
            for chunk in _chunks(sizes):
                ends = np.cumsum(chunk, dtype=np.int64) * self.dtype.itemsize + offset
                idx.write(memoryview(np.concatenate(([offset], ends[:-1])).astype(np.int64)))
                offset = int(ends[-1])
            for start in range(0, self.documents + 1, CHUNK):
                idx.write(memoryview(np.arange(start, min(start + CHUNK, self.documents + 1), dtype=np.int64)))
        sizes.close()
        os.unlink(sizes.name)

    def close(self) -> None:
        """Close the files without finishing (the staging they are in is being removed)."""
        self._bin.close()
        self._sizes.close()


def _chunks(sizes):
    """The spilled sizes, `CHUNK` entries at a time."""
    sizes.flush()
    sizes.seek(0)
    while chunk := sizes.read(CHUNK * 4):
        yield np.frombuffer(chunk, dtype=np.int32)


def output_files(prefix: Path) -> tuple[Path, Path]:
    """(`prefix.bin`, `prefix.idx`): the files a prefix names."""
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")
