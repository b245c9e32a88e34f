"""What a `torch.optim` optimizer steps: this rank's pieces of the fp32 main weights, as the module's parameters.

Each rank updates only its optimizer range of every flat buffer (the rank's piece of
the layout's `Shard(0)` optimizer placements). Cut at parameter boundaries, that
range gives every parameter at most one *main param*: elements `[start, stop)` of its
flattened data, an `nn.Parameter` that aliases the group's fp32 main weights, so an
optimizer updates them in place; after the last microbatch of a step its `.grad`
aliases the reduced gradient. A rank that holds no element of a parameter has an
empty one (0 elements), so every rank has a parameter under every name, and an
optimizer built from `model.parameters()` has the same structure on every rank.

Outside forward and backward these are the module's parameters (`model.parameters()`,
`named_parameters()`, under the original names), as FSDP2's sharded parameters are.
A piece that covers its whole parameter keeps the parameter's shape; a partial one is
`[1, ..., 1, n]`, which keeps the number of dimensions, so rules such as "decay only
parameters with `dim() >= 2`" pick the same parameters on every rank and as on the
unsharded model.

For an elementwise optimizer (SGD, Adam, AdamW, RMSprop, ...) stepping the pieces
computes exactly what it computes on the same elements of the unsharded model. An
optimizer that reduces over a whole tensor (Adafactor's factored second moment,
LAMB's trust ratio, Muon's orthogonalisation) would see only a piece;
`check_elementwise` refuses it unless every piece is a whole parameter (DDP, or one
rank), instead of letting it compute something else.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from hfsdp.core.buffers.flat_layout import FlatLayout, ParamSlot
from hfsdp.core.buffers.grad_buffer import GradBuffer
from hfsdp.core.buffers.param_remainders import join_master


class MainWeights(Protocol):
    """What a main param reads of its group: a `FlatParamGroup`, which builds its main params from this module
    (so this module names only what it reads, and imports nothing above it)."""

    flat: FlatLayout
    main: torch.Tensor  # this rank's optimizer range of the fp32 main weights (bf16 with a remainder)
    remainder: torch.Tensor | None  # their low 16 bits where the masters are a bf16 shard plus a remainder
    grads: GradBuffer

    def write_master(self, offset: int, values: torch.Tensor) -> None: ...


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
    """Elements [start, stop) of the parameter in `slot`, held by this rank as `param` (empty when start == stop)."""

    slot: ParamSlot
    group: MainWeights  # the FlatParamGroup whose main weights `param` aliases
    start: int
    stop: int
    offset: int  # of the piece in the group's optimizer range
    param: nn.Parameter
    #: A weak reference to the optimizer that reads this piece's reduced gradient from the group's buffer in the
    #: reduce dtype (`FusedAdamW`): while it lives, a non-fp32 reduction makes no fp32 copy as `.grad` for its step.
    grad_reader: Callable[[], object] | None = None

    @property
    def reads_reduced_grad(self) -> bool:
        return self.grad_reader is not None and self.grad_reader() is not None

    @property
    def name(self) -> str:
        """The parameter's global name (experts by global index)."""
        return self.slot.global_name

    @property
    def shape(self) -> torch.Size:
        """The whole parameter's shape."""
        return self.slot.shape

    @property
    def holds(self) -> bool:
        return self.stop > self.start

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.shape.numel()

    def master(self) -> torch.Tensor:
        """This piece's fp32 master weights, shaped like `param`: `param` itself, or where the group keeps them as
        a bf16 weight plus a remainder (`param_remainders`) the two joined, a new tensor (write with
        `write_master`)."""
        remainder = self.group.remainder
        if remainder is None:
            return self.param.detach()
        low = remainder[self.offset : self.offset + self.stop - self.start]
        return join_master(self.param.detach().reshape(-1), low).view(self.param.shape)

    def write_master(self, values: torch.Tensor) -> None:
        """Write fp32 `values` (this piece's elements) into the master weights (the caller republishes)."""
        self.group.write_master(self.offset, values.detach().reshape(-1))

    def grad_view(self) -> torch.Tensor:
        """The reduced gradient of this piece, as an fp32 tensor shaped like `param` (empty where this rank holds no
        element: every rank then has a gradient under every name, so a norm over them is one collective on every
        rank). It knows whose piece it is (`grad_piece_of`), so torch's norm utilities can compute the global norm."""
        grad = self.group.grads.main_grad[self.offset : self.offset + self.stop - self.start]
        if grad.dtype != torch.float32:
            grad = grad.float()
        grad = grad.view(self.param.shape)
        grad._hfsdp_grad_of = weakref.ref(self)
        return grad


def piece_shape(shape: torch.Size, numel: int) -> tuple[int, ...]:
    """The shape of a piece of `numel` elements of a parameter of `shape`: the same dimensions, all but the last 1."""
    if numel == shape.numel():
        return tuple(shape)
    return (*([1] * (len(shape) - 1)), numel) if len(shape) else (numel,)


def build_main_params(group: MainWeights, trainable: bool = True) -> list[MainParam]:
    """The main param of every slot of `group`, in slot order (an empty one where this rank holds no element);
    frozen ones (`trainable=False`) need no gradient, as the parameters they stand for."""
    lo, hi = group.flat.optim_range
    out = []
    for slot in group.flat.slots:
        start, stop = max(lo, slot.offset), min(hi, slot.stop)
        if start >= stop:  # no element here: an empty parameter on the main weights' device
            start = stop = lo if slot.offset < lo else hi
        view = group.main[start - lo : stop - lo].view(piece_shape(slot.shape, stop - start))
        param = nn.Parameter(view, requires_grad=trainable)
        piece = MainParam(slot, group, start - slot.offset, stop - slot.offset, start - lo, param)
        piece.param._hfsdp_piece = weakref.ref(piece)
        out.append(piece)
    return out


def piece_of(tensor: torch.Tensor) -> MainParam | None:
    """The main param `tensor` is, or None for any other tensor."""
    ref = getattr(tensor, "_hfsdp_piece", None)
    return ref() if ref is not None else None


def grad_piece_of(tensor: torch.Tensor) -> MainParam | None:
    """The main param whose reduced gradient `tensor` is (`MainParam.grad_view`), or None for any other tensor."""
    ref = getattr(tensor, "_hfsdp_grad_of", None)
    return ref() if ref is not None else None


def check_elementwise(optimizer: torch.optim.Optimizer, pieces: Iterable[MainParam]) -> None:
    """Refuse an optimizer not known to be elementwise when it steps a piece that is only part of its parameter."""
    if isinstance(optimizer, tuple(ELEMENTWISE)):
        return
    partial = next((p for p in pieces if p.holds and not p.whole), None)
    if partial is None:
        return
    raise TypeError(
        f"{type(optimizer).__name__} is not known to update each element independently, and this rank steps only "
        f"part of parameter '{partial.name}' (elements {partial.start}..{partial.stop} of {partial.shape.numel()}): "
        "an optimizer that reduces over whole tensors (Adafactor, LAMB, Muon) would compute something other than "
        "it does on the unsharded model. Use an elementwise optimizer (SGD, Adam, AdamW, ...), a layout whose "
        "optimizer state is not sharded, or declare the class elementwise with "
        "hfsdp.core.register_elementwise if it is."
    )
