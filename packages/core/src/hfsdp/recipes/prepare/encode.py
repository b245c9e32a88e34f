"""What a worker process does: load the tokenizer's backend once, then turn batches into token arrays.

Runs in the processes `workers.py` starts, which import only these modules, numpy and tokenizers: no
transformers, no torch. The backend encodes as `tokenizer(text)` does (special tokens as the tokenizer adds them,
no truncation, no padding), a document longer than `pieces.PIECE_CHARS` piece by piece with the same ids, and
every document ends with EOS (added unless the tokenizer's own post-processor put it there). The result is one
array of tokens in the dataset's dtype and one of lengths: a compact pickle to send back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import chain

import numpy as np

from hfsdp.recipes.prepare import pieces
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
_cuts = pieces.Cuts(False, False, False)  # where long documents may be cut (pieces.Cuts.of)
_around: tuple[list[int], list[int]] = ([], [])  # the special tokens the post-processor puts around a text

#: What a bad line that is a too long document says to do.
SPLIT = (
    "; split it: --split-lines makes every line of a text file a document, and a JSON or parquet text can be cut "
    "into several"
)


def start(job: Job) -> None:
    """A worker's setup: load the tokenizer once, and learn whether it can tokenize long documents in pieces."""
    global _job, _tokenizer, _cuts, _around
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers is the one knob
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(job.backend)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.encode_special_tokens = job.encode_special_tokens
    _job, _tokenizer = job, tokenizer
    _cuts, _around = pieces.Cuts.of(tokenizer), pieces.around(tokenizer)


def encode(batch: Batch) -> Encoded:
    """Tokenize one batch (in a worker, after `start`): texts up to `PIECE_CHARS` in one call to the tokenizer, each
    longer one piece by piece (`pieces`), in order."""
    job, tokenizer = _job, _tokenizer
    assert job is not None and tokenizer is not None, "encode runs in a worker, after start(job)"
    texts, bad, empty = documents(batch, job.json_key)
    parts: list[np.ndarray] = []  # token arrays in the dataset's dtype, documents back to back
    lengths: list[int] = []
    short: list[str] = []
    for number, text in texts:
        if len(text) <= pieces.PIECE_CHARS:
            short.append(text)
            continue
        _whole(short, parts, lengths)
        try:
            parts.append(_long(text))
        except ValueError as err:
            bad.append((number, f"{err}{SPLIT}"))
            continue
        lengths.append(parts[-1].size)
    _whole(short, parts, lengths)
    bad.sort()  # a too long document is found after the batch's other bad lines
    flat = np.concatenate(parts) if parts else np.empty(0, job.dtype)
    max_id = int(flat.max()) if flat.size else -1
    return Encoded(flat, np.asarray(lengths, dtype=np.int64), bad, empty, max_id)


def _whole(texts: list[str], parts: list[np.ndarray], lengths: list[int]) -> None:
    """Encode `texts` in one call, each as a whole, each ended with EOS; empties `texts`."""
    if not texts:
        return
    ids = [e.ids for e in _encode(texts, add_special_tokens=True)]
    eos = _job.eos_id
    for doc in ids:
        if not doc or doc[-1] != eos:
            doc.append(eos)
    sizes = [len(doc) for doc in ids]
    parts.append(_checked(np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=sum(sizes))))
    lengths.extend(sizes)
    texts.clear()


def _long(text: str) -> np.ndarray:
    """One long document's tokens, encoded piece by piece; ValueError if it cannot be cut."""
    if not _cuts.any:
        raise ValueError(
            f"a document of {len(text):,} characters, longer than the {pieces.PIECE_CHARS:,} prepare tokenizes in "
            "one piece, and this tokenizer does not tokenize a text cut at a line break as it does the whole "
            "(checked on probe texts when it is loaded), so prepare does not cut it"
        )
    before, after = _around
    out = [_checked(np.asarray(before, dtype=np.int64))]
    for a, b in pieces.cuts(text, _cuts):
        out.append(_checked(np.asarray(_encode([text[a:b]], add_special_tokens=False)[0].ids, dtype=np.int64)))
    last = after[-1] if after else int(out[-1][-1]) if out[-1].size else -1
    out.append(_checked(np.asarray(after + ([_job.eos_id] if last != _job.eos_id else []), dtype=np.int64)))
    return np.concatenate(out)


def _encode(texts: list[str], add_special_tokens: bool):
    fast = getattr(_tokenizer, "encode_batch_fast", _tokenizer.encode_batch)  # no offsets: faster, same ids
    return fast(texts, add_special_tokens=add_special_tokens)


def _checked(ids: np.ndarray) -> np.ndarray:
    """`ids` in the dataset's dtype, once every one is known to be in the vocabulary."""
    if ids.size and (int(ids.max()) >= _job.vocab_size or int(ids.min()) < 0):
        bad = int(ids.max()) if int(ids.max()) >= _job.vocab_size else int(ids.min())
        raise RuntimeError(f"the tokenizer produced the id {bad}, outside its vocabulary of {_job.vocab_size}")
    return ids.astype(_job.dtype)
