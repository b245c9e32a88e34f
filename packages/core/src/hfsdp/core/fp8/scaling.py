"""How a tensor becomes fp8: an amax, a power-of-two scale, a saturating cast.

Scales are powers of two, the largest that keeps the amax within the format's range. Multiplying
by one is exact, and so is its reciprocal, which `torch._scaled_mm` takes. Exactness is what lets a
weight be quantized piece by piece on its shard (`buffers/fp8_gather.py`) with the scale of its whole
amax (a max over the pieces' amaxes) and give exactly the bits the same weight gets quantized whole
here: every element's result depends only on itself and the scale.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def formats(fp8_format: str) -> tuple[torch.dtype, torch.dtype]:
    """(forward dtype, gradient dtype) of an fp8 format name ("e4m3" or "hybrid")."""
    return (E4M3, E5M2) if fp8_format == "hybrid" else (E4M3, E4M3)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 power-of-two scale that maps `amax` to at most `dtype`'s largest value: 2^(e-1) where
    max/amax = m * 2^e with m in [0.5, 1) (frexp is exact, where a log2 could round across an integer).
    An amax below 1e-12 (an all-zero tensor) counts as 1e-12, as torchao's does, so the scale stays finite."""
    ratio = torch.finfo(dtype).max / amax.float().clamp(min=1e-12)
    _, exponent = torch.frexp(ratio)
    return torch.ldexp(torch.ones_like(ratio), exponent - 1)


def quantize(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor * scale` cast to `dtype`, saturating at its largest value (a value scaled past it is clipped, not
    turned into NaN: e4m3fn has no infinity)."""
    limit = torch.finfo(dtype).max
    return (tensor.float() * scale).clamp(-limit, limit).to(dtype)


def tensorwise(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`tensor` in `dtype` with one scale for all of it: (fp8 tensor, scale)."""
    scale = amax_to_scale(tensor.abs().amax(), dtype)
    return quantize(tensor, scale, dtype), scale


def rowwise(tensor: torch.Tensor, dtype: torch.dtype, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """`tensor` in `dtype` with one scale per slice along `dim` (dim=-1: per row): (fp8 tensor, scales, with
    `dim` kept as a size-1 axis)."""
    scale = amax_to_scale(tensor.abs().amax(dim=dim, keepdim=True), dtype)
    return quantize(tensor, scale, dtype), scale
