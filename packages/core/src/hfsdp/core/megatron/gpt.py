"""A megatron-core GPT built from the local layer spec (no Transformer Engine, no apex).

The flags below are the ones that keep megatron-core off CUDA-only fused kernels,
so the same model runs on CPU/gloo and on CUDA/NCCL. MoE uses the allgather token
dispatcher and no linear biases, the configuration megatron-core supports on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPTShape:
    """The size of the model; the defaults train a tiny GPT on a laptop in about a minute."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 128
    seq_length: int = 32
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    ffn_hidden_size: int | None = None

    def num_params(self) -> int:
        """Parameter count of the dense model (experts counted once each), for throughput figures."""
        h, v, f = self.hidden_size, self.vocab_size, self.ffn_hidden_size or 4 * self.hidden_size
        experts = self.num_moe_experts or 1
        layer = 4 * h * h + experts * 2 * h * f + 2 * h + (h * experts if self.num_moe_experts else 0)
        return self.num_layers * layer + 2 * v * h + h


def transformer_config(shape: GPTShape, params_dtype: torch.dtype = torch.float32):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if shape.num_moe_experts:
        moe = {
            "num_moe_experts": shape.num_moe_experts,
            "moe_router_topk": shape.moe_router_topk,
            "moe_token_dispatcher_type": "allgather",
            "moe_grouped_gemm": False,
            "moe_aux_loss_coeff": 0.0,
            "moe_router_load_balancing_type": "none",
        }
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        ffn_hidden_size=shape.ffn_hidden_size,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        add_bias_linear=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **moe,
    )


def build_gpt(shape: GPTShape, params_dtype: torch.dtype = torch.float32):
    """A GPTModel with untied embeddings and rotary positions, built on the CPU."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(shape, params_dtype)
    spec = get_gpt_layer_local_spec(num_experts=shape.num_moe_experts, moe_grouped_gemm=False)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )


def reinit_by_global_name(model, naming, seed: int, std: float = 0.02) -> None:
    """Draw every weight matrix from a generator seeded by its global name.

    megatron-core initialises parameters from one RNG stream in build order, and
    with expert parallelism each rank builds fewer experts, so even the dense
    weights after the first MoE layer would differ between ep = 1 and ep = 2.
    Seeding each matrix by its layout-independent name gives every layout the
    same model. Vectors (norm weights) keep megatron-core's values.
    """
    from hfsdp.core.megatron.adapter import is_expert_param

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                continue
            global_name = naming.to_global(name) if naming is not None and is_expert_param(name, param) else name
            gen = torch.Generator().manual_seed(seed * 1_000_003 + hash_name(global_name))
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def hash_name(name: str) -> int:
    """A stable (not per-process-salted) hash of a parameter name."""
    value = 0
    for ch in name.encode():
        value = (value * 131 + ch) % 1_000_000_007
    return value


def lm_loss(model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a [batch, seq] microbatch."""
    seq = tokens.shape[1]
    positions = torch.arange(seq, device=tokens.device).expand_as(tokens)
    # An explicit causal mask (True = masked): megatron-core's default one is built on "cuda".
    causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).triu(1)[None, None]
    per_token = model(tokens, positions, causal, labels=labels)
    return per_token.float().mean()
