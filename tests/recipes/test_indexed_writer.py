"""The Megatron indexed format as hfsdp writes it, read back by megatron-core's IndexedDataset and by hfsdp's reader."""

from __future__ import annotations

import numpy as np
import pytest

from hfsdp.recipes.prepare import indexed_writer
from hfsdp.recipes.prepare.errors import PrepareError
from hfsdp.recipes.prepare.indexed_writer import IndexedWriter, token_dtype


def _documents(seed: int, count: int, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(1, 40)) for _ in range(count)]


def _write(prefix, docs, dtype, per_add=7):
    writer = IndexedWriter(prefix, dtype)
    for i in range(0, len(docs), per_add):
        part = docs[i : i + per_add]
        writer.add(np.concatenate(part).astype(dtype), np.array([len(d) for d in part], dtype=np.int64))
    writer.finish()
    return writer


@pytest.mark.parametrize("vocab", [300, 65_536, 70_000])
def test_megatron_core_reads_every_document_back(tmp_path, vocab):
    """Every document, its dtype, the pointers and the document indices, as megatron-core's reader sees them."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dtype = token_dtype(vocab, "t")
    docs = _documents(0, 53, vocab)
    writer = _write(tmp_path / "d", docs, dtype)
    data = IndexedDataset(str(tmp_path / "d"))
    assert len(data) == writer.documents == 53 and data.index.dtype == dtype.type
    assert all(np.array_equal(data[i], d) for i, d in enumerate(docs))
    assert list(data.document_indices) == list(range(54))
    lengths = np.array([len(d) for d in docs])
    assert np.array_equal(data.index.sequence_pointers, np.concatenate(([0], np.cumsum(lengths)[:-1])) * dtype.itemsize)
    assert not (tmp_path / "d.sizes").exists()  # the side file is gone


def test_the_index_is_assembled_chunk_by_chunk(tmp_path, monkeypatch):
    """With a chunk of 5 entries the index of 53 documents is written in 11 pieces, and reads the same."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = _documents(1, 53, 300)
    _write(tmp_path / "whole", docs, np.uint16)
    monkeypatch.setattr(indexed_writer, "CHUNK", 5)
    _write(tmp_path / "chunked", docs, np.uint16)
    assert (tmp_path / "whole.idx").read_bytes() == (tmp_path / "chunked.idx").read_bytes()
    assert len(IndexedDataset(str(tmp_path / "chunked"))) == 53


def test_hfsdp_reads_it_as_training_samples(tmp_path):
    """hfsdp's own reader (`--data-path`) cuts the documents' tokens, back to back, into samples."""
    from hfsdp.recipes.data import IndexedTokens

    docs = _documents(2, 20, 300)
    _write(tmp_path / "d", docs, np.uint16)
    stream = IndexedTokens(str(tmp_path / "d"), seq_length=8)
    flat = np.concatenate(docs)
    tokens, labels = stream.samples(0, 2)
    assert tokens.flatten().tolist() == flat[:16].tolist() and labels[0].tolist() == flat[1:9].tolist()


def test_the_token_dtype_follows_the_vocabulary():
    """uint16 up to 65,536 tokens, int32 beyond, and a vocabulary no dtype of the format holds is refused."""
    assert token_dtype(65_536, "t") == np.uint16
    assert token_dtype(65_537, "t") == np.int32
    assert token_dtype(2**31, "t") == np.int32
    with pytest.raises(PrepareError, match=r"tokenizer t has a vocabulary of 2,147,483,649 tokens"):
        token_dtype(2**31 + 1, "t")


def test_megatron_core_agrees_on_the_dtype_codes():
    """The codes written are megatron-core's own."""
    from megatron.core.datasets.indexed_dataset import DType

    for dtype, code in indexed_writer.DTYPE_CODES.items():
        assert DType.code_from_dtype(dtype.type) == code
