"""torchao's float8 training for bench_step's `fsdp2+float8t`, `fsdp2+float8r`, `model+float8t` and `model+float8r`
rows: the anchor hfsdp's own fp8 is measured against (issue 39), set up as torchtitan sets it up.

- `float8t`, tensorwise dynamic scaling: `Float8LinearConfig(enable_fsdp_float8_all_gather=True)` under FSDP2, so
  each rank casts its weight shard to fp8 before the all-gather (half the gather bytes of bf16), and
  `precompute_float8_dynamic_scale_for_fsdp(model)` after every optimizer step computes every weight's scale in one
  pass instead of one all-reduce per weight in the next forward. The model alone gathers nothing: plain tensorwise.
- `float8r`, rowwise: `Float8LinearConfig.from_recipe_name("rowwise")`; torchao gathers rowwise weights in the
  compute dtype (its fp8 all-gather is tensorwise only), so nothing is precomputed.

Only the `nn.Linear` layers inside the units (attention and MLP projections) are converted, and only those whose
dims are multiples of 16 (what the fp8 kernels take): embeddings, norms and the output layer stay in the compute
dtype, as in hfsdp's own fp8 (issue 39) and in torchtitan, which leaves the output layer out. The conversion comes
before compile and before `fully_shard`, as torchao asks.

torchao is no dependency of hfsdp: it is imported only when a float8 row is asked for, and a missing torchao is
refused in one line before anything is built.
"""

from __future__ import annotations

import torch

#: Engine-name suffix -> torchao recipe.
FLOAT8_RECIPES = {"float8t": "tensorwise", "float8r": "rowwise"}
#: The engines that take a float8 suffix.
FLOAT8_ENGINES = ("fsdp2", "model")
#: The fp8 kernels take only dims that are multiples of this.
FP8_DIM_MULTIPLE = 16


class Float8Unavailable(RuntimeError):
    """torchao, which the float8 rows need, cannot be imported."""


def float8_recipe(name: str) -> str | None:
    """`fsdp2+float8t` -> "tensorwise", `model+float8r` -> "rowwise"; None for any other engine name."""
    head, _, tail = name.partition("+")
    return FLOAT8_RECIPES.get(tail) if head in FLOAT8_ENGINES else None


def float8_suffix(recipe: str) -> str:
    """The engine-name suffix of a torchao recipe: "tensorwise" -> `float8t`, "rowwise" -> `float8r`."""
    return next(suffix for suffix, name in FLOAT8_RECIPES.items() if name == recipe)


def require_torchao():
    """`torchao.float8`, or Float8Unavailable with a one-line reason (imported here only, never at module load)."""
    try:
        import torchao.float8 as float8
    except ImportError as err:
        raise Float8Unavailable(
            f"the float8 engines need torchao ({type(err).__name__}: {err}); install it beside hfsdp "
            "(pip install torchao, or the wheel in .whl/ on the GPU machine), or leave them out of --engines"
        ) from None
    return float8


def torchao_version() -> str:
    """The installed torchao's version, for the run's record."""
    import torchao

    return torchao.__version__


def float8_config(float8, recipe: str, fsdp_all_gather: bool):
    """torchao's Float8LinearConfig for `recipe`; fp8 all-gather only for tensorwise under FSDP2."""
    if recipe == "tensorwise":
        return float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_all_gather)
    return float8.Float8LinearConfig.from_recipe_name(recipe)


def unit_linears(units, min_size: float = 0) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """(the units' nn.Linear layers the fp8 kernels take, those they do not: a dim not a multiple of 16, or, with
    `min_size`, too small to gain by hfsdp's rule, `in*out/(in+out) < min_size`, so both engines convert the same)."""
    from hfsdp.core.fp8.convert import size_of

    chosen, skipped = [], []
    for unit in units:
        for module in unit.modules():
            if isinstance(module, torch.nn.Linear):
                fits = all(d % FP8_DIM_MULTIPLE == 0 for d in module.weight.shape) and size_of(module) >= min_size
                (chosen if fits else skipped).append(module)
    return chosen, skipped


def convert(model, units, recipe: str, fsdp_all_gather: bool, float8=None, min_size: float = 0) -> str:
    """Swap the units' fp8-shaped Linear layers of `model` for torchao's Float8Linear, in place; returns what was done,
    for the row's label. `float8` stands in for `torchao.float8` in tests.

    The filter is by identity, not by name: it chooses the Linear modules found inside `units` before the swap, so
    the output layer and anything outside the units stay as they are whatever the model calls them."""
    float8 = float8 or require_torchao()
    chosen, skipped = unit_linears(units, min_size)
    if not chosen:
        raise ValueError(
            f"float8 {recipe}: the units hold no torch.nn.Linear with dims that are multiples of "
            f"{FP8_DIM_MULTIPLE} ({len(skipped)} without), so torchao would convert nothing"
        )
    ids = {id(m) for m in chosen}
    config = float8_config(float8, recipe, fsdp_all_gather)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: id(mod) in ids)
    gather = ", fp8 all-gather" if fsdp_all_gather and recipe == "tensorwise" else ""
    left = f", {len(skipped)} left in the compute dtype (dims, or min size {min_size:g})" if skipped else ""
    return f"torchao float8 {recipe}{gather}: {len(chosen)} unit Linears{left}"


def precompute_scales(float8, recipe: str, fsdp_all_gather: bool):
    """torchao's `precompute_float8_dynamic_scale_for_fsdp`, to call after every optimizer step, where the weights are
    gathered in fp8 (tensorwise under FSDP2); None where there is nothing to precompute."""
    if recipe == "tensorwise" and fsdp_all_gather:
        return float8.precompute_float8_dynamic_scale_for_fsdp
    return None
