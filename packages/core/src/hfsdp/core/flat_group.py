"""One unit's parameters of one mesh, in flat padded buffers.

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
- `grad_buffer` (reduce dtype): the gradient piece accumulated between
  microbatches; after the last microbatch its optimizer range holds the reduced
  gradient. It exists from a step's first backward until the step consumes it.

With `offload`, `main` (and so the optimizer and its state) lives in host memory:
the compute-dtype shard is always kept on the device, the reduced gradient is
copied to the host before the optimizer step, and the new piece copied back after.

Padding makes every piece equal on every axis, so collectives never see uneven
sizes. Padding starts at zero and stays zero: its gradient is zero, so
elementwise optimizers leave it at zero, and no parameter view, main param or
checkpoint ever covers it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hfsdp.core import collectives as comm
from hfsdp.core.comm_plan import plan_for
from hfsdp.core.layout import MeshLayout
from hfsdp.core.placement import State
from hfsdp.core.streams import SyncStreams


@dataclass(frozen=True)
class MixedPrecision:
    """Compute dtype of parameters (None keeps each parameter's own) and gradient-reduction dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        # Gradients are summed unscaled and each rank's reduced piece is scaled once per step, so the reduction
        # needs fp32's range: an fp16 sum over microbatches and ranks could overflow where the mean would not.
        if self.reduce_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"MixedPrecision(reduce_dtype={self.reduce_dtype}) is not supported: hfsdp sums gradients over "
                "microbatches and ranks before scaling them to the mean, which needs the range of float32; use "
                "reduce_dtype=torch.float32 (or torch.bfloat16, which has the same range)."
            )


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its group's flat buffers."""

    name: str
    param: nn.Parameter
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return self.shape.numel()


