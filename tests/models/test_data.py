"""Token streams: addressed by sample position, deterministic per sample; Megatron indexed datasets read exactly."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch

from hfsdp.recipes.data import IndexedTokens, SyntheticTokens, microbatch


def _write_indexed(prefix, documents):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for doc in documents:
        builder.add_item(torch.tensor(doc, dtype=torch.int32))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def test_synthetic_batches_depend_only_on_the_step():
    """Step k's global batch is the same tensor every time it is asked for, and differs between steps."""
    data = SyntheticTokens(vocab_size=64, seq_length=16)
    a, b = data.global_batch(3, 8), data.global_batch(3, 8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(data.global_batch(4, 8)[0], a[0])


@pytest.mark.parametrize(("vocab", "seq"), [(64, 1), (64, 16), (128, 37), (32000, 2048), (151936, 300)])
def test_synthetic_sequences_follow_their_recurrence_position_by_position(vocab, seq):
    """Every token is (a * previous + b) mod V for its sample's rule, stepped one position at a time in plain
    Python: the closed-form doubling that makes a batch gives exactly those integers, and labels are the tokens
    shifted by one."""
    data = SyntheticTokens(vocab_size=vocab, seq_length=seq)
    tokens, labels = data.samples(5, 6)
    assert tokens.shape == labels.shape == (6, seq) and tokens.dtype == torch.long
    assert torch.equal(tokens[:, 1:], labels[:, :-1])
    rules = _rules(data)
    for row in torch.cat([tokens, labels[:, -1:]], dim=1).tolist():
        follows = [all((a * x + b) % vocab == y for x, y in itertools.pairwise(row)) for a, b in rules]
        assert any(follows), row[:8]


def _rules(data: SyntheticTokens) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(data.seed)
    a = torch.randint(1, data.vocab_size, (data.rules,), generator=gen) | 1
    b = torch.randint(0, data.vocab_size, (data.rules,), generator=gen)
    return list(zip(a.tolist(), b.tolist(), strict=True))


def test_samples_are_addressed_by_position_whatever_the_batch_they_are_drawn_in(tmp_path):
    """Sample i is the same tokens whether drawn in a batch of 16, in batches of 5 and 11, or alone: so a run that
    changes its global batch at sample 37 continues at sample 37 (both streams; the indexed one wraps around)."""
    _write_indexed(tmp_path / "corpus", [list(range(0, 90)), list(range(200, 260))])
    streams = {
        "synthetic": SyntheticTokens(vocab_size=64, seq_length=8),
        "indexed": IndexedTokens(str(tmp_path / "corpus"), 8),
    }
    for name, data in streams.items():
        whole = data.samples(30, 16)
        parts = [data.samples(30, 5), data.samples(35, 11)]
        assert torch.equal(torch.cat([p[0] for p in parts]), whole[0]), name
        assert torch.equal(torch.cat([p[1] for p in parts]), whole[1]), name
        assert torch.equal(data.samples(37, 1)[0][0], whole[0][7]), name
        assert torch.equal(data.global_batch(3, 8)[0], data.samples(24, 8)[0]), name
        assert not torch.equal(data.samples(31, 1)[0], data.samples(30, 1)[0]), name


def test_synthetic_labels_are_the_next_tokens():
    """Labels are the inputs shifted by one, and every next token follows its sequence's affine rule."""
    tokens, labels = SyntheticTokens(vocab_size=64, seq_length=16).global_batch(0, 8)
    assert torch.equal(tokens[:, 1:], labels[:, :-1])
    assert int(tokens.max()) < 64 and int(tokens.min()) >= 0


def test_microbatches_partition_the_global_batch():
    """The microbatches of all ranks, in chunk order m*dp + r, concatenate back to the global batch."""
    batch = SyntheticTokens(vocab_size=64, seq_length=8).global_batch(0, 16)
    chunks = {}
    for m in range(2):
        for r in range(4):
            chunks[m * 4 + r] = microbatch(batch, m, 2, r, 4)[0]
    assert torch.equal(torch.cat([chunks[i] for i in range(8)]), batch[0])


def test_indexed_dataset_reads_the_written_tokens(tmp_path):
    """A Megatron .bin/.idx pair is read back as consecutive fixed-length samples with next-token labels."""
    documents = [list(range(0, 20)), list(range(100, 130))]
    _write_indexed(tmp_path / "corpus", documents)
    data = IndexedTokens(str(tmp_path / "corpus"), seq_length=8)
    stream = torch.tensor(documents[0] + documents[1])
    assert data.num_samples == (stream.numel() - 1) // 8
    tokens, labels = data.global_batch(0, 2)
    assert torch.equal(tokens[0], stream[0:8]) and torch.equal(labels[0], stream[1:9])
    assert torch.equal(tokens[1], stream[8:16])
    wrapped, _ = data.global_batch(3, 2)  # samples 6 and 7 wrap around to 0 and 1
    assert torch.equal(wrapped[0], stream[0:8])
