"""Mixed precision: the dtype parameters compute in, and the dtype gradients are reduced in.

The fp32 main weights are the truth (the optimizer steps them); the compute dtype is what each
unit's forward and backward see, cast from them on the way into a gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """Compute dtype of parameters (None keeps each parameter's own) and gradient-reduction dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        # Gradients are summed unscaled and each rank's reduced piece is scaled once per step, so the reduction
        # needs fp32's range: an fp16 sum over microbatches and ranks could overflow where the mean would not.
        if self.reduce_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"MixedPrecision(reduce_dtype={self.reduce_dtype}) is not supported: hfsdp sums gradients over "
                "microbatches and ranks before scaling them to the mean, which needs the range of float32; use "
                "reduce_dtype=torch.float32 (or torch.bfloat16, which has the same range)."
            )
