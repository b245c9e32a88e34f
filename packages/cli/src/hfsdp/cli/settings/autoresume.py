"""Where a restarted run resumes: the newest checkpoint that this run itself published, found by the run's id.

A restart must continue *this* run, never an older one whose checkpoints share the `--save`
root, and every rank of every node must reach the same answer without talking to the
others (under torchrun the ranks decide before their process group exists). So every save
records the run's id in its `extra` (`RUN_ID_KEY`): the launcher's id, the same for all its
attempts, or torchrun's `--rdzv-id` (one per job: SLURM's job id, so a requeued job
continues too). A start whose `--save` root's `latest` carries this id resumes from it; one
without such a checkpoint starts where the run started (`--load`, or step 0).

The resumed run keeps the checkpoint's inner size (ranks per instance) and global batch on
whatever world it now has (`continuation.on_world`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from hfsdp.cli.settings.continuation import CHECKPOINT, on_world
from hfsdp.cli.settings.train_config import DEFAULT, ENV, Given, TrainConfig

#: Where a checkpoint's `extra` records the id of the run that saved it.
RUN_ID_KEY = "run_id"
#: Set by hfsdp's launcher for its ranks: the run's id, one for all its attempts.
RUN_ID_ENV = "HFSDP_RUN_ID"


def run_id() -> str | None:
    """This run's id: hfsdp's launcher's, else torchrun's (`--rdzv-id`), else None (no launcher)."""
    return os.environ.get(RUN_ID_ENV) or os.environ.get("TORCHELASTIC_RUN_ID")


def torchrun_restarts(given: Mapping[str, Given]) -> Given | None:
    """torchrun's `--max-restarts` as the run's setting (None outside torchrun, or when torchrun restarts nothing)."""
    count = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if count <= 0 and not given["max_restarts"].value:
        return None
    return Given(count, "torchrun's --max-restarts", ENV)


def own_checkpoint(save: object, run: str | None) -> tuple[Path, object] | None:
    """(directory, index) of the checkpoint `save`'s `latest` names, when run `run` saved it; else None."""
    from hfsdp.ckpt import CheckpointError, read_index, resolve

    if not isinstance(save, str) or not save.strip() or run is None or not Path(save).is_dir():
        return None
    try:
        directory = resolve(save)
        index = read_index(directory)
    except (CheckpointError, OSError):
        return None
    return (directory, index) if index.extra.get(RUN_ID_KEY) == run else None


def resume_own(given: Mapping[str, Given], world: int, directory: Path, index) -> TrainConfig:
    """The run resumed from its own checkpoint on `world` ranks: that checkpoint's inner size and global batch (or
    the user's explicit one), `--load` the checkpoint. Raises ConfigError naming the world sizes that work."""
    layout = index.layout
    inner = layout["world_size"] // layout["instances"]
    batch = given["global_batch_size"]
    run_batch = batch.value if batch.source != DEFAULT else layout.get("global_batch_size")
    return on_world(given, world, inner, run_batch, load=Given(str(directory), "--load", CHECKPOINT))
