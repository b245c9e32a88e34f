"""Token streams: a deterministic learnable synthetic one, and Megatron indexed datasets.

Both are defined by global batch: step k's global batch is the same tokens whatever
the layout, and data-parallel rank r's microbatch m is chunk `m * dp + r` of it (with
instances that train apart, of their share of it: `microbatch`).
That is what makes layouts comparable loss for loss. `split()` sets data aside for
evaluation: sequences the training stream never shows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class SyntheticTokens:
    """Sequences of an affine recurrence t' = (a*t + b) mod V, with (a, b) drawn from a small set.

    The next token follows from the previous one once the model has worked out
    which rule a sequence uses, so the loss falls steadily from log(V).
    """

    vocab_size: int
    seq_length: int
    seed: int = 1234
    rules: int = 4
    stream: int = 0  # 0: training; 1: held out (other sequences of the same rules)

    def split(self) -> tuple[SyntheticTokens, SyntheticTokens]:
        """(training, held-out): the same rules, disjoint random streams of sequences."""
        return self, replace(self, stream=1)

    def global_batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step + self.stream * 2**40)
        rule_gen = torch.Generator().manual_seed(self.seed)
        a = torch.randint(1, self.vocab_size, (self.rules,), generator=rule_gen) | 1
        b = torch.randint(0, self.vocab_size, (self.rules,), generator=rule_gen)
        which = torch.randint(0, self.rules, (size, 1), generator=gen)
        seq = torch.empty(size, self.seq_length + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, self.vocab_size, (size,), generator=gen)
        for j in range(self.seq_length):
            seq[:, j + 1] = (a[which[:, 0]] * seq[:, j] + b[which[:, 0]]) % self.vocab_size
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class IndexedTokens:
    """Fixed-length samples cut from a Megatron indexed dataset (`PREFIX.bin` / `PREFIX.idx`)."""

    def __init__(self, prefix: str, seq_length: int):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.dataset = IndexedDataset(prefix)
        self.seq_length = seq_length
        tokens = torch.cat([torch.as_tensor(self.dataset[i].astype("int64")) for i in range(len(self.dataset))])
        usable = (tokens.numel() - 1) // seq_length * seq_length
        if usable == 0:
            raise ValueError(f"'{prefix}' holds fewer than {seq_length + 1} tokens; use a longer dataset.")
        self.tokens = tokens[: usable + 1]
        self.num_samples = usable // seq_length
        self.first = 0  # samples first .. first + num_samples - 1 are this stream's

    def split(self, held_out: float = 0.05) -> tuple[IndexedTokens, IndexedTokens]:
        """(training, held-out): the last `held_out` of the samples (at least one) are set aside for evaluation."""
        if self.num_samples < 2:
            raise ValueError(f"the dataset holds {self.num_samples} sample(s); evaluation needs at least 2.")
        count = max(1, round(self.num_samples * held_out))
        train, evaluate = _window(self, 0, self.num_samples - count), _window(self, self.num_samples - count, count)
        return train, evaluate

    def global_batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.first + (torch.arange(size) + step * size) % self.num_samples
        starts = index * self.seq_length
        rows = starts[:, None] + torch.arange(self.seq_length + 1)
        seq = self.tokens[rows]
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _window(data: IndexedTokens, first: int, count: int) -> IndexedTokens:
    view = object.__new__(IndexedTokens)
    view.__dict__.update(data.__dict__, first=data.first + first, num_samples=count)
    return view


def microbatch(
    batch: tuple[torch.Tensor, torch.Tensor], index: int, count: int, rank: int, dp: int, instances: int = 1
):
    """Rank `rank`'s microbatch `index` of `count`: chunk `index * dp + rank` of the global batch.

    With `instances` that train apart (DiLoCo), instance o gets the o-th 1/instances of the global
    batch, its ranks and microbatches splitting it as above: what an instance learns from then depends
    on the instance count alone, not on how many ranks it has (with one instance, the same chunks)."""
    tokens, labels = batch
    size = tokens.shape[0] // (count * dp)
    inner = dp // instances
    chunk = (rank // inner) * (count * inner) + index * inner + rank % inner
    return tokens[chunk * size : (chunk + 1) * size], labels[chunk * size : (chunk + 1) * size]
