"""The tokenizer, loaded once in the parent exactly as transformers loads it for the model's users.

`AutoTokenizer.from_pretrained` settles everything a tokenizer directory leaves to the library (the fast
tokenizer converted from a slow one, special tokens added to the vocabulary, the BOS/EOS post-processor a
`tokenizer_config.json` asks for); its Rust backend, serialized, is what the workers load, so they tokenize exactly
as `tokenizer(text)` does without importing transformers (or torch, which transformers imports) themselves.
A directory is checked for tokenizer files before transformers is imported: that mistake costs no seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from hfsdp.recipes.prepare.errors import PathError, PrepareError

#: Files one of which a directory `save_pretrained` wrote a tokenizer to holds.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


#: The largest tokenizer file read: the largest tokenizers in use are tens of MB (a tokenizer.json of 2 GB took
#: 3.5 GB and 10 s to read, before any check), and every worker holds the tokenizer once more.
MAX_TOKENIZER_BYTES = 256 << 20
#: The files of a tokenizer directory transformers may read whole, besides TOKENIZER_FILES.
READ_FILES = ("merges.txt", "added_tokens.json", "special_tokens_map.json", "config.json")


@dataclass(frozen=True)
class TokenizerInfo:
    name: str  # as the user gave it
    source: str  # the directory (absolute) or the hub name
    kind: str  # transformers' class
    vocab_size: int  # len(tokenizer): the base vocabulary and the added tokens
    eos_token: str
    eos_id: int
    backend: str  # the tokenizers JSON the workers load
    encode_special_tokens: bool
    fingerprint: str  # sha256 of `backend`: which tokenizer, exactly

    def record(self) -> dict:
        """What the dataset's sidecar says about the tokenizer that made it."""
        return {
            "name": self.name,
            "source": self.source,
            "class": self.kind,
            "vocab_size": self.vocab_size,
            "eos_token": self.eos_token,
            "eos_token_id": self.eos_id,
            "sha256": self.fingerprint,
        }


def load(name: str) -> TokenizerInfo:
    """The tokenizer `name` (a directory or a Hugging Face hub name), or PathError / PrepareError saying why not."""
    path = Path(name)
    source = name
    if path.exists():
        if not path.is_dir():
            raise PathError(
                f"--tokenizer {name} is a file; give the directory the tokenizer was saved to (save_pretrained: "
                "tokenizer.json and tokenizer_config.json), often the model's own directory."
            )
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise PathError(
                f"--tokenizer {name} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); give the directory "
                "the tokenizer was saved to (tokenizer.save_pretrained(DIR)), often the model's own directory."
            )
        _not_too_large(name, path)
        source = str(path.resolve())
    elif name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise PathError(f"--tokenizer {name} does not exist; give a tokenizer directory or a Hugging Face hub name.")
    tokenizer = _from_pretrained(name)
    if not getattr(tokenizer, "is_fast", False) or getattr(tokenizer, "backend_tokenizer", None) is None:
        raise PrepareError(
            f"--tokenizer {name} loads only as a slow (Python) tokenizer ({type(tokenizer).__name__}); prepare needs "
            "a fast one (a tokenizer.json). Save it once with tokenizers or transformers installed with "
            "sentencepiece, which converts it: AutoTokenizer.from_pretrained(...).save_pretrained(DIR)."
        )
    if tokenizer.eos_token_id is None:
        raise PrepareError(
            f"--tokenizer {name} has no end-of-document token (eos_token), which prepare puts after every document "
            "so that training sees where one ends; set eos_token in its tokenizer_config.json."
        )
    backend = tokenizer.backend_tokenizer.to_str()
    return TokenizerInfo(
        name=name,
        source=source,
        kind=type(tokenizer).__name__,
        vocab_size=len(tokenizer),
        eos_token=str(tokenizer.eos_token),
        eos_id=int(tokenizer.eos_token_id),
        backend=backend,
        encode_special_tokens=bool(getattr(tokenizer, "split_special_tokens", False)),
        fingerprint=hashlib.sha256(backend.encode()).hexdigest(),
    )


def _not_too_large(name: str, directory: Path) -> None:
    """PrepareError naming the first file of a tokenizer directory over MAX_TOKENIZER_BYTES, before any is read."""
    for file in (*TOKENIZER_FILES, *READ_FILES):
        try:
            size = (directory / file).stat().st_size
        except OSError:  # absent (or unreadable: loading says so)
            continue
        if size > MAX_TOKENIZER_BYTES:
            raise PrepareError(
                f"--tokenizer {name}: {directory / file} is {size:,} bytes, more than the {MAX_TOKENIZER_BYTES >> 20} "
                "MiB prepare reads as a tokenizer file (the largest tokenizers in use are tens of MB, and every "
                "worker would hold it again); check that it is the tokenizer you mean, or save a smaller one."
            )


def _from_pretrained(name: str):
    """transformers' tokenizer through hfsdp's one loader, which never runs a directory's own code (`hf_code`)."""
    from hfsdp.models.hf_code import OwnCodeError, load_tokenizer

    if importlib.util.find_spec("transformers") is None:
        raise PrepareError("prepare tokenizes with transformers, which is not installed; `pip install transformers`.")
    try:
        return load_tokenizer(name)
    except OwnCodeError as err:
        raise PrepareError(str(err)) from None
    except Exception as err:  # transformers' and the hub's errors are of many kinds; each is this one problem
        detail = " ".join(str(err).split())[:400] or type(err).__name__
        raise PathError(
            f"--tokenizer {name} could not be loaded ({detail}); give a directory a tokenizer was saved to, or a "
            "Hugging Face hub name (downloading it needs the network, or the hub's cache)."
        ) from None
