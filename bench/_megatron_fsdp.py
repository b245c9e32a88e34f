"""Megatron-FSDP (the `megatron-fsdp` package, NVIDIA's engine) as bench_step's `mfsdp` and `mfsdp2` engines.

Both are set up as their own documentation asks, with the same model, data, precision and optimizer as the other
engines: the model's parameters in the compute dtype (Megatron-FSDP computes in the dtype it finds and keeps fp32
main weights and gradients beside them), `torch.optim.AdamW` over its distributed parameters, gradients averaged
over the data-parallel ranks.

- `mfsdp`: `megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[the decoder layer class], ...)`, the
  strategy per axis given by name (`zero_dp_strategy`, `outer_dp_sharding_strategy`), HSDP/HFSDP through
  `dp_outer_dim` and the flattened group.
- `mfsdp2`: `megatron_fsdp.experimental.fully_shard` bottom-up (every decoder layer, then the root, as FSDP2),
  the per-axis placements read off hfsdp's own table (`v2_placements`), and
  `experimental.fully_shard_optimizer`.

Two things differ from the other engines by construction and are evened out here:
- the main weights are made from the model's compute-dtype parameters, so they start at the bf16-rounded initial
  weights (the other engines keep the fp32 ones). Step 1 computes with the same bf16 weights either way; later
  losses differ by that rounding, which the loss check's bf16 tolerance covers.
- `fully_shard_optimizer` of v1 runs one optimizer step with zero gradients to build the state eagerly. With the
  run's learning rate that step would decay the weights and count a step in Adam's bias correction; it runs here
  at learning rate 0 and its step count is reset, so step 1 is everyone's first step.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from hfsdp.core.rules.placement_names import PARTIAL, PLACEMENT_NAMES, REPLICATE, SHARD0, State
from hfsdp.core.rules.strategy import Strategy

#: hfsdp's placement names in megatron_fsdp.experimental's terms: Flat is its only sharded placement (a dim-0 shard
#: kept in a flat buffer), which is what hfsdp's Shard(0) of a flat group is.
V2_NAME = {REPLICATE: "Replicate", PARTIAL: "Partial", SHARD0: "Flat"}


def v2_placements(strategy: str) -> tuple[str, str, str]:
    """(parameter, gradient, optimizer) placement names of one mesh axis for Megatron-FSDP v2, read off hfsdp's own
    per-axis table, so that both engines run the same layout by construction."""
    row = PLACEMENT_NAMES[Strategy.parse(strategy)]
    return V2_NAME[row[State.PARAM]], V2_NAME[row[State.GRAD]], V2_NAME[row[State.OPTIM]]


def precision():
    """fp32 main weights and gradients (the reduction in fp32, as every engine here); compute in the model's dtype."""
    from megatron_fsdp.mixed_precision import MixedPrecisionPolicy

    return MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)


def shard_v1(model, unit_class, layout, mesh, device, lr: float, weight_decay: float):
    """`megatron_fsdp.fully_shard` of `model` (already in the compute dtype): (wrapped model, its optimizer)."""
    from megatron_fsdp import fully_shard

    hybrid = {}
    if layout.instances > 1:
        flat = mesh["dp_outer", "dp_shard"]._flatten("dp_flat_mfsdp")
        hybrid = {"dp_outer_dim": "dp_outer", "hybrid_fsdp_group": flat.get_group()}
        hybrid["outer_dp_sharding_strategy"] = "optim" if layout.outer == "optim" else "no_shard"
    # Built at lr 0: fully_shard_optimizer's eager step with zero gradients then changes no weight (see above).
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=weight_decay, fused=device.type == "cuda")
    wrapped, opt = fully_shard(
        model,
        opt,
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        tp_dim="tp",
        fsdp_unit_modules=[unit_class],
        zero_dp_strategy=layout.inner,
        device=device,
        mixed_precision_policy=precision(),
        **hybrid,
    )
    for group in opt.param_groups:
        group["lr"] = lr
    for state in opt.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0
    return wrapped, opt


def shard_v2(model, units, layout, mesh, device, lr: float, weight_decay: float):
    """`megatron_fsdp.experimental.fully_shard` on every unit, then the root: (model, its optimizer)."""
    from megatron_fsdp import experimental as v2

    axes = [(layout.outer, "dp_outer")] if layout.instances > 1 else []
    axes.append((layout.inner, "dp_shard"))
    per_axis = [v2_placements(strategy) for strategy, _ in axes]
    make = {"Replicate": v2.Replicate, "Partial": v2.Partial, "Flat": v2.Flat}
    placements = v2.Placements(
        dp_axes=[name for _, name in axes],
        parameter=[make[p[0]]() for p in per_axis],
        gradient=[make[p[1]]() for p in per_axis],
        optimizer=[make[p[2]]() for p in per_axis],
    )
    policy = precision()
    for unit in units:
        v2.fully_shard(unit, mesh, placements, mixed_precision_policy=policy)
    v2.fully_shard(model, mesh, placements, mixed_precision_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=device.type == "cuda")
    v2.fully_shard_optimizer(opt)
    return model, opt


def accumulation_context_v1(model, index: int, count: int):
    """Megatron-FSDP v1 reduces on every backward unless told a microbatch is not the last."""
    return model.no_sync() if index < count - 1 else nullcontext()


def accumulation_context_v2(model, index: int, count: int):
    from megatron_fsdp import experimental as v2

    return v2.microbatch(model, is_last=index == count - 1)
