"""A Llama-style megatron-core GPT as a transformers `LlamaForCausalLM`: the config and the name map.

This is the model family's "state dict adapter": two pure functions, `to_hf`
and `from_hf`, plus the transformers config, kept beside the GPT so that
checkpoint code stays format-agnostic. A megatron GPT is a Llama exactly when
it uses RMSNorm, SwiGLU, rotary positions, no linear biases, no experts and
untied embeddings; anything else is refused (`UnmappableModel`) rather than
exported as a model transformers would build differently.

Every megatron tensor maps to one or more HF tensors, and each HF tensor is a
list of row ranges of the megatron tensor, concatenated:

- `linear_qkv.weight` holds, per query group g, the q rows of its heads
  ((nh/ng)*hd), then its k rows (hd), then its v rows (hd); `q_proj` is the q
  rows of every group in group order (query head g*(nh/ng)+j uses key/value
  head g, as in transformers' grouped-query attention), `k_proj` and `v_proj`
  likewise;
- `linear_fc1.weight` is [gate; up] (megatron's SwiGLU is silu(first half) x
  second half): `gate_proj` the first ffn rows, `up_proj` the rest;
- every other tensor is renamed whole.

Row ranges of a row-major tensor are flat ranges, so an exporter can stream a
tensor of any size (`parts`), and `to_hf` / `from_hf` are that same plan
applied to whole tensors in memory. Both directions are unit-tested by round
trip, and the mapping numerically against transformers' forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

LLAMA = "LlamaForCausalLM"


class UnmappableModel(ValueError):
    """The recorded GPT has a feature Llama does not have; the message names it and the way out."""


@dataclass(frozen=True)
class Part:
    """One HF tensor made of rows of one megatron tensor: `rows` are [start, stop) row ranges, concatenated."""

    hf_name: str
    shape: tuple[int, ...]
    rows: tuple[tuple[int, int], ...]

    def flat_ranges(self, row_numel: int) -> list[tuple[int, int]]:
        """The same rows as flat element ranges of the megatron tensor."""
        return [(a * row_numel, b * row_numel) for a, b in self.rows]


#: What a GPT needs to be a Llama: (record key, required value, the feature named when it differs).
_REQUIRED = (
    ("normalization", "RMSNorm", "normalization '{value}' (Llama uses RMSNorm)"),
    ("swiglu", True, "a GELU MLP without SwiGLU (Llama's MLP is SwiGLU)"),
    ("position_embedding_type", "rope", "position embeddings '{value}' (Llama uses rotary positions)"),
    ("add_bias_linear", False, "linear biases (Llama has none)"),
    ("share_embeddings_and_output_weights", False, "tied input and output embeddings"),
)
_INTS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
    "seq_length",
)


def _refuse(feature: str) -> UnmappableModel:
    return UnmappableModel(
        f"The checkpoint's megatron GPT has {feature}, so it is not a Llama, the one transformers architecture "
        "hfsdp maps megatron GPTs to (RMSNorm, SwiGLU, rotary positions, no linear biases, no experts, untied "
        "embeddings); exporting it under Llama's names would build a different model. Export it with "
        "--format megatron (the consolidated megatron state dict) instead."
    )


def _checked(record: dict[str, Any]) -> dict[str, Any]:
    """The record's numbers after checking that the GPT is a Llama (UnmappableModel otherwise)."""
    if not isinstance(record, dict):
        raise _refuse("no architecture record")
    if record.get("num_moe_experts"):
        raise _refuse(f"{record['num_moe_experts']} mixture-of-experts experts per layer")
    for key, value, feature in _REQUIRED:
        if key not in record:
            raise _refuse(f"no '{key}' in its record")
        if record[key] != value:
            raise _refuse(feature.format(value=record[key]))
    numbers = {}
    for key in _INTS:
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise _refuse(f"no valid '{key}' in its record ({value!r})")
        numbers[key] = value
    for key in ("rotary_base", "layernorm_epsilon"):
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise _refuse(f"no valid '{key}' in its record ({value!r})")
        numbers[key] = value
    heads, groups, hidden = numbers["num_attention_heads"], numbers["num_query_groups"], numbers["hidden_size"]
    if hidden % heads or heads % groups:
        raise _refuse(f"{heads} attention heads, {groups} query groups and hidden size {hidden}, which do not divide")
    return numbers


def llama_config(record: dict[str, Any]) -> dict[str, Any]:
    """The transformers config (as a config.json dict) of the Llama that the recorded GPT is."""
    n = _checked(record)
    return {
        "model_type": "llama",
        "architectures": [LLAMA],
        "vocab_size": n["vocab_size"],
        "hidden_size": n["hidden_size"],
        "intermediate_size": n["ffn_hidden_size"],
        "num_hidden_layers": n["num_layers"],
        "num_attention_heads": n["num_attention_heads"],
        "num_key_value_heads": n["num_query_groups"],
        "head_dim": n["hidden_size"] // n["num_attention_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": n["seq_length"],
        "rms_norm_eps": float(n["layernorm_epsilon"]),
        "rope_theta": float(n["rotary_base"]),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }


