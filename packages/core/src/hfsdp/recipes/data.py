"""Token streams: a deterministic learnable synthetic one, and Megatron indexed datasets.

Both are addressed by *sample position*: sample i of a stream is the same tokens
whatever the batch it is drawn in, so `samples(first, count)` is samples
`first .. first + count - 1`. A run keeps its place as the number of samples it has
consumed (`consumed_samples`, saved in every checkpoint), not as step x batch: when the
global batch or the world changes on a resume, the next step starts at the first sample
not yet trained on, so nothing is replayed or skipped. `global_batch(step, size)` is
`samples(step * size, size)`, the batch of a run whose batch never changed.
Data-parallel rank r's microbatch m is chunk `m * dp + r` of a global batch (with
instances that train apart, of their share of it: `microbatch`), so layouts are
comparable loss for loss. `split()` sets data aside for evaluation:
sequences the training stream never shows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

_MASK = (1 << 64) - 1


def _mix(*words: int) -> int:
    """A 64-bit hash of whole numbers (splitmix64's finaliser, chained): the random draws of one sample, so that
    any sample can be drawn alone, in any batch, and is the same every time."""
    h = 0x9E3779B97F4A7C15
    for w in words:
        h = (h ^ (w & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 29
    return h


@dataclass(frozen=True)
class SyntheticTokens:
    """Sequences of an affine recurrence t' = (a*t + b) mod V, with (a, b) drawn from a small set.

    The next token follows from the previous one once the model has worked out
    which rule a sequence uses, so the loss falls steadily from log(V). Sample i's rule
    and first token are a hash of (seed, stream, i): addressable by position.
    """

    vocab_size: int
    seq_length: int
    seed: int = 1234
    rules: int = 4
    stream: int = 0  # 0: training; 1: held out (other sequences of the same rules)

    def split(self) -> tuple[SyntheticTokens, SyntheticTokens]:
        """(training, held-out): the same rules, disjoint random streams of sequences."""
        return self, replace(self, stream=1)

    def samples(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels) of samples `first .. first + count - 1`, each `seq_length` long."""
        rule_gen = torch.Generator().manual_seed(self.seed)
        a = torch.randint(1, self.vocab_size, (self.rules,), generator=rule_gen) | 1
        b = torch.randint(0, self.vocab_size, (self.rules,), generator=rule_gen)
        draws = [
            (_mix(self.seed, self.stream, i, 0), _mix(self.seed, self.stream, i, 1))
            for i in range(first, first + count)
        ]
        which = torch.tensor([w % self.rules for w, _ in draws], dtype=torch.long)
        length, v = self.seq_length + 1, self.vocab_size
        seq = torch.empty(count, length, dtype=torch.long)
        seq[:, 0] = torch.tensor([t % v for _, t in draws], dtype=torch.long)
        # t_{j+m} = (A_m t_j + B_m) mod V with A_m = a^m, B_m = b (1 + a + ... + a^(m-1)): each pass doubles the
        # filled prefix, so a sequence costs log2(seq) vector operations, not seq of them (a loop of 2,048 small
        # ops took tens of milliseconds per step, while the GPU waited for the batch). Exact integers: the same
        # tokens as stepping the recurrence one position at a time (products stay below V^2 < 2^63).
        step_a, step_b, filled = a[which][:, None], b[which][:, None], 1
        while filled < length:
            span = min(filled, length - filled)
            seq[:, filled : filled + span] = (step_a * seq[:, :span] + step_b) % v
            step_a, step_b = step_a * step_a % v, (step_a * step_b + step_b) % v
            filled += span
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def global_batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step`'s batch of a run whose global batch was always `size`."""
        return self.samples(step * size, size)


class IndexedTokens:
    """Fixed-length samples cut from a Megatron indexed dataset (`PREFIX.bin` / `PREFIX.idx`).

    Sample i is tokens `[i * seq_length, (i + 1) * seq_length]`; positions past the end wrap around (epochs).
    """

    def __init__(self, prefix: str, seq_length: int):
        from hfsdp.recipes.indexed_format import token_stream

        self.tokens = token_stream(prefix)  # memory-mapped: batches read their pages, nothing else is loaded
        self.seq_length = seq_length
        usable = (len(self.tokens) - 1) // seq_length * seq_length
        if usable <= 0:
            raise ValueError(f"'{prefix}' holds fewer than {seq_length + 1} tokens; use a longer dataset.")
        self.num_samples = usable // seq_length
        self.first = 0  # samples first .. first + num_samples - 1 are this stream's

    def split(self, held_out: float = 0.05) -> tuple[IndexedTokens, IndexedTokens]:
        """(training, held-out): the last `held_out` of the samples (at least one) are set aside for evaluation."""
        if self.num_samples < 2:
            raise ValueError(f"the dataset holds {self.num_samples} sample(s); evaluation needs at least 2.")
        count = max(1, round(self.num_samples * held_out))
        train, evaluate = _window(self, 0, self.num_samples - count), _window(self, self.num_samples - count, count)
        return train, evaluate

    def samples(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels) of samples `first .. first + count - 1` (wrapping around the dataset)."""
        index = self.first + (torch.arange(count) + first) % self.num_samples
        starts = index * self.seq_length
        rows = starts[:, None] + torch.arange(self.seq_length + 1)
        seq = torch.from_numpy(self.tokens[rows.numpy()].astype(np.int64))
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def global_batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step`'s batch of a run whose global batch was always `size`."""
        return self.samples(step * size, size)


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
