"""A tokenizer made on the spot (no download): byte-level BPE trained on a few kB, saved as transformers saves one.

`tiny_tokenizer(DIR)` writes `tokenizer.json` and `tokenizer_config.json` through `PreTrainedTokenizerFast
.save_pretrained`, with `<|endoftext|>` (id 0) as its EOS: what `hfsdp data prepare --tokenizer DIR` reads. The
same vocabulary size for the same arguments, so tests can size a model to it. `stdlib_texts` is real text every
machine has: the sources of standard-library packages.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

EOS = "<|endoftext|>"
SEED_TEXT = (
    "The quick brown fox jumps over the lazy dog. def main(argv):\n    return 0\n"
    "import json, email; print({'key': [1, 2, 3]}) # comment\n"
)


def stdlib_texts(*packages: str) -> list[str]:
    """The `.py` files of standard-library `packages` (e.g. "json", "email"), one string each, ordered by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for package in packages for p in (root / package).rglob("*.py"))
    return [p.read_text(encoding="utf-8") for p in files]


def tiny_tokenizer(directory: Path, vocab_size: int = 300, texts: list[str] | None = None, eos: bool = True) -> Path:
    """Train a byte-level BPE of at most `vocab_size` tokens on `texts` and save it to `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts or [SEED_TEXT] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS if eos else None)
    fast.save_pretrained(directory)
    return Path(directory)
