"""One unit's lifecycle: unshard, run, reshard, reduce.

States of a unit during one microbatch, driven by module and autograd hooks:

    SHARDED --pre-forward--> UNSHARDED --post-forward--> SHARDED (the root stays UNSHARDED by default)
            --pre-backward (grad of an output)--> UNSHARDED
            --post-backward (grad of an input, or end of backward)--> grads reduced, SHARDED

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

from hfsdp.core.flat_group import FlatParamGroup


def _grad_tensors(tree) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


class ShardedUnit:
    """Hooks that move one module's parameter groups through their states."""

    def __init__(
        self,
        module: nn.Module,
        groups: list[FlatParamGroup],
        *,
        is_root: bool,
        reshard_after_forward: bool = True,
        grad_scale: Callable[[], float],
        is_last_microbatch: Callable[[], bool],
        on_backward: Callable[[], None],
        on_forward: Callable[[], None] | None = None,
        input_dtype: torch.dtype | None = None,
    ):
        self.module, self.groups, self.is_root = module, groups, is_root
        self.reshard_after_forward = reshard_after_forward
        self.input_dtype = input_dtype  # floating inputs are cast to the compute dtype (root only)
        self._grad_scale, self._is_last_microbatch = grad_scale, is_last_microbatch
        self._on_backward, self._on_forward = on_backward, on_forward
        self.reduced = True  # nothing pending before the first backward
        # Set by the model: the unit whose gather to start when this one starts, in each direction.
        self.prefetch_forward: ShardedUnit | None = None
        self.prefetch_backward: ShardedUnit | None = None
        self._handles = [
            module.register_forward_pre_hook(self._pre_forward, with_kwargs=True, prepend=True),
            module.register_forward_hook(self._post_forward),
        ]

    def unshard(self) -> None:
        for group in self.groups:
            group.unshard()

    def start_unshard(self) -> None:
        """Issue this unit's gathers without waiting for them (prefetch)."""
        for group in self.groups:
            group.start_unshard()

    def _unshard_and_prefetch(self, following: ShardedUnit | None) -> None:
        """Wait for this unit's parameters, then start the next unit's gather so it overlaps our compute."""
        for group in self.groups:
            group.start_unshard()
        if following is not None:
            following.start_unshard()
        for group in self.groups:
            group.finish_unshard()

    def reshard(self) -> None:
        for group in self.groups:
            group.reshard()

    def _pre_forward(self, module, args, kwargs):
        if self._on_forward is not None:
            self._on_forward()
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
        outputs = _grad_tensors(output)
        if outputs:
            register_multi_grad_hook(outputs, self._pre_backward_hook, mode="any")
        return output

    def _pre_backward_hook(self, grad) -> None:
        self._on_backward()
        self._unshard_and_prefetch(self.prefetch_backward)

    def _post_backward_hook(self, grad) -> None:
        self.post_backward()

    def post_backward(self) -> None:
        """Move this microbatch's gradients into the flat buffers and free the parameters."""
        if self.reduced:
            return
        scale, last = self._grad_scale(), self._is_last_microbatch()
        for group in self.groups:
            group.accumulate_grads(scale, last)
        self.reshard()
        self.reduced = True

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
