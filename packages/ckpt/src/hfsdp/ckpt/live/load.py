"""Load a checkpoint into a ShardedModel of any layout (reshard on load).

Each rank reads, for each of its main params (the pieces of parameters its
optimizer steps), only those elements of "main" and of each optimizer state
through lazy slices; the range arithmetic is the same as the offline reshard's
(`pieces.py`). Main weights are read in place; optimizer states go to the
optimizer through its own `load_state_dict` (`optim_state.restore`). Experts are looked up by global name, so ep
may change. The compute-dtype weights are not read: they are re-derived from
the fp32 main weights with `publish_main_weights`, exactly as after an optimizer
step, so parameters and main weights always agree and a same-layout resume is
bit-identical. The module's unsharded tensors (persistent buffers, frozen
parameters) are read whole and copied into the module on every rank.

DiLoCo: a rank of instance o' reads the per-instance kinds of source instance
o' mod R (`pieces.source_range`; a checkpoint without instances has one copy, and
a model without DiLoCo is instance 0), and its piece of the outer state (the
global weights, the outer momentum, the anchor of a lossy exchange over its
optimizer piece; without an anchor in the checkpoint, the global weights, which
an exact exchange leaves every instance with). The optimizer steps done come back
with them, so each fragment resumes at its place in the cycle. A checkpoint
without DiLoCo state starts the outer step fresh from the loaded weights.

Before anything is touched, the checkpoint passes every reader's checks: the
index through `index_file.read_index` (its checksum, schema and structure),
every file's presence and size, and for the files this rank reads their
headers and checksums (`files.check_files`); the RNG state is read and checked
too. Every check that can fail does so on all ranks together (the checks run on
gathered data, and every error is exchanged before the first collective of the
engine), so a bad checkpoint raises a CheckpointError everywhere, and only a
CheckpointError, instead of leaving ranks waiting or a model half-loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.files import check_files, check_present
from hfsdp.ckpt.format.index import (
    MAIN,
    OUTER_ANCHOR,
    OUTER_KINDS,
    OUTER_MAIN,
    OUTER_MOMENTUM,
    UNSHARDED,
    CheckpointIndex,
)
from hfsdp.ckpt.format.index_file import read_index
from hfsdp.ckpt.format.pieces import instance_of, source_range
from hfsdp.ckpt.format.store import resolve
from hfsdp.ckpt.live import optim_state
from hfsdp.ckpt.live import rng as rng_states
from hfsdp.ckpt.live.agree import agree
from hfsdp.ckpt.live.model_state import engine_of, local_groups, unsharded_state, write_frozen
from hfsdp.ckpt.tensors.reader import CheckpointReader
from hfsdp.ckpt.tensors.writer import torch_dtype


def load_checkpoint(
    path: str | Path, model, optimizer=None, *, restore_rng: bool = True, verify_checksums: bool = True
) -> dict[str, Any]:
    """Load `path` (a checkpoint, or a root whose `latest` names one) into `model` and `optimizer`; collective.

    Returns the `extra` dict given to `save_checkpoint`, with "step" added when
    it was not there. RNG states are restored only when the world size is the
    one the checkpoint was saved with (rank r gets rank r's state). Every file
    of the checkpoint must be present with its recorded size; the files this
    rank reads are checksummed unless `verify_checksums` is False.
    """
    model = engine_of(model)  # the engine state: every helper below reads and writes through it
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt_dir, index = agree(lambda: _open(path))
    module_tensors = unsharded_state(model)
    mine = agree(lambda: ([m for g in local_groups(model, rank) for m in g.members], _shapes(module_tensors)))
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    agree(lambda: _check_model(ckpt_dir, index, [g[0] for g in gathered]))
    if optimizer is not None:
        agree(lambda: optim_state.check_matches(optimizer, model, index.optimizer, str(ckpt_dir)))
    agree(lambda: _check_unsharded(ckpt_dir, index, [g[1] for g in gathered]))
    rng_meta = index.rng.get(str(rank)) if restore_rng and index.layout["world_size"] == world else None
    # Two steps, each agreed: no rank touches its model until every rank's files and RNG state passed.
    plan, rng = agree(lambda: _prepare(ckpt_dir, index, model, optimizer, module_tensors, rng_meta, verify_checksums))
    states = agree(lambda: _fill(ckpt_dir, index, model, module_tensors, plan))
    write_frozen(model, module_tensors)

    model.republish()  # collective: every rank, every group, model order
    if model.outer is not None:
        if index.outer is None:
            model.outer.restart_from_main()
        model.outer.steps = index.outer["inner_steps"] if index.outer is not None else 0
        if index.outer is not None and "synced_at" in index.outer:  # a sync_outer() off the schedule, remembered
            model.outer.synced_at = list(index.outer["synced_at"])
    if optimizer is not None:
        optim_state.restore(optimizer, model, index.optimizer, states)
    if rng is not None:
        rng_states.restore(rng)
    extra = dict(index.extra)
    extra.setdefault("step", index.step)
    return extra


def _open(path) -> tuple[Path, CheckpointIndex]:
    ckpt_dir = resolve(path)
    return ckpt_dir, read_index(ckpt_dir)


def _check_model(ckpt_dir: Path, index: CheckpointIndex, gathered) -> None:
    """The model and the checkpoint must have the same parameters with the same shapes."""
    model_shapes = {name: tuple(shape) for members in gathered for name, shape in members}
    lead = 1 if index.per_instance(MAIN) else 0  # DiLoCo state: the instances in front
    saved = {name: tuple(entry.shape)[lead:] for name, entry in index.tensors.get(MAIN, {}).items()}
    _same_tensors(ckpt_dir, model_shapes, saved, "parameter")


def _check_unsharded(ckpt_dir: Path, index: CheckpointIndex, gathered) -> None:
    """The model's buffers and frozen parameters (over all ranks) are exactly the checkpoint's, shapes included."""
    model_shapes = {name: tuple(shape) for members in gathered for name, shape in members}
    saved = {name: tuple(entry.shape) for name, entry in index.unsharded.items()}
    _same_tensors(ckpt_dir, model_shapes, saved, "buffer or frozen parameter")


def _same_tensors(ckpt_dir: Path, model_shapes: dict, saved: dict, what: str) -> None:
    """Raise for the first tensor the checkpoint lacks, has of another shape, or has beyond the model's."""
    missing = sorted(set(model_shapes) - set(saved))
    unexpected = sorted(set(saved) - set(model_shapes))
    wrong = sorted(n for n in set(model_shapes) & set(saved) if saved[n] != model_shapes[n])
    hint = "it is a checkpoint of another model. Load it into the model that saved it."
    if missing:
        raise CheckpointError(
            f"The checkpoint {ckpt_dir} has no {what} '{missing[0]}' of the model ({len(missing)} missing in all); "
            + hint
        )
    if wrong:
        name = wrong[0]
        raise CheckpointError(
            f"{what[0].upper()}{what[1:]} '{name}' has shape {list(model_shapes[name])} in the model but "
            f"{list(saved[name])} in the checkpoint {ckpt_dir} ({len(wrong)} shape mismatches in all); " + hint
        )
    if unexpected:
        raise CheckpointError(
            f"The checkpoint {ckpt_dir} has {what} '{unexpected[0]}', which the model lacks "
            f"({len(unexpected)} unexpected in all); " + hint
        )


def _shapes(tensors: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(t.shape)) for name, t in tensors.items()]