class FlatParamGroup:
    """The flat buffers and the collectives of one (unit, mesh, dtype)."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        mesh: DeviceMesh,
        layout: MeshLayout,
        mp: MixedPrecision,
        streams=None,
        offload: bool = False,
    ):
        self.mesh, self.layout, self.plan = mesh, layout, plan_for(layout)
        self.offload = offload
        self.streams = streams or SyncStreams()
        self.is_expert = False  # set by the model: which mesh this group is on
        self.unit_index = 0  # set by the model: position of the owning unit (root last)
        self.coord = tuple(mesh.get_coordinate())
        self.process_groups = [mesh.get_group(name) for name in layout.names]
        self.slots: list[ParamSlot] = []
        offset = 0
        for name, param in named_params:
            self.slots.append(ParamSlot(name, param, param.shape, offset))
            offset += param.numel()
        self.numel = offset
        self.padded = layout.padded_numel(offset)
        self.param_range = layout.shard_range(State.PARAM, self.coord, self.padded)
        self.grad_range = layout.range_over(self.plan.microbatch_reduce, self.coord, self.padded)
        self.optim_range = layout.shard_range(State.OPTIM, self.coord, self.padded)
        source = named_params[0][1]
        self.compute_dtype = mp.param_dtype or source.dtype
        self.reduce_dtype = mp.reduce_dtype
        device = source.device

        full = torch.zeros(self.padded, dtype=torch.float32, device=device)
        with torch.no_grad():
            for slot in self.slots:
                full[slot.offset : slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
        self.param_shard: torch.Tensor | None = None
        if self.compute_dtype == torch.float32 and not offload:
            # fp32 compute: the optimizer steps the parameter shard itself (its piece is a sub-range).
            self.param_shard = full[slice(*self.param_range)].clone()
            lo = self.param_range[0]
            self.main = self.param_shard[self.optim_range[0] - lo : self.optim_range[1] - lo]
        else:
            main = full[slice(*self.optim_range)]
            self.main = _to_host(main) if offload else main.clone()
            if offload or self.param_range != self.optim_range:  # offloaded: gathers must not read host memory
                self.param_shard = full[slice(*self.param_range)].to(self.compute_dtype, copy=True)
        del full
        self._host_grad: torch.Tensor | None = None  # offload: where the reduced gradient goes for the optimizer
        self.main_params: list = []  # set by the model: the MainParams aliasing `main`
        # Whether `unsharded` is built (gathered, or cast from `main`) each time the unit runs.
        self.transient_unsharded = bool(self.plan.param_gather) or self.param_shard is None
        if self.transient_unsharded:
            self.unsharded = torch.empty(self.padded, dtype=self.compute_dtype, device=device)
        else:
            self.unsharded = self.param_shard
        for slot in self.slots:
            slot.param.data = self.unsharded[slot.offset : slot.offset + slot.numel].view(slot.shape)
        self.is_unsharded = True
        self._gathering, self._gather_event = False, None  # a gather in flight, and its event
        self._publish_event = None  # the post-step gather of new weights, until compute has waited on it
        self.reshard()
        self.device = device
        self._grad_buffer: torch.Tensor | None = None  # allocated by the first backward, freed by zero_grad
        self._reduction_in_flight: tuple = ()  # (event, tensors the reduce stream still reads)

    # -- parameters ------------------------------------------------------------------

    def unshard(self) -> None:
        """Gather the parameters into `unsharded` and make compute wait for them."""
        self.start_unshard()
        self.finish_unshard()

    def start_unshard(self) -> None:
        """Allocate `unsharded` (on the compute stream) and gather into it on the gather stream."""
        if self.is_unsharded or self._gathering:
            return
        self.unsharded.untyped_storage().resize_(self.padded * self.unsharded.element_size())
        allocated = self.streams.record("compute")
        with self.streams.side("gather"):
            self.streams.wait("gather", allocated)
            piece = self.param_shard
            if piece is None:  # cast the main weights into this rank's slot: the gather is then in place
                piece = self.unsharded[slice(*self.param_range)]
                piece.copy_(self.main)
            axes = self.layout.sharded_axes(State.PARAM)
            self._gather(piece, axes, self.plan.param_gather, self.unsharded, 0)
            self._gather_event = self.streams.record("gather")
        self._gathering = True

    def finish_unshard(self) -> None:
        """Make the compute stream wait for an in-flight gather (and for the last step's new weights)."""
        self.wait_for_publish()
        if self._gathering:
            self.streams.wait("compute", self._gather_event)
            self._gather_event, self._gathering = None, False
            self.is_unsharded = True

    def reshard(self) -> None:
        """Free the unsharded parameters (only where they are sharded), after any gather into them."""
        self.finish_unshard()
        if self.transient_unsharded and self.is_unsharded:
            self.unsharded.untyped_storage().resize_(0)
            self.is_unsharded = False

    def _gather(self, piece, sharded, axes, out: torch.Tensor, out_start: int) -> None:
        """All-gather `piece` over `axes`, outer first, growing it inside `out` (which starts at `out_start`).

        Each step's input is already in its own slot of the step's output, which
        is the in-place all-gather both NCCL and gloo support.
        """
        sharded = list(sharded)
        for k in axes:
            sharded.remove(k)
            start, stop = self.layout.range_over(tuple(sharded), self.coord, self.padded)
            target = out[start - out_start : stop - out_start]
            comm.all_gather(target, piece, self.process_groups[k], self.layout.names[k])
            piece = target

    # -- gradients -------------------------------------------------------------------

    @property
    def grad_buffer(self) -> torch.Tensor:
        """The gradient piece (reduce dtype); exists from the first backward of a step until `zero_grad`.

        Not holding it between steps keeps it out of the forward's activation peak,
        as FSDP2 does by setting gradients to None.
        """
        if self._grad_buffer is None:
            length = self.grad_range[1] - self.grad_range[0]
            self._grad_buffer = torch.zeros(length, dtype=self.reduce_dtype, device=self.device)
        return self._grad_buffer

    def accumulate_grads(self, scale: float, last: bool = True) -> None:
        """Move this microbatch's parameter grads into the flat buffers and reduce; scale once per step.

        Gradients enter the buffers as they are: an upcast copy on a step's first
        microbatch, an add after it. Reduce-scatters over the inner axis where
        gradients are sharded (every microbatch); elsewhere gradients accumulate
        unreduced. On the `last` microbatch of the step the once-per-step
        reductions over the remaining axes follow straight away (inner first), so
        that an HSDP all-reduce or an HFSDP outer reduce-scatter overlaps the
        backward of earlier units instead of running after the whole backward.
        Then this rank's optimizer piece, now the sum over microbatches and ranks,
        is multiplied by `scale` (the mean-loss factor): one pass over 1/s_o of
        the elements per step, instead of a broadcast multiply (which does not
        vectorise) over every element on every microbatch. Everything runs on the
        reduce stream; `release_reduction` makes compute wait for it.
        """
        self.release_reduction()
        inputs: list[torch.Tensor] = []
        microbatch = None
        if self.plan.microbatch_reduce:
            flat = self._written_grads()
            first = self._grad_buffer is None
            if first:  # the first microbatch reduce-scatters straight into a fresh buffer
                length = self.grad_range[1] - self.grad_range[0]
                self._grad_buffer = torch.empty(length, dtype=self.reduce_dtype, device=self.device)
            reduced = self._grad_buffer if first else torch.empty_like(self._grad_buffer)
            microbatch = (flat, reduced, first)
            inputs += [flat, reduced]
        elif self._grad_buffer is None:  # the step's first microbatch writes its gradients: nothing to add them to
            self._grad_buffer = self._written_grads()
        else:
            self._fill(self._grad_buffer, accumulate=True)
        steps = self._final_steps() if last else []
        rescale = last and scale != 1.0
        if microbatch is None and not steps:
            if rescale:
                self.main_grad.mul_(scale)
            return
        filled = self.streams.record("compute")  # after every allocation above: the reduce stream may write them
        with self.streams.side("reduce"):
            self.streams.wait("reduce", filled)
            if microbatch is not None:
                flat, reduced, first = microbatch
                (k,) = self.plan.microbatch_reduce
                comm.reduce_scatter(reduced, flat, self._group(k), self._name(k))
                if not first:
                    self._grad_buffer.add_(reduced)
            for k, view, out, target in steps:
                if out is None:
                    comm.all_reduce(view, self._group(k), self._name(k))
                else:
                    comm.reduce_scatter(out, view, self._group(k), self._name(k))
                    target.copy_(out)
                    inputs.append(out)
            if rescale:
                self.main_grad.mul_(scale)
            self._reduction_in_flight = (self.streams.record("reduce"), *inputs)

    def _final_steps(self) -> list[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """The once-per-step reductions as (axis, input view, output or None for all-reduce, copy target).

        Outputs are allocated here, on the compute stream, before the reduce
        stream is allowed to run. Each reduce-scatter narrows the buffer range
        that holds this rank's gradient; the last one ends on the optimizer range.
        """
        lo, hi = self.grad_range
        current = (lo, hi)
        sharded = list(self.plan.microbatch_reduce)
        steps = []
        for k, op in self.plan.final_reduce:
            view = self.grad_buffer[current[0] - lo : current[1] - lo]
            if op == "all_reduce":
                steps.append((k, view, None, None))
                continue
            sharded.append(k)
            start, stop = self.layout.range_over(tuple(sharded), self.coord, self.padded)
            out = torch.empty(stop - start, dtype=view.dtype, device=view.device)
            steps.append((k, view, out, self.grad_buffer[start - lo : stop - lo]))
            current = (start, stop)
        assert current == self.optim_range, f"reduction ends on {current}, optimizer owns {self.optim_range}"
        return steps

    def release_reduction(self) -> None:
        """Make compute wait for this group's in-flight reduction, then drop the buffers it reads."""
        if self._reduction_in_flight:
            self.streams.wait("compute", self._reduction_in_flight[0])
            self._reduction_in_flight = ()

    def _written_grads(self) -> torch.Tensor:
        """A new padded buffer of the reduction dtype holding this microbatch's grads (and zero padding)."""
        flat = torch.empty(self.padded, dtype=self.reduce_dtype, device=self.device)
        flat[self.numel :].zero_()
        self._fill(flat, accumulate=False)
        return flat

    def _fill(self, flat: torch.Tensor, accumulate: bool) -> None:
        """Write (or add) each parameter's grad into its slot, upcast to the reduction dtype; then drop the grads.

        Writing, when every parameter has a grad, is one `torch._foreach_copy_` for
        the whole group: on an H200 it moved a Llama layer's gradients at 3.1 TB/s
        with 0.03 ms of host time, against 1.7 TB/s and 0.10 ms for a `copy_` per
        parameter and 1.0 TB/s and 0.29 ms for `torch._chunk_cat`
        (`bench/bench_grad_copy.py`). Otherwise one kernel per parameter; slots of
        parameters without a grad are zeroed when writing.
        """
        grads = [slot.param.grad for slot in self.slots]
        views = [flat[slot.offset : slot.offset + slot.numel] for slot in self.slots]
        if not accumulate and all(g is not None for g in grads):
            torch._foreach_copy_(views, [g.reshape(-1) for g in grads])
        else:
            for view, grad in zip(views, grads, strict=True):
                if grad is None:
                    if not accumulate:
                        view.zero_()
                elif accumulate:
                    view.add_(grad.reshape(-1))
                else:
                    view.copy_(grad.reshape(-1))
        for slot in self.slots:
            slot.param.grad = None

    @property
    def main_grad(self) -> torch.Tensor:
        """The reduced gradient of this rank's optimizer piece (a view into `grad_buffer`)."""
        lo = self.grad_range[0]
        return self.grad_buffer[self.optim_range[0] - lo : self.optim_range[1] - lo]

    @property
    def holds_grads(self) -> bool:
        return self._grad_buffer is not None

    def expose_grads(self, copy: bool) -> None:
        """Point each main param's `.grad` at its piece of the reduced gradient (after the last microbatch).

        With an fp32 reduction the `.grad` is a view and costs nothing, so it is set
        as soon as backward ends. With another reduce dtype it must be an fp32 copy
        (an optimizer steps fp32 main params): `copy=True` makes it, which the model
        does only right before the optimizer step, so the copy is not held through
        the rest of the step.
        """
        if self.offload:
            if copy:
                self._stage_grads_on_host()
            return
        if self.reduce_dtype != torch.float32 and not copy:
            return
        for piece in self.main_params:
            if piece.param.grad is None:
                piece.param.grad = piece.grad_view()

    def _stage_grads_on_host(self) -> None:
        """Offload: copy the reduced gradient of the optimizer range into host memory (asynchronously; the model
        synchronizes once for all groups before the optimizer reads it) and point the main params at it."""
        if self._host_grad is None:
            self._host_grad = _to_host(torch.empty(self.main.numel(), dtype=torch.float32, device=self.device))
        self._host_grad.copy_(self.main_grad, non_blocking=True)
        for piece in self.main_params:
            numel = piece.stop - piece.start
            piece.param.grad = self._host_grad[piece.offset : piece.offset + numel].view(piece.param.shape)

    def zero_grad(self) -> None:
        """Free the gradient buffer (after any reduction into it) and the main params' views of it; the next
        backward starts from zero."""
        self.release_reduction()
        for piece in self.main_params:
            piece.param.grad = None
        self._grad_buffer = None

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
        if self.param_shard is not None:
            lo = self.param_range[0]
            piece = self.param_shard[self.optim_range[0] - lo : self.optim_range[1] - lo]
            if piece.data_ptr() != self.main.data_ptr():  # fp32 compute steps the shard in place
                piece.copy_(self.main, non_blocking=self.offload)  # from pinned host memory when offloaded
            if self.plan.post_step_gather:
                written = self.streams.record("compute")
                with self.streams.side("gather"):
                    self.streams.wait("gather", written)
                    axes = self.layout.sharded_axes(State.OPTIM)
                    self._gather(piece, axes, self.plan.post_step_gather, self.param_shard, lo)
                    self._publish_event = self.streams.record("gather")
        if self.transient_unsharded and self.is_unsharded:
            self.is_unsharded = False
            self.start_unshard()  # on the gather stream, after the gather above

    def compute_shard(self) -> torch.Tensor:
        """This rank's parameter piece in the compute dtype (a fresh cast of `main` where none is kept)."""
        self.wait_for_publish()
        return self.param_shard if self.param_shard is not None else self.main.to(self.compute_dtype)

    def wait_for_publish(self) -> None:
        """Make compute wait for the post-step gather of new weights, before anything reads them."""
        if self._publish_event is not None:
            self.streams.wait("compute", self._publish_event)
            self._publish_event = None

    # -- helpers ---------------------------------------------------------------------

    def _group(self, k: int) -> dist.ProcessGroup:
        return self.process_groups[k]

    def _name(self, k: int) -> str:
        return self.layout.names[k]

    def state_bytes(self) -> int:
        """Model-state bytes on this rank's device as the memory model counts them: the compute-dtype parameter
        shard where one is kept, the gradient piece, and the fp32 main weights where they are neither that shard
        nor offloaded to host memory."""
        shard = 0 if self.param_shard is None else self.param_shard.numel() * self.param_shard.element_size()
        grad = (self.grad_range[1] - self.grad_range[0]) * self.reduce_dtype.itemsize
        separate = self.compute_dtype != torch.float32 and not self.offload
        main = self.main.numel() * self.main.element_size() if separate else 0
        return shard + grad + main


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in host memory, page-locked when it comes from a GPU (so copies back run asynchronously)."""
    host = tensor.to("cpu", copy=True)
    return host.pin_memory() if tensor.is_cuda else host
