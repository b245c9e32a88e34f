"""Hugging Face causal language models (Llama, Qwen2, Mistral, ...) as hfsdp trains them.

A model built by `transformers` needs nothing of its own: its decoder layers are
the units, everything else (embeddings, final norm, the output head, tied or not)
is the root, and its parameter names are the names a `save_pretrained` directory
uses, so checkpoints map to Hugging Face one to one. This module builds such a
model from a `config.json`, names its units and computes the loss the trainer
uses; `transformers` is imported only when one of these is called.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from hfsdp.models import hf_code, hf_config
from hfsdp.models.hf_config import HFModelError

__all__ = ["HFModelError", "build_causal_lm", "causal_lm_loss", "config_from_dict", "decoder_layers", "load_config"]


def load_config(path: str | Path):
    """The transformers config in `path` (a config.json, or a directory holding one), after every check of
    `hf_config` on the file's contents and again on the config transformers built from them (its defaults)."""
    file = hf_config.config_file(path)
    return config_from_dict(hf_config.read_json_file(file, "model config"), str(file))


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
    """A transformers config from its dict (`config.to_dict()`, or a config.json's contents), checked by
    `hf_config` before transformers sees it and after (the architecture's defaults fill in what `data` omits). An
    architecture only the directory's own code (`auto_map`) builds is refused (`hf_code`): hfsdp never runs it."""
    from transformers import AutoConfig

    hf_config.check_hf_config(data, source)
    if problem := hf_code.model_code_problem(data, source):
        raise hf_code.OwnCodeError(problem)
    params = {k: v for k, v in data.items() if k != "model_type"}
    try:
        with quiet_transformers():
            config = AutoConfig.for_model(data["model_type"], **params)
    except Exception as err:  # transformers' own validation (ValueError, KeyError, its strict dataclasses' errors)
        raise HFModelError(
            f"{source}: transformers cannot build model_type '{data['model_type']}' ({_first_sentence(err)}); use a "
            "causal language model it knows (llama, qwen2, mistral, ...) with values it accepts."
        ) from None
    hf_config.check_hf_config(config.to_dict(), f"{source} (with {type(config).__name__}'s defaults)")
    return config


def build_causal_lm(config, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """An fp32 causal LM of `config`, initialised from `seed` (on "meta": shapes and names only, no memory)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    try:
        with torch.device(device), quiet_transformers():
            model = AutoModelForCausalLM.from_config(config).float()
    except ValueError as err:
        raise HFModelError(
            f"transformers has no causal language model for model_type '{config.model_type}' "
            f"({_first_sentence(err)}); use a decoder-only architecture such as llama, qwen2 or mistral."
        ) from None
    except Exception as err:  # a value transformers accepted in the config but cannot build (hidden_act: "nope")
        raise HFModelError(
            f"transformers cannot build a {config.model_type} model from this config ({type(err).__name__}: "
            f"{_first_sentence(err)}); correct the config.json, or give another."
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


def _first_sentence(err: BaseException) -> str:
    """The start of an error's message, bounded: transformers' messages go on to list every class it knows."""
    text = " ".join(str(err).split()) or type(err).__name__
    for stop in (". Should contain", ". Model type should be", "\n"):
        text = text.split(stop)[0]
    return text if len(text) <= 200 else text[:197] + "..."
