"""Gradient clipping by the global norm, each element counted exactly once.

Every rank holds the reduced gradient of its optimizer piece. A piece is held
by `mesh size / optimizer shard factor` ranks (the replicas along axes that do
not shard the optimizer), so each rank weights its sum of squares by one over
that count. Dense and expert pieces add up in one all-reduce over the world.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hfsdp.core.flat_group import FlatParamGroup
from hfsdp.core.placement import State


def global_grad_norm(model_or_groups) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, over dense and expert meshes together (collective)."""
    groups = _groups(model_or_groups)
    device = groups[0].device if groups else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    by_replicas: dict[int, list[torch.Tensor]] = {}
    for group in groups:
        replicas = group.layout.size // group.layout.shard_factor(State.OPTIM)
        by_replicas.setdefault(replicas, []).append(group.main_grad)
    for replicas, grads in by_replicas.items():
        # The norm of each piece in fp32 (no fp64 copy of the gradient), in one multi-tensor kernel; sums in fp64.
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        total += torch.stack(norms).double().square().sum() / replicas
    dist.all_reduce(total)
    return total.sqrt().float()


def clip_grad_norm_(model_or_groups, max_norm: float) -> torch.Tensor:
    """Scale every gradient piece so the global norm is at most `max_norm`; return the norm before (collective).

    Takes the sharded model (or its groups). `torch.nn.utils.clip_grad_norm_` on
    the main params would see this rank's pieces only and clip by a local norm.
    """
    groups = _groups(model_or_groups)
    norm = global_grad_norm(groups)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for group in groups:
        by_dtype.setdefault(group.main_grad.dtype, []).append(group.main_grad)
    for dtype, grads in by_dtype.items():
        torch._foreach_mul_(grads, coef.to(dtype))
    return norm


def _groups(model_or_groups) -> list[FlatParamGroup]:
    groups = getattr(model_or_groups, "groups", model_or_groups)
    return list(groups)
