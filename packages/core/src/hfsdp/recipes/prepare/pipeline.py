"""`prepare`: a corpus to a Megatron indexed dataset, every input checked first and nothing half-written.

The order is what makes a mistake cheap: the inputs and the output prefix are checked in milliseconds, then the
tokenizer is loaded (a second or two: transformers), then the workers tokenize while the parent reads the files,
writes tokens in order and routes every document to the training or the held-out set. Everything is written in
staging (`output.py`) and renamed into place at the end, so a bad line found at 90 %, an empty corpus or a Ctrl-C
leaves the prefix as it was.

With `validation_fraction` F, document i (counted from 0 over the whole corpus) is held out when
floor((i + 1) F) > floor(i F): one in every 1/F, spread over the corpus and decided as the documents stream past,
so the split is the same on every run and for any number of workers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np

from hfsdp.recipes.prepare import output, sidecar, sources, tokenizer
from hfsdp.recipes.prepare.encode import Encoded, Job
from hfsdp.recipes.prepare.errors import PrepareError
from hfsdp.recipes.prepare.indexed_writer import IndexedWriter, token_dtype
from hfsdp.recipes.prepare.workers import Workers

#: progress(input bytes done, input bytes in all, tokens written so far)
Progress = Callable[[int, int, int], None]


@dataclass(frozen=True)
class Request:
    inputs: list[str]
    tokenizer: str
    output: str
    json_key: str = "text"
    split_lines: bool = False
    workers: int | None = None  # None: one per usable CPU
    validation_fraction: float = 0.0
    skip_bad_lines: bool = False
    overwrite: bool = False


@dataclass
class Summary:
    prefix: Path
    tokenizer: tokenizer.TokenizerInfo
    dtype: str
    documents: int = 0
    tokens: int = 0
    validation_documents: int = 0
    validation_tokens: int = 0
    empty: int = 0  # items without text, skipped
    bad: int = 0  # bad lines skipped (--skip-bad-lines)
    first_bad: str | None = None
    input_bytes: int = 0
    output_bytes: int = 0
    seconds: float = 0.0
    files: list[Path] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return (self.tokens + self.validation_tokens) / max(self.seconds, 1e-9)


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prepare(request: Request, progress: Progress | None = None) -> Summary:
    """Tokenize `request.inputs` into `request.output`.bin/.idx (+ the sidecar, + the held-out set); the Summary,
    or PrepareError (PathError for a path) with nothing written."""
    workers = request.workers if request.workers is not None else default_workers()
    if workers < 1:
        raise PrepareError(f"--workers {workers}: at least one worker process tokenizes; give 1 or more.")
    fraction = request.validation_fraction
    if not 0 <= fraction < 1:
        raise PrepareError(
            f"--validation-fraction {fraction} is not in [0, 1): it is the share of documents held out for "
            "evaluation, e.g. 0.05; 0 holds out none."
        )
    inputs = sources.check_inputs(request.inputs, request.split_lines, request.json_key)
    prefix = output.check(request.output, request.overwrite, inputs)
    info = tokenizer.load(request.tokenizer)
    dtype = token_dtype(info.vocab_size, info.name)
    summary = Summary(prefix, info, dtype.name, input_bytes=sources.total_bytes(inputs))
    job = Job(info.backend, info.encode_special_tokens, info.eos_id, info.vocab_size, dtype.name, request.json_key)
    start = time.perf_counter()
    with output.Staged(prefix) as stage:
        train = IndexedWriter(stage.file(prefix.name), dtype)
        held = IndexedWriter(stage.file(output.validation_prefix(prefix).name), dtype) if fraction else None
        try:
            max_id = _write(request, inputs, job, workers, train, held, summary, progress)
            summary.documents, summary.tokens = train.documents, train.tokens
            _check_counts(request, inputs, summary, held)
            train.finish()
            if held is not None:
                held.finish()
        except BaseException:
            train.close()
            if held is not None:
                held.close()
            raise
        sidecar.write(stage.file(prefix.name + output.SIDECAR), _record(request, inputs, summary, max_id, held))
        summary.files = stage.publish()
    summary.seconds = time.perf_counter() - start
    summary.output_bytes = sum(p.stat().st_size for p in summary.files)
    return summary


def _write(request, inputs, job, workers, train, held, summary: Summary, progress: Progress | None) -> int:
    """Tokenize every batch in order, write it to the training or held-out set; the largest token id."""
    fraction = Fraction(request.validation_fraction).limit_denominator(1_000_000)
    done = count = 0
    max_id = -1
    with Workers(workers, job) as pool:
        for batch, encoded in pool.map(sources.batches(inputs, request.json_key)):
            _bad_lines(request, inputs[batch.source], encoded, summary)
            summary.empty += encoded.empty
            count = _route(encoded, count, fraction, train, held, summary)
            max_id = max(max_id, encoded.max_id)
            done += batch.nbytes
            if progress is not None:
                progress(done, summary.input_bytes, train.tokens + summary.validation_tokens)
    return max_id


def _route(encoded: Encoded, first: int, fraction: Fraction, train, held, summary: Summary) -> int:
    """Write a batch's documents (numbered from `first`) to their sets; the next document's number."""
    n = len(encoded.lengths)
    if held is None or n == 0:
        train.add(encoded.tokens, encoded.lengths)
        return first + n
    index = np.arange(first, first + n, dtype=np.int64)
    num, den = fraction.numerator, fraction.denominator
    out = (index + 1) * num // den > index * num // den
    by_token = np.repeat(out, encoded.lengths)
    train.add(encoded.tokens[~by_token], encoded.lengths[~out])
    held.add(encoded.tokens[by_token], encoded.lengths[out])
    summary.validation_documents, summary.validation_tokens = held.documents, held.tokens
    return first + n


def _bad_lines(request: Request, source: sources.Source, encoded: Encoded, summary: Summary) -> None:
    if not encoded.bad:
        return
    number, reason = encoded.bad[0]
    where = f"{sources.describe(source, number)}: {reason}"
    if not request.skip_bad_lines:
        raise PrepareError(
            f"{where}. Fix it, or pass --skip-bad-lines to count and skip such lines; nothing was written."
        )
    summary.bad += len(encoded.bad)
    summary.first_bad = summary.first_bad or where


def _check_counts(request: Request, inputs, summary: Summary, held) -> None:
    documents = summary.documents + summary.validation_documents
    if documents == 0:
        files = f"{inputs[0].path}" if len(inputs) == 1 else f"the {len(inputs)} input files"
        skipped = []
        if summary.empty:
            skipped.append(f"{summary.empty:,} without text")
        if summary.bad:
            skipped.append(f"{summary.bad:,} bad lines skipped")
        why = f" ({', '.join(skipped)})" if skipped else ""
        raise PrepareError(
            f"the corpus is empty: {files} hold no document{why}; nothing was written. Check the files and, for "
            f"JSON Lines or parquet, that the text is under --json-key {request.json_key}."
        )
    if held is not None and summary.validation_documents == 0:
        every = int(np.ceil(1 / request.validation_fraction))
        raise PrepareError(
            f"--validation-fraction {request.validation_fraction} holds out one document in every {every:,}, so none "
            f"of the {documents:,} documents here; nothing was written. Give more documents or a larger fraction."
        )


def _record(request: Request, inputs, summary: Summary, max_id: int, held) -> dict:
    listed = [str(s.path) for s in inputs[: sidecar.LISTED_INPUTS]]
    record = {
        "tokenizer": summary.tokenizer.record(),
        "dtype": summary.dtype,
        "documents": summary.documents,
        "tokens": summary.tokens,
        "max_token_id": max_id,
        "validation": None,
        "inputs": {"count": len(inputs), "bytes": summary.input_bytes, "listed": listed},
        "json_key": request.json_key,
        "split_lines": request.split_lines,
        "skipped": {"empty": summary.empty, "bad_lines": summary.bad},
    }
    if held is not None:
        record["validation"] = {
            "prefix": output.validation_prefix(summary.prefix).name,
            "fraction": request.validation_fraction,
            "documents": summary.validation_documents,
            "tokens": summary.validation_tokens,
        }
    return record
