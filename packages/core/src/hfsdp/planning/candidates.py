"""Every layout worth considering for a world, each evaluated, and the one to use.

Candidates: the four one-axis layouts (DDP, ZeRO-1, ZeRO-2, ZeRO-3 over all D ranks) and,
for every R > 1 dividing D, every outer/inner pair the layout rules allow (the outer
strategy no stronger than the inner one: HSDP, HFSDP, ZeRO-2 over ZeRO-3, ...), each
checked by core's `LayoutConfig` (so expert-parallel constraints hold too). R = nodes, the
node as the inner size, is the natural hybrid; `standard` marks the layouts a report always
shows. The recommendation is the fastest layout whose peak fits the device's memory.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hfsdp.core.rules.config import ConfigError, LayoutConfig
from hfsdp.core.rules.strategy import Strategy
from hfsdp.planning.activations import activations
from hfsdp.planning.cluster import Cluster
from hfsdp.planning.groups import groups_for, kinds
from hfsdp.planning.memory import Memory, Settings, memory
from hfsdp.planning.model_shape import ModelShape
from hfsdp.planning.timing import StepTime, step_time
from hfsdp.planning.traffic import step_bytes

#: The synchronous layouts: every step reduces over every axis, so each computes the same update and they compete on
#: time and memory alone. DiLoCo changes the optimisation (the instances meet every H steps), so it is not a
#: candidate among them.
PAIRS = [(o, i) for o, i in itertools.product(Strategy.sharding(), Strategy.sharding()) if o.level <= i.level]
NAMED = {
    (Strategy.NO_SHARD, Strategy.OPTIM_GRADS_PARAMS): "HSDP",
    (Strategy.OPTIM, Strategy.OPTIM_GRADS_PARAMS): "HFSDP",
}


@dataclass(frozen=True)
class Evaluated:
    """One layout's predicted memory, traffic and time on rank 0."""

    cfg: LayoutConfig
    memory: Memory
    bytes_per_axis: dict[str, float]
    links: dict[str, str]
    time: StepTime
    fits: bool
    standard: bool

    @property
    def name(self) -> str:
        return layout_name(self.cfg)


def layout_name(cfg: LayoutConfig) -> str:
    """`ZeRO-3 1x8`, `HFSDP 2x4`, `ZeRO-2 over ZeRO-3 2x4`: the name a table shows."""
    shape = f"{cfg.instances}x{cfg.inner_size}"
    if cfg.instances == 1:
        return f"{cfg.inner.zero_name} {shape}"
    named = NAMED.get((cfg.outer, cfg.inner))
    return f"{named or f'{cfg.outer.zero_name} over {cfg.inner.zero_name}'} {shape}"


def candidate_layouts(world: int, gpus_per_node: int = 8, **fields) -> list[LayoutConfig]:
    """Every valid layout of `world` ranks; `fields` are the LayoutConfig fields all of them share (ep, experts,
    batch sizes). Layouts the rules refuse (an expert constraint, say) are left out, and so are hybrids with one rank
    per instance where a node has several GPUs (the outer axis would do all the work of a one-axis layout)."""
    specs = [(Strategy.NO_SHARD, inner, 1) for inner in Strategy.sharding()]
    instances = [r for r in range(2, world + 1) if world % r == 0 and (r < world or gpus_per_node == 1)]
    specs += [(o, i, r) for r in instances for o, i in PAIRS]
    out = []
    for outer, inner, instances in specs:
        try:
            out.append(LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances, **fields))
        except ConfigError:
            continue
    return out


def evaluate(
    shape: ModelShape, cfg: LayoutConfig, cluster: Cluster, run: Settings, mfu: float, standard: bool = False
) -> Evaluated:
    groups = groups_for(shape, cfg, run.fp8_param_gather)
    acts = activations(shape, run.seq, run.micro_batch, run.compute_bytes, run.recompute)
    mem = memory(shape, groups, acts, run)
    sent = step_bytes(groups, run.microbatches, run.compute_bytes, run.reduce_bytes, run.root_resharded)
    links = {}
    for g, _ in kinds(groups):
        for k, axis in enumerate(g.layout.axes):
            if axis.size > 1:
                links[axis.name] = cluster.link(g.layout, k, cfg.ep if g.expert else 1)
    timing = step_time(shape, groups, cluster, run, mfu, cfg.ep)
    fits = mem.total <= cluster.gpu_memory_bytes
    return Evaluated(cfg, mem, sent, links, timing, fits, standard)


def is_standard(cfg: LayoutConfig, cluster: Cluster) -> bool:
    """The layouts a report always shows: the one-axis ones, and the hybrids with one node per instance."""
    if cfg.instances == 1:
        return True
    return cfg.inner_size == cluster.gpus_per_node or (cluster.nodes == 1 and cfg.inner_size * 2 == cfg.world_size)


def plan_layouts(shape: ModelShape, cluster: Cluster, run: Settings, mfu: float, **fields) -> list[Evaluated]:
    """Every candidate evaluated, fastest first (layouts that do not fit after those that do)."""
    rows = [
        evaluate(shape, cfg, cluster, run, mfu, is_standard(cfg, cluster))
        for cfg in candidate_layouts(cluster.world, cluster.gpus_per_node, **fields)
    ]
    return sorted(rows, key=lambda r: (not r.fits, r.time.step_s, r.memory.total))


def recommend(rows: list[Evaluated], cluster: Cluster) -> tuple[Evaluated | None, str]:
    """The fastest layout that fits, and one line saying why (or what to change when none fits)."""
    gib = 2**30
    fitting = [r for r in rows if r.fits]
    if not fitting:
        smallest = min(rows, key=lambda r: r.memory.total)
        return None, (
            f"no layout fits in {cluster.gpu_memory_gib:.1f} GiB per GPU: the smallest, {smallest.name}, needs "
            f"{smallest.memory.total / gib:.1f} GiB; try --recompute, --offload optim, a smaller --micro-batch-size "
            "or more GPUs."
        )
    best = fitting[0]
    line = (
        f"{best.name}: the fastest of the {len(fitting)} layouts that fit, {best.time.step_s:.3f} s per step "
        f"({best.time.exposed_s * 1e3:.1f} ms of communication exposed) at {best.memory.total / gib:.1f} of "
        f"{cluster.gpu_memory_gib:.1f} GiB per GPU"
    )
    if len(fitting) > 1:
        runner = fitting[1]
        slower = 100 * (runner.time.step_s / best.time.step_s - 1)
        line += f"; next, {runner.name}, is {slower:.1f}% slower at {runner.memory.total / gib:.1f} GiB"
    return best, line + "."
