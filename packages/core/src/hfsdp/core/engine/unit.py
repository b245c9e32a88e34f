"""One unit's lifecycle: unshard, run, reshard, reduce.

States of a unit during one microbatch, driven by module and autograd hooks:

    SHARDED --pre-forward--> UNSHARDED --post-forward--> SHARDED (the root stays UNSHARDED by default)
            --pre-backward (grad of an output)--> UNSHARDED
            --post-backward (grad of an input, or end of backward)--> grads reduced, SHARDED

While a unit computes (from pre-forward to post-forward, and from pre-backward to
post-backward) its modules hold the compute parameters; otherwise they hold the
rank's main params, what an optimizer steps (`FlatParamGroup.hold_*`).

Post-backward fires when the gradient with respect to the unit's inputs is
ready. The autograd engine runs gradient accumulation before any other ready
node, so at that point every parameter gradient of the unit has arrived. Units
whose inputs need no gradient (the root) are finished by the engine's
end-of-backward callback, in a fixed order, so every rank issues the same
collectives in the same order.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from hfsdp.core.buffers.flat_group import FlatParamGroup
from hfsdp.core.engine.step import StepContext


def _grad_tensors(tree) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


class ShardedUnit:
    """Hooks that move one module's parameter groups through their states."""

    def __init__(
        self,
        module: nn.Module,
        groups: list[FlatParamGroup],
        step: StepContext,
        *,
        reshard_after_forward: bool,
        input_dtype: torch.dtype | None = None,
    ):
        self.module, self.groups, self.step = module, groups, step
        self.reshard_after_forward = reshard_after_forward
        self.input_dtype = input_dtype  # floating inputs are cast to the compute dtype (root only)
        self.reduced = True  # nothing pending before the first backward
        # The unit whose gather to start when this one starts, in each direction: `link`ed once all units exist.
        self.prefetch_forward: ShardedUnit | None = None
        self.prefetch_backward: ShardedUnit | None = None
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True, prepend=True)
        module.register_forward_hook(self._post_forward)

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

    def _pre_forward(self, module, args, kwargs):
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

    def _post_forward(self, module, args, output):
        if self.reshard_after_forward:
            self.reshard()
        else:  # the parameters stay gathered for backward, but outside compute the modules hold the main params
            for group in self.groups:
                group.hold_main_params()
        outputs = _grad_tensors(output)
        if outputs:
            register_multi_grad_hook(outputs, self._pre_backward_hook, mode="any")
        return output

    def _pre_backward_hook(self, grad) -> None:
        self.step.enter_backward()
        self._unshard_and_prefetch(self.prefetch_backward)

    def _post_backward_hook(self, grad) -> None:
        self.post_backward()

    def post_backward(self) -> None:
        """Move this microbatch's gradients into the flat buffers and free the parameters."""
        if self.reduced:
            return
        scale, last = self.step.grad_scale, self.step.is_last
        for group in self.groups:
            group.grads.accumulate(scale, last)
            if last:
                group.start_host_grad_copy()  # offloaded groups only: to the host while backward goes on
        self.reshard()
        self.reduced = True
