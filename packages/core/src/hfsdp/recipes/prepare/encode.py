"""What a worker process does: load the tokenizer's backend once, then turn batches into token arrays.

Runs in processes started by `workers.py`, which import only this module, numpy and tokenizers: no transformers,
no torch. The backend encodes as `tokenizer(text)` does (special tokens as the tokenizer adds them, no truncation,
no padding) and every document ends with EOS (added unless the tokenizer's own post-processor put it there).
The result is one array of tokens in the dataset's dtype and one of lengths: a compact pickle to send back.
"""

from __future__ import annotations

import ctypes
import os
import signal
from dataclasses import dataclass
from itertools import chain

import numpy as np

from hfsdp.recipes.prepare.sources import Batch, documents

PR_SET_PDEATHSIG = 1


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


def start(job: Job, parent: int) -> None:
    """A worker's initializer: die with the parent, leave Ctrl-C to it, load the tokenizer."""
    global _job, _tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches every process; the parent handles it
    _die_with(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers is the one knob
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(job.backend)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.encode_special_tokens = job.encode_special_tokens
    _job, _tokenizer = job, tokenizer


def _die_with(parent: int) -> None:
    """Ask Linux to send SIGKILL when the parent dies (even by SIGKILL), so no worker outlives a killed run."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's shutdown still ends the workers
        return
    if os.getppid() != parent:  # the parent died before the request was made
        os._exit(1)


def encode(batch: Batch) -> Encoded:
    """Tokenize one batch (in a worker, after `start`)."""
    job, tokenizer = _job, _tokenizer
    assert job is not None and tokenizer is not None, "encode runs in a worker started by workers.Workers"
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
