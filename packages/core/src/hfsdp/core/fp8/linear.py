"""`Float8Linear`: an `nn.Linear` whose three matmuls run in fp8 through `torch._scaled_mm`.

Why `torch._scaled_mm` directly and not torchao's float8 tensors: the weights of a unit reach the
layer from hfsdp's flat gather, already in fp8 with their scale when `fp8_param_gather` is on, and
the layer only has to multiply them; wrapping them in a tensor subclass first would add a dispatch
layer to every op and a dependency, and buy nothing the three calls below do not do. It also runs on
the CPU (torch >= 2.13), so CPU runs and tests compute the same arithmetic a GPU does.

The recipes (`config.Float8Config`):
- tensorwise: input x, weight W and output gradient G each get one scale; y = x W^T, dx = G W and
  dW = G^T x all multiply in fp8 (G in e5m2 under "hybrid"). x and W are kept for backward in fp8.
- rowwise: y and dx multiply in fp8 with one scale per row of each operand (W is quantized by rows for
  y and by columns for dx); dW = G^T x stays in the compute dtype, for accuracy, as torchao's rowwise
  recipe with a high-precision weight gradient does.

`torch._scaled_mm` wants every dimension a multiple of 16. `convert.py` converts only layers whose
features are; the token count (rows of x) is padded with zero rows where it is not, which changes no
result (a zero row adds nothing to dW and its own outputs are dropped).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hfsdp.core.fp8 import scaling
from hfsdp.core.fp8.config import Float8Config

_ALIGN = 16


def _scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """a @ b with a (row-major) and b (column-major) in fp8, each multiplied back by its inverse scale."""
    return torch._scaled_mm(a, b, scale_a=scale_a.reciprocal(), scale_b=scale_b.reciprocal(), out_dtype=out_dtype)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


class _TensorwiseMatmul(torch.autograd.Function):
    """y = x W^T with one scale per tensor. `w_fp8`/`w_scale` are the weight already in fp8 (gathered so),
    or None: then W is quantized here, with exactly the same arithmetic."""

    @staticmethod
    def forward(ctx, x, weight, w_fp8, w_scale, fwd_dtype, grad_dtype):
        if w_fp8 is None:
            w_fp8, w_scale = scaling.tensorwise(weight, fwd_dtype)
        x_fp8, x_scale = scaling.tensorwise(x, fwd_dtype)
        ctx.save_for_backward(x_fp8, x_scale, w_fp8, w_scale)
        ctx.grad_dtype, ctx.dtypes = grad_dtype, (x.dtype, weight.dtype)
        return _scaled_mm(x_fp8, w_fp8.t(), x_scale, w_scale, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x_fp8, x_scale, w_fp8, w_scale = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g_fp8, g_scale = scaling.tensorwise(grad, ctx.grad_dtype)
        grad_x = grad_w = None  # only what autograd asks for: a frozen weight (a LoRA base) needs no dW
        if ctx.needs_input_grad[0]:
            grad_x = _scaled_mm(g_fp8, _column_major(w_fp8), g_scale, w_scale, x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _scaled_mm(g_fp8.t().contiguous(), _column_major(x_fp8), g_scale, x_scale, w_dtype)
        return grad_x, grad_w, None, None, None, None


class _RowwiseMatmul(torch.autograd.Function):
    """y = x W^T and dx = G W with one scale per row of each operand; dW = G^T x in the compute dtype."""

    @staticmethod
    def forward(ctx, x, weight, fwd_dtype):
        x_fp8, x_scale = scaling.rowwise(x, fwd_dtype)
        w_fp8, w_scale = scaling.rowwise(weight, fwd_dtype)
        ctx.save_for_backward(x, weight)
        ctx.fwd_dtype = fwd_dtype
        return _scaled_mm(x_fp8, w_fp8.t(), x_scale, w_scale.t(), x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g_fp8, g_scale = scaling.rowwise(grad, ctx.fwd_dtype)
            w_fp8, w_scale = scaling.rowwise(weight, ctx.fwd_dtype, dim=0)  # one scale per column of W
            grad_x = _scaled_mm(g_fp8, _column_major(w_fp8), g_scale, w_scale, x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (grad.t().to(weight.dtype) @ x.to(weight.dtype)).to(weight.dtype)
        return grad_x, grad_w, None


def float8_linear(x, weight, bias, config: Float8Config, w_fp8=None, w_scale=None) -> torch.Tensor:
    """F.linear(x, weight, bias) with the matmuls in fp8 by `config`; `w_fp8`, `w_scale`: the weight gathered in
    fp8 (tensorwise only), whose bits are what quantizing `weight` here would give."""
    fwd_dtype, grad_dtype = scaling.formats(config.format)
    rows = x.reshape(-1, x.shape[-1])
    pad = -rows.shape[0] % _ALIGN
    if pad:
        rows = F.pad(rows, (0, 0, 0, pad))
    if config.recipe == "tensorwise":
        out = _TensorwiseMatmul.apply(rows, weight, w_fp8, w_scale, fwd_dtype, grad_dtype)
    else:
        out = _RowwiseMatmul.apply(rows, weight, fwd_dtype)
    if pad:
        out = out[: out.shape[0] - pad]
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


class Float8Linear(nn.Linear):
    """An `nn.Linear` (the same parameters, names and state dict) that multiplies in fp8.

    Made from an existing `nn.Linear` by `convert.convert_to_float8`, never constructed directly. When hfsdp
    gathers the layer's weight in fp8 (`fully_shard(fp8_param_gather=True)`), it sets `fp8_weight` and
    `fp8_weight_scale` for the time the unit computes, and `weight` is then only the tensor autograd puts the
    weight's gradient on: its values are not the weight's (read the weight outside the unit's forward)."""

    fp8_config: Float8Config
    fp8_weight: torch.Tensor | None = None
    fp8_weight_scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias, self.fp8_config, self.fp8_weight, self.fp8_weight_scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_config.format}/{self.fp8_config.recipe}"
