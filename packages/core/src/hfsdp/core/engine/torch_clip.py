"""torch's gradient-norm utilities, made to compute the global norm of an hfsdp model's gradients.

A main param's gradient is this rank's piece, so torch's `clip_grad_norm_` and `get_total_norm`
(torchtitan's clipping calls `get_total_norm` and then `clip_grads_with_norm_`) would compute a
local norm and clip every rank by a different one: silently wrong. Given hfsdp's parameters or
their gradients, the two compute the global norm instead, through `clip.py`, the code
`model.clip_grad_norm_` runs; given anything else, torch's own code runs untouched.
`clip_grads_with_norm_` needs nothing: it scales each gradient in place by a coefficient, which is
right once the norm is.

A script imports these functions before it shards anything (`from torch.nn.utils import
clip_grad_norm_` at its top), so replacing the module attributes is not enough: the names it bound
still reach torch's original function objects. Each of those objects is a `no_grad` wrapper around
the function proper; `install` swaps the function inside it, so every name that reaches the object,
however and whenever it was imported, computes the global norm. (A sharding whose tensors are
DTensors would need none of this; see docs/design.md for why hfsdp's pieces are not, yet.)

Where the gradients are not `.grad` until the optimizer's step (offloaded groups, a reduce dtype
other than fp32, whose fp32 copies are made only then), `get_total_norm` sees none of them; it
refuses an empty list while such a model has gradients ready, instead of answering 0.
"""

from __future__ import annotations

import weakref

import torch

from hfsdp.core.buffers.main_params import grad_piece_of, piece_of
from hfsdp.core.engine.clip import clip_pieces_, grads_norm
from hfsdp.core.engine.step import StepPhase

#: Every sharded model's engine state, to tell whether some model holds gradients torch cannot see.
_models: weakref.WeakSet = weakref.WeakSet()
_originals: dict[str, object] = {}


def track(sharding) -> None:
    """Remember a sharded model's engine state (weakly)."""
    _models.add(sharding)


def install() -> None:
    """Make torch's `clip_grad_norm_` and `get_total_norm` global over hfsdp's pieces (once per process)."""
    if _originals:
        return
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    for name, replacement in (("clip_grad_norm_", _clip_grad_norm), ("_get_total_norm", _get_total_norm)):
        wrapper = getattr(clip_grad, name)
        cell = _inner_cell(wrapper)
        if cell is None:  # another torch's layout: replace the names at least
            _originals[name] = wrapper
            setattr(clip_grad, name, _no_grad(replacement))
            continue
        _originals[name] = cell.cell_contents
        cell.cell_contents = replacement
    utils.clip_grad_norm_, utils.get_total_norm = clip_grad.clip_grad_norm_, clip_grad._get_total_norm


def _inner_cell(wrapper):
    """The closure cell holding the function inside torch's `_no_grad` wrapper, or None if it is not one."""
    code, cells = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None)
    if code is None or cells is None or code.co_freevars != ("func",):
        return None
    return cells[0]


def _no_grad(fn):
    def wrapped(*args, **kwargs):
        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapped


def _as_list(tensors) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _mixed(what: str) -> TypeError:
    return TypeError(
        f"{what} was given tensors of an hfsdp-sharded model together with other tensors; the global norm of the "
        "sharded ones is a collective over all ranks and cannot be mixed with local ones. Pass the sharded model's "
        "parameters (or their gradients) apart from the others."
    )


def _clip_grad_norm(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    params = _as_list(parameters)
    pieces = [piece_of(p) for p in params]
    if not any(p is not None for p in pieces):
        return _originals["clip_grad_norm_"](params, max_norm, norm_type, error_if_nonfinite, foreach)
    if not all(p is not None for p in pieces):
        raise _mixed("clip_grad_norm_")
    return clip_pieces_(pieces, float(max_norm), norm_type, error_if_nonfinite)


def _get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    tensors = _as_list(tensors)
    pieces = [grad_piece_of(t) for t in tensors]
    if not any(p is not None for p in pieces):
        if not tensors and _hidden_grads_ready():
            raise RuntimeError(
                "get_total_norm was given no gradients while an hfsdp-sharded model holds this step's gradients "
                "outside .grad (offloaded groups, or a reduce dtype other than float32, get their .grad only at "
                "optimizer.step()). Clip with model.clip_grad_norm_(max_norm), torch.nn.utils.clip_grad_norm_("
                "model.parameters(), max_norm), or FusedAdamW(max_grad_norm=...)."
            )
        return _originals["_get_total_norm"](tensors, norm_type, error_if_nonfinite, foreach)
    if not all(p is not None for p in pieces):
        raise _mixed("get_total_norm")
    norm = grads_norm(pieces, tensors, norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return norm


def _hidden_grads_ready() -> bool:
    """Whether some sharded model has reduced gradients that are not yet any main param's `.grad`."""
    for sharding in list(_models):
        if sharding.step.phase is not StepPhase.GRADS_READY:
            continue
        for group in sharding.groups:
            if group.grads.holds and any(p.holds and p.param.grad is None for p in group.main_params):
                return True
    return False
