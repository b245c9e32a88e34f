"""What a `torch.optim` optimizer steps: this rank's pieces of the fp32 main weights, as parameters.

Each rank updates only its optimizer range of every flat buffer (the rank's
piece of the layout's `Shard(0)` optimizer placements). Cut at parameter
boundaries, that range is a list of *main params*: elements `[start, stop)` of
one parameter's flattened data. Each is an `nn.Parameter` that aliases the
group's fp32 main weights, so an optimizer updates them in place, and after the
last microbatch of a step its `.grad` aliases the reduced gradient. A main param
that covers its whole parameter keeps the parameter's shape; a partial one is 1-D.

For an elementwise optimizer (SGD, Adam, AdamW, RMSprop, ...) stepping the
pieces computes exactly what it computes on the same elements of the unsharded
model. An optimizer that reduces over a whole tensor (Adafactor's factored
second moment and RMS scaling, LAMB's trust ratio, Muon's orthogonalisation)
would see only a piece; `check_elementwise` refuses it unless every piece is a
whole parameter (DDP, or one rank), instead of letting it compute something else.

The engine's work around a step runs in global optimizer step hooks, so any
optimizer built on main params needs no wrapper and no subclass: before the
step, compute waits for the last step's weight gathers (they may still read the
main weights); after it, every group publishes its new weights (cast to the
compute dtype, gathered where parameters are replicated but the optimizer is
sharded) and the step's gradients are released.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

#: Optimizers whose update of an element depends on that element's gradient and state alone.
ELEMENTWISE: set[type] = {
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
}


def register_elementwise(optimizer_class: type) -> type:
    """Declare that `optimizer_class` updates every element from its own gradient and state (usable as a
    class decorator). Then hfsdp lets it step partial pieces of parameters."""
    ELEMENTWISE.add(optimizer_class)
    return optimizer_class


@dataclass(eq=False)
class MainParam:
    """Elements [start, stop) of parameter `name` (its global name), held by this rank as `param`."""

    name: str
    shape: torch.Size  # of the whole parameter
    start: int
    stop: int
    group: object  # the FlatParamGroup whose main weights `param` aliases
    offset: int  # of the piece in the group's optimizer range
    param: nn.Parameter

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.shape.numel()

    def grad_view(self) -> torch.Tensor:
        """The reduced gradient of this piece, as an fp32 tensor shaped like `param`."""
        grad = self.group.main_grad[self.offset : self.offset + self.stop - self.start]
        if grad.dtype != torch.float32:
            grad = grad.float()
        return grad.view(self.param.shape)


def build_main_params(model, groups) -> list[MainParam]:
    """The main params of `groups`, in group order and parameter order within each group."""
    out = []
    for group in groups:
        lo, hi = group.optim_range
        for slot in group.slots:
            start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start >= stop:
                continue
            view = group.main[start - lo : stop - lo]
            whole = stop - start == slot.numel
            param = nn.Parameter(view.view(slot.shape) if whole else view)
            param._hfsdp_model = weakref.ref(model)
            name = model.global_name(group, slot.name)
            out.append(MainParam(name, slot.shape, start - slot.offset, stop - slot.offset, group, start - lo, param))
    return out


# Parameter groups --------------------------------------------------------------------------------------

NoDecay = Callable[[str, torch.Size], bool]


def megatron_no_decay(name: str, shape: torch.Size) -> bool:
    """Megatron's rule: no weight decay for biases and 1-D parameters (norms); embeddings likewise here."""
    return name.endswith(".bias") or len(shape) <= 1 or "embed" in name


def param_groups(model, weight_decay: float = 0.01, no_decay: NoDecay | Iterable[str] | None = None) -> list[dict]:
    """Two optimizer parameter groups of `model`'s main params: with weight decay, and without.

    `no_decay` picks the parameters without decay: a function of (global name,
    full shape), or regular expressions matched against the name; default
    `megatron_no_decay`. The decision uses the whole parameter's shape and
    name, so every piece of a parameter lands in the same group on every rank.
    Groups that would be empty on this rank are kept (empty), so every rank's
    optimizer has the same group structure.
    """
    rule = _no_decay_rule(no_decay)
    decay, plain = [], []
    for piece in model.main_params:
        (plain if rule(piece.name, piece.shape) else decay).append(piece.param)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": plain, "weight_decay": 0.0, "name": "no_decay"},
    ]


def _no_decay_rule(no_decay: NoDecay | Iterable[str] | None) -> NoDecay:
    if no_decay is None:
        return megatron_no_decay
    if callable(no_decay):
        return no_decay
    patterns = [re.compile(p) for p in no_decay]
    return lambda name, shape: any(p.search(name) for p in patterns)


# Step hooks ------------------------------------------------------------------------------------------------


def models_of(optimizer: torch.optim.Optimizer) -> list:
    """The sharded models whose main params `optimizer` steps, in order of first appearance."""
    seen: dict[int, object] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            ref = getattr(param, "_hfsdp_model", None)
            model = ref() if ref is not None else None
            if model is not None:
                seen.setdefault(id(model), model)
    return list(seen.values())


def check_elementwise(optimizer: torch.optim.Optimizer, model) -> None:
    """Refuse an optimizer not known to be elementwise when some main param is only part of its parameter."""
    if isinstance(optimizer, tuple(ELEMENTWISE)) or all(p.whole for p in model.main_params):
        return
    partial = next(p for p in model.main_params if not p.whole)
    raise TypeError(
        f"{type(optimizer).__name__} is not known to update each element independently, and this rank steps only "
        f"part of parameter '{partial.name}' (elements {partial.start}..{partial.stop} of {partial.shape.numel()}): "
        "an optimizer that reduces over whole tensors (Adafactor, LAMB, Muon) would compute something other than "
        "it does on the unsharded model. Use an elementwise optimizer (SGD, Adam, AdamW, ...), a layout whose "
        "optimizer state is not sharded, or declare the class elementwise with "
        "hfsdp.core.register_elementwise if it is."
    )


def _before_step(optimizer, args, kwargs) -> None:
    for model in models_of(optimizer):
        check_elementwise(optimizer, model)
        model.before_optimizer_step()


def _after_step(optimizer, args, kwargs) -> None:
    for model in models_of(optimizer):
        model.after_optimizer_step()


_hooks_installed = False


def install_step_hooks() -> None:
    """Register the engine's work around every optimizer step, once per process."""
    global _hooks_installed
    if not _hooks_installed:
        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _hooks_installed = True


def named_main_params(model) -> Iterator[tuple[str, nn.Parameter]]:
    for piece in model.main_params:
        yield piece.name, piece.param
