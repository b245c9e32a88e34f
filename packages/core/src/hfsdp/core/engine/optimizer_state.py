"""An optimizer's state dict over hfsdp pieces, as FSDP2 users and DCP expect it.

torch's optimizers keep per-element state (AdamW's `exp_avg`, `exp_avg_sq`) shaped like the
parameters they step, which for hfsdp are this rank's pieces. FSDP2's state are DTensors, so
`dcp.save({"optim": opt.state_dict()})` and `get_optimizer_state_dict` write each rank's part where
it belongs. hfsdp gives the same: once an optimizer is bound to a sharded model (its first step),

- `state_dict()` hands each per-element state of a piece as a `PieceTensor` (a view of the live
  state, so `dcp.load` into it restores the optimizer in place), in a new dict per parameter, so
  the optimizer's own state is never replaced; `torch.save` of it still writes the plain pieces.
  Parameters and state names come in one order on every rank (by index, then by name), whatever
  order each rank's state was created in: gathering a full state dict is one collective per tensor,
  in that order;
  (Not where torch's `set_optimizer_state_dict` loads a full state dict: it asks for plain targets, and then
  hands over the whole tensors, which the load below takes.)
- `load_state_dict()` takes such tensors back as the pieces they view, ordinary DTensors (a full
  state dict distributed by torch's helpers) as this rank's range of their whole value
  (collective), and plain tensors of the whole parameter's shape as their range, so a full
  optimizer state dict loads too.
"""

from __future__ import annotations

from itertools import chain

import torch
from torch.distributed.tensor import DTensor

from hfsdp.core.buffers.main_params import MainParam, piece_of
from hfsdp.core.engine.caller import called_from_dcp
from hfsdp.core.engine.piece_tensor import to_piece
from hfsdp.core.engine.sharded_state_dict import check_supported, piece_tensor


def _per_element(value, piece: MainParam) -> bool:
    plain = isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
    return plain and value.dim() > 0 and value.shape == piece.param.shape


def as_pieces(optimizer, state_dict):
    """`state_dict` (the optimizer's, packed by torch) with each per-element state of a piece as a `PieceTensor`
    (the state dict post-hook; an optimizer that adds per-element entries after torch's packing, as FusedAdamW adds
    fp8 scales, calls it again: what is a DTensor already stays)."""
    if called_from_dcp(function="_load_optim_state_dict"):
        return state_dict  # torch's full-state-dict load: its targets are plain, so it hands over whole tensors
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index in sorted(state_dict["state"]):  # torch packs the state by parameter index
        entry = state_dict["state"][index]
        piece = piece_of(params[index]) if index < len(params) else None
        if piece is None:
            state[index] = entry
            continue
        check_supported(piece.group.owner())
        state[index] = {
            key: piece_tensor(piece, entry[key]) if _per_element(entry[key], piece) else entry[key]
            for key in sorted(entry)
        }
    state_dict["state"] = state
    return state_dict


def local_state_dict(optimizer, state_dict):
    """`state_dict` with each piece's state as this rank's plain piece (what the load pre-hook gives torch; an
    optimizer that reads the state before torch's own load, as FusedAdamW does, calls it first)."""
    saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
    current = chain.from_iterable(group["params"] for group in optimizer.param_groups)
    param_of = dict(zip(saved_ids, current, strict=False))
    state = {}
    for index in sorted(state_dict["state"]):  # the order `as_pieces` gives: an ordinary DTensor is gathered whole
        entry = state_dict["state"][index]
        piece = piece_of(param_of[index]) if index in param_of else None
        if piece is None:
            state[index] = entry
            continue
        out = {}
        for key in sorted(entry):
            value = entry[key]
            if isinstance(value, DTensor) or (
                isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == piece.shape and not piece.whole
            ):
                value = to_piece(value, piece.shape, piece.start, piece.stop).view(piece.param.shape)
            out[key] = value
        state[index] = out
    return {**state_dict, "state": state}


def serve_state_dicts(optimizer: torch.optim.Optimizer) -> None:
    """Install the two hooks on `optimizer` (once)."""
    if getattr(optimizer, "_hfsdp_state_hooks", False):
        return
    optimizer._hfsdp_state_hooks = True
    optimizer.register_state_dict_post_hook(as_pieces)
    optimizer.register_load_state_dict_pre_hook(local_state_dict)


__all__ = ["as_pieces", "local_state_dict", "serve_state_dicts"]
