"""`fully_shard`: wrap units of any module on the hybrid meshes.

The caller names the units (each transformer layer, say); the root takes every
parameter no unit claimed. Inside each unit, parameters are grouped by mesh
(dense or expert) and dtype into `FlatParamGroup`s.

Loss scaling lives here and only here: the reductions are plain sums, and after
a step's last reduction each rank's optimizer piece is multiplied by
1 / (microbatches x dp), so every layout computes the update of the mean loss
over the global batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor

from hfsdp.core.config import LayoutConfig
from hfsdp.core.dtensor import flat_dtensor
from hfsdp.core.expert_naming import ExpertNaming
from hfsdp.core.flat_group import FlatParamGroup, MixedPrecision
from hfsdp.core.main_params import build_main_params, install_step_hooks, named_main_params
from hfsdp.core.mesh import HybridMeshes
from hfsdp.core.placement import State
from hfsdp.core.streams import streams_for
from hfsdp.core.unit import ShardedUnit


def is_expert_param_default(name: str, param: nn.Parameter) -> bool:
    """megatron-core marks expert parameters with `allreduce = False`."""
    return getattr(param, "allreduce", True) is False


class ShardedModel(nn.Module):
    """A module whose parameters live in hfsdp's sharded flat buffers."""

    def __init__(
        self,
        module: nn.Module,
        config: LayoutConfig,
        meshes: HybridMeshes,
        units: Iterable[nn.Module],
        mp: MixedPrecision | None = None,
        is_expert: Callable[[str, nn.Parameter], bool] = is_expert_param_default,
        expert_naming: ExpertNaming | None = None,
        streams=None,
        offload: bool = False,
        reshard_root_after_forward: bool = False,
    ):
        super().__init__()
        self.module = module
        self.expert_naming = expert_naming
        device = next(module.parameters()).device
        self.streams = streams if streams is not None else streams_for(device)
        self.config, self.meshes = config, meshes
        self.mp = mp or MixedPrecision()
        self.offload = offload  # fp32 main weights and optimizer state in host memory
        self._num_microbatches, self._is_last = 1, True
        self._backward_queued = False
        names = {p: n for n, p in module.named_parameters()}
        claimed: set[nn.Parameter] = set()
        self.units: list[ShardedUnit] = []
        for unit_module in [*units, module]:
            params = [(names[p], p) for p in unit_module.parameters() if p not in claimed and p.requires_grad]
            claimed.update(p for _, p in params)
            groups = self._make_groups(params, is_expert)
            for group in groups:
                group.unit_index = len(self.units)
            self.units.append(
                ShardedUnit(
                    unit_module,
                    groups,
                    is_root=unit_module is module,
                    reshard_after_forward=unit_module is not module or reshard_root_after_forward,
                    grad_scale=self._grad_scale,
                    is_last_microbatch=lambda: self._is_last,
                    on_backward=self._queue_end_of_backward,
                    input_dtype=self.mp.param_dtype if unit_module is module else None,
                )
            )
        # Prefetch in execution order: forward runs root, then the units as given; backward the reverse. The
        # root's backward (the loss and the output layer: the step's largest activations and their gradients)
        # prefetches nothing: the last unit's gather starts when its own backward does, as in FSDP2, so it does
        # not sit on top of the step's memory peak (measured on one H200: 98 MiB of a Llama layer).
        order = [self.units[-1], *self.units[:-1]]
        for earlier, later in itertools.pairwise(order):
            earlier.prefetch_forward = later
            later.prefetch_backward = earlier if earlier is not self.units[-1] else None
        self.main_params = build_main_params(self, self.groups)
        for group in self.groups:
            group.main_params = [p for p in self.main_params if p.group is group]
        self._grads_complete = False  # the last backward was a step's last microbatch, not yet consumed
        install_step_hooks()

    def _make_groups(self, params, is_expert) -> list[FlatParamGroup]:
        buckets: dict[tuple[bool, torch.dtype], list] = {}
        for name, param in params:
            buckets.setdefault((is_expert(name, param), param.dtype), []).append((name, param))
        groups = []
        for (expert, _), members in buckets.items():
            if expert and self.meshes.expert is None:
                raise ValueError(
                    f"parameter '{members[0][0]}' is an expert parameter but the config has no experts; "
                    "set num_moe_experts (and ep) in the config."
                )
            mesh, layout = (
                (self.meshes.expert, self.meshes.expert_layout)
                if expert
                else (self.meshes.dense, self.meshes.dense_layout)
            )
            group = FlatParamGroup(members, mesh, layout, self.mp, self.streams, offload=self.offload)
            group.is_expert = expert
            groups.append(group)
        return groups

    # -- training-loop API -------------------------------------------------------------

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def groups(self) -> list[FlatParamGroup]:
        return [g for unit in self.units for g in unit.groups]

    def set_microbatch(self, index: int, count: int) -> None:
        """Declare the next backward as microbatch `index` of `count` in this optimizer step."""
        if not 0 <= index < count:
            raise ValueError(f"microbatch index {index} is outside 0..{count - 1}")
        self._num_microbatches, self._is_last = count, index == count - 1

    def _grad_scale(self) -> float:
        return 1.0 / (self._num_microbatches * self.config.dp)

    def _queue_end_of_backward(self) -> None:
        if not self._backward_queued:
            self._start_backward()
            self._backward_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _start_backward(self) -> None:
        """Begin a backward: the gradients of a finished step must have been consumed or discarded.

        The last microbatch reduces gradients over every axis, so nothing can be
        added to them afterwards. If `optimizer.zero_grad()` discarded them (the
        main params' `.grad` is None) the buffers are dropped here; if nothing
        did, adding this backward to them would be wrong, so it is refused.
        """
        if not self._grads_complete:
            return
        if any(p.param.grad is not None for p in self.main_params):
            raise RuntimeError(
                "backward() was called again after the last microbatch of a step, before optimizer.step() or "
                "zero_grad(): hfsdp reduced the step's gradients over all ranks on its last microbatch and cannot "
                "add to them. Call optimizer.step() (or zero_grad()) first, or declare gradient accumulation "
                "with model.set_microbatch(index, count) before each microbatch."
            )
        self.zero_grad()

    def _end_of_backward(self) -> None:
        """Finish units autograd did not (the root, unused units), then make compute wait for every reduction
        (on the last microbatch, those over all axes: the optimizer reads the gradients next, through the
        main params' `.grad`)."""
        self._backward_queued = False
        for unit in reversed(self.units):
            unit.post_backward()
        for group in self.groups:
            group.release_reduction()
        if self._is_last:
            for group in self.groups:
                group.expose_grads(copy=False)
            self._grads_complete = True

    # -- around the optimizer step (called by the global step hooks, see main_params.py) -----------------

    def before_optimizer_step(self) -> None:
        """The last step's weight gathers may still read the main weights the optimizer is about to write; main
        params whose gradient needs an fp32 copy get it now."""
        self.wait_for_weights()
        if self._grads_complete:
            for group in self.groups:
                group.expose_grads(copy=True)
            if self.offload and torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()  # the host gradients are in before the CPU reads them

    def after_optimizer_step(self) -> None:
        """Publish the new weights (collective, group order) and release the step's gradients."""
        for group in self.groups:
            group.publish_main_weights()
        self.zero_grad()

    def global_name(self, group: FlatParamGroup, name: str) -> str:
        """The layout-independent name of a parameter (experts by global index)."""
        if group.is_expert and self.expert_naming is not None:
            return self.expert_naming.to_global(name)
        return name

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Free every gradient buffer; the next backward starts a new step's gradients."""
        for group in self.groups:
            group.zero_grad()
        self._grads_complete = False

    def named_main_params(self):
        """(global name, main param) of every piece of the fp32 main weights this rank's optimizer steps."""
        return named_main_params(self)

    def wait_for_weights(self) -> None:
        """Make the current stream wait for the weights the last optimizer step published.

        The gathers of new weights run on a side stream and the next forward
        waits for each unit's own; code that reads parameters outside forward
        right after a step (an EMA, logging a norm) calls this first.
        """
        for group in self.groups:
            group.wait_for_publish()

    # -- sharded views ---------------------------------------------------------------------

    def sharded_buffers(self) -> list[dict[str, DTensor]]:
        """Each group's parameter, gradient and main-weight pieces as DTensors on its mesh."""
        self.wait_for_weights()
        out = []
        for group in self.groups:
            grad_axes = group.layout.sharded_axes(State.GRAD)
            lo = group.grad_range[0]
            start, stop = group.layout.range_over(grad_axes, group.coord, group.padded)
            out.append(
                {
                    "param": flat_dtensor(group.compute_shard(), group, State.PARAM),
                    "grad": flat_dtensor(group.grad_buffer[start - lo : stop - lo], group, State.GRAD),
                    "main": flat_dtensor(group.main, group, State.OPTIM),
                }
            )
        return out

    def state_bytes(self) -> int:
        return sum(g.state_bytes() for g in self.groups)


def fully_shard(
    module: nn.Module, config: LayoutConfig, meshes: HybridMeshes, units: Iterable[nn.Module], **options
) -> ShardedModel:
    """Shard `module` on `meshes`: each of `units` gets its own buffers, the root takes the rest.

    `options` are ShardedModel's: `mp`, `is_expert`, `expert_naming`, `streams`, `offload` (keep the fp32
    main weights and the optimizer state in host memory; the optimizer steps there), and
    `reshard_root_after_forward`. By default the root keeps its parameters from forward through backward, as
    FSDP2's does by default: when the loss is computed inside the model (a megatron GPT), backward needs them at
    once. When the loss is computed outside (a transformers model's logits), resharding the root frees its
    parameters while the loss and its gradient peak, at the price of gathering them again for backward.
    """
    return ShardedModel(module, config, meshes, units, **options)
