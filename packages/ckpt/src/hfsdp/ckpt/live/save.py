"""Online save: every rank writes its own file, rank 0 writes the index, one rename publishes it.

1. Ranks exchange their group structures (expert groups differ per ep rank) and
   plan the writes: each piece of each parameter is written once, by one of the
   replicas that hold it (`pieces.sections`).
2. Rank 0 makes `ROOT/.tmp-step-N-<nonce>/` (and holds it locked, see
   `staging.py`); each rank streams its pieces of every state kind, the
   unsharded module tensors it owns (buffers, frozen parameters: rank 0 the
   dense ones) and its RNG state into `rank-XXXXX.safetensors`, fsyncs.
3. Ranks exchange checksums (or errors). Rank 0 writes `index.json` and its
   checksum, fsyncs, renames the directory to `ROOT/step-N/`, then replaces
   `ROOT/latest`.
4. Rank 0 tells everyone how it went, so every rank returns or raises together.

With DiLoCo every instance's own weights and inner optimizer state are written
(per-instance kinds: ranks of different instances are not replicas), and the
outer state once over all instances (`pieces.sections`); the index records the
settings and the optimizer steps done, so a resume continues mid-cycle exactly.

The code has the same three phases, so that an asynchronous save is this save
and not a second saver: `prepare_save` (1 and the staging directory; collective),
`PreparedSave.snapshot` and `Snapshot.write` (2; the only phase that takes time,
and the only one with no collective and no engine call once the snapshot holds
copies, so it may run on a background thread: `async_save.py`), and
`PreparedSave.publish` (3 and 4; collective).

A crash before the rename leaves only a hidden temporary directory (removed by
the next save); a crash after it leaves a complete checkpoint that `latest`
does not name yet: unpublished (`store.py`). Readers of the root keep using the
step `latest` names, and a later save of the same step replaces the orphan: it
is moved aside just before the new directory is renamed into place, and
removed once `latest` names the new one. A published step is never replaced.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.fields import INT64_MAX
from hfsdp.ckpt.format.groups import canonical_groups, merged_order
from hfsdp.ckpt.format.index import MAIN, MODEL, CheckpointIndex, TensorEntry, meshes_of
from hfsdp.ckpt.format.index_file import write_index
from hfsdp.ckpt.format.model_record import checked_record
from hfsdp.ckpt.format.names import entry_kind
from hfsdp.ckpt.format.pieces import file_name, sections, unsharded_owner
from hfsdp.ckpt.format.staging import Staging, clean_stale, publish_dir, remove_quietly, staging_pattern
from hfsdp.ckpt.format.store import LATEST, TMP_PREFIX, atomic_write_text, is_unpublished, latest_step, step_dir_name
from hfsdp.ckpt.live import optim_state
from hfsdp.ckpt.live import rng as rng_states
from hfsdp.ckpt.live.agree import agree, as_checkpoint_error
from hfsdp.ckpt.live.model_state import (
    engine_of,
    local_groups,
    local_order,
    outer_kinds,
    outer_record,
    piece_tensors,
    unsharded_state,
)
from hfsdp.ckpt.tensors.build import file_entries, index_tensors, index_unsharded, plan_unsharded
from hfsdp.ckpt.tensors.writer import TensorFileWriter, dtype_name

#: What killed saves leave in a root: staging directories, orphans moved aside, temporary `latest` files.
LEFTOVERS = staging_pattern(r"(?:step-[0-9]+(?:-replaced)?|latest)")


def save_checkpoint(
    root: str | Path,
    model,
    optimizer=None,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
    save_rng: bool = True,
    model_record: dict[str, Any] | None = None,
) -> Path:
    """Save `model` (and `optimizer`) as `root/step-{step}` and point `root/latest` at it; collective.

    `extra` (JSON-serialisable: data position, scheduler state, ...) comes back
    from `load_checkpoint`. `model_record` says which model the weights are
    ({"format": "transformers", "config": hf_config.to_dict()} or {"format":
    "megatron-gpt", "config": shape.record()}), so that `export` can write a
    Hugging Face directory (`model_record.py`). Returns the checkpoint
    directory on every rank.
    """
    prepared = prepare_save(
        root, model, optimizer, step=step, extra=extra, save_rng=save_rng, model_record=model_record
    )
    return prepared.publish(prepared.snapshot().write())


def prepare_save(
    root: str | Path,
    model,
    optimizer=None,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
    save_rng: bool = True,
    model_record: dict[str, Any] | None = None,
) -> PreparedSave:
    """Phase 1 of a save, collective: agree on what every rank writes and make (and lock) the staging directory.

    Then `snapshot()` takes this rank's tensors (views, or copies into host memory), `Snapshot.write()` writes
    them (no collectives: any thread may run it), and `publish(result)` (collective) exchanges every rank's
    result and, if all wrote, makes the checkpoint the latest. `save_checkpoint` is the three in a row;
    `AsyncSaver` runs the write on a background thread and publishes at a later step boundary.
    """
    model = engine_of(model)  # the engine state: every helper below reads and writes through it
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(root)
    agree(lambda: _check_step(step))
    record = agree(lambda: checked_record(model_record))
    final = root / step_dir_name(step)
    module_tensors = unsharded_state(model)
    mine = agree(
        lambda: (
            local_groups(model, rank),
            local_order(model),
            _specs(module_tensors),
            None if optimizer is None else optim_state.local_report(model, optimizer),
        )
    )
    reports = [None] * world
    dist.all_gather_object(reports, mine)
    groups = canonical_groups([r[0] for r in reports], model.config.ep)
    order = merged_order([reports[e][1] for e in range(model.config.ep)])
    unsharded = agree(lambda: _unsharded_specs(model.config, [r[2] for r in reports]))
    optim_record = agree(lambda: optim_state.merge_reports([r[3] for r in reports]))
    kinds = [MODEL, MAIN, *(optim_record["states"] if optim_record else []), *outer_kinds(model)]
    plan = sections(model.config, groups, kinds, model.outer is not None)
    dtypes = _dtypes(groups, optim_state.state_dtypes([r[3] for r in reports]), outer_kinds(model))
    index = CheckpointIndex(
        step=step,
        layout=model.config.to_dict(),
        meshes=meshes_of(model.config),
        extra=dict(extra or {}),
        optimizer=optim_record,
        groups=groups,
        tensors={},
        files={},
        order=order,
        unsharded=index_unsharded(model.config, unsharded),
        model=record,
        outer=outer_record(model),
    )

    stage = _make_staging(root, final, step) if rank == 0 else None
    tmp_name = [stage.path.name if isinstance(stage, Staging) else stage]
    dist.broadcast_object_list(tmp_name, src=0)
    if isinstance(tmp_name[0], CheckpointError):
        raise tmp_name[0]
    owned = {name: module_tensors[name] for name in plan_unsharded(model.config, unsharded).get(rank, {})}
    return PreparedSave(
        root, final, root / tmp_name[0], stage if isinstance(stage, Staging) else None, index,
        (plan, kinds, dtypes), model, optimizer, rank, save_rng, owned,
    )  # fmt: skip


class PreparedSave:
    """A save whose every rank agreed on the plan, its staging directory made: snapshot, write, then publish."""

    def __init__(self, root, final, tmp, stage, index, planned, model, optimizer, rank, save_rng, owned):
        self.root, self.final, self.tmp, self._stage, self.index = root, final, tmp, stage, index
        self._planned, self._model, self._optimizer, self.rank = planned, model, optimizer, rank
        self._save_rng, self._owned = save_rng, owned

    def snapshot(self, copy=None) -> Snapshot:
        """This rank's tensors to write: the live ones, or `copy(tensors)` of them (host copies that training may
        not touch); the RNG state is taken now. Never raises: a failure becomes the result `write` returns."""
        plan, kinds, dtypes = self._planned
        try:
            rng = rng_states.capture() if self._save_rng else ({}, {})
            entries = file_entries(self.rank, plan, dtypes, rng[0], _specs(self._owned))
            tensors: list[torch.Tensor] = []
            if entries:  # in file order: pieces by kind, the module tensors this rank owns, its RNG state
                local = piece_tensors(self._model, self._optimizer, tuple(kinds))
                tensors = [
                    local[kind, it.name] for section in plan for kind in section.kinds for it in section.plan[self.rank]
                ]
                tensors += [t.detach() for t in self._owned.values()] + list(rng[0].values())
                if copy is not None:
                    tensors = copy(tensors)
            return Snapshot(self.tmp, self.rank, entries, tensors, list(rng[0]), rng[1])
        except Exception as err:
            return Snapshot(self.tmp, self.rank, [], [], [], {}, rank_write_failed(self.rank, self.tmp, err))

    def publish(self, result) -> Path:
        """Phase 3, collective: gather every rank's result; rank 0 writes the index and publishes; all return the
        checkpoint directory or all raise the same CheckpointError."""
        world = dist.get_world_size()
        try:
            results = [None] * world
            dist.all_gather_object(results, result)
            status: list[Any] = [None]
            if self.rank == 0:
                try:
                    status[0] = _publish(self.root, self.tmp, self.final, self.index, self._planned, results)
                except Exception as err:  # never leave the other ranks waiting for the broadcast
                    remove_quietly(self.tmp)
                    status[0] = as_checkpoint_error(err)
            dist.broadcast_object_list(status, src=0)
        finally:
            self.release()
        if isinstance(status[0], CheckpointError):
            raise status[0]
        return self.final

    def release(self) -> None:
        """Drop rank 0's lock on the staging directory (publish does; call it when abandoning the save)."""
        if self._stage is not None:
            self._stage.release()
            self._stage = None


