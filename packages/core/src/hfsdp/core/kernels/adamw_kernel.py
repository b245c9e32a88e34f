"""One pass of AdamW over a contiguous run of elements, optionally writing the new weights in the compute dtype.

torch's fused AdamW reads the parameter, gradient and both moments and writes the parameter and the
moments: 28 bytes per fp32 element, the floor for the update itself. Around it hfsdp used to add two
more passes: clipping's multiply of the gradient (8 bytes: read and write) and the cast of the new
fp32 weights to the compute dtype for the next forward (6 bytes: read 4, write 2). `adamw_run` does
all three in one pass: the clip coefficient multiplies the gradient as it is loaded, and the new
weights are stored in the compute dtype beside the fp32 ones (2 bytes more), 30 bytes per element.

Two implementations compute the same function:

- a Triton kernel (`_adamw_kernel`), used for CUDA tensors where Triton imports (it ships with
  torch's CUDA builds), and under Triton's interpreter (`TRITON_INTERPRET=1`) for CPU tensors;
- plain torch operations (`_torch_run`), used everywhere else (CPU CI, no Triton).

Both apply the same IEEE-rounded fp32 operations in the same order (the kernel is compiled with
floating-point contraction off and uses correctly rounded square root and division), so they give
the same bits; tests check both against a float64 reference and against each other. The compute-dtype
store rounds to nearest even, as `Tensor.to` does (bf16 by integer rounding, which Triton's
interpreter would otherwise truncate).

The formula is torch's AdamW (decoupled weight decay, bias-corrected moments):

    g = grad * coef;  p *= 1 - lr*wd;  m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*g*g
    p -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

try:  # Triton ships with torch's CUDA wheels; CPU-only installs usually lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None

#: Elements per Triton program and warps per program: 16 fp32 elements per thread, four 16-byte loads per tensor.
BLOCK, NUM_WARPS = 4096, 8


@dataclass(frozen=True)
class AdamWScalars:
    """The per-step scalars of one run, computed once on the host in double precision and rounded to fp32 by
    both implementations in the same way."""

    decay: float  # 1 - lr * weight_decay
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float  # lr / (1 - beta1^t)
    inv_bc2_sqrt: float  # 1 / sqrt(1 - beta2^t)
    eps: float

    @classmethod
    def of(cls, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> AdamWScalars:
        bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
        return cls(
            decay=1.0 - lr * weight_decay,
            beta1=beta1,
            one_minus_beta1=1.0 - beta1,
            beta2=beta2,
            one_minus_beta2=1.0 - beta2,
            step_size=lr / bc1,
            inv_bc2_sqrt=1.0 / math.sqrt(bc2),
            eps=eps,
        )


def triton_usable(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernel can step `tensor`: CUDA with Triton present, or CPU under Triton's interpreter."""
    if triton is None:
        return False
    if tensor.is_cuda:
        return True
    return tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def adamw_run(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalars: AdamWScalars,
    coef: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> str:
    """Step one run in place: `param`, `exp_avg`, `exp_avg_sq` (contiguous fp32, same length), `grad` (fp32),
    the gradient first multiplied by the one-element fp32 tensor `coef`; `out` (bf16 or fp16, same length)
    receives the new weights. Returns the backend used ("triton" or "torch")."""
    n = param.numel()
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.numel() != n or t.dtype != torch.float32 or t.device != param.device or not t.is_contiguous():
            raise ValueError(f"adamw_run: {name} must be a contiguous fp32 tensor of {n} elements on {param.device}")
    if param.dtype != torch.float32 or not param.is_contiguous():
        raise ValueError("adamw_run: the parameter run must be a contiguous fp32 tensor")
    if out is not None and (out.numel() != n or out.dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"adamw_run: out must be a bf16 or fp16 tensor of {n} elements")
    if backend == "auto":
        backend = "triton" if triton_usable(param) else "torch"
    if n == 0:
        return backend
    if backend == "triton":
        _triton_run(param, grad, exp_avg, exp_avg_sq, scalars, coef, out)
    else:
        _torch_run(param, grad, exp_avg, exp_avg_sq, scalars, coef, out)
    return backend


def _torch_run(param, grad, exp_avg, exp_avg_sq, s: AdamWScalars, coef, out) -> None:
    """The reference implementation: one IEEE-rounded fp32 operation at a time, in the kernel's order."""
    g = grad * coef if coef is not None else grad
    param.mul_(s.decay)
    exp_avg.mul_(s.beta1).add_(g * s.one_minus_beta1)
    exp_avg_sq.mul_(s.beta2).add_((g * g).mul_(s.one_minus_beta2))
    denom = _sqrt_rn(exp_avg_sq).mul_(s.inv_bc2_sqrt).add_(s.eps)
    param.sub_(torch.div(exp_avg, denom).mul_(s.step_size))
    if out is not None:
        out.copy_(param)


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root. CUDA's is; torch's vectorised CPU one is not (about one element in
    five is 1 ulp off on AVX2), so on the CPU it is taken in double and rounded once more, which is exact for
    square roots of floats (double has more than twice float's precision)."""
    return x.sqrt() if x.is_cuda else x.double().sqrt().float()


def _triton_run(param, grad, exp_avg, exp_avg_sq, s: AdamWScalars, coef, out) -> None:
    n = param.numel()
    bf16 = out is not None and out.dtype == torch.bfloat16
    out_arg = out.view(torch.int16) if bf16 else (out if out is not None else param)
    coef_arg = coef if coef is not None else param
    grid = (triton.cdiv(n, BLOCK),)
    _adamw_kernel[grid](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        out_arg,
        coef_arg,
        n,
        s.decay,
        s.beta1,
        s.one_minus_beta1,
        s.beta2,
        s.one_minus_beta2,
        s.step_size,
        s.inv_bc2_sqrt,
        s.eps,
        HAS_COEF=coef is not None,
        HAS_OUT=out is not None,
        OUT_BF16=bf16,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # one rounding per operation, as the torch implementation does
    )


if triton is not None:

    @triton.jit
    def _adamw_kernel(
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        out_ptr,
        coef_ptr,
        n,
        decay,
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        step_size,
        inv_bc2_sqrt,
        eps,
        HAS_COEF: tl.constexpr,
        HAS_OUT: tl.constexpr,
        OUT_BF16: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        if HAS_COEF:
            g = g * tl.load(coef_ptr)
        p = p * decay
        m = m * beta1 + g * one_minus_beta1
        v = v * beta2 + (g * g) * one_minus_beta2
        denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
        p = p - tl.div_rn(m, denom) * step_size
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if HAS_OUT:
            if OUT_BF16:
                # Round to nearest even on the bits (as torch's cast does; NaN becomes the canonical NaN).
                bits = p.to(tl.uint32, bitcast=True)
                rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
                tl.store(out_ptr + offs, tl.where(p != p, 0x7FC0, rounded), mask=mask)
            else:
                tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)
