"""What a worker process does: load the tokenizer's backend once, then turn batches into token arrays.

Runs in the processes `workers.py` starts, which import only these modules, numpy and tokenizers: no
transformers, no torch. The backend encodes as `tokenizer(text)` does (special tokens as the tokenizer adds them,
no truncation, no padding) and every document ends with EOS (added unless the tokenizer's own post-processor put
it there).
The result is one array of tokens in the dataset's dtype and one of lengths: a compact pickle to send back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import chain

import numpy as np

from hfsdp.recipes.prepare.sources import Batch, documents


@dataclass(frozen=True)
class Job:
    """What every worker needs, sent once when it starts."""

    backend: str
    encode_special_tokens: bool
    eos_id: int
    vocab_size: int
    dtype: str
    json_key: str


@dataclass
class Encoded:
    tokens: np.ndarray  # every document's tokens back to back, in the dataset's dtype
    lengths: np.ndarray  # int64, tokens per document
    bad: list[tuple[int, str]]  # (line or row number, what is wrong)
    empty: int  # items without text, skipped
    max_id: int  # the largest token id (-1: no documents)


_job: Job | None = None
_tokenizer = None


def start(job: Job) -> None:
    """A worker's setup: load the tokenizer once."""
    global _job, _tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers is the one knob
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(job.backend)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.encode_special_tokens = job.encode_special_tokens
    _job, _tokenizer = job, tokenizer


def encode(batch: Batch) -> Encoded:
    """Tokenize one batch (in a worker, after `start`)."""
    job, tokenizer = _job, _tokenizer
    assert job is not None and tokenizer is not None, "encode runs in a worker, after start(job)"
    texts, bad, empty = documents(batch, job.json_key)
    fast = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets: faster, same ids
    ids = [e.ids for e in fast(texts, add_special_tokens=True)] if texts else []
    eos = job.eos_id
    for doc in ids:
        if not doc or doc[-1] != eos:
            doc.append(eos)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
    max_id = int(flat.max()) if flat.size else -1
    if max_id >= job.vocab_size or (flat.size and int(flat.min()) < 0):
        raise ValueError(f"the tokenizer produced the id {max_id}, outside its vocabulary of {job.vocab_size}")
    return Encoded(flat.astype(job.dtype), lengths, bad, empty, max_id)
