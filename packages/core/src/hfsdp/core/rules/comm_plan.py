"""Which collectives a mesh needs, read off its placements and nothing else.

- Parameters are all-gathered before compute over the axes that shard them.
- Gradients are reduce-scattered after every microbatch over the innermost axis
  when it shards them: that is what keeps ZeRO-2/3 gradient memory at 1/N.
- Every other axis is reduced once, on the last microbatch (inner first): an
  all-reduce where the optimizer state is replicated, a reduce-scatter where it
  is sharded. So the outer axis sees exactly one collective per step.
- After the optimizer step, updated parameters are all-gathered over the axes
  where parameters are replicated but the optimizer state is sharded.
- Axes whose placements are Independent (diloco) see none of these: each
  coordinate trains apart. They are the `outer_sync` axes, over which the
  outer step every H steps exchanges the weights (`outer_sync.py`).

Gathers run outer axis first and reductions inner axis first, which keeps every
intermediate piece contiguous under the shard order of `layout.py`.

Nothing here imports torch: the placements are read as names (`placement_names.py`),
so `hfsdp plan` and other tools that only describe a layout get the engine's own
collective plan in a fraction of a second.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from hfsdp.core.rules.layout import MeshLayout
from hfsdp.core.rules.placement_names import State, is_shard_name


@dataclass(frozen=True)
class CommPlan:
    param_gather: tuple[int, ...]
    microbatch_reduce: tuple[int, ...]
    final_reduce: tuple[tuple[int, str], ...]
    post_step_gather: tuple[int, ...]
    outer_sync: tuple[int, ...] = ()  # axes that train apart and meet in the outer step


_plan_single_rank_axes = False


@contextmanager
def single_rank_collectives() -> Iterator[None]:
    """Plan the collectives of axes of size 1 too, for the layouts built inside (`fully_shard` under it).

    Each such collective is a copy (`collectives.py`), issued on the stream, at the point and with the buffers a
    larger mesh would use. It is never faster; it exists so that one GPU can check the stream ordering of what
    only a larger mesh otherwise runs: gathers into the unsharded buffers, fp8 quantization before its gather,
    reduce-scatters on the reduce stream (`bench/gpu_correctness.py`). Not thread-safe; not for training."""
    global _plan_single_rank_axes
    previous, _plan_single_rank_axes = _plan_single_rank_axes, True
    try:
        yield
    finally:
        _plan_single_rank_axes = previous


def plan_for(layout: MeshLayout) -> CommPlan:
    """The collectives of `layout`; axes of size 1 need none and are left out (one GPU runs no copies), unless
    planned under `single_rank_collectives()`."""
    param, grad, optim = (layout.placement_names(state) for state in (State.PARAM, State.GRAD, State.OPTIM))
    inner = len(layout.axes) - 1
    busy = [k for k in range(len(layout.axes)) if layout.axes[k].size > 1 or _plan_single_rank_axes]
    param_sharded = tuple(k for k in layout.sharded_axes(State.PARAM) if k in busy)
    microbatch = (inner,) if is_shard_name(grad[inner]) and inner in busy else ()
    apart = layout.independent_axes()
    final = tuple(
        (k, "reduce_scatter" if is_shard_name(optim[k]) else "all_reduce")
        for k in reversed(busy)
        if k not in microbatch and k not in apart
    )
    post_step = tuple(k for k in busy if is_shard_name(optim[k]) and not is_shard_name(param[k]))
    return CommPlan(
        param_gather=param_sharded,
        microbatch_reduce=microbatch,
        final_reduce=final,
        post_step_gather=post_step,
        outer_sync=tuple(k for k in apart if k in busy),
    )
