"""What may wrap a unit's forward: activation recomputation and torch.compile.

Both replace the unit's bound `forward` and leave the module itself alone: its
parameter names (which checkpoints use), its place in the model, and hfsdp's
work, which stays outside around `__call__` (`unit.UnitCall`). So the unit is
gathered before the wrapped forward runs and freed after, exactly as without it;
and when backward recomputes a checkpointed forward, the unit's parameters are
already gathered, because its pre-backward hook fires on the gradient of its
outputs, before any node inside it runs.

A user may compile the same way: `module.compile()` (before or after
`fully_shard`, `fullgraph=True` too) and `module.forward = torch.compile(...)`
keep the module in place. `torch.compile(module)` put into the model in the
module's stead does not: the wrapper it returns names every parameter
`..._orig_mod.<name>`, which are not the names checkpoints and Hugging Face
exports use. `fully_shard` puts the module back in the wrapper's place, compiled
in place with the wrapper's own settings (what `module.compile(...)` with the same
arguments does), so the names stay the model's; a unit replaced by a wrapper after
sharding is refused at the next forward, with the way that keeps the names.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def recompute(units: Iterable[nn.Module]) -> None:
    """Keep only each unit's inputs in forward and recompute its activations in backward (non-reentrant)."""
    for unit in units:
        inner = unit.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        unit.forward = forward


def adopt_compile_wrappers(module: nn.Module, units: Iterable[nn.Module]) -> list[nn.Module]:
    """Replace every `torch.compile` wrapper inside `module` by the module it wraps, compiled in place with the
    wrapper's settings; return `units` with each wrapper replaced by its module."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(module, OptimizedModule):
        raise ValueError(
            "fully_shard got a torch.compile wrapper (OptimizedModule, what torch.compile(model) returns) and shards "
            "in place, so it would shard the module inside it and hand back a model named '_orig_mod.<name>'. Call "
            "fully_shard on the model itself and compile it after: model.compile(), or compile each unit "
            "(unit.compile())."
        )
    for parent in list(module.modules()):
        for key, child in list(parent._modules.items()):
            if isinstance(child, OptimizedModule):
                parent._modules[key] = _compiled_in_place(child)
    return [_compiled_in_place(u) if isinstance(u, OptimizedModule) else u for u in units]


def _compiled_in_place(wrapper: nn.Module) -> nn.Module:
    """The module inside `wrapper`, its call compiled by the wrapper's own compile context (`module.compile` with the
    same arguments sets exactly this), once however often it is asked for."""
    inner = wrapper._orig_mod
    while type(inner).__name__ == "OptimizedModule":
        inner = inner._orig_mod
    if getattr(inner, "_compiled_call_impl", None) is None:
        inner._compiled_call_impl = wrapper.dynamo_ctx(inner._call_impl)
    return inner


def compile_wrapper_message(name: str) -> str:
    """The one paragraph for a unit replaced by a `torch.compile(module)` wrapper after sharding."""
    return (
        f"{name} was replaced by a torch.compile wrapper (OptimizedModule, what torch.compile(module) returns) after "
        "fully_shard: the wrapper names every parameter '_orig_mod.<name>' instead of the module's own names, which "
        "hfsdp's checkpoints and Hugging Face exports use. Compile the module in place instead: module.compile() "
        "(fullgraph=True works too) or module.forward = torch.compile(module.forward), and keep the module itself in "
        "the model (or wrap it before fully_shard, which compiles it in place for you)."
    )


def compile_units(units: Iterable[nn.Module], **options) -> None:
    """torch.compile each unit's forward (`options` go to torch.compile); hfsdp's hooks stay eager."""
    for unit in units:
        unit.forward = torch.compile(unit.forward, **options)
