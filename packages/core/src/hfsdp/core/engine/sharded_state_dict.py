"""Sharded state dicts: what `torch.distributed.checkpoint` and torch's state-dict helpers get.

FSDP2's `model.state_dict()` is sharded (a DTensor per parameter), and torchtitan's checkpointing is
built on that: `get_state_dict` -> `dcp.save`, and at resume `get_state_dict` (the targets) ->
`dcp.load` (in place) -> `set_state_dict`. hfsdp gives DCP's helpers the same: each parameter as a
`PieceTensor` viewing this rank's piece of the main weights, so `dcp.load` writes straight into
them, and the module's buffers as they are (replicated: DCP writes each once). `load` takes such a
dict back (every rank its own), and also one holding ordinary DTensors (what torch's helpers make of
a full state dict: `set_state_dict(..., full_state_dict=True)` or `broadcast_from_rank0`), whose
whole values it gathers. `model.state_dict()` called by anything else stays the full state dict on
rank 0 (`state_dict.py`), which a plain `dcp.save` of it also writes correctly (rank 0 writes all).

What DCP cannot be given: expert-parallel experts (a rank holds experts under local names, which
torch's helpers resolve against the module, where the same name is another expert elsewhere) and
DiLoCo's instances (each its own weights under one name); both are refused, naming
`hfsdp.ckpt`, which handles them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from hfsdp.core.buffers.main_params import MainParam, piece_of
from hfsdp.core.engine.piece_tensor import PieceTensor, to_piece
from hfsdp.core.engine.state_dict import expected_keys, load_problems, raise_load_errors
from hfsdp.core.rules.placement_names import State


def check_supported(sharding) -> None:
    """Refuse what DCP cannot hold (the same verdict on every rank, before any collective)."""
    what = None
    if sharding.config.ep > 1:
        what = "expert parallelism (ep > 1)"
    elif sharding.outer is not None:
        what = "DiLoCo (every instance keeps its own weights under the same names)"
    if what is not None:
        raise RuntimeError(
            f"torch.distributed.checkpoint is not supported with {what}. Save and resume with "
            "hfsdp.ckpt.save_checkpoint(dir, model, optimizer) and hfsdp.ckpt.load_checkpoint(dir, model, optimizer), "
            "which handle it and reshard to any layout."
        )


def piece_tensor(piece: MainParam, local: torch.Tensor) -> PieceTensor:
    """`local` (the main param, or a per-element optimizer state of it) as this rank's piece of the parameter."""
    group = piece.group
    sharded = group.layout.sharded_axes(State.OPTIM)
    return PieceTensor.of(local, group.mesh, sharded, piece.shape, piece.start, piece.stop)


def sharded_state_dict(sharding) -> dict[str, Any]:
    """Every parameter as a `PieceTensor` over its main param, every buffer as it is (no collective)."""
    check_supported(sharding)
    sharding.wait_for_weights()
    out: dict[str, Any] = {}
    for name, value in nn.Module.state_dict(sharding.module, keep_vars=True).items():
        piece = piece_of(value) if isinstance(value, torch.Tensor) else None
        if piece is not None:
            out[name] = piece_tensor(piece, piece.master())  # the fp32 masters (joined where kept as remainders)
        elif isinstance(value, torch.Tensor):
            out[name] = value.detach()
        else:
            out[name] = value
    return out


def is_sharded(state_dict: dict[str, Any]) -> bool:
    """Whether `state_dict` is a sharded one (any DTensor in it), which `load` takes."""
    return any(isinstance(v, DTensor) for v in state_dict.values())


@torch.no_grad()
def load(sharding, state_dict: dict[str, Any], strict: bool = True) -> _IncompatibleKeys:
    """Load a sharded state dict, each rank its own (collective: ordinary DTensors are gathered whole)."""
    check_supported(sharding)
    missing, unexpected, errors = load_problems(state_dict, expected_keys(sharding), strict)  # the full load's checks
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, errors)
    raise_load_errors(next((e for e in every if e), []), sharding.module)
    sharding.wait_for_weights()  # the last step's gathers may still read the main weights
    for name, target in nn.Module.state_dict(sharding.module, keep_vars=True).items():
        value = state_dict.get(name)
        if not isinstance(value, torch.Tensor) or not isinstance(target, torch.Tensor):
            continue
        piece = piece_of(target)
        if piece is None:
            target.copy_(value.full_tensor() if isinstance(value, DTensor) else value)
            continue
        data = to_piece(value, piece.shape, piece.start, piece.stop)  # every rank, every key: may gather
        if data.numel() and (piece.group.remainder is not None or data.data_ptr() != piece.param.data_ptr()):
            piece.write_master(data)
    sharding.republish()
    return _IncompatibleKeys(missing, unexpected)
