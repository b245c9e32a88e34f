"""`PREFIX.meta.json`: what made a dataset, read before a run trains on it.

Megatron's `.bin/.idx` pair records tokens, not which tokenizer made them, so a dataset of a 128,000-token
vocabulary fed to a model of 32,000 fails inside every rank (an index error in the embedding, on a GPU a device
assert). The sidecar `hfsdp data prepare` writes beside them records the tokenizer (its name, class, vocabulary
size, EOS and a sha256 of its definition), the largest token id actually written, the counts, and the held-out
prefix; `hfsdp train` reads it before launch (`problems`) and finds the held-out data through it. A dataset made
elsewhere has no sidecar and is trained on as before, unchecked. Reading it needs neither torch nor numpy.
"""

from __future__ import annotations

import json
from pathlib import Path

FORMAT = "hfsdp-indexed-dataset"
VERSION = 1
SUFFIX = ".meta.json"
MAX_BYTES = 16 << 20
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
        record = json.loads(data)
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} record")
        if record.get("version") != VERSION:
            raise ValueError(f"version {record.get('version')!r}, this hfsdp reads {VERSION}")
        for key in ("documents", "tokens", "max_token_id"):
            if not isinstance(record.get(key), int):
                raise ValueError(f"'{key}' is not a whole number")
    except ValueError as err:
        raise SidecarError(
            f"{where} is not the sidecar hfsdp data prepare writes ({err}); prepare the data again, or remove the file "
            "to train on the dataset unchecked."
        ) from None
    return record


def validation_prefix(prefix: str | Path) -> str | None:
    """The held-out dataset's prefix the sidecar names (beside `prefix`), or None."""
    record = read(prefix)
    held_out = record.get("validation") if record else None
    if not isinstance(held_out, dict) or not isinstance(held_out.get("prefix"), str):
        return None
    return str(Path(prefix).with_name(held_out["prefix"]))


def problems(prefix: str, model_vocab: int, model: str, seq_len: int, evaluates: bool) -> list[str]:
    """What the sidecar of `prefix` says would fail in every rank: token ids past the model's vocabulary (`model`
    names where its `model_vocab` comes from), fewer tokens than one sequence, missing held-out files."""
    try:
        record = read(prefix)
    except SidecarError as err:
        return [str(err)]
    if record is None:
        return []
    tokenizer = record.get("tokenizer") or {}
    made_by = f"{tokenizer.get('name', 'an unnamed tokenizer')} ({tokenizer.get('class', '?')}, vocabulary "
    made_by += f"{tokenizer['vocab_size']:,})" if isinstance(tokenizer.get("vocab_size"), int) else "unknown)"
    out = []
    if record["max_token_id"] >= model_vocab:
        out.append(
            f"--data-path {prefix} was tokenized by {made_by} and holds token ids up to {record['max_token_id']:,}, "
            f"but {model} has a vocabulary of {model_vocab:,}: ids from {model_vocab:,} up are past the model's "
            f"embedding. Train a model whose vocab_size is at least {record['max_token_id'] + 1:,}, or prepare the "
            "data again with the model's own tokenizer (hfsdp data prepare --tokenizer DIR)."
        )
    sets = [(prefix, record)]
    held_out = record.get("validation")
    if evaluates and isinstance(held_out, dict):
        val = str(Path(prefix).with_name(str(held_out.get("prefix"))))
        missing = [val + s for s in (".bin", ".idx") if not Path(val + s).is_file()]
        if missing:
            out.append(
                f"--data-path {prefix}'s sidecar names the held-out data {val}, but {' and '.join(missing)} do not "
                "exist; prepare the data again (--validation-fraction), or remove the sidecar's 'validation'."
            )
        else:
            sets.append((val, held_out))
    for name, counts in sets:
        tokens = counts.get("tokens")
        if isinstance(tokens, int) and tokens < seq_len + 1:
            out.append(
                f"{name} holds {tokens:,} tokens, fewer than the {seq_len + 1:,} one sequence of --seq-len {seq_len} "
                "needs; prepare more text, or lower --seq-len."
            )
    return out
