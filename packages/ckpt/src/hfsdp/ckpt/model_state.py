"""What a checkpoint needs from a live ShardedModel and optimizer, in checkpoint terms.

This is the only module that knows the engine's objects: every group as a
`GroupSpec` under global names, the flat buffer of each state kind with the
flat range it starts at, the module tensors the engine leaves alone, and the
optimizer's hyper-parameters. Save and load speak to the engine only through it.
"""

from __future__ import annotations

import torch

from hfsdp.ckpt.errors import CheckpointError
from hfsdp.ckpt.index import MAIN, MODEL, GroupSpec
from hfsdp.ckpt.schema import HYPER_PARAMS
from hfsdp.ckpt.writer import dtype_name


def ep_rank_of(model, rank: int) -> int:
    return rank % model.config.ep


def local_groups(model, rank: int) -> list[GroupSpec]:
    """This rank's groups, in model order, under global names."""
    if model.config.ep > 1 and model.expert_naming is None and any(g.is_expert for g in model.groups):
        raise CheckpointError(
            f"The model has expert parameters and ep = {model.config.ep}, but no ExpertNaming: their local names "
            "collide across expert-parallel ranks, so they cannot be checkpointed. Pass "
            "expert_naming=ExpertNaming(num_experts, ep, ep_rank) to fully_shard."
        )
    return [
        GroupSpec(
            g.unit_index,
            g.is_expert,
            dtype_name(g.compute_dtype),
            ep_rank_of(model, rank) if g.is_expert else None,
            tuple((model.global_name(g, s.name), tuple(s.shape)) for s in g.slots),
        )
        for g in model.groups
    ]


def local_order(model) -> list[str]:
    """Global names of this rank's parameters and unsharded tensors in the module's state-dict order."""
    names = {s.name: model.global_name(g, s.name) for g in model.groups for s in g.slots}
    unsharded = dict(_unsharded_items(model))
    return [
        names.get(n) or unsharded[n][0] for n in model.module.state_dict(keep_vars=True) if n in names or n in unsharded
    ]


def unsharded_state(model) -> dict[str, torch.Tensor]:
    """The module's tensors the engine does not shard, by global name: the module's own tensor objects.

    These are the entries of `state_dict()` that are not sharded parameters:
    persistent buffers (running statistics, counters) and frozen parameters.
    The engine keeps them whole on every rank, so they are checkpointed whole;
    dense ones are assumed equal on every rank (rank 0's are saved), expert ones
    equal within an expert-parallel rank's replicas. Non-tensor extra state is
    not saved.
    """
    return dict(_unsharded_items(model).values())


def _unsharded_items(model) -> dict[str, tuple[str, torch.Tensor]]:
    """local state-dict name -> (global name, tensor) of every unsharded tensor."""
    sharded = {s.name for g in model.groups for s in g.slots}
    naming = model.expert_naming
    out = {}
    for name, value in model.module.state_dict(keep_vars=True).items():
        if name in sharded or not isinstance(value, torch.Tensor):
            continue
        out[name] = (naming.to_global(name) if naming is not None else name, value)
    return out


def state_kinds(optimizer) -> list[str]:
    return [MODEL, MAIN, *(optimizer.state_names if optimizer is not None else ())]


def buffers(model, optimizer, index: int) -> dict[str, tuple[torch.Tensor, int]]:
    """For group `index`: each kind's local flat buffer and the flat position of its first element.

    Waits first for the group's post-step gather, which may still be writing
    the parameter shard (and reading the main weights) on a side stream.
    """
    group = model.groups[index]
    group.wait_for_publish()
    out = {
        MODEL: (group.compute_shard(), group.param_range[0]),
        MAIN: (group.main, group.optim_range[0]),
    }
    if optimizer is not None:
        state = optimizer_state(model, optimizer, index)
        for name in optimizer.state_names:
            out[name] = (state[name], group.optim_range[0])
    return out


def optimizer_state(model, optimizer, index: int) -> dict[str, torch.Tensor]:
    group = model.groups[index]
    for g, state in zip(optimizer.groups, optimizer.state, strict=True):
        if g is group:
            return state
    raise CheckpointError(
        "The optimizer does not step one of the model's parameter groups; build it from model.groups "
        "(e.g. ShardedAdamW(model.groups)) so its state can be checkpointed."
    )


def optimizer_meta(optimizer) -> dict | None:
    if optimizer is None:
        return None
    hyper = {}
    for name in HYPER_PARAMS:
        if hasattr(optimizer, name):
            value = getattr(optimizer, name)
            hyper[name] = list(value) if isinstance(value, tuple) else value
    return {
        "type": type(optimizer).__name__,
        "step_count": optimizer.step_count,
        "hyper": hyper,
        "states": list(optimizer.state_names),
    }


def check_optimizer(optimizer, meta: dict | None, source: str) -> None:
    """Refuse a checkpoint saved without an optimizer, or with another optimizer class."""
    if meta is None:
        raise CheckpointError(
            f"The checkpoint {source} holds no optimizer state (it was saved without an optimizer); "
            "load it with optimizer=None, or start the optimizer fresh."
        )
    if meta["type"] != type(optimizer).__name__:
        raise CheckpointError(
            f"The checkpoint {source} was saved with {meta['type']}, but the optimizer is "
            f"{type(optimizer).__name__}; use the same optimizer class, or load with optimizer=None."
        )


def restore_optimizer(optimizer, meta: dict) -> None:
    """Set step count and hyper-parameters from the index (the state tensors are loaded separately)."""
    optimizer.step_count = int(meta["step_count"])
    for name, value in meta.get("hyper", {}).items():
        if hasattr(optimizer, name):
            setattr(optimizer, name, tuple(value) if isinstance(value, list) else value)
