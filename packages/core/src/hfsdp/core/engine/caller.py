"""`torch.distributed.checkpoint` refused at once, on every rank, with the way that works.

DCP knows which part of a tensor a rank holds from its DTensor placements. hfsdp's pieces are plain
tensors (docs/design.md says why, for now), so DCP would take each rank's piece of an optimizer
state for the whole tensor: `dcp.save` would write rank 0's pieces as everybody's, and torch's
`get_state_dict` would meet hfsdp's full-on-rank-0 `state_dict()` with an empty dict on the other
ranks and leave rank 0 waiting in `dcp.save` for ranks that had already failed. Until the pieces
are DTensors, each entry point refuses before any collective, on every rank alike, so nothing
hangs and nothing is written half right:

- `model.state_dict()` / `load_state_dict()` called from DCP's state-dict helpers
  (`get_state_dict`, `get_model_state_dict`, `set_state_dict`, ...);
- an optimizer's `state_dict()` called from them (a hook the engine adds to each optimizer over
  its pieces);
- `dcp.save` / `dcp.load` of an optimizer state dict taken directly (`opt.state_dict()`): its
  per-element tensors carry DCP's own planning hooks, which refuse inside DCP's planning step,
  whose failure DCP reports on every rank.
"""

from __future__ import annotations

import sys

import torch

_DCP = "torch.distributed.checkpoint"

MESSAGE = (
    "torch.distributed.checkpoint is not supported for hfsdp-sharded models yet: hfsdp's parameters and optimizer "
    "state are each rank's flat piece of a tensor, not DTensors, so DCP cannot tell which part a rank holds and would "
    "save or load the wrong values. Save and resume with hfsdp.ckpt.save_checkpoint(dir, model, optimizer) and "
    "hfsdp.ckpt.load_checkpoint(dir, model, optimizer), which reshard to any layout and world size (model."
    "state_dict() gives the full model on rank 0 for a single-file export)."
)


def called_from_dcp(depth: int = 12) -> bool:
    """Whether one of the calling frames (up to `depth`) belongs to torch.distributed.checkpoint."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith(_DCP):
            return True
        frame = frame.f_back
    return False


def refuse_if_dcp() -> None:
    """Raise the refusal when DCP's helpers are the caller."""
    if called_from_dcp():
        raise RuntimeError(MESSAGE)


def _refuse(*args, **kwargs):
    raise RuntimeError(MESSAGE)


_HOOKS = ("__create_write_items__", "__create_chunk_list__", "__getstate__")


def mark_for_dcp(tensor: torch.Tensor) -> None:
    """Make DCP's planning refuse `tensor` (a piece of an optimizer state): DCP asks these hooks, when a tensor has
    them, for the chunks it writes or reads. Pickling leaves them out (`__getstate__`), so `torch.save` of the state
    dict writes plain tensors, which `torch.load(weights_only=True)` reads as before."""
    tensor.__create_write_items__ = _refuse
    tensor.__create_chunk_list__ = _refuse
    tensor.__getstate__ = lambda: {k: v for k, v in tensor.__dict__.items() if k not in _HOOKS}


def guard_optimizer(optimizer: torch.optim.Optimizer, holds_piece) -> None:
    """Refuse DCP on `optimizer`'s state dict: from DCP's helpers at once, and in DCP's planning for the per-element
    state of the parameters `holds_piece(param)` says are hfsdp pieces (once per optimizer)."""
    if getattr(optimizer, "_hfsdp_dcp_guarded", False):
        return
    optimizer._hfsdp_dcp_guarded = True

    def pre_hook(opt) -> None:
        refuse_if_dcp()

    def post_hook(opt, state_dict):
        params = [p for group in opt.param_groups for p in group["params"]]
        for index, entry in state_dict["state"].items():
            if index < len(params) and holds_piece(params[index]):
                for value in entry.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        mark_for_dcp(value)
        return state_dict

    optimizer.register_state_dict_pre_hook(pre_hook)
    optimizer.register_state_dict_post_hook(post_hook)
