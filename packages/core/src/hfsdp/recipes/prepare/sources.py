"""The corpus: which files are read how, cut into batches of raw lines, and what each line means as a document.

A file's kind follows its name: `.jsonl`, `.ndjson` and `.json` are JSON Lines (one object per line, the text under
`json_key`), `.parquet` is a table (the text in the column `json_key`; needs pyarrow), anything else is plain
UTF-8 text: one document per file, or per non-blank line with `split_lines`. Every input is checked before anything
is tokenized (it exists, is a regular file, can be read), so a typo costs a message, not a half-run.

The parent process only reads bytes and cuts them into batches of about `BATCH_BYTES`; decoding, JSON parsing and
tokenizing happen in the worker processes (`documents`, called by `encode.py`), which report every bad line by its
number, so one slow core never parses for all of them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hfsdp.recipes.prepare.errors import PathError, PrepareError

JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIX = ".parquet"
#: Input bytes per batch a worker tokenizes: large enough that passing it costs little, small enough to keep memory
#: bounded (a few batches per worker are in flight) and the progress bar moving.
BATCH_BYTES = 1 << 20
PARQUET_ROWS = 4096
#: The most bytes one document may have (a text file without --split-lines, or a line): the parent reads a document
#: whole and a worker holds it two or three times over (bytes, text, tokens), so this bounds their memory. A larger
#: one is a bad line, never read.
MAX_DOCUMENT_BYTES = 64 << 20


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # "json", "lines", "file" or "parquet"
    size: int


@dataclass(frozen=True)
class Oversized:
    """What a batch holds in place of a document over `MAX_DOCUMENT_BYTES`, which is not read."""

    nbytes: int


@dataclass
class Batch:
    """Documents to tokenize: raw lines (json, line), one whole file (file) or a parquet column's values (utf8: a text
    column's, as bytes; row: any other's)."""

    source: int  # index of the Source
    first: int  # number (from 1) of items[0]'s line or row in its file; 1 for a whole file
    kind: str
    items: list
    nbytes: int  # input bytes this batch stands for (progress)


def check_inputs(paths: list[str], split_lines: bool, json_key: str) -> list[Source]:
    """Every input as a Source, or PathError naming the first that cannot be read."""
    sources = []
    for given in paths:
        path = Path(given)
        try:
            info = path.stat()
        except FileNotFoundError:
            raise PathError(f"the input {given} does not exist; check the path.") from None
        except OSError as err:
            raise PathError(f"the input {given} cannot be read ({err.strerror or err}); check the path.") from None
        if stat.S_ISDIR(info.st_mode):
            raise PathError(
                f"the input {given} is a directory; give the files in it (e.g. {path / '*.jsonl'}), each of which is "
                "read by its name: JSON Lines, parquet or text."
            )
        if not stat.S_ISREG(info.st_mode):
            raise PathError(
                f"the input {given} is not a regular file (a FIFO, a device or a socket): prepare reads files whose "
                "size it knows, and never waits on a pipe. Write it to a file first."
            )
        try:
            with open(path, "rb"):
                pass
        except OSError as err:
            raise PathError(f"the input {given} cannot be read ({err.strerror or err}); check its rights.") from None
        sources.append(Source(path, _kind(path, split_lines), info.st_size))
    if any(s.kind == "parquet" for s in sources) and importlib.util.find_spec("pyarrow") is None:
        first = next(s.path for s in sources if s.kind == "parquet")
        raise PathError(
            f"reading the parquet file {first} needs pyarrow, which is not installed; `pip install pyarrow`, or "
            f"convert it to JSON Lines (one object per line, the text under '{json_key}')."
        )
    return sources


def _kind(path: Path, split_lines: bool) -> str:
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return "json"
    if suffix == PARQUET_SUFFIX:
        return "parquet"
    return "lines" if split_lines else "file"


def batches(sources: list[Source], json_key: str) -> Iterator[Batch]:
    """Every source's documents-to-be, in order, about `BATCH_BYTES` of input at a time."""
    for index, source in enumerate(sources):
        try:
            if source.kind == "file":
                item = Oversized(source.size) if source.size > MAX_DOCUMENT_BYTES else source.path.read_bytes()
                yield Batch(index, 1, "file", [item], source.size)
            elif source.kind == "parquet":
                yield from _parquet(index, source, json_key)
            else:
                yield from _lines(index, source)
        except OSError as err:
            raise PathError(f"reading {source.path} failed ({err.strerror or err}); nothing was written.") from None


