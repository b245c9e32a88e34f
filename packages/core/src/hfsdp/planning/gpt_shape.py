"""The megatron-core GPT that `hfsdp train` builds (local layer spec, `hfsdp.models.megatron.gpt`), in closed form.

Per layer: `input_layernorm`, `self_attention.linear_qkv` (queries, keys and values in one
weight), `linear_proj`, `pre_mlp_layernorm`, and an MLP (`linear_fc1`, twice as tall when
gated, and `linear_fc2`) or, with experts, a router (`mlp.router`, dense) and one such MLP
per expert (`mlp.experts...`, on the expert mesh). No linear biases; a LayerNorm has a
bias, an RMSNorm does not. The root: word embeddings, the final norm, an untied output
layer; positions are rotary (no parameters). The FFN size is 4 x hidden, as `GPTShape` has it.
Its linears are megatron-core's own, which hfsdp's fp8 does not convert (`hfsdp train` refuses
`--fp8-format` for it), so no unit has fp8 weights.
"""

from __future__ import annotations

from hfsdp.planning.model_shape import MEGATRON_GPT, ModelShape, ModelShapeError, UnitParams


def gpt_shape(
    *,
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    normalization: str = "LayerNorm",
    swiglu: bool = False,
    num_query_groups: int | None = None,
    num_moe_experts: int | None = None,
    moe_topk: int = 2,
    seq_len: int | None = None,
) -> ModelShape:
    """The GPT of `hfsdp train`'s model flags (their validation is the CLI's rules; only what the formulas need
    is checked here)."""
    if hidden % heads:
        raise ModelShapeError(f"hidden size {hidden} is not divisible by {heads} heads; choose a multiple of {heads}.")
    groups = num_query_groups or heads
    if heads % groups:
        raise ModelShapeError(f"{groups} query groups do not divide {heads} heads; each group serves whole heads.")
    head_dim = hidden // heads
    ffn = 4 * hidden
    norm = hidden if normalization == "RMSNorm" else 2 * hidden
    attention = (hidden + 2 * groups * head_dim) * hidden + hidden * hidden
    mlp = (2 * ffn if swiglu else ffn) * hidden + hidden * ffn
    units = []
    for index in range(layers):
        if num_moe_experts:
            router = num_moe_experts * hidden
            dense = 2 * norm + attention + router
            active = attention + router + moe_topk * mlp
            units.append(UnitParams(f"decoder.layers.{index}", dense, num_moe_experts * mlp, active))
        else:
            units.append(UnitParams(f"decoder.layers.{index}", 2 * norm + attention + mlp, 0, attention + mlp))
    units.append(UnitParams("root (embedding, final norm, output layer)", 2 * vocab * hidden + norm, 0, vocab * hidden))
    return ModelShape(
        family=MEGATRON_GPT,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=groups,
        head_dim=head_dim,
        ffn=ffn,
        vocab=vocab,
        norm=normalization,
        gated=swiglu,
        units=tuple(units),
        experts=num_moe_experts or None,
        topk=moe_topk if num_moe_experts else 0,
        loss_inside=True,
        max_positions=seq_len,
    )
