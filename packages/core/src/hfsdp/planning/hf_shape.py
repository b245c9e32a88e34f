"""The Hugging Face causal LMs hfsdp trains (Llama, Mistral, Qwen2, Mixtral), in closed form from config.json.

Per decoder layer: `input_layernorm` and `post_attention_layernorm` (RMSNorm, weight only),
`q_proj`, `k_proj`, `v_proj`, `o_proj` (biases: Llama's `attention_bias` on all four, Qwen2
on q, k and v always), and an MLP `gate_proj`, `up_proj`, `down_proj` (Llama's `mlp_bias`),
or for Mixtral a router `mlp.gate` (experts x hidden) and the experts' fused `gate_up_proj`
and `down_proj`. The root: `embed_tokens`, the final `norm` and `lm_head` (absent when the
embeddings are tied). `hfsdp train` shards a Hugging Face model's experts as dense
parameters (it marks no expert mesh for them), so here they count as dense too.

FP8 (`--fp8-format`) converts the layer's q/k/v/o and MLP projections whose dims are multiples
of 16 and whose in*out/(in+out) reaches the run's min size (`--fp8-min-size`, 2048 by default: at
Llama-3-8B's shape q/o and the MLP, not k/v); Mixtral's router and fused experts are not `nn.Linear`
layers, so only its attention is.

Missing fields take transformers' defaults for the family, as `AutoConfig.for_model` would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hfsdp.planning.model_shape import (
    FP8_MIN_SIZE,
    HF_FAMILIES,
    ModelShape,
    ModelShapeError,
    UnitParams,
    fp8_linears,
)

#: transformers' defaults of the fields the counts need, per family (LlamaConfig() etc., transformers 5).
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "max_position_embeddings": 2048},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "max_position_embeddings": 32768},
    "mixtral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "num_local_experts": 8, "num_experts_per_tok": 2},
}  # fmt: skip


def hf_shape(
    config: Mapping[str, Any], source: str = "the model config", fp8_min_size: float = FP8_MIN_SIZE
) -> ModelShape:
    """The shape of the causal LM a config.json's fields describe; `source` names the file in errors, `fp8_min_size`
    is the run's `--fp8-min-size` (which Linear layers fp8 would convert)."""
    family = config.get("model_type")
    if family not in HF_FAMILIES:
        raise ModelShapeError(
            f"{source} has model_type {family!r}; the planner counts parameters of {', '.join(HF_FAMILIES)} "
            "(the families hfsdp trains); give a config.json of one of them."
        )
    fields = {**DEFAULTS[family], **config}

    def size(name: str, default: int | None = None) -> int:
        value = fields.get(name, default)
        if value is None and default is not None:
            value = default
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelShapeError(f"{source}: {name} must be a positive whole number, got {value!r}.")
        return value

    h, f, layers, heads, vocab = (
        size(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    )
    kv = size("num_key_value_heads", heads)
    if heads % kv:
        raise ModelShapeError(f"{source}: num_key_value_heads {kv} does not divide num_attention_heads {heads}.")
    head_dim = size("head_dim", h // heads) if fields.get("head_dim") is not None else h // heads
    if head_dim < 1:
        raise ModelShapeError(f"{source}: hidden_size {h} is smaller than num_attention_heads {heads}.")
    q, kvd = heads * head_dim, kv * head_dim
    attention = matmul_attention = 2 * q * h + 2 * kvd * h  # biases are stored, but no matmul multiplies them
    if family == "llama" and fields.get("attention_bias"):
        attention += q + 2 * kvd + h
    if family == "qwen2":
        attention += q + 2 * kvd
    matmul_mlp = 3 * h * f
    mlp = matmul_mlp + (2 * f + h if family == "llama" and fields.get("mlp_bias") else 0)
    experts = topk = 0
    if family == "mixtral":
        experts, topk = size("num_local_experts"), size("num_experts_per_tok")
        if topk > experts:
            raise ModelShapeError(f"{source}: num_experts_per_tok {topk} is more than num_local_experts {experts}.")
        dense = 2 * h + attention + experts * h + experts * mlp
        active = matmul_attention + experts * h + topk * matmul_mlp
    else:
        dense, active = 2 * h + attention + mlp, matmul_attention + matmul_mlp
    linears = [(q, h), (kvd, h), (kvd, h), (h, q)] + ([] if family == "mixtral" else [(f, h), (f, h), (h, f)])
    fp8, fp8_weights = fp8_linears(linears, fp8_min_size)
    units = [UnitParams(f"model.layers.{i}", dense, 0, active, fp8, fp8_weights) for i in range(layers)]
    tied = bool(fields.get("tie_word_embeddings", False))
    root = vocab * h + h + (0 if tied else vocab * h)
    units.append(UnitParams("root (embed_tokens, norm, lm_head)", root, 0, vocab * h))
    longest = fields.get("max_position_embeddings")
    return ModelShape(
        family=family,
        layers=layers,
        hidden=h,
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        ffn=f,
        vocab=vocab,
        norm="RMSNorm",
        gated=True,
        units=tuple(units),
        experts=experts or None,
        topk=topk,
        loss_inside=False,
        max_positions=longest if isinstance(longest, int) and not isinstance(longest, bool) else None,
    )
