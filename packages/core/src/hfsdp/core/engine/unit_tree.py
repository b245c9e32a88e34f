"""Which unit owns each parameter: the units as a tree inside the model, checked before anything is sharded.

A unit gathers the parameters it owns around its own call, so a parameter must be owned by a unit
that is running whenever any module holding it computes. Units may nest, as FSDP2's may: the inner
unit runs inside the outer one's call, so each parameter goes to the innermost unit (or the root)
that contains it, whatever order `units=` lists them in; the outer unit keeps the rest.

What cannot work is refused here, before any parameter moves, in one sentence that names the fix:

- a unit that is not a submodule of the model (its parameters would be nobody's);
- the model itself in `units=` (it is the root unit already);
- a module already sharded by a `fully_shard` call of its own (FSDP2's per-layer style), or a part of
  a model already sharded: hfsdp shards a whole model in one call, its layers named in `units=`;
- a parameter tied across units (an embedding in one unit, the output layer that shares its weight
  in another): whichever unit owned it, the other would compute with this rank's piece of it;
- a model only partly on the meta device (one wholly on it is sharded into meta buffers, which
  `to_empty` makes real).
"""

from __future__ import annotations

from torch import nn

from hfsdp.core.engine.unit import SHARDING_ATTRIBUTE, UNIT_ATTRIBUTE


def check_unit_modules(module: nn.Module, units: list[nn.Module]) -> dict[int, str]:
    """Refuse units `fully_shard` cannot shard; return each unit's qualified name in `module`, by id."""
    where = {id(sub): name for name, sub in module.named_modules(remove_duplicate=False)}
    sharded = next((name for name, sub in module.named_modules() if _already_sharded(sub)), None)
    if sharded is not None:
        raise ValueError(
            f"'{sharded or type(module).__name__}' is already sharded by hfsdp (a fully_shard call of its own, as "
            "FSDP2's per-layer style makes, or it belongs to a model already sharded). hfsdp shards a whole model in "
            "one call, each layer named as a unit: fully_shard(model, config, meshes, units=model.layers), on the "
            "unsharded model."
        )
    seen: set[int] = set()
    for unit in units:
        if unit is module:
            raise ValueError(
                f"the model itself ({type(module).__name__}) is in units=; it is the root unit already, which owns "
                "every parameter no unit claims. List only its submodules (its layers) in units=."
            )
        if id(unit) not in where:
            raise ValueError(
                f"a unit in units= (a {type(unit).__name__}) is not a submodule of the model passed to fully_shard, "
                "so its parameters would belong to no unit. Pass modules of this model, e.g. "
                "units=model.model.layers, and shard the model that contains them."
            )
        if id(unit) in seen:
            raise ValueError(f"unit '{where[id(unit)]}' is listed twice in units=; list each module once.")
        seen.add(id(unit))
    kinds = {p.is_meta for p in module.parameters()}
    if len(kinds) > 1:
        meta = next(name for name, p in module.named_parameters() if p.is_meta)
        raise ValueError(
            f"parameter '{meta}' is on the meta device but others are not: fully_shard takes a model built wholly on "
            "the meta device (then model.to_empty(device=...) and load its weights) or wholly materialised, not a mix."
        )
    return {id(u): where[id(u)] for u in units}


Named = list[tuple[str, nn.Parameter]]


def claim_parameters(
    module: nn.Module, units: list[nn.Module], names: dict[int, str], *, trainable: bool = True
) -> list[Named]:
    """The parameters each of `units` owns, then the root's (`module`'s) last: each goes to the innermost unit
    containing every module that holds it. `trainable` picks those that require a gradient, or the frozen ones.
    A parameter tied across units is refused."""
    unit_names = [names[id(u)] for u in units]
    owners: dict[int, int] = {}  # parameter id -> index into units (len(units): the root)
    holders: dict[int, tuple[str, list[str]]] = {}
    for module_name, sub in module.named_modules(remove_duplicate=False):
        owner = _innermost(module_name, unit_names)
        for attr, param in sub._parameters.items():
            if param is None or param.requires_grad != trainable:
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            claimed = owners.setdefault(id(param), owner)
            holders.setdefault(id(param), (name, []))[1].append(name)
            if claimed != owner:
                first, _ = holders[id(param)]
                raise ValueError(
                    f"parameter '{first}' is tied to '{name}', and the two sit in different units "
                    f"({_label(claimed, unit_names)} and {_label(owner, unit_names)}): each unit gathers only the "
                    "parameters it owns around its own call, so one of them would compute with this rank's piece. Put "
                    "both modules in one unit, or leave both to the root (take their units out of units=)."
                )
    out: list[Named] = [[] for _ in range(len(units) + 1)]
    for name, param in module.named_parameters():
        if param.requires_grad == trainable:
            out[owners[id(param)]].append((name, param))
    return out


def _innermost(module_name: str, unit_names: list[str]) -> int:
    """The index of the deepest unit whose subtree holds `module_name` (len(unit_names): only the root's)."""
    best, depth = len(unit_names), -1
    for index, unit_name in enumerate(unit_names):
        inside = module_name == unit_name or module_name.startswith(unit_name + ".")
        if inside and unit_name.count(".") > depth:
            best, depth = index, unit_name.count(".")
    return best


def _label(index: int, unit_names: list[str]) -> str:
    return f"unit '{unit_names[index]}'" if index < len(unit_names) else "the root"


def _already_sharded(sub: nn.Module) -> bool:
    return UNIT_ATTRIBUTE in sub.__dict__ or SHARDING_ATTRIBUTE in sub.__dict__
