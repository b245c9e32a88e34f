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

from typing import Any

from hfsdp.cli.train_config import Given, TrainConfig, resolve
from hfsdp.core.config import ConfigError, LayoutConfig, Problem

#: A Given's source: the value came from the checkpoint the run resumes (or from the run itself, on a restart).
CHECKPOINT = "checkpoint"


def derive(cfg: TrainConfig, nproc: int | None = None, **values: Given) -> TrainConfig:
    """`cfg` with some settings replaced (every rule checked again); raises ConfigError."""
    given = {**cfg.given, **values}
    return resolve(given, nproc=nproc if nproc is not None else cfg.nproc)


def keep_batch(cfg: TrainConfig, saved: dict[str, Any], where: str) -> TrainConfig:
    """Resume with the checkpoint's global batch (`saved` is its layout record) unless the user set one.

    Raises ConfigError, naming the sizes that work, when that batch cannot be split over this run's ranks.
    """
    batch = saved.get("global_batch_size")
    if batch is None or cfg.explicit("global_batch_size") or batch == cfg.layout.global_batch_size:
        return cfg
    try:
        return derive(cfg, global_batch_size=Given(batch, "the checkpoint's global batch", CHECKPOINT))
    except ConfigError as err:
        raise ConfigError([Problem("--load", unsplittable(cfg, batch, where))]) from err


def unsplittable(cfg: TrainConfig, batch: int, where: str) -> str:
    """Why the checkpoint's global batch `batch` cannot be trained on this run's ranks, and the sizes that can."""
    dp, micro = cfg.layout.dp, cfg.layout.micro_batch_size
    worlds = [w for w in range(1, batch // micro + 1) if batch % (micro * w) == 0]
    micros = [m for m in range(1, batch // dp + 1) if batch % (m * dp) == 0]
    ranks = f"{dp} rank{'s' if dp != 1 else ''}"
    return (
        f"the checkpoint {where} trained with a global batch of {batch} sequences per step, which does not split over "
        f"{ranks} with --micro-batch-size {micro} (it is not a multiple of {micro} x {dp} = {micro * dp}). Numbers of "
        f"ranks that split it with --micro-batch-size {micro}: {_listed(worlds)}; micro-batch sizes that split it over "
        f"{ranks}: {_listed(micros)}. Resume on one of those, or set --global-batch-size to change the run's batch (a "
        f"multiple of {micro * dp}; the learning-rate schedule keeps counting steps)."
    )


def working_worlds(layout: LayoutConfig, batch: int | None, up_to: int | None = None) -> list[int]:
    """World sizes on which `layout`, with its inner size kept and its instances changed, can train `batch`."""
    inner = layout.inner_size
    limit = up_to or max(4 * layout.world_size, inner)
    found = []
    for world in range(inner, limit + 1, inner):
        try:
            LayoutConfig(**{**layout.to_dict(), "world_size": world, "instances": world // inner,
                            "global_batch_size": batch})  # fmt: skip
        except ConfigError:
            continue
        found.append(world)
    return found


def on_world(cfg: TrainConfig, world: int, inner: int, batch: int | None) -> TrainConfig:
    """The run's layout on `world` ranks after a restart: `inner` ranks per instance, world / inner instances, the
    run's global batch `batch` kept. Raises ConfigError naming the world sizes that work."""
    values: dict[str, Given] = {"world_size": Given(world, cfg.given["world_size"].spelled, CHECKPOINT)}
    if world % inner == 0:
        values["instances"] = Given(world // inner, "--instances", CHECKPOINT)
    if batch is not None:
        values["global_batch_size"] = Given(batch, "the run's global batch", CHECKPOINT)
    problem = None
    if world % inner:
        problem = f"{world} is not a multiple of the {inner} ranks of one instance"
    else:
        try:
            return derive(cfg, nproc=world, **values)
        except ConfigError as err:
            problem = "; ".join(p.message for p in err.problems)
    same = LayoutConfig(**{**cfg.layout.to_dict(), "world_size": inner * cfg.layout.instances,
                           "instances": cfg.layout.instances, "global_batch_size": batch})  # fmt: skip
    raise ConfigError(
        [
            Problem(
                "world size",
                f"the run cannot continue on {world} ranks ({problem}). It keeps {inner} ranks per instance and its "
                f"global batch of {batch}; world sizes that work: {_listed(working_worlds(same, batch))}.",
            )
        ]
    )


def _listed(sizes: list[int]) -> str:
    if not sizes:
        return "none"
    shown = [str(s) for s in sizes[:8]]
    return ", ".join(shown) + (", ..." if len(sizes) > 8 else "")
