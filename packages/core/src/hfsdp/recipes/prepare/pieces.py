"""Long documents tokenized in pieces, so that a worker's memory is bounded by a piece, not by a document.

The tokenizers library holds about 130 times a text's size while it encodes it (every byte's alignment in the
normalized string, every pre-token, every token's string and offsets): 0.75 GB for a 5 MB document, over 6 GB for
50 MB, and a plain text file is one document by default. So a text longer than `PIECE_CHARS` is encoded piece by
piece, each at most `PIECE_CHARS` long, and the pieces' ids are joined, with the tokenizer's special tokens
(BOS, ...) around the whole as its post-processor puts them.

A piece ends at a line break that has a non-space character on each side ("...end.\nNext...", "...)\n\ndef..."):
a boundary the common pre-tokenizers split at, and since a tokenizer's model never merges across pre-tokens, the
ids are then exactly those of the whole document. Where in a run of line breaks a pre-tokenizer splits differs
(GPT-2's regex splits "\n\n" before its last "\n", Llama 3's keeps it whole), so `Cuts.of` finds out, on probe
texts, which of three places this tokenizer splits at: after a lone line break, after a run of them, before a
run's last one. A tokenizer that splits at none of them (one that marks the start of every text, or has no
pre-tokenizer) is never cut. A document longer than a piece that such a tokenizer has to read, or with no cut
within a piece's length, is a bad line (a ValueError saying how to split it), not a run that takes all memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

#: The longest text encoded in one call (characters): about 130 MiB of the tokenizer's memory for ASCII text.
PIECE_CHARS = 1 << 20

#: Characters on either side of the line breaks the probes cut at: letters, digits, punctuation, CJK, an emoji,
#: an apostrophe (GPT-2's contractions), an accented capital.
_BEFORE = ("x", "7", ".", ")", "中", "😀", ":")
_AFTER = ("x", "7", "'s", "#", "中", "😀", "É", "-")
#: Runs of line breaks the probes cut: lone, and longer (blank lines, Windows' CRLF).
_LONE, _RUNS = ("\n",), ("\n\n", "\n\n\n", "\r\n", "\r\n\r\n", "\r\r")


@dataclass(frozen=True)
class Cuts:
    """Where in a run of line breaks (between two non-space characters) a tokenizer splits as the whole text does."""

    after_lone: bool  # "a\n|b"
    after_run: bool  # "a\n\n|b" (Llama 3)
    before_last: bool  # "a\n|\nb" (GPT-2)

    @classmethod
    def of(cls, tokenizer) -> Cuts:
        """Probe `tokenizer` (a tokenizers.Tokenizer); no cut at all without a pre-tokenizer (the model then reads
        the whole text as one word) or with an added token holding a line break (a cut could fall inside it)."""
        added = tokenizer.get_added_tokens_decoder().values()
        if tokenizer.pre_tokenizer is None or any("\n" in t.content.rstrip("\r\n") for t in added):
            return cls(False, False, False)
        return cls(
            _same(tokenizer, [(run, len(run)) for run in _LONE]),
            _same(tokenizer, [(run, len(run)) for run in _RUNS]),
            _same(tokenizer, [(run, len(run) - 1) for run in _RUNS]),
        )

    @property
    def any(self) -> bool:
        return self.after_lone or self.after_run or self.before_last

    def last(self, text: str, start: int, stop: int) -> int | None:
        """The largest cut in (start, stop]: in a run of line breaks with a non-space character on each side."""
        best = None
        for run in _BREAKS.finditer(text, start + 1, min(stop + 1, len(text))):
            j, k = run.span()
            while k < len(text) and text[k] in "\r\n":  # a run the search end cut short
                k += 1
            if k == len(text) or text[j - 1].isspace() or text[k].isspace():
                continue
            lone = k - j == 1
            if k <= stop and (self.after_lone if lone else self.after_run):
                best = k
            elif not lone and k - 1 <= stop and self.before_last:
                best = k - 1
        return best


_BREAKS = re.compile(r"[\r\n]+")


def _same(tokenizer, runs: list[tuple[str, int]]) -> bool:
    """Whether every probe "...{before}{run}{after}...", cut `at` characters into the run, is normalized,
    pre-tokenized and tokenized as the whole is: the same pre-tokens (so no vocabulary can merge across the cut) and
    the same ids."""
    for before in _BEFORE:
        for after in _AFTER:
            for run, at in runs:
                head, tail = f"Some {before}{run[:at]}", f"{run[at:]}{after} more text"
                whole, parts = (
                    _pre_tokens(tokenizer, head + tail),
                    _pre_tokens(tokenizer, head) + _pre_tokens(tokenizer, tail),
                )
                ids = _ids(tokenizer, [head + tail, head, tail])
                if whole != parts or ids[0] != ids[1] + ids[2]:
                    return False
    return True


def _pre_tokens(tokenizer, text: str) -> list[str]:
    if tokenizer.normalizer is not None:
        text = tokenizer.normalizer.normalize_str(text)
    return [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def cuts(text: str, where: Cuts, size: int | None = None) -> Iterator[tuple[int, int]]:
    """(start, end) of each piece of `text`, in order, each at most `size` (default PIECE_CHARS) characters, cut
    where `where` allows; ValueError where a stretch of `size` characters has no such cut."""
    size = size or PIECE_CHARS
    start = 0
    while len(text) - start > size:
        end = where.last(text, start, start + size)
        if end is None:
            raise ValueError(
                f"a document of {len(text):,} characters has no line break between two non-space characters in the "
                f"{size:,} characters from character {start + 1:,}, so prepare cannot cut it into pieces it can "
                "tokenize in bounded memory"
            )
        yield start, end
        start = end
    yield start, len(text)


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=False)]


def around(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer's post-processor puts before and after a single text (BOS, CLS, ...)."""
    encoding = tokenizer.encode("x", add_special_tokens=True)
    mask = encoding.special_tokens_mask
    inner = [i for i, special in enumerate(mask) if not special]
    if not inner:  # "x" became special tokens only: nothing to tell the two sides apart by
        return [], []
    return encoding.ids[: inner[0]], encoding.ids[inner[-1] + 1 :]
