"""Stand-ins for what a new user brings: a Hugging Face model directory (config, weights, tokenizer) and a JSONL
corpus, both made here without a download, so the README's data block runs on any machine.

    python examples/model_and_corpus.py model corpus.jsonl

The corpus is real text every machine has: the `.py` files of the standard library's `json` and `email` packages,
one JSON line each (`{"text": ...}`). The tokenizer is a byte-level BPE of 2,048 tokens trained on that corpus (with
`<|endoftext|>` as its EOS), the model a small random Llama whose vocabulary is the tokenizer's. With your own model
and corpus, skip this step.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path


def main(model_dir: str, corpus: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [
        p.read_text(encoding="utf-8") for package in ("json", "email") for p in sorted((root / package).rglob("*.py"))
    ]
    Path(corpus).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet)
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(model_dir)

    shape = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 4}
    config = LlamaConfig(vocab_size=len(tokenizer), num_key_value_heads=2, max_position_embeddings=256, **shape)
    config.eos_token_id, config.bos_token_id = tokenizer.eos_token_id, None
    LlamaForCausalLM(config).save_pretrained(model_dir)
    print(f"{model_dir}: a Llama of vocabulary {len(tokenizer):,} and its tokenizer; {corpus}: {len(texts)} documents")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python examples/model_and_corpus.py MODEL_DIR CORPUS.jsonl")
    main(*sys.argv[1:])