class Snapshot:
    """One rank's tensors of a save, ready to write; `write` needs no collective and no engine call."""

    def __init__(self, tmp: Path, rank: int, entries, tensors: list, rng_keys: list, rng_meta: dict, error=None):
        self.tmp, self.rank, self.entries, self.tensors = tmp, rank, entries, tensors
        self.rng_keys, self.rng_meta, self.error = rng_keys, rng_meta, error

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def write(self) -> dict[str, Any] | CheckpointError | None:
        """Stream the tensors into `rank-XXXXX.safetensors`, fsync; return the file's metadata and RNG record, None
        when this rank writes nothing, or the CheckpointError that stopped it (exchanged by `publish`)."""
        if self.error is not None:
            return self.error
        if not self.entries:
            return None
        writer = None
        try:
            writer = TensorFileWriter(self.tmp / file_name(self.rank), self.entries)
            for tensor in self.tensors:
                writer.write(tensor)
            entry = writer.finish()
        except Exception as err:
            if writer is not None:
                writer.abort()
            return rank_write_failed(self.rank, self.tmp, err)
        keys = self.rng_keys
        record = {"file": file_name(self.rank), "keys": keys, **self.rng_meta} if keys else None
        return {"file": file_name(self.rank), "entry": entry, "rng": record}


