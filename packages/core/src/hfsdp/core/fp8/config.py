"""What an fp8 run is: the fp8 format of each tensor role and how scales are taken.

Kept free of torch so that `hfsdp validate-config` can check the same choices without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "rowwise")


@dataclass(frozen=True)
class Float8Config:
    """`format`: "e4m3" for every tensor, or "hybrid" (Megatron's and TransformerEngine's name): e4m3 for the
    forward's activations and weights, e5m2 (more range, less precision) for the gradients of outputs.

    `recipe`: "tensorwise" takes one scale per tensor (one amax per activation, weight and gradient), which is
    what lets a weight be gathered already in fp8 (`fully_shard(fp8_param_gather=True)`); "rowwise" takes one
    scale per row of each operand (closer to each row's own range, so more accurate, and its weight gradient is
    computed in bf16, as torchao's rowwise recipe with a high-precision weight gradient)."""

    format: str = "hybrid"
    recipe: str = "tensorwise"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(
                f"Float8Config(format={self.format!r}) is not an fp8 format hfsdp knows; use 'e4m3' (every tensor "
                "in e4m3) or 'hybrid' (e4m3 forward, e5m2 gradients)."
            )
        if self.recipe not in RECIPES:
            raise ValueError(
                f"Float8Config(recipe={self.recipe!r}) is not an fp8 recipe hfsdp knows; use 'tensorwise' (one scale "
                "per tensor) or 'rowwise' (one scale per row)."
            )
        if self.recipe == "rowwise" and self.format == "hybrid":
            raise ValueError(
                "Float8Config(recipe='rowwise', format='hybrid') is refused: the rowwise recipe scales gradients "
                "per row in e4m3 (e5m2's extra range is what a single per-tensor scale needs, not a per-row one), "
                "so it has no hybrid form; use format='e4m3' with rowwise, or recipe='tensorwise' with hybrid."
            )

    @property
    def gathers_in_fp8(self) -> bool:
        """Whether a weight can be quantized on its shard and gathered in fp8: only with one scale per tensor,
        which a max over the shards' amaxes gives exactly."""
        return self.recipe == "tensorwise"
