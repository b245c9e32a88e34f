"""Online save: every rank writes its own file, rank 0 writes the index, one rename publishes it.

1. Ranks exchange their group structures (expert groups differ per ep rank) and
   plan the writes: each piece of each parameter is written once, by one of the
   replicas that hold it (`pieces.plan_writes`).
2. Rank 0 makes `ROOT/.tmp-step-N-<nonce>/`; each rank streams its pieces of
   every state kind, the unsharded module tensors it owns (buffers, frozen
   parameters: rank 0 the dense ones) and its RNG state into
   `rank-XXXXX.safetensors`, fsyncs.
3. Ranks exchange checksums (or errors). Rank 0 writes `index.json`, fsyncs,
   renames the directory to `ROOT/step-N/`, then replaces `ROOT/latest`.
4. Rank 0 tells everyone how it went, so every rank returns or raises together.

A crash before the rename leaves only a hidden temporary directory (removed by
the next save); a crash after it leaves a complete checkpoint.
"""

from __future__ import annotations

import random
import secrets
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hfsdp.ckpt.agree import agree
from hfsdp.ckpt.build import file_entries, index_tensors, index_unsharded, plan_unsharded, write_index
from hfsdp.ckpt.errors import CheckpointError
from hfsdp.ckpt.groups import canonical_groups, merged_order
from hfsdp.ckpt.index import INDEX_NAME, MODEL, CheckpointIndex, TensorEntry, meshes_of
from hfsdp.ckpt.model_state import buffers, local_groups, local_order, optimizer_meta, state_kinds, unsharded_state
from hfsdp.ckpt.pieces import file_name, plan_writes, unsharded_owner
from hfsdp.ckpt.store import TMP_PREFIX, atomic_write_text, publish_dir, remove_quietly, step_dir_name
from hfsdp.ckpt.writer import TensorFileWriter, dtype_name


def save_checkpoint(
    root: str | Path, model, optimizer=None, *, step: int, extra: dict[str, Any] | None = None, save_rng: bool = True
) -> Path:
    """Save `model` (and `optimizer`) as `root/step-{step}` and point `root/latest` at it; collective.

    `extra` (JSON-serialisable: data position, scheduler state, ...) comes back
    from `load_checkpoint`. Returns the checkpoint directory on every rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(root)
    final = root / step_dir_name(step)
    module_tensors = unsharded_state(model)
    mine = agree(lambda: (local_groups(model, rank), local_order(model), _specs(module_tensors)))
    reports = [None] * world
    dist.all_gather_object(reports, mine)
    groups = canonical_groups([r[0] for r in reports], model.config.ep)
    order = merged_order([reports[e][1] for e in range(model.config.ep)])
    unsharded = agree(lambda: _unsharded_specs(model.config, [r[2] for r in reports]))
    plan = plan_writes(model.config, groups)
    kinds = state_kinds(optimizer)
    dtypes = agree(lambda: _dtypes(model, optimizer, groups))

    tmp_name = [_make_tmp(root, final, step) if rank == 0 else None]
    dist.broadcast_object_list(tmp_name, src=0)
    if isinstance(tmp_name[0], CheckpointError):
        raise tmp_name[0]
    tmp = root / tmp_name[0]

    rng = _rng_tensors() if save_rng else {}
    try:
        owned = {name: module_tensors[name] for name in plan_unsharded(model.config, unsharded).get(rank, {})}
        result: Any = _write_rank_file(tmp, model, optimizer, rank, plan[rank], kinds, dtypes, rng, owned)
    except (OSError, CheckpointError) as err:
        result = CheckpointError(f"Rank {rank} could not write its file in {tmp}: {err}")
    results = [None] * world
    dist.all_gather_object(results, result)

    status: list[Any] = [None]
    if rank == 0:
        index = CheckpointIndex(
            step=step,
            layout=model.config.to_dict(),
            meshes=meshes_of(model.config),
            extra=dict(extra or {}),
            optimizer=optimizer_meta(optimizer),
            groups=groups,
            tensors={},
            files={},
            order=order,
            unsharded=index_unsharded(model.config, unsharded),
        )
        status[0] = _publish(root, tmp, final, index, (plan, kinds, dtypes), results)
    dist.broadcast_object_list(status, src=0)
    if isinstance(status[0], CheckpointError):
        raise status[0]
    return final


def _make_tmp(root: Path, final: Path, step: int) -> str | CheckpointError:
    if final.exists():
        return CheckpointError(
            f"{final} already exists; a save never overwrites a checkpoint. Save under another step, "
            "or delete the old directory first."
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in [*root.glob(f"{TMP_PREFIX}step-*"), *root.glob(f"{TMP_PREFIX}latest-*")]:  # crashed saves
            if stale.is_dir():
                remove_quietly(stale)
            else:
                stale.unlink(missing_ok=True)
        name = f"{TMP_PREFIX}step-{step}-{secrets.token_hex(4)}"
        (root / name).mkdir()
        return name
    except OSError as err:
        return CheckpointError(f"Cannot create a checkpoint directory in {root} ({err}); check the path and rights.")


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["rng/torch_cuda"] = torch.cuda.get_rng_state()
    return out


def _dtypes(model, optimizer, groups) -> dict[tuple[str, str], str]:
    """dtype of every (kind, global name): the group's compute dtype for "model", the buffer's dtype otherwise."""
    if not model.groups:
        return {}
    kinds = {kind: dtype_name(buf.dtype) for kind, (buf, _) in buffers(model, optimizer, 0).items()}
    out = {}
    for group in groups:
        for name, _ in group.members:
            for kind, dtype in kinds.items():
                out[kind, name] = group.dtype if kind == MODEL else dtype
    return out


def _specs(tensors: dict[str, torch.Tensor]) -> dict[str, TensorEntry]:
    return {name: TensorEntry(tuple(t.shape), dtype_name(t.dtype)) for name, t in tensors.items()}


def _unsharded_specs(cfg, reports: list[dict[str, TensorEntry]]) -> dict[str, TensorEntry]:
    """Every rank's unsharded tensors merged; the rank that writes each one must hold it, all with one shape."""
    merged: dict[str, TensorEntry] = {}
    for rank, specs in enumerate(reports):
        for name, spec in specs.items():
            seen = merged.setdefault(name, spec)
            if (seen.shape, seen.dtype) != (spec.shape, spec.dtype):
                raise CheckpointError(
                    f"The module tensor '{name}' (a buffer or frozen parameter) is {seen.dtype} {list(seen.shape)} "
                    f"on one rank but {spec.dtype} {list(spec.shape)} on rank {rank}; every rank must build the same "
                    "model. Fix the model construction so all ranks agree."
                )
    for name in merged:
        owner = unsharded_owner(cfg, name)
        if name not in reports[owner]:
            raise CheckpointError(
                f"The module tensor '{name}' (a buffer or frozen parameter) exists on some ranks but not on rank "
                f"{owner}, which saves it; every rank must build the same model (experts: every rank of an "
                "expert-parallel rank). Fix the model construction so all ranks agree."
            )
    return merged


