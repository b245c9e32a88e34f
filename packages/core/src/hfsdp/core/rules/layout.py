"""The geometry of one mesh, with no process group attached.

A `MeshLayout` is the pure description of a mesh: its axes (outer first), their
sizes and strategies. From it follow the placements, which flat piece of a
padded buffer each rank holds, and the order of the collectives. Checkpoint
resharding uses the same object offline, so the engine and the checkpoint can
never disagree about who holds what.

The shard order: when several axes shard a state, the innermost axis is the most
significant digit of the piece index. On `(dp_outer=R, dp_shard=N)` the rank at
(o, i) holds piece `i*R + o` of `N*R`, so a rank's optimizer shard is a
sub-range of its gradient shard and every outer collective works on one
contiguous range.

Nothing here imports torch: which axes shard what is read off the placement
names (`placement_names.py`), and the torch placement objects are built only
when `placements` is asked for, so describing a layout stays cheap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hfsdp.core.rules.config import LayoutConfig
from hfsdp.core.rules.placement_names import State, is_independent_name, is_shard_name, names_of
from hfsdp.core.rules.strategy import Strategy

if TYPE_CHECKING:
    from hfsdp.core.rules.placement import Placements

DENSE_AXES = ("dp_outer", "dp_shard")
EXPERT_AXES = ("expert_dp_outer", "expert_dp")


@dataclass(frozen=True)
class Axis:
    name: str
    size: int
    strategy: Strategy


@dataclass(frozen=True)
class MeshLayout:
    """Axes of one mesh, outer first, and everything that follows from them."""

    axes: tuple[Axis, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def placements(self) -> Placements:
        """torch's DTensor placements of every state on this mesh (imports torch)."""
        from hfsdp.core.rules.placement import compose

        return compose([a.strategy for a in self.axes])

    def placement_names(self, state: State) -> tuple[str, ...]:
        """The placements of `state` as names, outer axis first: `("Replicate()", "Shard(0)")`; no torch."""
        return names_of([a.strategy for a in self.axes], state)

    def sharded_axes(self, state: State) -> tuple[int, ...]:
        """Indices of the axes that shard `state`, outer first."""
        return tuple(k for k, name in enumerate(self.placement_names(state)) if is_shard_name(name))

    def independent_axes(self) -> tuple[int, ...]:
        """Indices of the axes along which every coordinate trains apart (diloco): no per-step collective there."""
        return tuple(k for k, name in enumerate(self.placement_names(State.GRAD)) if is_independent_name(name))

    @property
    def reduced_size(self) -> int:
        """How many ranks one step's gradients are summed over: the mesh without its independent axes.

        That is the data-parallel size of one step's mean loss (with DiLoCo the
        ranks of one instance), so the loss scale is 1 / (microbatches x this).
        """
        return self.size // math.prod(self.axes[k].size for k in self.independent_axes())

    def shard_factor(self, state: State) -> int:
        """Into how many pieces `state` is cut (the product of its sharding axes' sizes)."""
        return math.prod(self.axes[k].size for k in self.sharded_axes(state))

    def padded_numel(self, numel: int) -> int:
        """Round `numel` up so that every piece on every axis has the same length."""
        return -(-numel // self.size) * self.size

    def piece(self, state: State, coord: tuple[int, ...]) -> tuple[int, int]:
        """(index, count) of the piece of `state` the rank at `coord` holds."""
        return self.piece_over(self.sharded_axes(state), coord)

    def piece_over(self, axes: tuple[int, ...], coord: tuple[int, ...]) -> tuple[int, int]:
        """(index, count) of a rank's piece when `axes` shard; inner axes are the significant digits."""
        index, count = 0, 1
        for k in sorted(axes, reverse=True):
            index = index * self.axes[k].size + coord[k]
            count *= self.axes[k].size
        return index, count

    def shard_range(self, state: State, coord: tuple[int, ...], padded: int) -> tuple[int, int]:
        """[start, stop) of the padded flat buffer that the rank at `coord` holds for `state`."""
        return self.range_over(self.sharded_axes(state), coord, padded)

    def range_over(self, axes: tuple[int, ...], coord: tuple[int, ...], padded: int) -> tuple[int, int]:
        """[start, stop) of a rank's piece of a `padded` buffer when `axes` shard it."""
        index, count = self.piece_over(axes, coord)
        length = padded // count
        return index * length, (index + 1) * length

    def coords(self) -> list[tuple[int, ...]]:
        """Every rank's coordinate, in rank order (row-major over the mesh)."""
        out = [()]
        for size in self.shape:
            out = [(*c, j) for c in out for j in range(size)]
        return out

    def bytes_per_param(
        self, param_bytes: int = 2, grad_bytes: int = 2, optim_bytes: float = 12, remainders: bool = False
    ) -> float:
        """Model-state bytes per parameter on one rank: 2/s_p + 2/s_g + 12/s_o (bf16 params and grads, fp32 main
        weights and Adam), where the compute-dtype parameter shard is kept only when s_p != s_o.

        Where the parameter and optimizer shards are the same range, every gather
        casts the fp32 main weights into its own input, so the 2/s_p term is gone
        (docs/design.md, "Memory"). With `remainders` (`store_param_remainders`) the
        shard is kept everywhere and holds the masters' upper halves: of the 4 bytes
        of fp32 main weight in `optim_bytes` only the 2-byte remainder is left.
        """
        s_p, s_o = self.shard_factor(State.PARAM), self.shard_factor(State.OPTIM)
        params = param_bytes / s_p if s_p != s_o or remainders else 0.0
        optim = optim_bytes - 2 if remainders else optim_bytes
        return params + grad_bytes / self.shard_factor(State.GRAD) + optim / s_o

    def outer_bytes_per_param(self, anchored: bool = False, momentum: bool = True) -> float:
        """The outer optimizer's bytes per parameter on one rank: 8/s_outer (fp32 global weights and momentum; 4
        without momentum) where an axis trains apart, plus 4/s_o for the anchor a compressed outer exchange keeps
        (`anchored`: the weights of the last outer step, over the inner optimizer's piece); 0 without such an axis."""
        if not self.independent_axes():
            return 0.0
        anchor = 4 / self.shard_factor(State.OPTIM) if anchored else 0.0
        return (8 if momentum else 4) / self.shard_factor(State.OUTER) + anchor


def dense_layout(cfg: LayoutConfig) -> MeshLayout:
    """The mesh of dense parameters: (dp_outer, dp_shard) with instances > 1, else (dp_shard,)."""
    inner = Axis(DENSE_AXES[1], cfg.inner_size, cfg.inner)
    if cfg.instances == 1:
        return MeshLayout((inner,))
    return MeshLayout((Axis(DENSE_AXES[0], cfg.instances, cfg.outer), inner))


def expert_layout(cfg: LayoutConfig) -> MeshLayout:
    """The mesh of expert parameters: (expert_dp,), with an outer axis only when asked for."""
    inner = Axis(EXPERT_AXES[1], cfg.expert_inner_size, cfg.resolved_expert_strategy)
    if cfg.expert_instances == 1:
        return MeshLayout((inner,))
    return MeshLayout((Axis(EXPERT_AXES[0], cfg.expert_instances, cfg.expert_outer), inner))
