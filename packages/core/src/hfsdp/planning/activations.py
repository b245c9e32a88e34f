"""What one microbatch's activations cost: bytes kept for backward per layer, and the loss's peak on top.

Counted tensor by tensor from what autograd saves in the two implementations hfsdp trains
(docs/planning.md, "Activations", lists each term). T = tokens of a microbatch (sequence x
micro-batch), c = bytes of the compute dtype, h = hidden, q / kv = query / key-value width,
f = FFN width, a = heads, s = sequence, V = vocabulary.

- megatron-core GPT, local spec (`DotProductAttention`: the s x s scores are materialised; the
  model is built with fp32 `params_dtype`, so its softmax runs in the compute dtype). Per layer:
  the two norms (LayerNorm: input and output, 2cTh, plus fp32 statistics; RMSNorm: torch's
  composite, with fp32 copies), the fused QKV output (kept
  whole because the values are a view of it; with grouped queries the repeated keys and values
  instead), the rotated queries and keys, the softmax output (c·a·s·T), the attention context
  (cTq) and the MLP (gelu 2cTf, SwiGLU 5cTf). Per microbatch once: megatron's persistent score
  buffer (c·a·s·T, `get_global_memory_buffer`) and the causal mask. The loss is computed in the
  model: the final norm, the logits in the compute dtype and their fp32 copy, which the
  cross-entropy softmaxes in place and keeps (c·TV + 4TV).
- transformers Llama family (SDPA: flash or memory-efficient attention, no s x s matrix). Per
  layer: each RMSNorm keeps an fp32 copy of its input, the normalised value cast back and its
  output ((4 + 2c)·Th), the rotated queries and keys, the values, the attention output and its
  log-sum-exp, and the gated MLP (4cTf). The loss is computed outside on the logits: at its
  peak, the log-softmax's fp32 output, the gradient arriving at it and the one it produces (12TV).

With `recompute` a layer keeps only its input (cTh); the one layer being recomputed holds its
full activations during its backward. Mixture-of-experts layers are approximated (tokens x top-k
through the experts' MLPs, plus the permuted copies); docs/planning.md says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfsdp.planning.model_shape import MEGATRON_GPT, ModelShape


@dataclass(frozen=True)
class Activations:
    """Bytes of one microbatch on one rank, by when they are alive."""

    per_layer: int  # kept for backward by each layer (only its input with recompute)
    fixed: int  # kept once per microbatch whatever the layers (masks, position tables, megatron's score buffer)
    loss_peak: int  # on top of every layer's, at the peak of the loss (final norm, logits, their gradients)
    backward_workspace: int  # transient on top of what a layer keeps, during the largest layer's backward
    exact: bool  # False where the model is an approximation (mixture-of-experts layers)

    def at_loss(self, layers: int) -> int:
        return layers * self.per_layer + self.fixed + self.loss_peak


def activations(shape: ModelShape, seq: int, micro_batch: int, compute_bytes: int, recompute: bool) -> Activations:
    """The activation model of `shape` for microbatches of `micro_batch` sequences of `seq` tokens."""
    tokens = seq * micro_batch
    if shape.family == MEGATRON_GPT:
        layer, fixed, loss, workspace = _megatron_gpt(shape, seq, micro_batch, compute_bytes)
    else:
        layer, fixed, loss, workspace = _hf_llama_family(shape, seq, micro_batch, compute_bytes)
    if recompute:
        workspace += layer
        layer = compute_bytes * tokens * shape.hidden
    return Activations(layer, fixed, loss, workspace, exact=not shape.experts)


def _megatron_norm(shape: ModelShape, tokens: int, c: int) -> int:
    """What one of megatron's norms keeps, its output included. LayerNorm: its input, its output and fp32 mean and
    reciprocal deviation. RMSNorm (torch's composite `rms_norm`): an fp32 copy of its input, the fp32 normalised
    value, the output, and the fp32 reciprocal RMS."""
    th = tokens * shape.hidden
    if shape.norm == "LayerNorm":
        return 2 * c * th + 8 * tokens
    return (8 + c) * th + 4 * tokens


def _moe_mlp(shape: ModelShape, tokens: int, c: int) -> int:
    """Approximate: each token's top-k copies through an expert MLP, the permuted inputs and outputs, and the
    router's fp32 logits and probabilities."""
    routed = tokens * shape.topk
    mlp = (4 if shape.gated else 2) * c * routed * shape.ffn
    return mlp + 2 * c * routed * shape.hidden + 8 * tokens * shape.experts


def _megatron_gpt(shape: ModelShape, s: int, b: int, c: int) -> tuple[int, int, int, int]:
    t, q, kv, f, a = s * b, shape.q_dim, shape.kv_dim, shape.ffn, shape.heads
    scores = c * a * s * t  # one microbatch's attention probabilities: b x a x s x s
    norms = 2 * _megatron_norm(shape, t, c)
    # Without grouped queries: the fused output (the values are a view of it) and the rotated queries and keys. With
    # them: the rotated queries, and the keys and values repeated to every head (the fused output is then freed).
    qkv = c * t * (q + 2 * kv) + c * t * (q + kv) if shape.kv_heads == shape.heads else 3 * c * t * q
    rotary = 4 * c * s * shape.head_dim  # cos and sin in the compute dtype, for queries and keys
    # gelu: fc1's output and gelu's; SwiGLU: fc1's output, the linear half plus megatron's glu offset (a new
    # tensor), silu's output and the product.
    mlp = _moe_mlp(shape, t, c) if shape.experts else (5 if shape.gated else 2) * c * t * f
    layer = norms + qkv + rotary + scores + c * t * q + mlp
    fixed = scores + s * s  # megatron's persistent score buffer, the boolean causal mask
    logits = t * shape.vocab
    loss = _megatron_norm(shape, t, c) + 4 * logits + (c * logits if c != 4 else 0)
    workspace = 2 * scores  # the softmax's input and output gradients
    return layer, fixed, loss, workspace


def _hf_llama_family(shape: ModelShape, s: int, b: int, c: int) -> tuple[int, int, int, int]:
    t, h, q, kv, f = s * b, shape.hidden, shape.q_dim, shape.kv_dim, shape.ffn
    norm = (4 + 2 * c) * t * h + 4 * t  # fp32 copy, cast back, output; the fp32 reciprocal RMS
    attention = c * t * (2 * q + 2 * kv) + 4 * t * shape.heads  # q, k rotated, v, output; log-sum-exp
    mlp = _moe_mlp(shape, t, c) if shape.experts else 4 * c * t * f
    layer = 2 * norm + attention + mlp
    fixed = 2 * c * s * shape.head_dim  # the rotary cos and sin (one sequence's: positions are shared), every layer's
    loss = norm + 12 * t * shape.vocab
    workspace = 3 * c * t * f
    return layer, fixed, loss, workspace
