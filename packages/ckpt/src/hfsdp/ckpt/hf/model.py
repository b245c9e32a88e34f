"""What a transformers causal LM is in checkpoint terms, from its config alone: tensors, groups, order.

Import and export must agree with the engine about a model they never build
for real: which tensors it has, how `fully_shard(model, cfg, meshes,
units=hf.decoder_layers(model))` groups them, and the state-dict order. So the
model is built on the `meta` device (`hfsdp.models.hf.build_causal_lm`: names and
shapes, no memory, no weights) and read off exactly as the engine reads a real
one:

- groups: one per decoder layer, then the root (embeddings, final norm, output
  head), each holding the unit's parameters that no earlier unit claimed, in
  `parameters()` order, under their `named_parameters()` names; a tied weight
  is one parameter, named once by its first name (`model.embed_tokens.weight`);
- unsharded tensors: the persistent buffers (and frozen parameters), which the
  engine keeps whole; rotary `inv_freq` is non-persistent and not among them;
- aliases: the other names of a tied weight (`lm_head.weight`), which
  `save_pretrained` leaves out and `from_pretrained` ties again;
- order: the state dict's, aliases left out.

transformers is imported only here (through `hfsdp.models.hf`), on first use.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.index import GroupSpec, TensorEntry
from hfsdp.ckpt.tensors.writer import dtype_name


@dataclass(frozen=True)
class Skeleton:
    """A causal LM's checkpoint-side description (see the module docstring)."""

    config: Any  # the transformers config
    architecture: str  # the model class, e.g. "LlamaForCausalLM"
    groups: list[GroupSpec]
    parameters: dict[str, tuple[int, ...]]  # first name -> shape, in state-dict order
    unsharded: dict[str, TensorEntry]  # persistent buffers and frozen parameters (no pieces)
    aliases: dict[str, str]  # second name of a tied weight -> its first name
    order: list[str]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint of the model holds (parameters and unsharded), by name, in state-dict order."""
        shapes = {**self.parameters, **{n: t.shape for n, t in self.unsharded.items()}}
        return {name: shapes[name] for name in self.order}


def skeleton(
    config_dict: dict[str, Any], source: str, names: Iterable[str], compute_dtype: str = "float32"
) -> Skeleton:
    """The skeleton of the causal LM that `config_dict` (a config.json's contents) describes; `compute_dtype` is
    the dtype the groups declare (the "model" kind's). `names` are the tensor names the weights hold: a config
    declaring more decoder layers than they have weights for is refused before anything is built (a meta model
    costs no memory, but building a billion layers would still take forever)."""
    from hfsdp.models.hf import HFModelError, build_causal_lm, config_from_dict, decoder_layers, quiet_transformers

    check_layer_count(config_dict.get("num_hidden_layers"), names, source)

    try:
        # build_causal_lm seeds torch's global generator: keep the caller's RNG state as it was.
        with quiet_transformers(), torch.random.fork_rng(devices=[]):
            config = config_from_dict(config_dict, source)
            model = build_causal_lm(config, device="meta")
    except HFModelError as err:
        raise CheckpointError(f"{err} Nothing was written.") from None
    except Exception as err:  # transformers' own validation of the config's values
        raise CheckpointError(
            f"transformers cannot build a model from {source} ({type(err).__name__}: {str(err)[:300]}); the config "
            "is damaged or written for another transformers release. Nothing was written."
        ) from None
    names = {param: name for name, param in model.named_parameters()}
    claimed: set = set()
    groups = []
    units = [*decoder_layers(model), model]
    for unit_index, unit in enumerate(units):
        members = [(names[p], tuple(p.shape)) for p in unit.parameters() if p not in claimed and p.requires_grad]
        claimed.update(p for p in unit.parameters() if p.requires_grad)
        if members:
            groups.append(GroupSpec(unit_index, False, compute_dtype, None, tuple(members)))
    sharded = {id(p) for p in claimed}
    parameters, unsharded, aliases, order = {}, {}, {}, []
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in sharded and names[value] != name:
            aliases[name] = names[value]
            continue
        order.append(name)
        if id(value) in sharded:
            parameters[name] = tuple(value.shape)
        else:
            unsharded[name] = TensorEntry(tuple(value.shape), dtype_name(value.dtype))
    return Skeleton(config, type(model).__name__, groups, parameters, unsharded, aliases, order)


#: A decoder layer's index in a parameter name: `model.layers.3.mlp...` (transformers), `decoder.layers.3...`
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_layer_count(declared: Any, names: Iterable[str], source: str) -> None:
    """Refuse a model config that declares more layers than the weights hold (CheckpointError)."""
    if isinstance(declared, bool) or not isinstance(declared, int):
        return  # transformers validates the config itself
    held = {match.group(1) for name in names if (match := LAYER.search(name))}
    if declared > len(held):
        raise CheckpointError(
            f"{source} declares {declared} decoder layers, but the weights hold tensors of {len(held)}: the config "
            "and the weights belong to different models. Nothing was written."
        )
