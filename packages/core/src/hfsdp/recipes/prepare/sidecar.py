"""`PREFIX.meta.json`: what made a dataset, read before a run trains on it.

Megatron's `.bin/.idx` pair records tokens, not which tokenizer made them. The sidecar `hfsdp data prepare` writes
beside them records the tokenizer (its name, class, vocabulary size, EOS and a sha256 of its definition), the largest
token id written, the counts, and the held-out prefix. `hfsdp train` checks the pair itself before launch
(`hfsdp.cli.checks.dataset_check`: a pair made elsewhere has no sidecar, and a `.bin` may change after this was
written); the sidecar adds which tokenizer made the data to a refusal (`made_by`) and names the held-out set.
It is read as untrusted input (bounded, every field checked) since a rank opens the file it names; reading it
needs neither torch nor numpy.
"""

from __future__ import annotations

import json
from pathlib import Path

from hfsdp.models.safe_json import loads

FORMAT = "hfsdp-indexed-dataset"
VERSION = 1
SUFFIX = ".meta.json"
MAX_BYTES = 16 << 20
MAX_DEPTH = 8
#: Input paths listed by name (a corpus of a million files is counted, not listed).
LISTED_INPUTS = 1000


class SidecarError(ValueError):
    """The sidecar exists but cannot be used."""


def path(prefix: str | Path) -> Path:
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + SUFFIX)


def write(target: Path, record: dict) -> None:
    body = {"format": FORMAT, "version": VERSION, **record}
    target.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")


def read(prefix: str | Path) -> dict | None:
    """The sidecar of `prefix`, None where there is none (a dataset made elsewhere), SidecarError where it is
    unreadable or not one of ours."""
    where = path(prefix)
    try:
        with open(where, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise SidecarError(f"{where} cannot be read ({err.strerror or err}); check its rights.") from None
    try:
        if len(data) > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES >> 20} MiB")
        record = loads(data, MAX_DEPTH)  # JsonError (a ValueError): not JSON, nested too deep, NaN, ...
        _check(record)
    except ValueError as err:
        raise SidecarError(
            f"{where} is not the sidecar hfsdp data prepare writes ({err}); prepare the data again, or remove the file "
            "to train on the dataset with only its .bin/.idx checked."
        ) from None
    return record


def _check(record: object) -> None:
    """ValueError naming the first field of `record` that is not what `write` writes."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} record")
    if record.get("version") != VERSION:
        raise ValueError(f"version {str(record.get('version'))[:40]}, this hfsdp reads {VERSION}")
    for key in ("documents", "tokens", "max_token_id"):
        if not _count(record.get(key)):
            raise ValueError(f"'{key}' is not a whole number")
    tokenizer = record.get("tokenizer")
    if tokenizer is not None and not isinstance(tokenizer, dict):
        raise ValueError("'tokenizer' is not an object")
    held_out = record.get("validation")
    if held_out is None:
        return
    if not isinstance(held_out, dict) or not _count(held_out.get("tokens")):
        raise ValueError("'validation' is not an object with a whole number of 'tokens'")
    name = held_out.get("prefix")
    if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError("'validation' names no file beside the dataset")
    if len(name.encode("utf-8", "surrogatepass")) + len(".bin") > 255:
        raise ValueError("'validation' names a file longer than a file name can be")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def made_by(record: dict | None) -> str | None:
    """The tokenizer the sidecar names, as a refusal says it: "NAME (CLASS, vocabulary N)"; None without one."""
    tokenizer = (record or {}).get("tokenizer")
    if not tokenizer:
        return None
    vocab = tokenizer.get("vocab_size")
    size = f"vocabulary {vocab:,}" if _count(vocab) else "vocabulary unknown"
    return f"{_text(tokenizer.get('name'), 'an unnamed tokenizer')} ({_text(tokenizer.get('class'), '?')}, {size})"


def _text(value: object, default: str) -> str:
    return str(value)[:200].encode("ascii", "backslashreplace").decode() if isinstance(value, str) else default


def validation_prefix(prefix: str | Path) -> str | None:
    """The held-out dataset's prefix the sidecar names (beside `prefix`), or None."""
    record = read(prefix)
    held_out = record.get("validation") if record else None
    if not isinstance(held_out, dict) or not isinstance(held_out.get("prefix"), str):
        return None
    return str(Path(prefix).with_name(held_out["prefix"]))
