"""Tiny Hugging Face causal LMs saved with `save_pretrained`, and what transformers makes of them again."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)
LAYOUTS = {
    "HFSDP 3x2 (world 6)": dict(world_size=6, instances=3, outer="optim"),
    "HFSDP 2x2": dict(world_size=4, instances=2, outer="optim"),
    "HSDP 2x2": dict(world_size=4, instances=2),
    "ZeRO-1 1x3": dict(world_size=3, inner="optim"),
    "one rank": dict(world_size=1),
}
#: name -> (model_type, tied, dtype the files hold, max_shard_size of save_pretrained)
MODELS = {
    "llama tied sharded": ("llama", True, torch.float32, "20KB"),
    "llama untied": ("llama", False, torch.float32, "10GB"),
    "llama bf16 sharded": ("llama", False, torch.bfloat16, "20KB"),
    "qwen2 tied": ("qwen2", True, torch.float32, "10GB"),
}
TOKENS = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(7))


def tiny_config(model_type: str = "llama", tied: bool = False):
    from hfsdp.models.hf import config_from_dict

    return config_from_dict({"model_type": model_type, **TINY, "tie_word_embeddings": tied})


def write_hf_dir(path: Path, model_type="llama", tied=False, dtype=torch.float32, shard="10GB", seed=0) -> Path:
    """save_pretrained of a tiny causal LM with random norm weights (so that a swapped norm would show)."""
    from hfsdp.models.hf import build_causal_lm

    model = build_causal_lm(tiny_config(model_type, tied), seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(path, max_shard_size=shard)
    return path


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def hf_logits(path: Path, dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def load_info(path: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return model, info
