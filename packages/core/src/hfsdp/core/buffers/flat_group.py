"""One unit's parameters of one mesh, in flat padded buffers: the parameter side of a group.

A `FlatParamGroup` owns these buffers:

- `main` (fp32): the optimizer's piece of the weights (the rank's optimizer
  range); the main params a `torch.optim` optimizer steps are views into it;
- `param_shard` (compute dtype): this rank's piece of the parameters, kept only
  where it is not just `main` in another dtype. With fp32 compute `main` is a
  view of it. With a lower compute dtype it exists where the parameter shard is
  larger than the optimizer's (parameters replicated over an axis that shards
  the optimizer: HFSDP's outer axis, ZeRO-1/2), and is refreshed from `main`
  after each step. Where the two ranges coincide (ZeRO-3, HSDP, DDP, one GPU) it
  does not exist: each gather casts `main` straight into its own slot of the
  gather's output, as FSDP2 does, which saves 2 bytes per parameter per shard;
- `unsharded` (compute dtype): the whole padded buffer, which every module
  parameter is a view into. Its storage exists only while the unit runs
  (`unshard` / `reshard`) unless it *is* the persistent `param_shard` (a
  replicated parameter that needs no gather and no cast);
- `grads` (`GradBuffer`): the gradient piece and its reductions;
- `remainder` (int16, optimizer range, only after `store_param_remainders`): the
  low 16 bits of the fp32 main weights, whose upper half, rounded, is then the
  bf16 `param_shard` itself (`buffers/param_remainders.py`). `main` is that
  shard's optimizer range (bf16, what the main params view), and the fp32 main
  weights exist only as `master_weights()`, joined when read.

A *frozen* group holds parameters that need no gradient (a LoRA base): sharded and
cast like any other, so every rank holds only its piece, but never reduced, never
stepped and never published after a step; its `grads` never allocates a buffer, and
its `main` keeps the parameters' own dtype (nothing updates it, so no fp32 master).

An *fp8* group holds the weights of `Float8Linear` layers gathered in fp8 (`fp8_gather.py`): its
`unsharded` buffer is fp8, filled by gathering each rank's quantized piece, and while the unit
computes each layer's `weight` is a carrier for its gradient while the layer reads `fp8_weight`.

The unsharded buffer moves through `ParamState`: SHARDED (no storage) -> GATHERING
(a gather in flight on the gather stream) -> UNSHARDED (compute has waited for it).
A group whose unsharded buffer is its persistent shard is always UNSHARDED.

Which tensors the modules hold moves with it: while the unit computes, each module
attribute is the compute parameter (a view into `unsharded`); otherwise it is the
rank's main param (`main_params.py`), what an optimizer steps.

With `offload`, `main` (and so the optimizer and its state) lives in host memory:
the compute-dtype shard is always kept on the device, the reduced gradient is
copied to the host before the optimizer step, and the new piece copied back after.

Padding makes every piece equal on every axis, so collectives never see uneven
sizes. Padding starts at zero and stays zero: its gradient is zero, so
elementwise optimizers leave it at zero, and no parameter view, main param or
checkpoint ever covers it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from enum import Enum

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hfsdp.core.buffers.flat_layout import FlatLayout
from hfsdp.core.buffers.fp8_gather import Fp8Weights
from hfsdp.core.buffers.grad_buffer import GradBuffer
from hfsdp.core.buffers.group_comms import GroupComms
from hfsdp.core.buffers.main_params import MainParam, build_main_params
from hfsdp.core.buffers.mixed_precision import MixedPrecision
from hfsdp.core.buffers.param_remainders import join_master, split_master, write_master
from hfsdp.core.buffers.streams import SyncStreams
from hfsdp.core.offload.host_memory import page_locked_empty
from hfsdp.core.rules.layout import MeshLayout
from hfsdp.core.rules.placement_names import State

#: Where a module holds one of the group's parameters: (module, attribute name). A tied parameter has several.
Location = tuple[nn.Module, str]


class ParamState(Enum):
    SHARDED = "sharded"  # the unsharded buffer has no storage
    GATHERING = "gathering"  # a gather into it is in flight on the gather stream
    UNSHARDED = "unsharded"  # compute may read it


class FlatParamGroup:
    """The flat buffers and the collectives of one (unit, mesh, dtype)."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        global_names: list[str],
        locations: list[list[Location]],
        mesh: DeviceMesh,
        layout: MeshLayout,
        mp: MixedPrecision,
        *,
        is_expert: bool,
        unit_index: int,
        owner: Callable[[], object] = lambda: None,
        streams=None,
        offload: bool = False,
        frozen: bool = False,
        fp8: bool = False,
    ):
        self.frozen = frozen  # parameters that need no gradient: gathered and cast, never reduced or stepped
        self.is_expert, self.unit_index = is_expert, unit_index  # which mesh; the owning unit's position (root last)
        self.owner = owner  # () -> the engine state (`Sharding`) this group belongs to, held weakly
        self.mesh, self.layout, self.offload = mesh, layout, offload
        self.flat = FlatLayout.build(named_params, global_names, layout, tuple(mesh.get_coordinate()))
        self.streams = streams or SyncStreams()
        self.comms = GroupComms(mesh, self.flat)
        self.locations = locations
        self.fp8_requested = fp8  # gather in fp8 where the parameters are gathered at all
        self.fp8: Fp8Weights | None = None
        source = named_params[0][1]
        self.compute_dtype = mp.param_dtype or source.dtype
        # fp32 masters for what an optimizer steps; a frozen group's never change, so it keeps its own dtype
        # (a bf16 LoRA base: 2 bytes per element, as FSDP2 keeps it).
        self.main_dtype = source.dtype if frozen else torch.float32
        self.device = source.device
        self.remainder: torch.Tensor | None = None  # `store_param_remainders`: the masters' low 16 bits

        full = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for slot in self.slots:
                full[slot.offset : slot.stop].copy_(slot.param.detach().reshape(-1))
        self._place(full)
        del full
        self.state = ParamState.UNSHARDED
        self._gather_event = None  # GATHERING: the event of the gather in flight
        self._new_weights = None  # the post-step gather of new weights, until compute has waited on it
        self._stepped = None  # an optimizer step on the optim stream, until compute has waited on it
        self._step_inputs: tuple[torch.Tensor, ...] = ()  # what that step reads, kept alive until then
        self._free_grads_after_step = False  # release_grads came while the step was in flight
        self._compute_weights_written = False  # an optimizer wrote this step's weights in the compute dtype
        self._gather_input_ready = False  # `unsharded[param_range]` already holds the cast of `main`
        self.main_params: list[MainParam] = build_main_params(self, trainable=not frozen)
        self.grads = GradBuffer(self.flat, self.comms, self.streams, mp.reduce_dtype, self.device)
        self._host_grad: torch.Tensor | None = None  # offload: where the reduced gradient goes for the optimizer
        self._host_grad_event = None  # offload: the copy of this step's gradient into `_host_grad`, once issued
        self._host_grad_fresh = False  # offload: `_host_grad` holds this step's reduced gradient (as last scaled)
        self._early_host_copy = True  # offload: copy the gradient during backward (off while clipping binds)
        self._computing = True  # whether the modules hold the compute parameters (not the main params)
        self.reshard()
        self.hold_main_params()

    def _place(self, full: torch.Tensor) -> None:
        """Make this rank's buffers from `full`, the whole padded group in fp32 (on the group's device), and point
        every module parameter at its slot of `unsharded`."""
        param_slice = slice(*self.param_range)
        self.param_shard: torch.Tensor | None = None
        if self.remainder is not None:  # the masters as the bf16 shard plus their low halves
            self.param_shard, low = split_master(full[param_slice])
            within = FlatLayout.within(self.param_range, self.optim_range)
            self.main, self.remainder = self.param_shard[within], low[within].clone()
        elif self.compute_dtype == self.main_dtype and not self.offload:
            # Compute in the main weights' dtype: the optimizer steps the parameter shard itself (a sub-range).
            self.param_shard = full[param_slice].to(self.main_dtype, copy=True)
            self.main = self.param_shard[FlatLayout.within(self.param_range, self.optim_range)]
        else:
            main = full[slice(*self.optim_range)].to(self.main_dtype)
            self.main = _to_host(main) if self.offload else main.clone()
            if self.offload or self.param_range != self.optim_range:  # offloaded: gathers must not read host memory
                self.param_shard = full[param_slice].to(self.compute_dtype, copy=True)
        # Whether `unsharded` is built (gathered, or cast from `main`) each time the unit runs.
        self.transient_unsharded = bool(self.flat.plan.param_gather) or self.param_shard is None
        self.fp8_outer = False  # the post-step gather moves fp8 (`fp8_gather.py`)
        self._param_shard_stale = False  # fp8_outer: `param_shard` holds only the optimizer piece's new weights
        if self.fp8_requested and self.flat.plan.param_gather:
            sharded = self.layout.sharded_axes(State.PARAM)
            self.fp8 = Fp8Weights(self.flat, self.comms, sharded, self.compute_dtype, self.device)
            self.fp8.start_from(full.to(self.compute_dtype))
            self.fp8_outer = self.param_shard is not None and not self.offload and bool(self.plan.post_step_gather)
            self.unsharded = self.fp8.unsharded
            for slot in self.slots:
                _point(slot.param, self.fp8.carrier(slot.shape))
            return
        if self.transient_unsharded:
            self.unsharded = torch.empty(self.padded, dtype=self.compute_dtype, device=self.device)
        else:
            self.unsharded = self.param_shard
        for slot in self.slots:
            _point(slot.param, self.unsharded[slot.offset : slot.stop].view(slot.shape))

    def materialize(self, device: torch.device, streams) -> None:
        """Give a group built on the meta device real buffers on `device`, zero-filled (`HFSDPModule.to_empty`):
        the same parameter objects, module and main params alike, now views into them."""
        self.device, self.streams = device, streams
        self.grads.device, self.grads.streams = device, streams
        self._place(torch.zeros(self.padded, dtype=torch.float32, device=device))
        for piece in self.main_params:
            held = self.main[piece.offset : piece.offset + piece.stop - piece.start]
            _point(piece.param, held.view(piece.param.shape))
        self.state = ParamState.UNSHARDED
        self.reshard()

    # -- the fp32 masters as a bf16 shard plus a remainder ----------------------------------

    def store_param_remainders(self) -> None:
        """Keep the fp32 main weights as the bf16 parameter shard plus a 16-bit remainder from now on (what
        `FusedAdamW(store_param_remainders=True)` asks; it steps both halves). Exact: the same fp32 masters in 4
        bytes per element of the optimizer range, 2 less where a bf16 shard is kept beside them (HFSDP's outer
        axis, ZeRO-1/2), and the same elsewhere (ZeRO-3, HSDP, DDP, one GPU: the shard is kept now, the next
        gather or forward reads it without a cast). Collective over the group's mesh where the shard is gathered
        after a step: every rank converts its groups in the model's order. The main params stay the same objects,
        now bf16 views; the bf16 weights are the masters rounded to nearest, ties away from zero
        (`param_remainders`), published before the next forward."""
        if self.remainder is not None:
            return
        self.wait_for_publish()
        high, self.remainder = split_master(self.main)
        if self.param_shard is None:  # none is kept only where the parameter and optimizer ranges coincide
            self.param_shard = high
        else:
            self.param_shard[FlatLayout.within(self.param_range, self.optim_range)].copy_(high)
        self.main = self.param_shard[FlatLayout.within(self.param_range, self.optim_range)]
        self.main_dtype = high.dtype
        for piece in self.main_params:
            held = self.main[piece.offset : piece.offset + piece.stop - piece.start]
            _point(piece.param, held.view(piece.param.shape))
        if not self.flat.plan.param_gather:  # nothing to gather: the modules compute with the kept shard itself
            self.reshard()
            self.transient_unsharded, self.unsharded = False, self.param_shard
            for slot in self.slots:
                _point(slot.param, self.unsharded[slot.offset : slot.stop].view(slot.shape))
            self.state = ParamState.UNSHARDED
        self.publish_main_weights()

    def master_weights(self) -> torch.Tensor:
        """The fp32 main weights of this rank's optimizer range: `main` itself, or joined from the bf16 shard and
        the remainder (a new tensor: writing it changes nothing; use `write_master`)."""
        if self.remainder is None:
            return self.main
        return join_master(self.main, self.remainder)

    def write_master(self, offset: int, values: torch.Tensor) -> None:
        """Write fp32 `values` into the main weights from `offset` of the optimizer range on (split where the
        masters are kept as a bf16 shard plus a remainder). Publish afterwards (`Sharding.republish`)."""
        n = values.numel()
        if self.remainder is None:
            self.main[offset : offset + n].copy_(values.reshape(-1))
        else:
            write_master(self.main[offset : offset + n], self.remainder[offset : offset + n], values.float())

    def zero_master(self) -> None:
        """Zero the main weights (a checkpoint's load then writes every piece; the padding stays zero)."""
        self.main.zero_()
        if self.remainder is not None:
            self.remainder.zero_()

    # -- the flat layout, for readers --------------------------------------------------

    @property
    def slots(self):
        return self.flat.slots

    @property
    def numel(self) -> int:
        return self.flat.numel

    @property
    def padded(self) -> int:
        return self.flat.padded

    @property
    def param_range(self) -> tuple[int, int]:
        return self.flat.param_range

    @property
    def grad_range(self) -> tuple[int, int]:
        return self.flat.grad_range

    @property
    def optim_range(self) -> tuple[int, int]:
        return self.flat.optim_range

    @property
    def coord(self) -> tuple[int, ...]:
        return self.flat.coord

    @property
    def plan(self):
        return self.flat.plan

    # -- what the modules hold -------------------------------------------------------------

    def hold_compute_params(self) -> None:
        """Point every module attribute of this group at its compute parameter (the unit is about to compute)."""
        if not self._computing:
            for i, (slot, places) in enumerate(zip(self.slots, self.locations, strict=True)):
                for module, attr in places:
                    module._parameters[attr] = slot.param
                    if self.fp8 is not None:
                        module.fp8_weight, module.fp8_weight_scale = self.fp8.weights[i], self.fp8.weight_scales[i]
            self._computing = True

    def hold_main_params(self) -> None:
        """Point every module attribute of this group at this rank's main param (the unit is done computing)."""
        if self._computing:
            for piece, places in zip(self.main_params, self.locations, strict=True):
                for module, attr in places:
                    module._parameters[attr] = piece.param
                    if self.fp8 is not None:
                        module.fp8_weight = module.fp8_weight_scale = None
            self._computing = False

    # -- parameters ------------------------------------------------------------------

    def start_unshard(self) -> None:
        """Allocate `unsharded` (on the compute stream) and gather into it on the gather stream."""
        if self.state is not ParamState.SHARDED:
            return
        self.unsharded.untyped_storage().resize_(self.padded * self.unsharded.element_size())
        allocated = self.streams.record("compute")
        with self.streams.side("gather"):
            self.streams.wait("gather", allocated)
            self.streams.wait("gather", self._stepped)  # the step writes the main weights (and the cast of them)
            sharded = self.layout.sharded_axes(State.PARAM)
            if self.fp8 is not None:  # this rank's piece, quantized when it was published, gathered as fp8 bytes
                piece, out = self.fp8.shard.view(torch.uint8), self.unsharded.view(torch.uint8)
            else:
                piece, out = self._gather_input(), self.unsharded
            self.comms.gather(piece, sharded, self.plan.param_gather, out, 0)
            self._gather_event = self.streams.record("gather")
        self.state = ParamState.GATHERING

    def _fp8_source(self) -> torch.Tensor:
        """What an fp8 group quantizes: this rank's piece in the compute dtype, the kept shard, or what the optimizer
        step wrote (`compute_weights_out`, held until compute has waited for the quantization), or else a
        cast of `main`."""
        if self.param_shard is not None:
            return self.param_shard
        staged, self.fp8.staged = self.fp8.staged, None
        if self._gather_input_ready and staged is not None:
            self._gather_input_ready = False
            self.fp8.reading = staged
            return staged
        return self.main.to(self.compute_dtype)

    def _gather_input(self) -> torch.Tensor:
        """This rank's piece in the compute dtype: the kept shard, or the cast of `main` into its own slot of
        `unsharded` (the gather is then in place), unless the optimizer step wrote it there already."""
        if self.param_shard is not None:
            return self.param_shard
        piece = self.unsharded[slice(*self.param_range)]
        if self._gather_input_ready:  # the optimizer step wrote it already (`compute_weights_out`)
            self._gather_input_ready = False
        else:
            piece.copy_(self.main)
        return piece

    def finish_unshard(self) -> None:
        """Make the compute stream wait for an in-flight gather (and for the last step's new weights)."""
        self.wait_for_publish()
        if self.state is ParamState.GATHERING:
            self.streams.wait("compute", self._gather_event)
            self._gather_event = None
            self.state = ParamState.UNSHARDED

    def reshard(self) -> None:
        """Free the unsharded parameters (only where they are sharded), after any gather into them."""
        self.finish_unshard()
        if self.transient_unsharded and self.state is ParamState.UNSHARDED:
            self.unsharded.untyped_storage().resize_(0)
            self.state = ParamState.SHARDED

    # -- gradients (`grads` does the work; the main params' `.grad` are set here) -------------

    def expose_grads(self, pieces: list[MainParam], copy: bool) -> None:
        """Point the `.grad` of `pieces` (this group's) at their part of the reduced gradient.

        With an fp32 reduction the `.grad` is a view and costs nothing, so it is set
        as soon as backward ends. With another reduce dtype it must be an fp32 copy
        (an optimizer steps fp32 main params): `copy=True` makes it, which is done only
        right before the optimizer step, so the copy is not held through the rest of
        the step; none for a piece whose optimizer reads the buffer in the reduce dtype
        itself (`reads_reduced_grad`). Offloaded, `copy=True` stages the reduced gradient
        in host memory.
        """
        if not self.grads.holds:
            return
        if self.offload:
            if copy:
                self._stage_grads_on_host(pieces)
            return
        # A piece whose optimizer reads the buffer needs no copy; a bf16 main param (remainders) takes no fp32 `.grad`.
        direct = self.grads.reduce_dtype != torch.float32 or self.remainder is not None
        if direct and not copy:
            return
        for piece in pieces:  # an empty piece gets an empty gradient: every rank has one under every name
            if piece.param.grad is None and not (direct and piece.reads_reduced_grad):
                piece.param.grad = piece.grad_view()

    def start_host_grad_copy(self) -> None:
        """Offload, after the step's last reduction into this group: copy its reduced gradient to the host now, on
        the host stream, so the copy overlaps the backward of the units still to come (they are earlier ones:
        `offload_plan` offloads the last units first). Not while clipping binds: a copy made before the clip
        would need a pass over host memory to be scaled, which costs more than the transfer it hides."""
        if not self.offload or not self.grads.holds or not self._early_host_copy:
            return
        host = self._host_grad_buffer()
        pending = self.grads.pending
        ready = pending.event if pending is not None else self.streams.record("compute")
        with self.streams.side("host"):
            self.streams.wait("host", ready)
            host.copy_(self.grads.main_grad, non_blocking=True)
            self._host_grad_event = self.streams.record("host")
        self._host_grad_fresh = True

    def scale_host_grads(self, coef: torch.Tensor, ranges: list[tuple[int, int]] | None) -> None:
        """Clipping multiplies the device gradient by `coef`: do the same to a host copy already made (the whole
        optimizer range, or `ranges` of it), and keep the device copy untouched until the transfer has read it.
        The same fp32 multiply on the host gives the same bits; a coefficient of 1 (the clip did not bind)
        changes nothing and costs no host pass. Whether it bound decides whether the next step copies early."""
        if not self.offload:
            return
        value = float(coef.item())
        self._early_host_copy = value == 1.0
        if not self._host_grad_fresh:
            return
        self.streams.wait("compute", self._host_grad_event)
        if value == 1.0:
            return
        self.wait_for_host_grads()
        for lo, hi in ranges or [(0, self._host_grad.numel())]:
            self._host_grad[lo:hi].mul_(value)

    def wait_for_host_grads(self) -> None:
        """Block the host until this group's gradient copy to host memory is complete (offload)."""
        event = self._host_grad_event
        if event is not None and hasattr(event, "synchronize"):
            event.synchronize()

    def _host_grad_buffer(self) -> torch.Tensor:
        if self._host_grad is None:
            self._host_grad = _host_empty(self.main.numel(), self.device)
        return self._host_grad

    def _stage_grads_on_host(self, pieces: list[MainParam]) -> None:
        """Offload: the reduced gradient of the optimizer range in host memory (copied now, asynchronously, unless
        `start_host_grad_copy` already did; `wait_for_host_grads` before the optimizer reads it), and `pieces`
        pointed at it."""
        if not self._host_grad_fresh:
            self._host_grad_buffer().copy_(self.grads.main_grad, non_blocking=True)
            self._host_grad_event = self.streams.record("compute")
            self._host_grad_fresh = True
        for piece in pieces:
            if piece.holds:
                numel = piece.stop - piece.start
                piece.param.grad = self._host_grad[piece.offset : piece.offset + numel].view(piece.param.shape)

    def release_grads(self) -> None:
        """Drop every main param's `.grad` and free the gradient buffer (after any reduction into it, and after the
        copy of it to the host)."""
        for piece in self.main_params:
            piece.param.grad = None
        if self._host_grad_event is not None:
            self.streams.wait("compute", self._host_grad_event)
        self._host_grad_event, self._host_grad_fresh = None, False
        if self._stepped is not None:  # the optim stream may still read the buffer: freed once compute waited
            self._free_grads_after_step = True
        else:
            self.grads.free()

    # -- after the optimizer step ----------------------------------------------------

    def publish_main_weights(self) -> None:
        """Make the updated fp32 piece the weights the next forward computes with.

        Where a compute-dtype parameter shard is kept, the new piece is cast into
        it and then gathered over the axes with replicated parameters but a
        sharded optimizer (HFSDP's outer axis, ZeRO-1/2). That gather runs on
        the gather stream: it overlaps the update of the groups after this one
        and the next forward, which waits for it only when this group's unit
        runs (`finish_unshard`). Where no shard is kept, the next gather casts
        `main` itself, so there is nothing to do but refresh parameters that are
        still unsharded (the root after a forward without backward).
        """
        written, self._compute_weights_written = self._compute_weights_written, False
        if self.param_shard is not None:
            lo = self.param_range[0]
            piece = self.param_shard[FlatLayout.within(self.param_range, self.optim_range)]
            if piece.data_ptr() != self.main.data_ptr() and not written and not self.offload:
                self._wait_for_step()
                piece.copy_(self.main)  # fp32 compute steps the shard in place
            if self.offload or self.plan.post_step_gather:
                ready = self.streams.record("compute")  # nothing queued on compute still reads the old shard
                with self.streams.side("gather"):
                    self.streams.wait("gather", ready)
                    self.streams.wait("gather", self._stepped)
                    if self.offload:  # from pinned host memory, cast on the device; overlaps the next forward
                        piece.copy_(self.main.to(self.device, non_blocking=True))
                    if self.fp8_outer:
                        self._gather_fp8_outer(piece)
                    elif self.plan.post_step_gather:
                        sharded = self.layout.sharded_axes(State.OPTIM)
                        self.comms.gather(piece, sharded, self.plan.post_step_gather, self.param_shard, lo)
                    self._new_weights = self.streams.record("gather")
        if self.param_shard is None:
            self._gather_input_ready = written  # else stale: a write outside the step (a load) came after it
        if self.fp8 is not None and not self.fp8_outer:  # quantize the new piece now, overlapping what follows
            ready = self.streams.record("compute")
            with self.streams.side("gather"):
                self.streams.wait("gather", ready)
                self.streams.wait("gather", self._stepped)
                self.fp8.refresh(self._fp8_source())
                self._new_weights = self.streams.record("gather")
        if self.transient_unsharded and self.state is ParamState.UNSHARDED:
            self.state = ParamState.SHARDED  # stale: gather again (the storage is still there)
            self.start_unshard()  # on the gather stream, after the gather above

    def _gather_fp8_outer(self, piece: torch.Tensor) -> None:
        """HFSDP's post-step gather of an fp8 group (on the gather stream): quantize the optimizer piece `piece`
        (the amaxes over every axis that shards the optimizer) and gather the fp8 bytes into the fp8 parameter piece,
        which the next forward's gather takes as it is. The compute-dtype shard outside `piece` is stale until a
        reader asks for it (`compute_shard`)."""
        sharded = self.layout.sharded_axes(State.OPTIM)
        self.fp8.refresh(piece, self.optim_range, sharded)
        fp8_piece = self.fp8.shard[FlatLayout.within(self.param_range, self.optim_range)].view(torch.uint8)
        shard = self.fp8.shard.view(torch.uint8)
        self.comms.gather(fp8_piece, sharded, self.plan.post_step_gather, shard, self.param_range[0])
        self._param_shard_stale = True

    def compute_weights_out(self, prestage: bool) -> torch.Tensor | None:
        """Where an optimizer that writes the new weights in the compute dtype as it steps (`FusedAdamW`) may put
        them: a tensor aligned with `main` (the optimizer range), or None where nothing needs them.

        Where a compute-dtype shard is kept (HFSDP's outer axis, ZeRO-1/2) it is that shard's optimizer range:
        `publish_main_weights` then skips its own cast. Where none is kept (ZeRO-3, HSDP, one GPU) the next gather
        casts `main` into its input slot; with `prestage` the slot's storage is allocated now and returned, so
        the step writes it and that gather skips the cast (2 bytes per element held from the step to the unit's
        forward, in exchange for the 6-byte cast). The caller writes every element of it, padding included, and
        then calls `compute_weights_written`.
        """
        if self.offload or self.compute_dtype == self.main_dtype or self.main.device != self.device:
            return None  # (compute in the masters' dtype, or remainders: the step writes the weights themselves)
        if self.param_shard is not None:
            return self.param_shard[FlatLayout.within(self.param_range, self.optim_range)]
        if self.fp8 is not None:  # an fp8 group quantizes the step's compute-dtype weights before its gather
            if not prestage:
                return None
            self.fp8.staged = torch.empty(self.main.numel(), dtype=self.compute_dtype, device=self.device)
            return self.fp8.staged
        if not prestage or self.state is ParamState.GATHERING:
            return None
        if self.state is ParamState.SHARDED:  # allocated on the compute stream, which the step runs on
            self.unsharded.untyped_storage().resize_(self.padded * self.unsharded.element_size())
        return self.unsharded[slice(*self.param_range)]

    def compute_weights_written(self) -> None:
        """The tensor `compute_weights_out` returned holds this step's new weights (consumed by the next publish)."""
        self._compute_weights_written = True

    def compute_optim_piece(self) -> torch.Tensor:
        """This rank's optimizer piece in the compute dtype (what a checkpoint's "model" copy holds); never a
        collective."""
        self.wait_for_publish()
        if self.param_shard is not None:
            return self.param_shard[FlatLayout.within(self.param_range, self.optim_range)]
        return self.main.to(self.compute_dtype)

    def compute_shard(self) -> torch.Tensor:
        """This rank's parameter piece in the compute dtype (a fresh cast of `main` where none is kept). Collective
        for an fp8 group whose post-step gather moved fp8 (`fp8_outer`): the compute-dtype piece is gathered then,
        by every rank (its one reader, `Sharding.sharded_buffers`, runs on every rank in group order)."""
        self.wait_for_publish()
        if self._param_shard_stale:
            piece = self.param_shard[FlatLayout.within(self.param_range, self.optim_range)]
            sharded = self.layout.sharded_axes(State.OPTIM)
            self.comms.gather(piece, sharded, self.plan.post_step_gather, self.param_shard, self.param_range[0])
            self._param_shard_stale = False
        return self.param_shard if self.param_shard is not None else self.main.to(self.compute_dtype)

    @contextmanager
    def step_on_optim_stream(self, inputs: tuple[torch.Tensor, ...]):
        """Run the optimizer's kernels for this group inside on the optim stream, overlapping the next forward.

        Everything the step reads or writes must exist before (allocated on compute: the optim stream starts
        after an event recorded on entry); `inputs` (the gradient and clip coefficient tensors it reads) stay
        referenced until compute has waited on the step. The next forward's gather of this group waits for the
        step on the gather stream and its compute on the compute stream (`wait_for_publish`), and so does every
        reader of the weights that calls `Sharding.wait_for_weights` first (state dicts, checkpoints).
        """
        ready = self.streams.record("compute")
        with self.streams.side("optim"):
            self.streams.wait("optim", ready)
            yield
            self._stepped = self.streams.record("optim")
        self._step_inputs = inputs

    def _wait_for_step(self) -> None:
        """Make compute wait for an optimizer step on the optim stream; then what it read may be freed."""
        if self._stepped is None:
            return
        self.streams.wait("compute", self._stepped)
        self._stepped, self._step_inputs = None, ()
        if self._free_grads_after_step:
            self._free_grads_after_step = False
            self.grads.free()

    def wait_for_publish(self) -> None:
        """Make compute wait for the step and the post-step gather of new weights, before anything reads them."""
        self._wait_for_step()
        if self._new_weights is not None:
            self.streams.wait("compute", self._new_weights)
            self._new_weights = None
            if self.fp8 is not None:
                self.fp8.reading = None  # what the gather stream quantized from: free once compute waited

    def state_bytes(self) -> int:
        """Model-state bytes on this rank's device as the memory model counts them: the compute-dtype parameter
        shard where one is kept, the gradient piece, the fp32 main weights where they are neither that shard
        nor offloaded to host memory, and the masters' 16-bit remainders where they are kept as the shard plus
        those (`main_dtype` is then the shard's)."""
        shard = 0 if self.param_shard is None else self.param_shard.numel() * self.param_shard.element_size()
        grad = 0 if self.frozen else (self.grad_range[1] - self.grad_range[0]) * self.grads.reduce_dtype.itemsize
        separate = self.compute_dtype != self.main_dtype and not self.offload
        main = self.main.numel() * self.main.element_size() if separate else 0
        fp8 = 0 if self.fp8 is None else self.fp8.state_bytes()
        remainder = 0 if self.remainder is None else self.remainder.numel() * self.remainder.element_size()
        return shard + grad + main + fp8 + remainder


def _point(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make `param` (the same Python object) a view of `view`. `.data =` cannot move a tensor off the meta device,
    so there the parameter's contents are swapped with a new one's (`torch.utils.swap_tensors`), attributes kept."""
    if param.device.type != view.device.type:  # an empty stand-in of its own: `.data =` then keeps its version counter
        fresh = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device), requires_grad=param.requires_grad)
        fresh.__dict__.update(param.__dict__)
        torch.utils.swap_tensors(param, fresh)
    param.data = view


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in host memory, page-locked when it comes from a GPU (so copies back run asynchronously);
    allocated page-locked at once, without a pageable copy first."""
    host = _host_empty(tensor.numel(), tensor.device, tensor.dtype).view(tensor.shape)
    host.copy_(tensor)
    return host


def _host_empty(numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised host buffer, page-locked (at its exact size: `host_memory`) when the group lives on a GPU."""
    return page_locked_empty(numel, dtype) if device.type == "cuda" else torch.empty(numel, dtype=dtype)
