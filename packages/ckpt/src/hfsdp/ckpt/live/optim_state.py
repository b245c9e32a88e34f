"""A `torch.optim` optimizer's state in checkpoint terms: per-element kinds, per-parameter scalars, groups.

Each rank's optimizer steps its main params: pieces `[start, stop)` of parameters
(see `hfsdp.core.buffers.main_params`). Its state splits three ways, and each is stored so
that it reshards:

- per-element tensors (AdamW's `exp_avg`, SGD's `momentum_buffer`): one more
  state *kind*, stored exactly like the main weights, piece by piece;
- per-parameter scalars (AdamW's `step`): the same for every piece of a
  parameter, stored once per global name in the index;
- parameter groups: their hyper-parameters, and which global names each holds.

A state tensor of any other shape (Adafactor's row and column factors) belongs to
a whole tensor, not to elements, so it cannot be cut at other boundaries; saving
it is refused with that reason.

Each kind keeps its dtype: `FusedAdamW`'s bf16, fp16 or fp8 moments are stored as
they are (the index's `dtypes` and `hfsdp ckpt inspect` show them), an fp8 moment
with its scales as one more kind, `<moment>_scale` (one uint8 per element, E8M0:
2**(byte - 127), the same within each of the optimizer's scale blocks), so it is
cut and resharded like the moment. A resume on the same layout gives the
optimizer the same bits; on another layout each fp8 block is rebuilt from the
exact values of the elements it now holds (dequantized, requantized with the new
block's scale). An optimizer that does not take scaled state (torch's AdamW)
gets fp8 moments dequantized, exactly, into fp32.

The index's optimizer record is `{"type", "param_groups": [{"hyper", "params"}],
"states", "scalars": {key: {"tensor", "values": {name: number}}}}`. On load,
numeric hyper-parameters (lr, betas, eps, weight decay, ...) come from the
checkpoint, as `Optimizer.load_state_dict` does; switches (foreach, fused,
capturable, names) stay those of the optimizer the caller built.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hfsdp.ckpt.format.errors import CheckpointError

Report = dict[str, Any]


def _json_value(value: Any) -> Any:
    """A hyper-parameter as JSON: numbers, bools, strings and None as they are, tuples and lists of numbers as
    lists, 0-d tensors as numbers; anything else is left out (returns ...)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | float):
        return value if math.isfinite(value) else ...
    if isinstance(value, list | tuple) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return list(value)
    return ...


def _members(optimizer, model):
    """(group index, parameter, its MainParam) of every parameter the optimizer steps. A frozen parameter (one that
    needs no gradient, which `model.parameters()` also yields: the engine shards it, but nothing steps it) is passed
    over; any other tensor that is not one of the model's main params cannot be checkpointed by name, and is
    refused."""
    pieces = {id(p.param): p for p in model.main_params}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            piece = pieces.get(id(param))
            if piece is None and not param.requires_grad:
                continue
            if piece is None:
                raise CheckpointError(
                    f"Parameter group {index} of the optimizer holds a tensor that is not one of the model's main "
                    "params; build the optimizer from model.parameters() or hfsdp.core.param_groups(model), "
                    "so that its state can be checkpointed and resharded."
                )
            yield index, param, piece


def optimizer_kind(optimizer) -> str:
    """What a checkpoint records as the optimizer's kind: its class name, or the `state_format` a class declares
    when its state is another's (hfsdp.core.FusedAdamW keeps torch's AdamW state, so the two load each other's)."""
    return getattr(type(optimizer), "state_format", type(optimizer).__name__)


def param_state(optimizer, param) -> dict[str, Any]:
    """`param`'s state as a checkpoint stores it: the optimizer's `checkpoint_state` where it has one (FusedAdamW adds
    its fp8 moments' scales), else its `state` entry."""
    own = getattr(optimizer, "checkpoint_state", None)
    return own(param) if own is not None else optimizer.state.get(param, {})


