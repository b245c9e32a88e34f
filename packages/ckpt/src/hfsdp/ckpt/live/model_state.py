"""What a checkpoint needs from a live sharded model and optimizer, in checkpoint terms.

This is the only module that knows the engine's objects (`hfsdp.core.sharding_of(model)`):
every group as a `GroupSpec` under global names, the piece of every tensor this rank holds,
and the module tensors the engine leaves alone (the optimizer's state is `optim_state.py`'s).
Save and load speak to the engine only through it; each function takes the engine state
(`engine_of(model)`), not the module.
"""

from __future__ import annotations

import torch
from torch import nn

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.index import MAIN, MODEL, OUTER_ANCHOR, OUTER_MAIN, OUTER_MOMENTUM, GroupSpec
from hfsdp.ckpt.live import optim_state
from hfsdp.ckpt.tensors.writer import dtype_name
from hfsdp.core.buffers.main_params import piece_of
from hfsdp.core.engine.sharding import Sharding, sharding_of
from hfsdp.core.engine.state_dict import gather_main


def engine_of(model) -> Sharding:
    """The engine state of a model `fully_shard` sharded (or the state itself)."""
    return model if isinstance(model, Sharding) else sharding_of(model)


def ep_rank_of(model, rank: int) -> int:
    return rank % model.config.ep


def module_state(model) -> dict[str, object]:
    """The module's own state dict (keep_vars): its main params and buffers, no collective (the sharded module's
    `state_dict()` is the gathered full one)."""
    model = engine_of(model)
    return nn.Module.state_dict(model.module, keep_vars=True)


def local_groups(model, rank: int) -> list[GroupSpec]:
    """This rank's groups, in model order, under global names."""
    model = engine_of(model)
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
            tuple((s.global_name, tuple(s.shape)) for s in g.slots),
        )
        for g in model.groups
        if not g.frozen
    ]


def local_order(model) -> list[str]:
    """Global names of this rank's parameters and unsharded tensors in the module's state-dict order."""
    model = engine_of(model)
    names = {s.name: s.global_name for g in model.groups if not g.frozen for s in g.slots}
    unsharded = dict(_unsharded_items(model, whole_frozen=False))
    return [names.get(n) or unsharded[n][0] for n in module_state(model) if n in names or n in unsharded]


def unsharded_state(model) -> dict[str, torch.Tensor]:
    """The module's tensors the engine does not shard, by global name: the module's own tensor objects.

    These are the entries of `state_dict()` that are not sharded parameters:
    persistent buffers (running statistics, counters) and frozen parameters.
    Buffers are whole on every rank; frozen parameters are sharded by the engine
    but checkpointed whole, as a checkpoint has always stored them (so a
    checkpoint does not depend on whether the engine shards them): each is
    gathered here, a copy in its own dtype (collective: every rank calls this;
    `write_frozen` puts loaded values back into the pieces). Dense ones are
    assumed equal on every rank (rank 0's are saved), expert ones equal within an
    expert-parallel rank's replicas. Non-tensor extra state is not saved.
    """
    model = engine_of(model)
    return dict(_unsharded_items(model).values())


def _unsharded_items(model, whole_frozen: bool = True) -> dict[str, tuple[str, torch.Tensor | None]]:
    """local state-dict name -> (global name, tensor) of every unsharded tensor.

    A tied parameter (a causal LM's `lm_head.weight` that is `embed_tokens.weight`)
    is one entry of the state dict per name but one sharded parameter, held
    under its first name: its other names are aliases, not tensors of their own.
    """
    model = engine_of(model)
    naming = model.expert_naming
    frozen = _frozen_whole(model, whole_frozen)
    out = {}
    for name, value in module_state(model).items():
        if name in frozen:
            out[name] = frozen[name]
            continue
        if not isinstance(value, torch.Tensor) or piece_of(value) is not None:
            continue
        out[name] = (naming.to_global(name) if naming is not None else name, value)
    return out