def rank_write_failed(rank: int, tmp: Path, err: BaseException) -> CheckpointError:
    reason = err if isinstance(err, CheckpointError | OSError) else f"{type(err).__name__}: {err}"
    return CheckpointError(
        f"Rank {rank} could not write its file in {tmp} ({reason}); nothing was published and the previous "
        "checkpoint is still the latest. Check free space and rights on that rank's node, then save again."
    )


def _check_step(step) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= INT64_MAX:
        raise CheckpointError(f"The step to save must be a non-negative whole number, got {step!r}.")


def _make_staging(root: Path, final: Path, step: int) -> Staging | CheckpointError:
    """Rank 0: refuse a published `final`, clear what killed saves left, and make (and lock) the staging directory."""
    try:
        kind = entry_kind(final)
        if kind not in (None, "dir"):
            return CheckpointError(
                f"{final} exists and is not a directory but a {kind}; a save never replaces it. Remove it, or save "
                "under another step."
            )
        if kind == "dir" and not is_unpublished(root, step):
            return CheckpointError(
                f"{final} already exists and is published ('{LATEST}' names step {latest_step(root)}); a save never "
                "overwrites a published checkpoint. Save under another step, or delete the old directory first."
            )
        clean_stale(root, LEFTOVERS)
        return Staging.create(root, f"step-{step}")
    except CheckpointError as err:
        return err
    except OSError as err:
        return CheckpointError(f"Cannot create a checkpoint directory in {root} ({err}); check the path and rights.")


def _dtypes(groups, state_dtypes: dict[str, str], outer: list[str]) -> dict[tuple[str, str], str]:
    """dtype of every (kind, global name): the group's compute dtype for "model", fp32 for "main" and DiLoCo's
    `outer` kinds, the optimizer's for its states."""
    out = {}
    for group in groups:
        for name, _ in group.members:
            out[MODEL, name] = group.dtype
            out[MAIN, name] = "float32"
            for kind, dtype in state_dtypes.items():
                out[kind, name] = dtype
            for kind in outer:
                out[kind, name] = "float32"
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


def _publish(root, tmp, final, index, planned, results) -> CheckpointError | None:
    """Rank 0: complete the index with the files, write it, rename (replacing an unpublished orphan of the same
    step), point `latest`; return the error, if any."""
    failures = [r for r in results if isinstance(r, CheckpointError)]
    if failures:
        remove_quietly(tmp)
        return failures[0]
    aside = None
    try:
        files, rng, has_file = {}, {}, set()
        for rank, result in enumerate(results):
            if result is None:
                continue
            has_file.add(rank)
            files[result["file"]] = result["entry"]
            if result["rng"] is not None:
                rng[str(rank)] = result["rng"]
        plan, _, dtypes = planned
        index.tensors = index_tensors(plan, index.groups, dtypes, has_file)
        index.files, index.rng = dict(sorted(files.items())), rng
        write_index(tmp, index)
        if os.path.lexists(final):  # the orphan of a crashed save of this step (checked in _make_staging)
            aside = root / f"{TMP_PREFIX}{final.name}-replaced-{secrets.token_hex(4)}"
            os.rename(final, aside)
        publish_dir(tmp, final)
        atomic_write_text(root / LATEST, final.name + "\n")
    except Exception as err:
        remove_quietly(tmp)
        if aside is not None and not os.path.lexists(final):
            os.rename(aside, final)  # put the orphan back: the failed save changed nothing
        if isinstance(err, CheckpointError):
            return err
        return CheckpointError(
            f"Could not publish {final} ({type(err).__name__}: {err}); nothing was published and the previous "
            f"checkpoint is still the latest. Check that the disk has room and {root} is writable."
        )
    if aside is not None:
        remove_quietly(aside)
    return None