def _prepare(
    ckpt_dir: Path,
    index: CheckpointIndex,
    model,
    optimizer,
    module_tensors: dict[str, torch.Tensor],
    rng_meta: dict | None,
    checksums: bool,
) -> tuple[list, rng_states.RngState | None]:
    """What this rank reads, after checking every file it reads (headers, checksums; all files' sizes) and
    reading its RNG state: (plan, RNG state). Nothing of the model is touched yet."""
    plan = []  # (kind, global name, start in the flat tensor, destination)
    states = index.optimizer["states"] if optimizer is not None else []
    for piece in model.main_params:
        if not piece.holds:
            continue
        numel, instance = piece.shape.numel(), instance_of(piece.group.layout, piece.group.coord)

        def start(kind: str, piece=piece, numel=numel, instance=instance) -> int:
            first = instance * numel + piece.start
            return source_range(index, kind, piece.name, numel, first, first + piece.param.numel())[0]

        # Read in place into fp32 masters; into a copy where they are a bf16 shard plus a remainder (split by `_fill`).
        master = piece.param.detach().view(-1) if piece.group.remainder is None else torch.empty(piece.param.numel())
        plan.append((MAIN, piece.name, start(MAIN), master))
        for kind in states:
            dtype = torch_dtype(index.tensors[kind][piece.name].dtype)
            plan.append((kind, piece.name, start(kind), torch.empty(piece.param.numel(), dtype=dtype)))
    plan += _outer_plan(index, model)
    for name, tensor in module_tensors.items():
        plan.append((UNSHARDED, name, 0, torch.empty(tensor.numel(), dtype=torch_dtype(index.unsharded[name].dtype))))
    reader = CheckpointReader(ckpt_dir, index)
    files = {rng_meta["file"]} if rng_meta else set()
    for kind, name, start, out in plan:
        files |= reader.files_for(kind, name, start, start + out.numel())
    check_present(ckpt_dir, index)
    check_files(ckpt_dir, index, files, checksums=checksums)
    return plan, rng_states.read(ckpt_dir, rng_meta) if rng_meta else None


