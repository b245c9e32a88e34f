"""What a resumed run keeps from its checkpoint: the global batch, and after a restart on another world the inner size.

A run's global batch is part of what it *is* (with the step count it fixes how many samples
each step trains on), while the micro-batch count per rank is how a world happens to split
it. So a resume keeps the checkpoint's global batch unless the user sets one, and the count
of microbatches follows the new world (`keep_batch`). A restart on another number of ranks
(a node lost or back under `torchrun --nnodes MIN:MAX`, or `--min-nproc` locally) keeps the
inner size, the ranks of one instance, and changes the number of instances
(`on_world`). Where the batch or the layout cannot be split over a world, the problem
names the sizes that work. Nothing here imports torch: the launcher calls it before any
rank starts (under torchrun every rank calls it, with its own WORLD_SIZE).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hfsdp.cli.settings.train_config import Given, TrainConfig, resolve
from hfsdp.core.rules.config import ConfigError, Problem

#: A Given's source: the value came from the checkpoint the run resumes (or from the run itself, on a restart).
CHECKPOINT = "checkpoint"


def derive(given: Mapping[str, Given], nproc: int, **values: Given) -> TrainConfig:
    """The run `given` describes, with some settings replaced, every rule checked again; raises ConfigError."""
    return resolve({**given, **values}, nproc=nproc)


def keep_batch(cfg: TrainConfig, saved: dict[str, Any], where: str) -> TrainConfig:
    """Resume with the checkpoint's global batch (`saved` is its layout record) unless the user set one.

    Raises ConfigError, naming the sizes that work, when that batch cannot be split over this run's ranks.
    """
    batch = saved.get("global_batch_size")
    if batch is None or cfg.explicit("global_batch_size") or batch == cfg.layout.global_batch_size:
        return cfg
    try:
        return derive(cfg.given, cfg.nproc, global_batch_size=Given(batch, "the checkpoint's global batch", CHECKPOINT))
    except ConfigError as err:
        raise ConfigError([Problem("--load", unsplittable(cfg, batch, where))]) from err


def unsplittable(cfg: TrainConfig, batch: int, where: str) -> str:
    """Why the checkpoint's global batch `batch` cannot be trained on this run's ranks, and the sizes that can."""
    dp, micro = cfg.layout.dp, cfg.layout.micro_batch_size
    return (
        f"the checkpoint {where} trained with a global batch of {batch} sequences per step, which "
        f"{split_advice(batch, micro, dp, '--micro-batch-size')} Resume on one of those, or set --global-batch-size "
        f"to change the run's batch (a multiple of {micro * dp}; the learning-rate schedule keeps counting steps)."
    )


def split_advice(batch: int, micro: int, dp: int, micro_flag: str) -> str:
    """'does not split over 3 ranks with --micro-batch-size 2 (...). Numbers of ranks that split it ...: ...'."""
    worlds = [w for w in range(1, batch // micro + 1) if batch % (micro * w) == 0]
    micros = [m for m in range(1, batch // dp + 1) if batch % (m * dp) == 0]
    ranks = f"{dp} rank{'s' if dp != 1 else ''}"
    return (
        f"does not split over {ranks} with {micro_flag} {micro} (it is not a multiple of {micro} x {dp} = "
        f"{micro * dp}). Numbers of ranks that split it with {micro_flag} {micro}: {_listed(worlds)}; micro-batch "
        f"sizes that split it over {ranks}: {_listed(micros)}."
    )


def on_world(given: Mapping[str, Given], world: int, inner: int, batch: int | None, **values: Given) -> TrainConfig:
    """The run on `world` ranks after a restart: `inner` ranks per instance, world / inner instances, its global
    batch `batch` kept (and any other `values` replaced). Raises ConfigError naming the world sizes that work."""
    if world % inner:
        why = f"{world} is not a multiple of the {inner} ranks of one instance."
    else:
        try:
            return derive(given, world, **_world_values(given, world, inner, batch), **values)
        except ConfigError as err:
            why = " ".join(p.message for p in err.problems)
    first = given["world_size"].value if "world_size" in given and isinstance(given["world_size"].value, int) else 0
    works = working_worlds(given, inner, batch, up_to=2 * max(world, first, inner))
    raise ConfigError(
        [
            Problem(
                "world size",
                f"the run cannot continue on {world} ranks: {why} It keeps {inner} ranks per instance and its global "
                f"batch of {batch} sequences; world sizes that work: {_listed(works)}.",
            )
        ]
    )


def working_worlds(given: Mapping[str, Given], inner: int, batch: int | None, up_to: int) -> list[int]:
    """World sizes on which the run, keeping `inner` ranks per instance and its global batch, is a valid layout."""
    found = []
    for world in range(inner, up_to + 1, inner):
        try:
            derive(given, world, **_world_values(given, world, inner, batch))  # a multiple of inner
        except ConfigError:
            continue
        found.append(world)
    return found


def _world_values(given: Mapping[str, Given], world: int, inner: int, batch: int | None) -> dict[str, Given]:
    spelled = given["world_size"].spelled if "world_size" in given else "WORLD_SIZE"
    values = {
        "world_size": Given(world, spelled, CHECKPOINT),
        "instances": Given(world // inner, "--instances", CHECKPOINT),
    }
    if batch is not None:
        values["global_batch_size"] = Given(batch, "the run's global batch", CHECKPOINT)
    return values


def _listed(sizes: list[int]) -> str:
    if not sizes:
        return "none"
    shown = [str(s) for s in sizes[:8]]
    return ", ".join(shown) + (", ..." if len(sizes) > 8 else "")