def local_report(model, optimizer) -> Report:
    """What this rank's optimizer holds, for the record: its groups, per-element kinds and per-parameter scalars."""
    groups = [{"hyper": _hyper(group), "names": []} for group in optimizer.param_groups]
    kinds, scalars, stateless = {}, {}, []
    for index, param, piece in _members(optimizer, model):
        groups[index]["names"].append(piece.name)
        if not piece.holds:  # this rank holds no element of it: no state, nothing to report
            continue
        state = param_state(optimizer, param)
        if not state:
            stateless.append(piece.name)
        for key, value in state.items():
            _sort_state(piece, key, value, kinds, scalars)
    return {
        "type": optimizer_kind(optimizer),
        "groups": groups,
        "kinds": kinds,
        "scalars": scalars,
        "stateless": stateless,
    }


def _hyper(group: dict) -> dict[str, Any]:
    """A parameter group's settings that JSON can hold (everything but its parameters)."""
    return {k: v for k, v in ((k, _json_value(v)) for k, v in group.items() if k != "params") if v is not ...}


def _sort_state(piece, key: str, value: Any, kinds: dict, scalars: dict) -> None:
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if value.numel() != piece.param.numel():
            raise CheckpointError(
                f"The optimizer's state '{key}' of '{piece.name}' has shape {list(value.shape)}, not one value per "
                f"element ({piece.param.numel()}): it belongs to the whole tensor (as Adafactor's factored moments "
                "do), so it cannot be cut into pieces and resharded. Checkpoint with an elementwise optimizer "
                "(AdamW, SGD, ...), or save the optimizer's own state_dict yourself."
            )
        kinds[key] = str(value.dtype).removeprefix("torch.")
        return
    number = value.item() if isinstance(value, torch.Tensor) else value
    if isinstance(number, bool) or not isinstance(number, int | float) or not math.isfinite(number):
        raise CheckpointError(
            f"The optimizer's state '{key}' of '{piece.name}' is {type(value).__name__} {value!r}, which is neither a "
            "tensor per element nor a finite number; hfsdp cannot checkpoint it."
        )
    entry = scalars.setdefault(key, {"tensor": isinstance(value, torch.Tensor), "values": {}})
    entry["values"].setdefault(piece.name, number)


def merge_reports(reports: list[Report | None]) -> dict[str, Any] | None:
    """The index's optimizer record from every rank's report (None: saved without an optimizer)."""
    if all(r is None for r in reports):
        return None
    if any(r is None for r in reports):
        raise CheckpointError("Some ranks saved with an optimizer and some without; pass the optimizer on every rank.")
    types = {r["type"] for r in reports}
    if len(types) != 1 or len({len(r["groups"]) for r in reports}) != 1:
        raise CheckpointError(
            "The ranks' optimizers differ (class or number of parameter groups); build the same optimizer on every "
            "rank."
        )
    kinds: dict[str, str] = {}
    for r in reports:
        for key, dtype in r["kinds"].items():
            if kinds.setdefault(key, dtype) != dtype:
                raise CheckpointError(f"The optimizer's state '{key}' has different dtypes on different ranks.")
    stepped = [r for r in reports if r["kinds"] or r["scalars"]]
    lacking = next((name for r in reports for name in r["stateless"]), None)
    if stepped and lacking is not None:
        raise CheckpointError(
            f"The optimizer has state for some parameters but none for '{lacking}' (it never had a gradient when "
            "the optimizer stepped); hfsdp checkpoints an optimizer whose every parameter has state, or none."
        )
    groups, owner = [], {}
    for index in range(len(reports[0]["groups"])):
        names: list[str] = []
        for r in reports:
            for name in r["groups"][index]["names"]:
                if owner.setdefault(name, index) != index:
                    raise CheckpointError(
                        f"Pieces of '{name}' are in parameter groups {owner[name]} and {index}; every piece of a "
                        "parameter must be in the same group (hfsdp.core.param_groups groups by name)."
                    )
                if name not in names:
                    names.append(name)
        groups.append({"hyper": reports[0]["groups"][index]["hyper"], "params": names})
    scalars: dict[str, dict[str, Any]] = {}
    for r in reports:
        for key, entry in r["scalars"].items():
            merged = scalars.setdefault(key, {"tensor": entry["tensor"], "values": {}})
            for name, value in entry["values"].items():
                merged["values"].setdefault(name, value)
    return {"type": types.pop(), "param_groups": groups, "states": sorted(kinds), "scalars": scalars}


