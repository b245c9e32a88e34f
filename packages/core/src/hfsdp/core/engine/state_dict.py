"""Full state dicts of a sharded module: gathered to rank 0 on the CPU, and loaded back into the main weights.

`model.state_dict()` is what torch's `get_model_state_dict(model, options=StateDictOptions(
full_state_dict=True, cpu_offload=True))` gives for FSDP2: on rank 0 every parameter whole, on
the CPU, in the dtype it had when it was sharded (the fp32 main weights are the truth; they are
cast back), under the original names (experts by global index), with the module's buffers;
on every other rank an empty dict. `torch.save` writes it and the unsharded model loads it. It is
collective: call it on every rank. The gather runs one group at a time over the group's mesh,
so a rank holds at most one unit's parameters besides its own shards.

With DiLoCo each instance has its own weights between two outer steps, and `state_dict()`
gives instance 0's (call `sync_outer()` first for the global weights).

`model.load_state_dict(sd)` writes into the fp32 main weights and derives the compute weights
from them again (collective), in every layout, with offload too, so what it loads lasts through
later steps; with DiLoCo the loaded weights become the global weights too (the outer momentum
is kept). Every rank may pass the same full dict, or rank 0 alone (the others an empty dict:
what `state_dict()` gave them), and rank 0 then broadcasts each tensor. For large models,
`hfsdp.ckpt.save_checkpoint` writes the sharded form, one file per rank, loadable on any layout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from hfsdp.core.buffers.flat_group import FlatParamGroup
from hfsdp.core.buffers.main_params import piece_of
from hfsdp.core.rules.placement_names import State


def _device_for_collectives(fallback: torch.device) -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return fallback if fallback.type != "cuda" else torch.device("cpu")


def gather_main(group: FlatParamGroup) -> torch.Tensor:
    """The group's whole padded fp32 main weights, on every rank of its mesh (collective over the mesh)."""
    device = group.device
    full = torch.empty(group.padded, dtype=torch.float32, device=device)
    piece = full[slice(*group.optim_range)]
    piece.copy_(group.master_weights())
    sharded = group.layout.sharded_axes(State.OPTIM)
    group.comms.gather(piece, sharded, sharded, full, 0)
    return full


def _global(sharding, name: str) -> str:
    naming = sharding.expert_naming
    return naming.to_global(name) if naming is not None else name


def _leads_experts(sharding) -> bool:
    """Whether this rank holds the first copy of its expert-parallel rank's experts (it sends them to rank 0)."""
    mesh = sharding.meshes.expert
    return mesh is not None and all(c == 0 for c in mesh.get_coordinate())