class LlamaMapping:
    """The name map between a recorded Llama-style megatron GPT and transformers' Llama."""

    def __init__(self, record: dict[str, Any]):
        n = _checked(record)
        self.config = llama_config(record)
        self.layers = n["num_layers"]
        self.hidden, self.vocab, self.ffn = n["hidden_size"], n["vocab_size"], n["ffn_hidden_size"]
        self.heads, self.groups = n["num_attention_heads"], n["num_query_groups"]
        self.head_dim = self.hidden // self.heads

    # -- the plan -----------------------------------------------------------------------------

    def megatron_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every megatron tensor of the GPT and its shape, in megatron's parameter order."""
        h, kv = self.hidden, self.groups * self.head_dim
        out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"decoder.layers.{i}"
            out[f"{p}.input_layernorm.weight"] = (h,)
            out[f"{p}.self_attention.linear_proj.weight"] = (h, h)
            out[f"{p}.self_attention.linear_qkv.weight"] = (h + 2 * kv, h)
            out[f"{p}.pre_mlp_layernorm.weight"] = (h,)
            out[f"{p}.mlp.linear_fc1.weight"] = (2 * self.ffn, h)
            out[f"{p}.mlp.linear_fc2.weight"] = (h, self.ffn)
        out["decoder.final_layernorm.weight"] = (h,)
        out["output_layer.weight"] = (self.vocab, h)
        return out

    def parts(self, name: str) -> list[Part]:
        """The HF tensors of megatron tensor `name`, each as row ranges of it; KeyError for a name Llama lacks."""
        shape = self.megatron_shapes()[name]
        whole = (0, shape[0])
        if name == "embedding.word_embeddings.weight":
            return [Part("model.embed_tokens.weight", shape, (whole,))]
        if name == "decoder.final_layernorm.weight":
            return [Part("model.norm.weight", shape, (whole,))]
        if name == "output_layer.weight":
            return [Part("lm_head.weight", shape, (whole,))]
        _, _, index, rest = name.split(".", 3)
        hf = f"model.layers.{index}"
        if rest == "self_attention.linear_qkv.weight":
            return self._qkv_parts(hf)
        if rest == "mlp.linear_fc1.weight":
            f = self.ffn
            return [
                Part(f"{hf}.mlp.gate_proj.weight", (f, self.hidden), ((0, f),)),
                Part(f"{hf}.mlp.up_proj.weight", (f, self.hidden), ((f, 2 * f),)),
            ]
        renamed = {
            "input_layernorm.weight": "input_layernorm.weight",
            "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
            "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
            "mlp.linear_fc2.weight": "mlp.down_proj.weight",
        }
        return [Part(f"{hf}.{renamed[rest]}", shape, (whole,))]

    def _qkv_parts(self, hf: str) -> list[Part]:
        hd, per_group = self.head_dim, self.heads // self.groups
        stride = (per_group + 2) * hd  # rows of one query group: its q heads, one k head, one v head
        q = tuple((g * stride, g * stride + per_group * hd) for g in range(self.groups))
        k = tuple((g * stride + per_group * hd, g * stride + (per_group + 1) * hd) for g in range(self.groups))
        v = tuple((g * stride + (per_group + 1) * hd, (g + 1) * stride) for g in range(self.groups))
        kv = (self.groups * hd, self.hidden)
        return [
            Part(f"{hf}.self_attn.q_proj.weight", (self.heads * hd, self.hidden), q),
            Part(f"{hf}.self_attn.k_proj.weight", kv, k),
            Part(f"{hf}.self_attn.v_proj.weight", kv, v),
        ]

    # -- the two directions, on whole tensors ------------------------------------------------

    def to_hf(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The HF tensors (name, tensor) of megatron tensor `name`."""
        return [(p.hf_name, torch.cat([tensor[a:b] for a, b in p.rows]).view(p.shape)) for p in self.parts(name)]

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The megatron state dict of an HF Llama state dict (the inverse of `to_hf`); KeyError for a missing one."""
        out = {}
        for name, shape in self.megatron_shapes().items():
            parts = self.parts(name)
            first = hf_state_dict[parts[0].hf_name]
            tensor = torch.empty(shape, dtype=first.dtype, device=first.device)
            for part in parts:
                source, row = hf_state_dict[part.hf_name], 0
                for a, b in part.rows:
                    tensor[a:b] = source[row : row + b - a]
                    row += b - a
            out[name] = tensor
        return out


def llama_mapping(record: dict[str, Any]) -> LlamaMapping:
    """The mapping of the GPT in a `GPTShape.record()`, or UnmappableModel naming what Llama lacks."""
    return LlamaMapping(record)


def to_hf(record: dict[str, Any], name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return LlamaMapping(record).to_hf(name, tensor)


def from_hf(record: dict[str, Any], hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return LlamaMapping(record).from_hf(hf_state_dict)
