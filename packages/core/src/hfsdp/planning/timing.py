"""Step time: compute from FLOPs, communication from bytes and links, and what the engine's overlap leaves exposed.

Compute: a layer's forward is 2 FLOPs per active weight per token plus attention's
4·s·(query width) per token; backward twice that, recomputation one forward more; the root's
forward is the output layer. Time = FLOPs / (peak x `mfu`), where `mfu` is the efficiency of
the model's forward and backward measured on one GPU. The optimizer step streams 28 bytes per
element of the rank's piece (fused AdamW, fp32 state and gradients; fewer with the precision-aware
optimizer's dtypes, `adamw_bytes_per_element`) at the rate measured on an H200; offloaded, it runs
on the host at the per-element rate measured there.

Overlap (docs/design.md, "CUDA streams"), simulated stream by stream: gathers run on a gather
stream and reductions on a reduce stream, each collective also holding its link (so two
streams on the same link share it, one after the other). In forward each unit starts the next
unit's gather before waiting for its own; in backward the last unit's gather starts with its
own backward and each unit prefetches the one before it; a unit's gradient reduction (and, on
the last microbatch, its once-per-step reductions) is issued when its backward ends and
overlaps the units still to come; the end of backward waits for all reductions. After the
optimizer step the new weights are gathered on the gather stream (ahead of the next forward's
gathers), and each unit's next forward waits for its own; an fp8 group's amax all-reduce, once
per step on the gather stream, is counted with them. Kernel launch and copy times are not
modelled, nor fp8's faster matmuls: compute runs at `mfu` of the given peak, fp8 or not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hfsdp.planning.cluster import Cluster
from hfsdp.planning.groups import Group
from hfsdp.planning.memory import SCALE_BLOCK, Settings, moment_bytes
from hfsdp.planning.model_shape import ModelShape
from hfsdp.planning.traffic import (
    Collective,
    amax_reduction,
    final_reductions,
    microbatch_reduction,
    parameter_gather,
    post_step_gather,
)

#: Fused AdamW reads parameter, gradient and both moments and writes three of them: 28 bytes per element.
ADAMW_BYTES_PER_ELEMENT = 28
#: The rate it streams them at: 805M elements in 7.18 ms on one H200 (docs/benchmarks.md, bench_optimizer.py).
ADAMW_BYTES_PER_S = 805_306_368 * ADAMW_BYTES_PER_ELEMENT / 7.18e-3
#: With the optimizer in host memory, the step cost 0.350 s more for 953.2M elements (0.491 s against 0.141 s on one
#: H200, docs/benchmarks.md): the host AdamW and the copies to and from the host.
HOST_OPTIMIZER_S_PER_ELEMENT = 0.350 / 953_223_168


def adamw_bytes_per_element(run: Settings) -> float:
    """Bytes the fused step streams per element: the fp32 main weight read and written, the gradient read in its
    reduce dtype, each moment read and written in its dtype (fp8 with its block scale): 28 with fp32 state."""
    moments = sum(2 * moment_bytes(d, SCALE_BLOCK) / SCALE_BLOCK for d in run.moment_dtypes)
    return 8 + run.reduce_bytes + moments


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # forward, backward (and recomputation) of every microbatch
    optimizer_s: float
    comm_s: dict[str, float]  # per mesh axis: what its bytes take on its link, overlapped or not
    step_s: float  # the simulated step

    @property
    def exposed_s(self) -> float:
        """Communication the overlap leaves on the critical path."""
        return max(0.0, self.step_s - self.compute_s - self.optimizer_s)


def unit_flops(shape: ModelShape, unit: int, tokens: int, seq: int) -> float:
    """Forward FLOPs of one unit for `tokens` tokens."""
    params = shape.units[unit]
    if unit == len(shape.units) - 1:
        return 2.0 * tokens * params.active_matmul
    return 2.0 * tokens * params.active_matmul + 4.0 * tokens * seq * shape.q_dim


def step_flops(shape: ModelShape, run: Settings) -> float:
    """FLOPs one rank computes in an optimizer step, recomputation included (what its time is made of)."""
    tokens = run.seq * run.micro_batch
    forward = sum(unit_flops(shape, u, tokens, run.seq) for u in range(len(shape.units)))
    layers = forward - unit_flops(shape, len(shape.units) - 1, tokens, run.seq)
    return run.microbatches * (3 * forward + (layers if run.recompute else 0.0))


def model_flops(shape: ModelShape, run: Settings) -> float:
    """The model FLOPs of one rank's optimizer step, what MFU counts: forward and backward of every microbatch,
    never the recomputation (a run that recomputes does more work for the same model FLOPs)."""
    return step_flops(shape, replace(run, recompute=False))


class _Streams:
    """The gather and reduce streams and the two links; a collective waits for its stream and its link."""

    def __init__(self) -> None:
        self.free = {"gather": 0.0, "reduce": 0.0}
        self.link_free: dict[str, float] = {}

    def run(self, stream: str, issued: float, chain: list[tuple[str, float]]) -> float:
        if not chain:
            return issued
        t = max(issued, self.free[stream])
        for link, seconds in chain:
            t = max(t, self.link_free.get(link, 0.0)) + seconds
            self.link_free[link] = t
        self.free[stream] = t
        return t


def step_time(
    shape: ModelShape, groups: list[Group], cluster: Cluster, run: Settings, mfu: float, expert_parallel: int = 1
) -> StepTime:
    """Simulate one steady-state optimizer step of `run.microbatches` microbatches on rank 0."""
    rate = cluster.peak_tflops * 1e12 * mfu
    tokens, c = run.seq * run.micro_batch, run.compute_bytes
    units = len(shape.units)
    root, layers = units - 1, units - 1
    forward = [unit_flops(shape, u, tokens, run.seq) / rate for u in range(units)]
    backward = [2 * f + (f if run.recompute and u != root else 0.0) for u, f in enumerate(forward)]
    comm: dict[str, float] = {}
    by_unit: list[list[tuple[int, Group]]] = [[] for _ in range(units)]
    for index, group in enumerate(groups):
        by_unit[group.unit].append((index, group))
    cache: dict[tuple, tuple] = {}

    def timed(collectives: list[Collective]) -> list[tuple[str, float, str]]:
        out = []
        for col in collectives:
            group = groups[col.group]
            link = cluster.link(
                group.layout, group.layout.names.index(col.axis), expert_parallel if group.expert else 1
            )
            out.append((link, col.bytes_sent / cluster.bandwidth(link), col.axis))
        return out

    def chains(unit: int) -> tuple:
        """(gather, per-microbatch reduction, last-microbatch reductions, post-step gather) of a unit, each a list
        of (link, seconds, axis); computed once per kind of unit."""
        key = tuple((g.is_root, g.expert, g.numel, g.fp8_weights) for _, g in by_unit[unit])  # one layout
        if key not in cache:
            members = by_unit[unit]
            cache[key] = tuple(
                timed([col for i, g in members for col in make(g, i)])
                for make in (
                    lambda g, i: parameter_gather(g, i, "gather", c),
                    lambda g, i: microbatch_reduction(g, i, run.reduce_bytes),
                    lambda g, i: final_reductions(g, i, run.reduce_bytes),
                    lambda g, i: post_step_gather(g, i, c) + amax_reduction(g, i),
                )
            )
        return cache[key]

    per_unit = [tuple([(link, seconds) for link, seconds, _ in steps] for steps in chains(u)) for u in range(units)]
    used: dict[tuple[int, int], int] = {}  # how often each chain ran, for the time per axis

    def chain(unit: int, which: int) -> list[tuple[str, float]]:
        used[unit, which] = used.get((unit, which), 0) + 1
        return per_unit[unit][which]

    gather, reduce_each, reduce_last, publish = 0, 1, 2, 3

    s, t = _Streams(), 0.0
    published = [s.run("gather", 0.0, chain(u, publish)) for u in range(units)]
    for m in range(run.microbatches):
        last = m == run.microbatches - 1
        done = {root: s.run("gather", t, chain(root, gather))}
        if layers:
            done[0] = s.run("gather", t, chain(0, gather))
        t = max(t, done[root], published[root])
        for i in range(layers):
            if i + 1 < layers:
                done[i + 1] = s.run("gather", t, chain(i + 1, gather))
            t = max(t, done[i], published[i]) + forward[i]
        t += forward[root]
        if run.root_resharded:  # freed after forward: gathered again when the loss's gradient reaches it
            t = max(t, s.run("gather", t, chain(root, gather)))
        t += backward[root]
        for i in reversed(range(layers)):
            if i == layers - 1:
                done[i] = s.run("gather", t, chain(i, gather))
            if i > 0:
                done[i - 1] = s.run("gather", t, chain(i - 1, gather))
            t = max(t, done[i]) + backward[i]
            s.run("reduce", t, chain(i, reduce_each) + (chain(i, reduce_last) if last else []))
        s.run("reduce", t, chain(root, reduce_each) + (chain(root, reduce_last) if last else []))
        t = max(t, s.free["reduce"])
    for (unit, which), count in used.items():
        for _, seconds, axis in chains(unit)[which]:
            comm[axis] = comm.get(axis, 0.0) + count * seconds
    elements = sum(g.optim_real for g in groups)
    if run.offload:
        optimizer = elements * HOST_OPTIMIZER_S_PER_ELEMENT
    else:
        optimizer = elements * adamw_bytes_per_element(run) / ADAMW_BYTES_PER_S
    compute = run.microbatches * (sum(forward) + sum(backward))
    return StepTime(compute, optimizer, comm, t + optimizer)
