"""Gradient norms and clipping over every rank's pieces, each element counted exactly once.

Every rank holds the reduced gradient of its optimizer piece. A piece is held
by `ranks that reduce / optimizer shard factor` ranks (the replicas along axes that do
not shard the optimizer), so each rank weights its sum of |g|^p by one over
that count, and the sums of all ranks add up in one all-reduce over the ranks
one step reduces over (dense and expert meshes together): the world, or with
DiLoCo one instance, which clips by its own norm. The infinity norm is a max,
where replicas do not matter.

`torch.nn.utils.clip_grad_norm_` on pieces would compute this rank's local norm
and clip by it: silently wrong. `torch_clip.py` makes torch's utilities compute
the global norm through this module, however they were imported.

Reading a norm never allocates a gradient: a piece without one counts as zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from hfsdp.core.buffers.main_params import MainParam
from hfsdp.core.engine.sharding import sharding_of
from hfsdp.core.rules.placement_names import State


def _replicas(group) -> int:
    """How many ranks hold each of `group`'s optimizer pieces (the replicas along axes that do not shard it)."""
    return group.layout.reduced_size // group.layout.shard_factor(State.OPTIM)


def _grads(pieces: Iterable[MainParam]) -> dict[int, list[torch.Tensor]]:
    """The reduced gradient of `pieces`, by how many ranks hold the same piece: one tensor per group where all of
    a group's pieces are there (the common case: the whole model), else one per piece."""
    by_group: dict[int, list[MainParam]] = {}
    for piece in pieces:
        by_group.setdefault(id(piece.group), []).append(piece)
    out: dict[int, list[torch.Tensor]] = {}
    for mine in by_group.values():
        group = mine[0].group
        grad = group.grads.main_grad
        if grad is None:
            continue
        replicas = _replicas(group)
        if len(mine) == len(group.main_params):
            out.setdefault(replicas, []).append(grad)
            continue
        for piece in mine:
            if piece.holds:
                out.setdefault(replicas, []).append(grad[piece.offset : piece.offset + piece.stop - piece.start])
    return out


def _device(pieces: list[MainParam]) -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return pieces[0].group.device if pieces else torch.device("cpu")


def pieces_norm(pieces: list[MainParam], norm_type: float = 2.0) -> torch.Tensor:
    """The `norm_type` norm of the gradient of the parameters `pieces` are pieces of, over all ranks (collective)."""
    return _norm(pieces, _grads(pieces), float(norm_type))


def grads_norm(pieces: list[MainParam], grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The global `norm_type` norm of `grads`, each the gradient of the piece beside it in `pieces` (collective)."""
    by_replicas: dict[int, list[torch.Tensor]] = {}
    for piece, grad in zip(pieces, grads, strict=True):
        by_replicas.setdefault(_replicas(piece.group), []).append(grad)
    return _norm(pieces, by_replicas, float(norm_type))


def _norm(pieces: list[MainParam], by_replicas: dict[int, list[torch.Tensor]], norm_type: float) -> torch.Tensor:
    device = _device(pieces)
    group = pieces[0].group.owner().norm_group if pieces else None
    if math.isinf(norm_type):
        total = torch.zeros((), dtype=torch.float32, device=device)
        for grads in by_replicas.values():
            total = torch.maximum(total, torch.stack(torch._foreach_norm(grads, norm_type)).max().float().to(device))
        if dist.is_initialized():
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    total = torch.zeros((), dtype=torch.float64, device=device)
    for replicas, grads in by_replicas.items():
        # The norm of each piece in fp32 (no fp64 copy of the gradient), in one multi-tensor kernel; sums in fp64.
        norms = torch._foreach_norm(grads, norm_type, dtype=torch.float32)
        total += torch.stack(norms).double().pow(norm_type).sum().to(device) / replicas
    if dist.is_initialized():
        dist.all_reduce(total, group=group)
    return total.pow(1.0 / norm_type).float()


def clip_pieces_(
    pieces: list[MainParam], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Scale the gradient of `pieces` so its global norm is at most `max_norm`; return the norm before."""
    by_replicas = _grads(pieces)
    norm = _norm(pieces, by_replicas, float(norm_type))
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    _scale_host_copies(pieces, coef)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for grads in by_replicas.values():
        for grad in grads:
            by_dtype.setdefault((grad.dtype, grad.device), []).append(grad)
    for (dtype, device), grads in by_dtype.items():
        torch._foreach_mul_(grads, coef.to(device=device, dtype=dtype))
    return norm


def _scale_host_copies(pieces: list[MainParam], coef: torch.Tensor) -> None:
    """Offloaded groups may already hold their gradient in host memory (copied during backward): scale it too."""
    by_group: dict[int, list[MainParam]] = {}
    for piece in pieces:
        if piece.group.offload:
            by_group.setdefault(id(piece.group), []).append(piece)
    for mine in by_group.values():
        group = mine[0].group
        whole = len(mine) == len(group.main_params)
        ranges = None if whole else [(p.offset, p.offset + p.stop - p.start) for p in mine if p.holds]
        group.scale_host_grads(coef, ranges)


def _pieces(model) -> list[MainParam]:
    return sharding_of(model).main_params


def global_grad_norm(model, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole model's gradient, over dense and expert meshes together (collective)."""
    return pieces_norm(_pieces(model), norm_type)


def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale every gradient piece of the sharded `model` so the global norm is at most `max_norm`; return the norm
    before (collective). The same as `model.clip_grad_norm_(max_norm)`."""
    return clip_pieces_(_pieces(model), max_norm, norm_type, error_if_nonfinite)