def _frozen_whole(model, gather: bool) -> dict[str, tuple[str, torch.Tensor | None]]:
    """local name -> (global name, the whole value) of every frozen parameter: gathered (collective over each frozen
    group's mesh, one group at a time, in model order), or None for the names alone."""
    out = {}
    for group in model.groups:
        if not group.frozen:
            continue
        full = gather_main(group) if gather else None
        for slot in group.slots:
            whole = None if full is None else full[slot.offset : slot.stop].view(slot.shape)
            out[slot.name] = (slot.global_name, None if whole is None else whole.to(slot.dtype, copy=True))
        del full
    return out


def write_frozen(model, module_tensors: dict[str, torch.Tensor]) -> None:
    """Put loaded whole frozen parameters (`unsharded_state`'s copies, by global name) back into this rank's pieces
    of the frozen groups' main weights."""
    model = engine_of(model)
    for group in model.groups:
        if not group.frozen:
            continue
        for piece in group.main_params:
            if piece.holds:
                whole = module_tensors[piece.name].reshape(-1)
                piece.param.detach().view(-1).copy_(whole[piece.start : piece.stop])


def outer_kinds(model) -> list[str]:
    """DiLoCo's state kinds this model holds: the global weights, the momentum (when there is one), the anchor
    (a lossy exchange); none without DiLoCo."""
    model = engine_of(model)
    if model.outer is None:
        return []
    config = model.outer.config
    momentum = [OUTER_MOMENTUM] if config.momentum > 0 else []
    return [OUTER_MAIN, *momentum, *([OUTER_ANCHOR] if config.anchored else [])]


def outer_record(model) -> dict | None:
    """The index's outer record: DiLoCo's settings and the optimizer steps done (where each fragment is in its
    cycle), or None without DiLoCo."""
    model = engine_of(model)
    if model.outer is None:
        return None
    outer = model.outer
    schedule = {"inner_steps": outer.steps, "synced_at": list(outer.synced_at)}
    return {"strategy": "diloco", **outer.config.to_dict(), **schedule}


def outer_tensors(model) -> dict[tuple[str, str], torch.Tensor]:
    """This rank's piece of DiLoCo's outer state (its outer piece of each parameter), by (kind, global name)."""
    model = engine_of(model)
    out: dict[tuple[str, str], torch.Tensor] = {}
    if model.outer is None:
        return out
    for piece in model.outer.pieces():
        state, numel = piece.state, piece.stop - piece.start
        out[OUTER_MAIN, piece.name] = state.theta.detach()[piece.offset : piece.offset + numel]
        momentum = model.outer.momentum(state)
        if momentum is not None:
            out[OUTER_MOMENTUM, piece.name] = momentum[piece.offset : piece.offset + numel]
        if state.anchor is not None:
            out[OUTER_ANCHOR, piece.name] = state.anchor[state.within][piece.offset : piece.offset + numel]
    return out


def piece_tensors(model, optimizer=None, kinds: tuple[str, ...] | None = None) -> dict[tuple[str, str], torch.Tensor]:
    """This rank's piece of each tensor, by (kind, global name), as 1-D tensors, in model order.

    A piece is a main param's range of its parameter: what this rank's optimizer
    steps, and exactly what the save plan has it write and the load plan has it
    read. "model" is the compute-dtype copy (a fresh cast where the engine keeps
    none), "main" the fp32 main param itself (so loading into it is in place),
    every other kind the optimizer's per-element state (`kinds` limits them).
    Waits first for the post-step gathers, which may still read the main weights.
    """
    model = engine_of(model)
    model.wait_for_weights()
    out: dict[tuple[str, str], torch.Tensor] = {}
    for group in model.groups:
        if group.frozen:  # checkpointed whole, with the buffers (`unsharded_state`)
            continue
        shard = group.compute_optim_piece()
        for piece in group.main_params:
            if not piece.holds:
                continue
            out[MODEL, piece.name] = shard[piece.offset : piece.offset + piece.param.numel()]
            out[MAIN, piece.name] = piece.master().view(-1)  # fp32, joined where kept as a bf16 shard + remainder
            state = optim_state.param_state(optimizer, piece.param) if optimizer is not None else {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and (kinds is None or key in kinds):
                    out[key, piece.name] = value.detach().view(-1)
    out.update(outer_tensors(model))
    return out
