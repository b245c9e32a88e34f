"""hfsdp's reader of the Megatron indexed format: the tokens of every document in order, memory-mapped (a corpus
larger than memory trains), equal to what megatron-core reads; and every broken pair refused with the file named."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from hfsdp.recipes import indexed_format
from hfsdp.recipes.data import IndexedTokens
from hfsdp.recipes.indexed_format import HEADER, IndexedFormatError, token_stream
from hfsdp.recipes.prepare.indexed_writer import IndexedWriter


def _write(prefix, docs, dtype=np.uint16):
    writer = IndexedWriter(prefix, dtype)
    writer.add(np.concatenate(docs).astype(dtype), np.array([len(d) for d in docs], dtype=np.int64))
    writer.finish()


def _docs(seed=0, count=37, vocab=300):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(1, 30)) for _ in range(count)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_the_stream_is_every_document_in_order_as_megatron_core_reads_them(tmp_path, dtype):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = _docs()
    _write(tmp_path / "d", docs, dtype)
    stream = token_stream(tmp_path / "d")
    megatron = IndexedDataset(str(tmp_path / "d"))
    assert stream.dtype == dtype
    assert np.array_equal(stream, np.concatenate([megatron[i] for i in range(len(megatron))]))


def test_nothing_is_loaded_the_samples_read_the_map(tmp_path):
    """The stream is a read-only memory map of the .bin, and a batch of samples is read out of it."""
    docs = _docs(1)
    _write(tmp_path / "d", docs)
    data = IndexedTokens(str(tmp_path / "d"), seq_length=8)
    assert isinstance(data.tokens, np.memmap) and not data.tokens.flags.writeable
    flat = np.concatenate(docs)
    tokens, labels = data.samples(3, 2)
    assert tokens.dtype == torch.int64 and tokens.tolist() == [flat[24:32].tolist(), flat[32:40].tolist()]
    assert labels[0].tolist() == flat[25:33].tolist()


def test_the_back_to_back_check_runs_chunk_by_chunk(tmp_path, monkeypatch):
    """With a chunk of 4 index entries the same 37 documents read the same (the check crosses chunk edges)."""
    docs = _docs(2)
    _write(tmp_path / "d", docs)
    whole = np.array(token_stream(tmp_path / "d"))
    monkeypatch.setattr(indexed_format, "CHUNK", 4)
    assert np.array_equal(token_stream(tmp_path / "d"), whole)


def _corrupt(tmp_path, how):
    docs = _docs(3)
    _write(tmp_path / "d", docs)
    idx, bin_ = tmp_path / "d.idx", tmp_path / "d.bin"
    raw = bytearray(idx.read_bytes())
    if how == "magic":
        raw[:9] = b"NOTANIDX\x00"
    elif how == "dtype":
        raw[17] = 99
    elif how == "short index":
        raw = raw[: HEADER.size + 10]
    elif how == "header":
        raw = raw[:12]
    elif how == "gap":  # the fifth sequence starts two bytes late
        at = HEADER.size + 4 * len(docs) + 8 * 4
        (pointer,) = struct.unpack_from("<q", raw, at)
        struct.pack_into("<q", raw, at, pointer + 2)
    elif how == "bin size":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    idx.write_bytes(bytes(raw))
    return tmp_path / "d"


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("magic", "is not a Megatron indexed dataset index"),
        ("dtype", "unknown token dtype code 99"),
        ("short index", "is cut short"),
        ("header", "shorter than the indexed format's header"),
        ("gap", "sequence 4 starts at byte"),
        ("bin size", "the pair does not belong together"),
    ],
)
def test_a_broken_pair_is_refused_with_the_file_named(tmp_path, how, says):
    prefix = _corrupt(tmp_path, how)
    with pytest.raises(IndexedFormatError) as err:
        token_stream(prefix)
    assert says in str(err.value) and str(prefix) in str(err.value)


def test_train_refuses_a_broken_dataset_before_any_rank_starts(tmp_path):
    """`hfsdp train --data-path` on a .bin cut short: one paragraph naming the file, exit 1, no traceback."""
    import subprocess
    import sys

    prefix = _corrupt(tmp_path, "bin size")
    cmd = [sys.executable, "-m", "hfsdp.cli", "train", "--data-path", str(prefix), "--steps", "1", "--vocab", "300"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "the pair does not belong together" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
