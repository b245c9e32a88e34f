"""One unit's lifecycle: unshard, run, reshard, reduce.

States of a unit during one microbatch, driven by the unit's call and by autograd hooks:

    SHARDED --pre-forward--> UNSHARDED --post-forward--> SHARDED (the root stays UNSHARDED by default)
            --pre-backward (grad of an output)--> UNSHARDED
            --post-backward (grad of an input, or end of backward)--> grads reduced, SHARDED

While a unit computes (from pre-forward to post-forward, and from pre-backward to
post-backward) its modules hold the compute parameters; otherwise they hold the
rank's main params, what an optimizer steps (`FlatParamGroup.hold_*`).

Pre- and post-forward run around the module's whole call (`UnitCall.__call__`), not as
forward hooks: `module.compile()` compiles the module's `_call_impl`, forward hooks
included, and a hook traced into a compiled graph loses what makes it correct (the
side-stream gathers, their events, the storage resizes become graph ops that the
compiler is free to reorder; on a GPU that trained wrong, non-deterministic weights).
Around the call, outside `_call_impl`, they stay eager whichever way the user compiles:
`module.compile()` (with `fullgraph=True` too), `torch.compile(module)`, a compiled
`forward`, or a compiled model around the units. Each entry point is also hidden from
TorchDynamo (`torch.compiler.disable`), so a compiled region that reaches a unit breaks
its graph there and runs the engine's work eagerly, as FSDP2 does with its hooks.

Post-backward fires when the gradient with respect to the unit's inputs is
ready. The autograd engine runs gradient accumulation before any other ready
node, so at that point every parameter gradient of the unit has arrived. Units
whose inputs need no gradient (the root) are finished by the engine's
end-of-backward callback, in a fixed order, so every rank issues the same
collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from hfsdp.core.buffers.flat_group import FlatParamGroup
from hfsdp.core.engine.step import StepContext

#: Where a unit module keeps its `ShardedUnit` (in its `__dict__`, beside its parameters and submodules).
UNIT_ATTRIBUTE = "_hfsdp_unit"
#: Where a sharded model keeps its engine state (`sharding.Sharding`), in its `__dict__`.
SHARDING_ATTRIBUTE = "_hfsdp_sharding"


def _grad_tensors(tree) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


class UnitCall:
    """What a unit module's class gains (mixed in before its own class, as the root's `HFSDPModule` is): a call that
    gathers the unit's parameters before the module's own call and frees them after.

    The frame is hidden from TorchDynamo but not what it calls (`recursive=False`): under `torch.compile(module)`
    or a compiled model, the module's own forward below it is still compiled, with `fullgraph=True` too, while
    the engine's work before and after it runs eagerly."""

    @torch.compiler.disable(recursive=False)
    def __call__(self, *args, **kwargs):
        unit = self.__dict__[UNIT_ATTRIBUTE]
        args, kwargs = unit.pre_forward(args, kwargs)
        return unit.post_forward(super().__call__(*args, **kwargs))


_UNIT_CLASSES: dict[type, type] = {}


def unit_class(cls: type) -> type:
    """`cls` with `UnitCall` mixed in (one class per original class, as FSDP2 makes one per sharded class)."""
    if issubclass(cls, UnitCall):
        return cls
    if cls not in _UNIT_CLASSES:
        _UNIT_CLASSES[cls] = type(f"HFSDPUnit{cls.__name__}", (UnitCall, cls), {"__module__": cls.__module__})
    return _UNIT_CLASSES[cls]


class ShardedUnit:
    """The engine's work around one module's forward and backward: moves its parameter groups through their states."""

    def __init__(
        self,
        module: nn.Module,
        groups: list[FlatParamGroup],
        step: StepContext,
        *,
        reshard_after_forward: bool,
        input_dtype: torch.dtype | None = None,
        before_forward: Callable[[], None] | None = None,
    ):
        self.module, self.groups, self.step = module, groups, step
        self.before_forward = before_forward  # a check the root runs first (`Sharding.check_before_forward`)
        self.reshard_after_forward = reshard_after_forward
        self.input_dtype = input_dtype  # floating inputs are cast to the compute dtype (root only)
        self.reduced = True  # nothing pending before the first backward
        # The unit whose gather to start when this one starts, in each direction: `link`ed once all units exist.
        self.prefetch_forward: ShardedUnit | None = None
        self.prefetch_backward: ShardedUnit | None = None
        if UNIT_ATTRIBUTE in module.__dict__:
            raise ValueError(
                f"{type(module).__name__} is already a unit of an hfsdp-sharded model; pass each module once in "
                "units=, and call fully_shard once per model."
            )
        module.__dict__[UNIT_ATTRIBUTE] = self  # its class gains `UnitCall` (the root's: through `HFSDPModule`)

    def link(self, forward: ShardedUnit | None, backward: ShardedUnit | None) -> None:
        """Name the units that run right after this one in forward and in backward."""
        self.prefetch_forward, self.prefetch_backward = forward, backward

    def start_unshard(self) -> None:
        """Issue this unit's gathers without waiting for them (prefetch)."""
        for group in self.groups:
            group.start_unshard()

    def _unshard_and_prefetch(self, following: ShardedUnit | None) -> None:
        """Wait for this unit's parameters, then start the next unit's gather so it overlaps our compute."""
        self.start_unshard()
        if following is not None:
            following.start_unshard()
        for group in self.groups:
            group.finish_unshard()
            group.hold_compute_params()

    def reshard(self) -> None:
        for group in self.groups:
            group.reshard()
            group.hold_main_params()

    @torch.compiler.disable
    def pre_forward(self, args, kwargs):
        if self.before_forward is not None:
            self.before_forward()
        self._unshard_and_prefetch(self.prefetch_forward)
        if self.input_dtype is not None:
            args, kwargs = tree_map(self._cast, (args, kwargs))
        if torch.is_grad_enabled():
            self.reduced = False
            inputs = _grad_tensors((args, kwargs))
            if inputs:
                register_multi_grad_hook(inputs, self._post_backward_hook, mode="any")
        return args, kwargs

    def _cast(self, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.input_dtype)
        return value

    @torch.compiler.disable
    def post_forward(self, output):
        if self.reshard_after_forward:
            self.reshard()
        else:  # the parameters stay gathered for backward, but outside compute the modules hold the main params
            for group in self.groups:
                group.hold_main_params()
        outputs = _grad_tensors(output)
        if outputs:
            register_multi_grad_hook(outputs, self._pre_backward_hook, mode="any")
        return output

    @torch.compiler.disable
    def _pre_backward_hook(self, grad) -> None:
        self.step.enter_backward()
        self._unshard_and_prefetch(self.prefetch_backward)

    @torch.compiler.disable
    def _post_backward_hook(self, grad) -> None:
        self.post_backward()

    def post_backward(self) -> None:
        """Move this microbatch's gradients into the flat buffers and free the parameters."""
        if self.reduced:
            return
        scale, last = self.step.grad_scale, self.step.is_last
        for group in self.groups:
            if group.frozen:  # no gradient to reduce
                continue
            group.grads.accumulate(scale, last)
            if last:
                group.start_host_grad_copy()  # offloaded groups only: to the host while backward goes on
        self.reshard()
        self.reduced = True
