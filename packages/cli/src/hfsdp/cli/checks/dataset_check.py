"""`--data-path`: the `.bin/.idx` pair itself, checked before any rank starts, whoever made it.

A rank trusts its data: a token id past the model's vocabulary raises IndexError inside the embedding (on a GPU a
device assert) only when a batch reaches it, float tokens would be read as ids, and a dataset shorter than one
sequence fails as every rank starts. The sidecar `hfsdp data prepare` writes records the largest id, but a pair made
by Megatron-LM has none and a `.bin` rewritten afterwards contradicts it, so the pair itself is read: its index (the
format, an integer token dtype, sequences back to back filling the `.bin` exactly: `indexed_format.token_stream`),
its length against the run's `--seq-len`, and its smallest and largest id against the model's vocabulary, in one
pass over the memory-mapped `.bin` (`id_range`, a chunk at a time: the README says what it costs). The sidecar adds
which tokenizer made the data to a refusal, and names the held-out set; a damaged one is a refusal too, since every
rank reads it. Each problem is one paragraph naming the file and what to do.
"""

from __future__ import annotations

from pathlib import Path

#: Tokens read at a time by `id_range` (32 MiB of uint16): large enough for numpy's reductions to run at memory
#: speed, small enough that the pass holds no more than this much of the file at once.
CHUNK = 1 << 24


def problems(prefix: str, vocab: int | None, model: str, seq_len: int, evaluates: bool, scan: bool = True) -> list[str]:
    """What would fail inside the ranks of a run training `model` (its `vocab`; None where its config was refused)
    on `prefix` with `seq_len` (`evaluates`: --eval-interval is set). `scan=False` skips the pass over the tokens (a
    torchrun rank other than 0: rank 0 reads them)."""
    from hfsdp.recipes.prepare import sidecar

    missing = [prefix + ext for ext in (".bin", ".idx") if not Path(prefix + ext).is_file()]
    if missing:
        return [
            f"--data-path {prefix} needs {' and '.join(missing)}, which do not exist; give the prefix of a Megatron "
            "indexed dataset (PREFIX.bin and PREFIX.idx)."
        ]
    out, record = [], None
    try:
        record = sidecar.read(prefix)
    except sidecar.SidecarError as err:
        out.append(f"--data-path {prefix}: {err}")
    label = f"--data-path {prefix}"
    held_out = sidecar.validation_prefix(prefix) if evaluates and record else None
    sets = [(prefix, label, record)]
    if held_out is not None:
        gone = [held_out + s for s in (".bin", ".idx") if not Path(held_out + s).is_file()]
        if gone:
            out.append(
                f"{label}'s sidecar names the held-out data {held_out}, but {' and '.join(gone)} do not exist; prepare "
                "the data again (--validation-fraction), or remove the sidecar's 'validation'."
            )
        else:
            sets.append((held_out, f"the held-out set {held_out} (named by {sidecar.path(prefix)})", record))
    for name, said, made in sets:
        # evaluating without a held-out set splits the training set: one sample to train, one to evaluate, at least
        samples = 2 if evaluates and name == prefix and held_out is None else 1
        out += _pair(name, said, sidecar.made_by(made), vocab, model, seq_len, samples, scan)
    return out


def _pair(
    prefix: str, said: str, made_by: str | None, vocab: int | None, model: str, seq_len: int, samples: int, scan: bool
) -> list[str]:
    from hfsdp.recipes.indexed_format import IndexedFormatError, token_stream

    try:
        tokens = token_stream(prefix)
    except (IndexedFormatError, OSError) as err:
        return [f"{said}: {err}"]
    need = samples * seq_len + 1
    if len(tokens) < need:
        what = "one sequence" if samples == 1 else "two sequences (one trains, one is held out for --eval-interval)"
        return [
            f"{said}: {prefix}.bin holds {len(tokens):,} tokens, fewer than the {need:,} {what} of --seq-len "
            f"{seq_len} needs (each sample is seq_len tokens and the next one); prepare more text, or lower --seq-len."
        ]
    if not scan:
        return []
    low, high = id_range(tokens)
    tokenized = f" was tokenized by {made_by} and" if made_by else ""
    if low < 0:
        return [
            f"{said}{tokenized} holds the negative token id {low:,} ({prefix}.bin), which no embedding has; the file "
            "is damaged or not made by a tokenizer: tokenize the text again (hfsdp data prepare)."
        ]
    if vocab is not None and high >= vocab:
        return [
            f"{said}{tokenized} holds token ids up to {high:,} ({prefix}.bin), but {model} has a vocabulary of "
            f"{vocab:,}: ids from {vocab:,} up are past the model's embedding. Train a model whose vocab_size is at "
            f"least {high + 1:,}, or tokenize the data again with the model's own tokenizer (hfsdp data prepare "
            "--tokenizer DIR)."
        ]
    return []


def id_range(tokens) -> tuple[int, int]:
    """The smallest and largest token id of a (memory-mapped) token array, `CHUNK` tokens at a time: one sequential
    pass over the file, in bounded memory (only unsigned dtypes skip the minimum: theirs is never negative)."""
    import numpy as np

    signed = tokens.dtype.kind == "i"
    low, high = 0, -1
    for start in range(0, len(tokens), CHUNK):
        part = np.asarray(tokens[start : start + CHUNK])
        high = max(high, int(part.max()))
        if signed:
            low = min(low, int(part.min()))
    return low, high
