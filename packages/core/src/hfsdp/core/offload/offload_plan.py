"""Which units keep their optimizer state in host memory: all, none, a fraction, or what the GPU cannot hold.

Offloading moves a unit's fp32 main weights and its optimizer state to the host, where the optimizer
steps them on the CPU; it costs PCIe transfers and a CPU step, so it should cost only what does not fit
(DeepSpeed's ZeRO-Offload++ offloads a set ratio of the optimizer state for the same reason). A
fraction f offloads whole units, the last ones in forward order first, until at least f of the
trainable elements are on the host. The last units are the right ones: their gradients are ready
first in backward (the copy to the host overlaps the backward of the units before them), and their
weights are needed last in the next forward (the copy back overlaps the forward of the units that stayed).
The root (embeddings, output layer) goes last, only when nothing else is left.

`"auto"` picks the smallest fraction with which the device holds what stays, from the memory free when
`fully_shard` runs (plus what the unsharded model's parameters hold now, which sharding frees) minus a
reserve for activations and the allocator (default 10% of the device). Per element of this rank's pieces a
unit kept on the device holds the fp32 main weights and AdamW's two moments (12 bytes over the optimizer's
shard factor), its gradient and, where the layout keeps one, a compute-dtype shard; an offloaded unit holds
the compute-dtype shard and the gradient. Every rank takes the largest fraction any rank needs, so all
ranks agree. Host memory is not checked: an offloaded element costs 16 bytes there (main weights, two
moments, and the gradient staged for the CPU step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hfsdp.core.rules.layout import MeshLayout
from hfsdp.core.rules.placement_names import State

#: Default room left on the device for activations, workspaces and the allocator, as a fraction of its memory.
RESERVE_FRACTION = 0.10


@dataclass(frozen=True)
class OffloadPlan:
    units: tuple[bool, ...]  # per unit (the root last): its optimizer state lives in host memory
    fraction: float  # of the trainable elements offloaded
    asked: float | str | bool  # what the caller asked for


def check_offload(offload) -> None:
    """Refuse an `offload` that is not False/True, a fraction in [0, 1] or "auto", with what it must be."""
    if isinstance(offload, bool) or offload == "auto":
        return
    if isinstance(offload, int | float) and math.isfinite(offload) and 0.0 <= offload <= 1.0:
        return
    raise ValueError(
        f"offload={offload!r} is not understood: pass False (everything on the device), True (all of the "
        "optimizer state in host memory), a fraction from 0 to 1 (that share of the state in host memory, the "
        "last units first), or 'auto' (offload only what the device cannot hold, measured when fully_shard runs)."
    )


def plan_offload(
    offload,
    unit_elements: list[int],
    layout: MeshLayout,
    compute_bytes: int,
    device: torch.device,
    current_bytes: int,
    reserve: int | None = None,
    reduce_bytes: int = 4,
    state_bytes: float = 8.0,
) -> OffloadPlan:
    """The per-unit decision for `offload` (checked by `check_offload`); `unit_elements` are the trainable elements of
    each unit, the root last; `current_bytes` what the model's parameters on the device hold now."""
    check_offload(offload)
    total = sum(unit_elements)
    if offload is True or offload is False:
        return OffloadPlan(tuple([bool(offload)] * len(unit_elements)), float(offload), offload)
    if offload == "auto":
        fraction = auto_fraction(
            total, layout, compute_bytes, device, current_bytes, reserve, reduce_bytes, state_bytes
        )
    else:
        fraction = float(offload)
    chosen = [False] * len(unit_elements)
    order = [*range(len(unit_elements) - 2, -1, -1), len(unit_elements) - 1]  # last unit first, the root last
    moved = 0
    for index in order:
        if moved >= fraction * total or fraction == 0.0:
            break
        chosen[index] = True
        moved += unit_elements[index]
    return OffloadPlan(tuple(chosen), moved / max(total, 1), offload)


def per_element_bytes(
    layout: MeshLayout, compute_bytes: int, reduce_bytes: int = 4, state_bytes: float = 8.0
) -> tuple[float, float]:
    """(kept on the device, offloaded): device bytes per trainable element of the model, on this rank.
    `state_bytes`: the optimizer's state per element (AdamW's two fp32 moments: 8; FusedAdamW's in bf16: 4)."""
    s_p, s_g, s_o = (layout.shard_factor(s) for s in (State.PARAM, State.GRAD, State.OPTIM))
    if compute_bytes == 4:  # fp32 compute: the main weights are a range of the parameter shard
        kept = 4 / s_p + state_bytes / s_o + reduce_bytes / s_g
    else:
        kept = (4 + state_bytes) / s_o + reduce_bytes / s_g + (compute_bytes / s_p if s_p != s_o else 0.0)
    offloaded = compute_bytes / s_p + reduce_bytes / s_g
    return kept, offloaded


def auto_fraction(
    total: int,
    layout: MeshLayout,
    compute_bytes: int,
    device: torch.device,
    current_bytes: int,
    reserve: int | None,
    reduce_bytes: int = 4,
    state_bytes: float = 8.0,
) -> float:
    """The smallest fraction to offload so that the rest fits on `device` (the largest over all ranks)."""
    if device.type != "cuda":
        fraction = 0.0  # host memory is the device: offloading saves nothing
    else:
        free, capacity = torch.cuda.mem_get_info(device)
        reserve = int(RESERVE_FRACTION * capacity) if reserve is None else reserve
        budget = free + current_bytes - reserve
        kept, offloaded = per_element_bytes(layout, compute_bytes, reduce_bytes, state_bytes)
        fraction = fraction_for(total, kept, offloaded, budget)
    if dist.is_initialized() and dist.get_world_size() > 1:
        backend = dist.get_backend()
        where = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        value = torch.tensor(fraction, dtype=torch.float64, device=where)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        fraction = float(value.item())
    return fraction


def fraction_for(total: int, kept: float, offloaded: float, budget: float) -> float:
    """Solve total·((1-f)·kept + f·offloaded) <= budget for the smallest f in [0, 1]."""
    if total * kept <= budget:
        return 0.0
    saved = kept - offloaded
    if saved <= 0:
        return 1.0
    return min(1.0, (total * kept - budget) / (total * saved))