def _write_rank_file(tmp, model, optimizer, rank, items, kinds, dtypes, rng, owned) -> dict[str, Any] | None:
    """Stream this rank's planned pieces of every kind, the unsharded tensors it owns (`owned`: global name ->
    module tensor), then its RNG state; return the file's metadata."""
    entries = file_entries(items, kinds, dtypes, rng, _specs(owned))
    if not entries:
        return None
    local = {}  # global name -> (group index, flat offset of the member)
    for gi, group in enumerate(model.groups):
        for slot in group.slots:
            local[model.global_name(group, slot.name)] = (gi, slot.offset)
    writer = TensorFileWriter(tmp / file_name(rank), entries)
    try:
        for kind in kinds:
            for it in items:
                gi, offset = local[it.name]
                buf, base = buffers(model, optimizer, gi)[kind]
                writer.write(buf[offset + it.start - base : offset + it.stop - base])
        for tensor in owned.values():
            writer.write(tensor.detach())
        for tensor in rng.values():
            writer.write(tensor)
        entry = writer.finish()
    except BaseException:
        writer.abort()
        raise
    state = random.getstate()
    rng_meta = {"file": file_name(rank), "keys": list(rng), "python": [state[0], list(state[1]), state[2]]}
    return {"file": file_name(rank), "entry": entry, "rng": rng_meta if rng else None}


def _publish(root, tmp, final, index, planned, results) -> CheckpointError | None:
    """Rank 0: complete the index with the files, write it, rename, point `latest`; return the error, if any."""
    failures = [r for r in results if isinstance(r, CheckpointError)]
    if failures:
        remove_quietly(tmp)
        return failures[0]
    try:
        files, rng, has_file = {}, {}, set()
        for rank, result in enumerate(results):
            if result is None:
                continue
            has_file.add(rank)
            files[result["file"]] = result["entry"]
            if result["rng"] is not None:
                rng[str(rank)] = result["rng"]
        plan, kinds, dtypes = planned
        index.tensors = index_tensors(plan, index.groups, kinds, dtypes, has_file)
        index.files, index.rng = dict(sorted(files.items())), rng
        write_index(tmp, index)
        publish_dir(tmp, final)
        atomic_write_text(root / "latest", final.name + "\n")
    except (OSError, TypeError, ValueError, CheckpointError) as err:
        remove_quietly(tmp)
        if isinstance(err, CheckpointError):
            return err
        return CheckpointError(
            f"Could not write the index {tmp / INDEX_NAME} ({type(err).__name__}: {err}); nothing was published and "
            "the previous checkpoint is still the latest. Check that `extra` is JSON-serialisable and the disk has "
            "room."
        )
    return None
