"""Hugging Face causal language models (Llama, Qwen2, Mistral, ...) as hfsdp trains them.

A model built by `transformers` needs nothing of its own: its decoder layers are
the units, everything else (embeddings, final norm, the output head, tied or not)
is the root, and its parameter names are the names a `save_pretrained` directory
uses, so checkpoints map to Hugging Face one to one. This module builds such a
model from a `config.json`, names its units and computes the loss the trainer
uses; `transformers` is imported only when one of these is called.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

CONFIG_NAME = "config.json"


class HFModelError(ValueError):
    """A config.json that cannot be turned into a causal language model hfsdp can shard."""


def load_config(path: str | Path):
    """The transformers config in `path` (a config.json, or a directory holding one)."""
    path = Path(path)
    file = path / CONFIG_NAME if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        reason = f"{file} cannot be read as a JSON config ({err})"
        raise HFModelError(f"{reason}; give a Hugging Face config.json.") from None
    return config_from_dict(data, str(file))


@contextmanager
def quiet_transformers():
    """transformers' advice while building a model ("add is_decoder=True", deprecations) is for its own users;
    hfsdp's own message says what matters. Restores the caller's verbosity after."""
    from transformers.utils import logging

    before = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(before)


def config_from_dict(data: object, source: str = "the model config"):
    """A transformers config from its dict (`config.to_dict()`, or a config.json's contents)."""
    from transformers import AutoConfig

    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise HFModelError(
            f"{source} has no 'model_type'; a Hugging Face config.json names its architecture there "
            '(e.g. "model_type": "llama").'
        )
    params = {k: v for k, v in data.items() if k != "model_type"}
    try:
        with quiet_transformers():
            return AutoConfig.for_model(data["model_type"], **params)
    except (ValueError, KeyError, TypeError) as err:
        reason = str(err).split(". Should contain")[0][:300]  # transformers lists every model type it knows
        raise HFModelError(
            f"{source}: transformers cannot build model_type '{data['model_type']}' ({reason}); use a causal "
            "language model it knows (llama, qwen2, mistral, ...)."
        ) from None


def build_causal_lm(config, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """An fp32 causal LM of `config`, initialised from `seed` (on "meta": shapes and names only, no memory)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    try:
        with torch.device(device), quiet_transformers():
            model = AutoModelForCausalLM.from_config(config).float()
    except ValueError as err:
        raise HFModelError(
            f"transformers has no causal language model for model_type '{config.model_type}' ({err}); use a "
            "decoder-only architecture such as llama, qwen2 or mistral."
        ) from None
    decoder_layers(model)  # refuse early what hfsdp cannot split into units
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The units of a causal LM: its decoder layers (`model.model.layers` in every family hfsdp supports)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise HFModelError(
            f"{type(model).__name__} keeps no decoder layers at model.model.layers, where Llama, Qwen2 and Mistral "
            "keep them; hfsdp shards each layer as one unit and cannot find them in this architecture."
        )
    return list(layers)


def causal_lm_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a [batch, seq] microbatch (`labels` are already the next tokens), in fp32."""
    logits = model(input_ids=tokens, use_cache=False).logits
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def vocab_size(config) -> int:
    return int(config.vocab_size)
