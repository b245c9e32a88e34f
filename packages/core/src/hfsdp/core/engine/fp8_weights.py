"""Which weights `fully_shard(fp8_param_gather=True)` gathers in fp8, or why it cannot.

The weight of every `Float8Linear` inside a unit, held by that layer alone (a weight tied to another
module is read there in the compute dtype, so it is gathered so). Only the tensorwise recipe can
gather in fp8: one scale per weight is what the max over the shards' amaxes gives exactly; a row's
scale would need the whole row, which a flat piece does not hold.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from hfsdp.core.fp8.linear import Float8Linear


def fp8_gathered_weights(module: nn.Module, units: Iterable[nn.Module], locations: dict[int, list]) -> set[int]:
    """The ids of the weights to gather in fp8 (`locations`: where each parameter is held, by id)."""
    layers = [m for unit in units for m in unit.modules() if isinstance(m, Float8Linear)]
    converted = {n: m for n, m in module.named_modules() if isinstance(m, Float8Linear)}
    rowwise = sorted(n for n, m in converted.items() if not m.fp8_config.gathers_in_fp8)
    if rowwise:
        raise ValueError(
            f"fully_shard(fp8_param_gather=True) needs the tensorwise fp8 recipe, but {rowwise[0]} (and "
            f"{len(rowwise) - 1} more) use '{converted[rowwise[0]].fp8_config.recipe}': a weight gathered in fp8 has "
            "one scale, the max over its pieces; convert with Float8Config(recipe='tensorwise') or leave "
            "fp8_param_gather off."
        )
    chosen = {id(m.weight) for m in layers if len(locations.get(id(m.weight), ())) == 1}
    if not chosen:
        raise ValueError(
            "fully_shard(fp8_param_gather=True) found no Float8Linear layer inside the units to gather in fp8; "
            "convert the model's Linear layers first with hfsdp.core.convert_to_float8(model, Float8Config(), "
            "units=units), before fully_shard."
        )
    return chosen