def state_dtypes(reports: list[Report | None]) -> dict[str, str]:
    """The dtype of every per-element kind (the moments' own: fp32, bf16, fp16, fp8, and uint8 fp8 scales)."""
    return {k: v for r in reports if r is not None for k, v in r["kinds"].items()}


def check_matches(optimizer, model, record: dict[str, Any] | None, source: str) -> None:
    """Refuse a checkpoint saved without an optimizer, with another class, or with other parameter groups."""
    if record is None:
        raise CheckpointError(
            f"The checkpoint {source} holds no optimizer state (it was saved without an optimizer, or imported); "
            "load it with optimizer=None and start the optimizer fresh."
        )
    if record["type"] != optimizer_kind(optimizer):
        raise CheckpointError(
            f"The checkpoint {source} was saved with {record['type']}, but the optimizer is "
            f"{type(optimizer).__name__}; use the same optimizer class, or load with optimizer=None."
        )
    saved = record["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"The checkpoint {source} has {len(saved)} optimizer parameter group(s), the optimizer "
            f"{len(optimizer.param_groups)}; build the optimizer's groups as the run that saved it did."
        )
    where = {name: i for i, group in enumerate(saved) for name in group["params"]}
    for index, _, piece in _members(optimizer, model):
        if where.get(piece.name, index) != index:
            raise CheckpointError(
                f"'{piece.name}' is in optimizer parameter group {index}, but in group {where[piece.name]} in the "
                f"checkpoint {source}; build the optimizer's groups as the run that saved it did."
            )


def restore(optimizer, model, record: dict[str, Any], tensors: dict[tuple[str, str], torch.Tensor]) -> None:
    """Give `optimizer` the checkpoint's numeric hyper-parameters and its state for this rank's main params.

    `tensors` holds this rank's piece of every per-element kind, by (kind, global
    name). The state goes in through `Optimizer.load_state_dict`, so the optimizer
    puts each tensor on the device and in the dtype it wants (AdamW keeps `step`
    on the CPU unless fused or capturable), exactly as for its own state dicts.
    fp8 moments with their `<moment>_scale` go to an optimizer that takes them
    (`loads_scaled_state`) as they are; any other gets them dequantized into fp32.
    """
    for group, saved in zip(optimizer.param_groups, record["param_groups"], strict=True):
        for key, value in saved["hyper"].items():
            if key in group and _is_numeric(value):
                if isinstance(group[key], torch.Tensor) and group[key].dim() == 0 and not isinstance(value, list):
                    group[key].fill_(value)  # a tensor lr (capturable) stays the tensor a captured graph reads
                else:
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value
    pieces = {id(p.param): p for p in model.main_params}
    dtypes = {kind: tensor.dtype for (kind, _), tensor in tensors.items()}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group in optimizer.param_groups:
        ids = []
        for param in group["params"]:
            piece = pieces.get(id(param))
            if piece is None:  # frozen: no state
                ids.append(index)
                index += 1
                continue
            if piece.holds:
                entry = {kind: tensors[kind, piece.name].view(param.shape) for kind in record["states"]}
            else:  # no element here: empty state and the step count, as the optimizer keeps for it (DCP needs them)
                entry = {
                    kind: torch.zeros(param.shape, dtype=dtypes.get(kind, torch.float32)) for kind in record["states"]
                }
            if not getattr(optimizer, "loads_scaled_state", False):
                _dequantize(entry)
            for key, scalar in record["scalars"].items():
                if piece.name not in scalar["values"]:
                    continue
                value = scalar["values"][piece.name]
                entry[key] = torch.tensor(float(value), dtype=torch.float32) if scalar["tensor"] else value
            if entry:
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _dequantize(entry: dict[str, Any]) -> None:
    """Replace each fp8 moment that has a `<moment>_scale` (E8M0 per element) by its fp32 values (exact: an fp8
    value times a power of two) and drop the scale."""
    for key in [k for k in entry if f"{k}_scale" in entry]:
        exponent = entry.pop(f"{key}_scale").to(torch.int32)
        entry[key] = entry[key].float() * (exponent << 23).view(torch.float32)  # E8M0 byte b: 2**(b - 127)


def _is_numeric(value: Any) -> bool:
    if isinstance(value, list):
        return bool(value) and all(_is_numeric(v) for v in value)
    return isinstance(value, int | float) and not isinstance(value, bool)