def _outer_plan(index: CheckpointIndex, model) -> list:
    """What this rank reads of DiLoCo's outer state, in place: the global weights and the momentum over its outer
    piece, the anchor over its optimizer piece (the global weights where the checkpoint keeps no anchor)."""
    if model.outer is None or index.outer is None:
        return []
    plan = []
    for piece in model.outer.pieces():
        state, numel = piece.state, piece.stop - piece.start
        plan.append((OUTER_MAIN, piece.name, piece.start, state.theta.detach()[piece.offset : piece.offset + numel]))
        momentum = model.outer.momentum(state)
        if momentum is not None and OUTER_MOMENTUM in index.tensors:
            plan.append((OUTER_MOMENTUM, piece.name, piece.start, momentum[piece.offset : piece.offset + numel]))
    anchor_kind = OUTER_ANCHOR if OUTER_ANCHOR in index.tensors else OUTER_MAIN
    states = {id(s.group): s for s in model.outer.states}
    for piece in model.main_params:
        state = states[id(piece.group)]
        if piece.holds and state.anchor is not None:
            numel = piece.stop - piece.start
            plan.append((anchor_kind, piece.name, piece.start, state.anchor[piece.offset : piece.offset + numel]))
    return plan


def _fill(ckpt_dir: Path, index: CheckpointIndex, model, module_tensors, plan) -> dict[tuple[str, str], torch.Tensor]:
    """Read the planned ranges into the main weights and the module's unsharded tensors; return the optimizer
    states read, by (kind, global name)."""
    states = {}
    model.wait_for_weights()  # the last step's gathers may still read the main weights
    split = {p.name: p for p in model.main_params if p.group.remainder is not None}
    with CheckpointReader(ckpt_dir, index) as reader, torch.no_grad():
        for group in model.groups:
            group.zero_master()  # padding stays zero
        if model.outer is not None and index.outer is not None:
            for state in model.outer.states:
                for tensor in (state.theta.detach(), model.outer.momentum(state), state.anchor):
                    if tensor is not None:
                        tensor.zero_()
        for kind, name, start, out in plan:
            reader.read_into(kind, name, start, out)
            if kind == UNSHARDED:
                module_tensors[name].copy_(out.view(module_tensors[name].shape))
            elif kind == MAIN and name in split:  # masters kept as a bf16 shard plus a remainder
                split[name].write_master(out)
            elif kind != MAIN and kind not in OUTER_KINDS:
                states[kind, name] = out
    return states