def _lines(index: int, source: Source) -> Iterator[Batch]:
    kind = "json" if source.kind == "json" else "line"
    items: list[bytes] = []
    first, size = 1, 0
    with open(source.path, "rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_DOCUMENT_BYTES + 1), b""), 1):
            if len(line) > MAX_DOCUMENT_BYTES:  # not read further: the rest of the line is skipped in pieces
                line = Oversized(len(line) + (0 if line.endswith(b"\n") else _skip_line(f)))
            items.append(line)
            size += line.nbytes if isinstance(line, Oversized) else len(line)
            if size >= BATCH_BYTES:
                yield Batch(index, first, kind, items, size)
                items, first, size = [], number + 1, 0
    if items:
        yield Batch(index, first, kind, items, size)


def _skip_line(f) -> int:
    """Read past the rest of the current line (up to and including its line break); its bytes."""
    skipped = 0
    while chunk := f.readline(BATCH_BYTES):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


def _parquet(index: int, source: Source, column: str) -> Iterator[Batch]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(source.path)
    except Exception as err:  # pyarrow's own errors: not a parquet file, a damaged footer
        raise PrepareError(f"{source.path} cannot be read as parquet ({err}); check the file.") from None
    names = table.schema_arrow.names
    if column not in names:
        raise PrepareError(
            f"{source.path} has no column '{column}' (its columns: {', '.join(names[:20])}); name the text column "
            "with --json-key."
        )
    rows = max(1, table.metadata.num_rows)
    first = 1
    parts = table.iter_batches(batch_size=PARQUET_ROWS, columns=[column])
    while True:
        try:
            part = next(parts, None)
            if part is None:
                return
            kind, values = _values(part.column(0))
        except Exception as err:  # pyarrow's errors: a damaged page, a value it cannot convert
            detail = " ".join(str(err).split())[:300] or type(err).__name__
            raise PrepareError(
                f"{source.path} cannot be read as parquet after row {first - 1:,} ({detail}); check the file."
            ) from None
        yield Batch(index, first, kind, values, source.size * len(values) // rows)
        first += len(values)


def _values(column) -> tuple[str, list]:
    """A parquet column's values: a text column's as bytes ("utf8": a worker decodes them strictly, so text that is
    not UTF-8 is a bad row, not pyarrow's error here), any other's as Python values ("row")."""
    import pyarrow as pa

    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return "utf8", column.cast(pa.large_binary()).to_pylist()
    return "row", column.to_pylist()


def documents(batch: Batch, json_key: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]], int]:
    """(texts, bad, empty) of a batch: each document's (line or row number, text), each bad item's (number, what is
    wrong), and how many items held no text (blank lines, empty strings): these are skipped, not documents."""
    texts: list[tuple[int, str]] = []
    bad: list[tuple[int, str]] = []
    empty = 0
    for number, item in enumerate(batch.items, batch.first):
        try:
            text = _text(batch.kind, item, json_key)
        except ValueError as err:
            bad.append((_line_of(batch.kind, item, err, number), str(err)))
            continue
        if not text or text.isspace():  # (not strip(): no copy of a long text)
            empty += 1
        else:
            texts.append((number, text))
    return texts, bad, empty


def _text(kind: str, item, json_key: str) -> str | None:
    """The document an item holds (None for a blank JSON line); ValueError saying what is wrong with it."""
    if isinstance(item, Oversized):
        what = "text file" if kind == "file" else "line"
        raise ValueError(
            f"a {what} of {item.nbytes:,} bytes, more than the {MAX_DOCUMENT_BYTES >> 20} MiB one document may have "
            "(prepare holds a document whole, so this bounds its memory); split it: --split-lines makes every line "
            "of a text file a document, and a JSON or parquet text can be cut into several"
        )
    if kind in ("row", "utf8"):
        if item is None:
            raise ValueError("the value is null")
        if kind == "utf8":
            try:
                return item.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(_not_utf8(err, "value")) from None
        if not isinstance(item, str):
            raise ValueError(f"the value is {type(item).__name__}, not text")
        return item
    if kind == "json":
        if not item.strip():
            return None
        try:  # decoded here, strictly: json.loads would let the bytes of a surrogate through, and guess UTF-16
            line = item.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark opens some files
        except UnicodeDecodeError as err:
            raise ValueError(_not_utf8(err, "line")) from None
        value = _json(line)
        if not isinstance(value, dict):
            raise ValueError("not a JSON object (JSON Lines: one object per line)")
        if json_key not in value:
            keys = ", ".join(repr(k)[:40] for k in list(value)[:8]) or "none"  # a hostile key can be megabytes
            raise ValueError(f"no key '{json_key}' (its keys: {keys}; choose the text's with --json-key)")
        text = value[json_key]
        if not isinstance(text, str):
            raise ValueError(f"'{json_key}' holds {type(text).__name__}, not text")
        if "\\u" in line:  # an escape is the one way a lone surrogate gets into a string from strict UTF-8
            _no_surrogate(text, json_key)
        return text
    try:
        text = item.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _DecodeError(_not_utf8(err, "file" if kind == "file" else "line"), err.start) from None
    return text.removesuffix("\n").removesuffix("\r") if kind == "line" else text


def _json(line: str):
    """The value a JSON line holds; ValueError saying why there is none (each kind of bad line is one message)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise ValueError(
            f"nested deeper than the JSON reader goes (about {sys.getrecursionlimit():,} arrays or objects within "
            "each other)"
        ) from None
    except ValueError as err:  # what the parser itself refuses, e.g. an integer of more digits than Python converts
        raise ValueError(f"not JSON that can be read ({' '.join(str(err).split())[:200]})") from None


def _no_surrogate(text: str, json_key: str) -> None:
    """ValueError if `text` holds half of a UTF-16 surrogate pair (an escape like \\ud800 without its other half):
    not a character, so no UTF-8 text and nothing a tokenizer reads."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"'{json_key}' holds \\u{ord(text[err.start]):04x} at character {err.start + 1:,}, half of a UTF-16 "
            "surrogate pair without its other half: not a character, so not text a tokenizer can read"
        ) from None


class _DecodeError(ValueError):
    def __init__(self, message: str, offset: int):
        super().__init__(message)
        self.offset = offset


def _not_utf8(err: UnicodeDecodeError, where: str) -> str:
    return f"not UTF-8 text (byte 0x{err.object[err.start]:02x} at byte {err.start + 1} of the {where})"


def _line_of(kind: str, item, err: ValueError, number: int) -> int:
    """The line a bad item is on: its own number, or in a whole file, the line of the first byte not UTF-8."""
    if kind == "file" and isinstance(err, _DecodeError):
        return item.count(b"\n", 0, err.offset) + 1
    return number


def describe(source: Source, number: int) -> str:
    """Where a bad item is, as a message names it."""
    return f"{source.path} {'row' if source.kind == 'parquet' else 'line'} {number}"


def total_bytes(sources: list[Source]) -> int:
    return sum(s.size for s in sources)


def same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
