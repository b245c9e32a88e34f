"""Which groups `FusedAdamW(store_param_remainders=True)` converts to a bf16 shard plus a remainder, and the
refusals, each naming a parameter and the fix.

Converting a group changes every main param of it into a bf16 view, so the optimizer must hold them all (another
optimizer stepping one would update the bf16 half alone). The groups convert in the model's group order: where the
bf16 shard is gathered after a step (HFSDP's outer axis, ZeRO-1/2) the conversion publishes the new weights, which
is collective, and every rank holds a piece (perhaps empty) of every group.
"""

from __future__ import annotations

import torch

from hfsdp.core.buffers.main_params import piece_of


def keep_remainders(optimizer) -> None:
    """Convert every group `optimizer` steps (`FlatParamGroup.store_param_remainders`), or raise a ValueError naming
    each problem, before any group changes."""
    pieces = [piece for g in optimizer.param_groups for p in g["params"] if (piece := piece_of(p)) is not None]
    groups = {id(p.group): p.group for p in pieces if not p.group.frozen}
    held = {id(p) for p in pieces}
    problems = [] if optimizer._direct_grads else ["store_param_remainders needs the gradients read from the buffer"]
    if not groups:
        problems.append(
            "store_param_remainders=True keeps an hfsdp-sharded model's fp32 main weights as a bf16 shard plus a "
            "remainder, but this optimizer steps no parameter of one (pass sharded_model.parameters())"
        )
    found: dict[str, str] = {}  # one message per kind of problem, naming the first parameter it concerns
    for group in groups.values():
        problem = _problem(group, held)
        if problem is not None:
            found.setdefault(*problem)
    problems += found.values()
    if problems:
        raise ValueError("FusedAdamW: " + "; ".join(problems) + ".")
    owners = {id(o): o for g in groups.values() if (o := g.owner()) is not None}
    ordered = [g for o in owners.values() for g in o.groups if id(g) in groups]
    ordered += [g for g in groups.values() if not any(g is h for h in ordered)]
    for group in ordered:
        group.store_param_remainders()


def _problem(group, held: set[int]) -> tuple[str, str] | None:
    """(kind, message) of what keeps `group` from being converted, or None."""
    name = group.main_params[0].name
    if group.remainder is not None:
        return None  # converted already (an optimizer built again): the remainder is the group's
    if group.compute_dtype != torch.bfloat16 or group.main_dtype != torch.float32:
        return "dtype", (
            f"store_param_remainders=True completes a bf16 weight to its fp32 master, but '{name}' computes in "
            f"{group.compute_dtype}: shard the model with MixedPrecision(param_dtype=torch.bfloat16), or leave "
            "store_param_remainders off"
        )
    if group.offload:
        return "offload", (
            f"store_param_remainders=True cannot be combined with offload ('{name}' keeps its main weights in host "
            "memory): offloading moves them off the GPU already"
        )
    missing = next((p for p in group.main_params if id(p) not in held), None)
    if missing is not None:
        return "subset", (
            f"store_param_remainders=True converts whole groups of parameters, and '{missing.name}' (in the same "
            f"group as '{name}') is not in this optimizer: another optimizer would then step its bf16 half alone. "
            "Give this optimizer every parameter of the model (sharded_model.parameters()), or leave "
            "store_param_remainders off"
        )
    return None
