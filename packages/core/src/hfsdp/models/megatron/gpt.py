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
    #: "LayerNorm" or "RMSNorm"; with RMSNorm, SwiGLU and rotary positions and no biases the GPT is a Llama.
    normalization: str = "LayerNorm"
    swiglu: bool = False
    num_query_groups: int | None = None  # grouped-query attention; None: one group per head

    def record(self) -> dict:
        """The architecture as plain data, for a checkpoint's model record."""
        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_query_groups or self.num_attention_heads,
            "ffn_hidden_size": self.ffn_size,
            "vocab_size": self.vocab_size,
            "seq_length": self.seq_length,
            "normalization": self.normalization,
            "swiglu": self.swiglu,
            "num_moe_experts": self.num_moe_experts,
            "moe_router_topk": self.moe_router_topk,
            "position_embedding_type": "rope",
            "rotary_base": 10000,
            "layernorm_epsilon": 1e-5,
            "add_bias_linear": False,
            "share_embeddings_and_output_weights": False,
        }

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def num_params(self) -> int:
        """Parameter count of the dense model (experts counted once each), for throughput figures."""
        h, v, f = self.hidden_size, self.vocab_size, self.ffn_size
        kv = h * (self.num_query_groups or self.num_attention_heads) // self.num_attention_heads
        experts = self.num_moe_experts or 1
        mlp = (3 if self.swiglu else 2) * h * f
        norms = 2 * h if self.normalization == "RMSNorm" else 4 * h
        layer = 2 * h * h + 2 * h * kv + experts * mlp + norms + (h * experts if self.num_moe_experts else 0)
        return self.num_layers * layer + 2 * v * h + (h if self.normalization == "RMSNorm" else 2 * h)


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
    llama = {}
    if shape.swiglu:
        llama.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False)
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_size,
        normalization=shape.normalization,
        layernorm_epsilon=1e-5,
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
        **llama,
        **moe,
    )


def build_gpt(shape: GPTShape, params_dtype: torch.dtype = torch.float32):
    """A GPTModel with untied embeddings and rotary positions, built on the CPU."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(shape, params_dtype)
    spec = get_gpt_layer_local_spec(
        num_experts=shape.num_moe_experts, moe_grouped_gemm=False, normalization=shape.normalization
    )
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
    from hfsdp.models.megatron.adapter import is_expert_param

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