def full_state_dict(sharding) -> dict[str, torch.Tensor]:
    """The module's full state dict on rank 0 (CPU), an empty one elsewhere (collective)."""
    sharding.wait_for_weights()
    rank = dist.get_rank()
    leader = _leads_experts(sharding)
    params: dict[str, torch.Tensor] = {}
    for group in sharding.groups:  # every rank, every group, model order
        full = gather_main(group)
        if rank == 0 or (group.is_expert and leader):
            for slot in group.slots:
                whole = full[slot.offset : slot.stop].view(slot.shape)
                params[slot.global_name] = whole.to(device="cpu", dtype=slot.dtype, copy=True)
        del full
    local = nn.Module.state_dict(sharding.module, keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    for name, value in local.items():
        piece = piece_of(value) if isinstance(value, torch.Tensor) else None
        key = _global(sharding, name)
        if piece is not None:
            tensor = params.get(piece.name)
        elif isinstance(value, torch.Tensor):
            tensor = value.detach().to("cpu", copy=True)
        else:
            tensor = value  # non-tensor extra state, as nn.Module.state_dict gives it
        if rank == 0:
            out[key] = tensor
        elif leader and key != name:  # an expert's tensor (its name changed to the global index)
            experts[key] = tensor
    if sharding.config.ep > 1:
        sent = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(experts if rank != 0 else {}, sent, dst=0)
        if rank == 0:
            for part in sent:
                for key, tensor in part.items():
                    out.setdefault(key, tensor)
    return out


def expected_keys(sharding) -> dict[str, tuple[tuple[int, ...] | None, bool]]:
    """Every key of the module's full state dict -> (its shape, whether it is a sharded parameter), over all ranks
    (collective: with expert parallelism a rank knows only its own experts). A non-tensor extra state (megatron's
    `_extra_state`, which `state_dict()` gives) is a known key of no shape: expected, never checked or written."""
    mine: dict[str, tuple[tuple[int, ...] | None, bool]] = {}
    for name, value in nn.Module.state_dict(sharding.module, keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            piece = piece_of(value)
            shape = tuple(piece.shape) if piece is not None else tuple(value.shape)
            mine[_global(sharding, name)] = (shape, piece is not None)
        else:
            mine[_global(sharding, name)] = (None, False)
    if sharding.config.ep == 1:
        return mine
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged: dict[str, tuple[tuple[int, ...], bool]] = {}
    for part in every:
        merged.update(part)
    return merged


def load_problems(sd: dict[str, Any], expected, strict: bool) -> tuple[list[str], list[str], list[str]]:
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    errors = []
    for key, (shape, _) in expected.items():
        value = sd.get(key)
        if shape is not None and isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
            errors.append(
                f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from checkpoint, the "
                f"shape in current model is {shape}."
            )
    if strict and unexpected:
        errors.insert(0, "Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    if strict and missing:
        errors.insert(0, "Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ". ")
    return missing, unexpected, errors


def raise_load_errors(errors: list[str], module: nn.Module) -> None:
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(errors))


def load_full_state_dict(sharding, state_dict: dict[str, Any], strict: bool = True) -> _IncompatibleKeys:
    """Write a full state dict into the main weights and buffers, then republish (collective)."""
    module = sharding.module
    has = [None] * dist.get_world_size()
    dist.all_gather_object(has, bool(state_dict))
    if all(has):
        broadcast = False
    elif has[0] and not any(has[1:]):
        broadcast = True
    else:
        raise ValueError(
            f"load_state_dict got a state dict on ranks {[r for r, h in enumerate(has) if h]} and an empty one on "
            f"the others: pass the same full state dict on every rank, or on rank 0 alone (the others an empty "
            "dict, as state_dict() gives them)."
        )
    expected = expected_keys(sharding)
    verdict = [None]
    if not broadcast or dist.get_rank() == 0:
        verdict = [load_problems(state_dict, expected, strict)]
    if broadcast:
        dist.broadcast_object_list(verdict, src=0)
    else:  # every rank judged its own dict: fail together if any rank failed
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, verdict[0][2])
        verdict[0] = (verdict[0][0], verdict[0][1], next((e for e in every if e), []))
    missing, unexpected, errors = verdict[0]
    raise_load_errors(errors, module)
    source = _broadcast_from_rank0(sharding, state_dict, expected) if broadcast else state_dict
    _write(sharding, source)
    return _IncompatibleKeys(missing, unexpected)


def _needed(sharding) -> dict[str, list]:
    """Global name -> what this rank writes it into: main params (with elements here) and buffers."""
    out: dict[str, list] = {}
    for name, value in nn.Module.state_dict(sharding.module, keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue
        piece = piece_of(value)
        if piece is None or piece.holds:
            out.setdefault(_global(sharding, name), []).append(piece if piece is not None else value)
    return out


def _broadcast_from_rank0(sharding, state_dict, expected) -> dict[str, torch.Tensor]:
    """Rank 0's tensors, each broadcast in turn; every rank keeps only the part it writes (collective)."""
    needed = _needed(sharding)
    device = _device_for_collectives(sharding.device)
    meta = [None]
    if dist.get_rank() == 0:
        meta = [
            [
                (k, v.dtype)
                for k, v in state_dict.items()
                if isinstance(v, torch.Tensor) and expected.get(k, (None,))[0] is not None
            ]
        ]
    dist.broadcast_object_list(meta, src=0)
    kept: dict[str, torch.Tensor] = {}
    for key, dtype in meta[0]:
        shape = expected[key][0]
        if dist.get_rank() == 0:
            tensor = state_dict[key].detach().to(device=device, dtype=dtype).contiguous()
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=0)
        if key in needed:
            kept[key] = tensor.cpu() if device.type == "cuda" and sharding.device.type != "cuda" else tensor
    return kept


@torch.no_grad()
def _write(sharding, source: dict[str, Any]) -> None:
    """Copy each tensor of `source` this rank needs into its main param (its elements) or buffer, then republish."""
    sharding.wait_for_weights()  # the last step's gathers may still read the main weights
    for key, targets in _needed(sharding).items():
        value = source.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        for target in targets:
            if hasattr(target, "slot"):  # a main param: its elements of the flattened parameter
                target.write_master(value.detach().reshape(-1)[target.start : target.stop])
            else:
                target.copy_(value.detach())
    sharding.republish()
    if sharding.outer is not None:
        sharding.outer.restart_from_main()
