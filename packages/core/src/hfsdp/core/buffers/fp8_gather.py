"""The fp8 side of a group whose weights are gathered in fp8 (`fully_shard(fp8_param_gather=True)`).

The group's weights belong to `Float8Linear` layers with one scale per tensor. Instead of gathering
them in the compute dtype and letting each layer quantize its whole weight, every rank quantizes its
own piece and the gather moves fp8 bytes: half of bf16's on every axis that gathers parameters.

The bits are exactly those of the layer quantizing the whole weight itself (`fp8/scaling.py`): a
weight's amax is the max of its pieces' amaxes (one small all-reduce per group, over the axes that
shard the parameters), its scale a power of two taken from that amax, and each element's fp8 value
depends only on the element and that scale. The piece is quantized from the same compute-dtype values
the bf16 gather would have sent (the cast of the fp32 main weights), once per optimizer step, right
after it (`publish_main_weights`, on the gather stream), and from the whole weights when the group is
built: a backward that gathers the unit again reuses it.

Where the parameters are replicated over an axis that shards the optimizer (HFSDP's outer axis,
`FlatParamGroup.fp8_outer`), the post-step gather over that axis moves fp8 too: right after the step
each rank quantizes its optimizer piece (the amaxes max-reduced over every axis that shards the
optimizer, so again the whole weight's) and the gather grows it into the fp8 parameter piece, which
the forward's gather then takes as it is.

While the unit computes, each layer's `weight` attribute is a *carrier*: a tensor of the weight's shape
and dtype on one NaN element, which autograd hands the weight's gradient to; the layer multiplies
`fp8_weight` (a view of the gathered fp8 buffer) with `fp8_weight_scale` instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hfsdp.core.buffers.flat_layout import FlatLayout
from hfsdp.core.buffers.group_comms import GroupComms
from hfsdp.core.fp8 import scaling

FP8_WEIGHT_DTYPE = scaling.E4M3


class Fp8Weights:
    def __init__(self, flat: FlatLayout, comms: GroupComms, sharded_axes: tuple[int, ...], compute_dtype, device):
        self.flat, self.comms, self.sharded_axes = flat, comms, sharded_axes
        lo, hi = flat.param_range
        self.shard = torch.zeros(hi - lo, dtype=FP8_WEIGHT_DTYPE, device=device)
        self.scales = torch.ones(len(flat.slots), dtype=torch.float32, device=device)
        self._carrier = torch.full((1,), float("nan"), dtype=compute_dtype, device=device)
        # Where the optimizer step wrote this rank's piece in the compute dtype (prestaged gathers), until the
        # quantization reads it; then `reading`, until compute has waited for that (the gather stream reads it).
        self.staged: torch.Tensor | None = None
        self.reading: torch.Tensor | None = None
        self.unsharded = torch.empty(flat.padded, dtype=FP8_WEIGHT_DTYPE, device=device)
        # What each layer reads while its unit computes. Tensors of their own over views (as the module parameters
        # are): a gather into `unsharded` for backward must not count as a change to what forward saved.
        self.weights = [_own(self.unsharded[s.offset : s.stop].view(s.shape)) for s in flat.slots]
        self.weight_scales = [_own(self.scales[i]) for i in range(len(flat.slots))]

    def carrier(self, shape: torch.Size) -> torch.Tensor:
        """What a layer's `weight` is while its unit computes: the weight's shape, no storage of its own."""
        return self._carrier.expand(shape)

    def refresh(self, source: torch.Tensor, covers: tuple[int, int] | None = None, axes=None) -> None:
        """Quantize `source`, the compute-dtype values of the flat range `covers` (default: this rank's parameter
        piece; HFSDP's post-step path passes the optimizer piece inside it), into its place in `shard`. Collective:
        the amaxes are max-reduced over `axes`, the axes that shard `covers` (default: those of the parameters)."""
        covers = covers or self.flat.param_range
        amax = torch.zeros(len(self.flat.slots), dtype=torch.float32, device=self.shard.device)
        for i, start, stop in _segments(self.flat, covers):
            amax[i] = source[start:stop].abs().amax().float()
        for k in self.sharded_axes if axes is None else axes:
            self.comms.all_reduce(k, amax, op=dist.ReduceOp.MAX)
        self._quantize(source, covers, amax)

    def start_from(self, full: torch.Tensor) -> None:
        """Quantize this rank's piece from `full`, the whole padded group in the compute dtype, which every rank
        holds when the group is built: each weight's amax is taken whole, so no collective is needed."""
        amax = torch.stack([full[s.offset : s.stop].abs().amax().float() for s in self.flat.slots])
        lo, hi = self.flat.param_range
        self._quantize(full[lo:hi], self.flat.param_range, amax)

    def _quantize(self, source: torch.Tensor, covers: tuple[int, int], amax: torch.Tensor) -> None:
        """Every weight's scale from its whole amax, and `source` (the values of `covers`) quantized into `shard`."""
        self.scales.copy_(scaling.amax_to_scale(amax, FP8_WEIGHT_DTYPE))
        base = covers[0] - self.flat.param_range[0]
        for i, start, stop in _segments(self.flat, covers):
            quantized = scaling.quantize(source[start:stop], self.scales[i], FP8_WEIGHT_DTYPE)
            self.shard[base + start : base + stop] = quantized

    def state_bytes(self) -> int:
        return self.shard.numel()


def _segments(flat: FlatLayout, covers: tuple[int, int]) -> list[tuple[int, int, int]]:
    """(slot index, start, stop) of each slot's part of the flat range `covers`, relative to it."""
    lo, hi = covers
    return [
        (i, max(slot.offset, lo) - lo, min(slot.stop, hi) - lo)
        for i, slot in enumerate(flat.slots)
        if max(slot.offset, lo) < min(slot.stop, hi)
    ]


def _own(view: torch.Tensor) -> torch.Tensor:
    """`view`'s data in a tensor with its own version counter."""
    held = torch.empty(0, dtype=view.dtype, device=view.device)
    held.data = view
    return held
