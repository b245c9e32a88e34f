"""The structure of an index: its fields agree with each other, checked before any reader touches a file.

The schema (`schema.py`) made sure every field has the right type and bounds;
this checks what no single field can: the group structure lists each
parameter once and apart from the unsharded tensors; every state kind lists
exactly the group's parameters with the group's shapes; the pieces of every
tensor cover its elements exactly once, each in a file the index lists and
under a key no other piece uses; the RNG records belong to ranks of the
layout and name listed files; the optimizer's states are kinds the index has.
With DiLoCo state (format 4) every kind but the outer ones has one copy per
instance, its shape the group's with the number of instances in front, and
the outer kinds are the group's shapes; without it, no outer kind exists.

Every reader (verify, inspect, load, reshard, export) gets its index from
`index_file.read_index`, which runs this right after the schema, so they all
refuse the same indexes, before reading a byte of the safetensors files. That
the files hold what the index says is checked next, by `files.check_files`.
"""

from __future__ import annotations

from hfsdp.ckpt.format.index import MAIN, MODEL, OUTER_KINDS, OUTER_MAIN, UNSHARDED, CheckpointIndex, TensorEntry
from hfsdp.ckpt.format.schema import SchemaError


def check_structure(index: CheckpointIndex) -> None:
    """Raise SchemaError for the first way in which the fields of `index` disagree with each other."""
    shapes = _group_shapes(index)
    _check_groups(index)
    both = sorted(set(shapes) & set(index.unsharded))
    if both:
        raise SchemaError(f"it lists '{both[0]}' both as a sharded parameter and as an unsharded tensor")
    if index.order and (len(set(index.order)) != len(index.order) or set(index.order) != {*shapes, *index.unsharded}):
        raise SchemaError("its tensor order does not list each of its tensors exactly once")
    if MAIN not in index.tensors:
        raise SchemaError(f"it has no '{MAIN}' state kind (the fp32 weights every checkpoint holds)")
    _check_outer(index)
    for kind, entries in index.tensors.items():
        if set(entries) != set(shapes):
            odd = sorted(set(entries) ^ set(shapes))[0]
            if odd in shapes:
                raise SchemaError(f"its '{kind}' tensors lack '{odd}', which the group structure lists")
            raise SchemaError(f"it has a '{kind}' tensor '{odd}', which the group structure lacks")
        lead = (index.instances,) if index.per_instance(kind) else ()
        for name, entry in entries.items():
            if entry.shape != (*lead, *shapes[name]):
                raise SchemaError(
                    f"it gives '{kind}' tensor '{name}' shape {list(entry.shape)} but its group lists "
                    f"{list(shapes[name])}" + (f" for each of {lead[0]} instances" if lead else "")
                )
    used: set[tuple[str, str]] = set()
    for kind in [*index.tensors, UNSHARDED]:
        for name, entry in index.entries(kind).items():
            _check_pieces(index, kind, name, entry, used)
    _check_rng(index)
    _check_optimizer(index)


def _check_outer(index: CheckpointIndex) -> None:
    """DiLoCo state belongs to a 'diloco' layout and holds the global weights; without it there is no outer kind."""
    present = [k for k in OUTER_KINDS if k in index.tensors]
    if index.outer is None:
        if present:
            raise SchemaError(f"it has the outer state kind '{present[0]}' but no outer record")
        return
    if index.layout.get("outer") != "diloco":
        raise SchemaError(f"it has an outer record but its layout's outer strategy is {index.layout.get('outer')!r}")
    if OUTER_MAIN not in index.tensors:
        raise SchemaError(f"its outer record has no '{OUTER_MAIN}' state kind (the global weights)")
    if index.optimizer is not None and any(s in OUTER_KINDS for s in index.optimizer["states"]):
        raise SchemaError("its optimizer record lists an outer state kind as an optimizer state")


def _group_shapes(index: CheckpointIndex) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for group in index.groups:
        for name, shape in group.members:
            if name in shapes:
                raise SchemaError(f"it lists the parameter '{name}' in more than one group")
            shapes[name] = shape
    return shapes


def _check_groups(index: CheckpointIndex) -> None:
    """Dense groups have no expert-parallel rank; expert groups one below the layout's ep."""
    ep = index.layout.get("ep", 1)
    for i, group in enumerate(index.groups):
        if group.is_expert and (group.ep_rank is None or group.ep_rank >= ep):
            raise SchemaError(
                f"groups[{i}] is an expert group with ep_rank {group.ep_rank}, but the layout has ep {ep}"
            )
        if not group.is_expert and group.ep_rank is not None:
            raise SchemaError(f"groups[{i}] is a dense group but records ep_rank {group.ep_rank}")


def _check_pieces(index: CheckpointIndex, kind: str, name: str, entry: TensorEntry, used: set) -> None:
    """The pieces of one tensor cover it exactly once, in files the index lists, under keys used once."""
    position = 0
    for piece in sorted(entry.pieces, key=lambda p: (p.start, p.stop)):
        if piece.file not in index.files:
            raise SchemaError(f"it puts a piece of '{kind}' tensor '{name}' in {piece.file}, which its file list lacks")
        if (piece.file, piece.key) in used:
            raise SchemaError(f"two pieces are the same key '{piece.key}' of {piece.file}")
        used.add((piece.file, piece.key))
        if piece.start != position or piece.stop <= piece.start:
            problem = "overlap" if piece.start < position else "leave a gap"
            problem = "include an empty one" if piece.stop <= piece.start else problem
            raise SchemaError(
                f"the pieces of '{kind}' tensor '{name}' {problem} at element {position} (piece "
                f"{piece.start}..{piece.stop} in {piece.file})"
            )
        position = piece.stop
    if position != entry.numel:
        raise SchemaError(f"the pieces of '{kind}' tensor '{name}' cover {position} of its {entry.numel} elements")


def _check_rng(index: CheckpointIndex) -> None:
    world = index.layout["world_size"]
    for rank, meta in index.rng.items():
        if int(rank) >= world:
            raise SchemaError(f"it records an RNG state for rank {rank}, but the layout has {world} ranks")
        if meta["file"] not in index.files:
            raise SchemaError(f"the RNG state of rank {rank} is in {meta['file']}, which its file list lacks")


def _check_optimizer(index: CheckpointIndex) -> None:
    """The optimizer's states are kinds the index has; its groups and scalars name each parameter once."""
    if index.optimizer is None:
        return
    missing = [s for s in index.optimizer["states"] if s not in index.tensors or s in (MODEL, MAIN)]
    if missing:
        raise SchemaError(f"its optimizer record lists the state '{missing[0]}', which is not an optimizer state kind")
    names = {name for g in index.groups for name, _ in g.members}
    listed = [name for group in index.optimizer["param_groups"] for name in group["params"]]
    odd = next((n for n in listed if n not in names), None)
    if odd is not None or len(listed) != len(set(listed)) or set(listed) != names:
        what = f"'{odd}', which is no parameter" if odd is not None else "a parameter twice, or not every parameter"
        raise SchemaError(f"its optimizer parameter groups list {what}")
    for key, entry in index.optimizer["scalars"].items():
        if set(entry["values"]) != names:
            raise SchemaError(f"its optimizer scalar '{key}' does not give one value for every parameter")
