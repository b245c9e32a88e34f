"""Measurement helpers for the benchmarks: host timers around functions, profiler summaries, tables.

Nothing here changes what the engines compute. `CallTimers` replaces functions and
methods by timed wrappers (restored by `restore`); `summarize_profile` reads a
`torch.profiler` run and splits its time into compute, communication, copies and
what no operator covers.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

# -- host timers around functions ------------------------------------------------------------


@dataclass
class Tally:
    seconds: float = 0.0  # wall time
    cpu_seconds: float = 0.0  # process CPU time (all threads: gloo's too) over the same intervals
    calls: int = 0


@dataclass
class CallTimers:
    """Wall time the calling thread spends inside wrapped functions, by label, while `enabled`.

    While `annotating`, every timed range is also a `torch.profiler.record_function`
    range with its label, so profiles show the phases and the collectives by name.
    Wrappers of the same `family` do not nest: when a timed collective calls another
    timed collective (hfsdp's `all_reduce` calls `torch.distributed.all_reduce`, which
    calls `Work.wait`), only the outermost call counts. Different families (phases vs
    collectives) nest freely, so a phase's time includes the collectives inside it.
    """

    enabled: bool = False
    annotating: bool = False
    tallies: dict[str, Tally] = field(default_factory=dict)
    _busy: set[str] = field(default_factory=set)
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def reset(self) -> None:
        self.tallies.clear()

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {
            k: {"seconds": v.seconds, "cpu_seconds": v.cpu_seconds, "calls": v.calls}
            for k, v in sorted(self.tallies.items())
        }

    def total(self, prefix: str = "") -> float:
        return sum(v.seconds for k, v in self.tallies.items() if k.startswith(prefix))

    @contextmanager
    def section(self, label: str, family: str | None = None):
        family = family or label
        if not (self.enabled or self.annotating) or family in self._busy:
            yield
            return
        self._busy.add(family)
        enabled = self.enabled
        annotation = torch.profiler.record_function(label) if self.annotating else nullcontext()
        began, began_cpu = time.perf_counter(), time.process_time()
        try:
            with annotation:
                yield
        finally:
            self._busy.discard(family)
            if enabled:
                tally = self.tallies.setdefault(label, Tally())
                tally.seconds += time.perf_counter() - began
                tally.cpu_seconds += time.process_time() - began_cpu
                tally.calls += 1

    def wrap(
        self,
        owner: object,
        attr: str,
        label: str,
        family: str | None = None,
        skip: Callable[..., bool] | None = None,
    ) -> None:
        """Replace `owner.attr` (a module function or a class method) by a timed wrapper.

        Calls for which `skip(*args, **kwargs)` is true run untimed, and so does every call of
        the same family inside them.
        """
        original = getattr(owner, attr, None)
        if original is None:
            return
        family = family or label

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if not (self.enabled or self.annotating) or family in self._busy:
                return original(*args, **kwargs)
            if skip is not None and skip(*args, **kwargs):
                self._busy.add(family)  # nothing inside a skipped call counts either (its Work.wait)
                try:
                    return original(*args, **kwargs)
                finally:
                    self._busy.discard(family)
            with self.section(label, family):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, original))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def install_comm_timers(timers: CallTimers) -> None:
    """Time every collective the engines issue (label 'comm::<op>', one family so calls never double-count).

    hfsdp's three functions in `hfsdp.core.buffers.collectives` are wrapped (flat_group.py calls
    them through the module), and so are the `torch.distributed` functions FSDP2, the
    clipping and the loss reduction call; `Work.wait` counts the wait of asynchronous ones.
    Calls over one-rank groups (megatron-core's tensor-parallel all-reduces in the loss at
    tp = 1) are not counted. DTensor's functional collectives (FSDP2's gradient-norm
    reduction) are not covered by the host timers; in profiles they show as `wait_tensor`.
    """
    import torch.distributed as dist

    from hfsdp.core.buffers import collectives

    def single_rank(*args, **kwargs) -> bool:
        """A collective over a group of one rank (megatron-core's tensor-parallel group of size 1)."""
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        return group is not None and group.size() == 1

    for name in ("all_gather", "reduce_scatter", "all_reduce"):
        timers.wrap(collectives, name, f"comm::{name}", family="comm", skip=single_rank)
    for name in (
        "all_gather_single",
        "all_gather_into_tensor",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_reduce",
        "broadcast",
        "all_gather",
    ):
        label = "comm::" + name.replace("_single", "").replace("_into_tensor", "").replace("_tensor", "")
        timers.wrap(dist, name, label, family="comm", skip=single_rank)
    timers.wrap(torch._C._distributed_c10d.Work, "wait", "comm::wait", family="comm")


# -- profiler summaries ---------------------------------------------------------------------

STEP_LABEL = "bench::step"
_COMM_WORDS = ("nccl", "gloo", "c10d", "record_param_comms", "all_gather", "allgather", "reduce_scatter")
_COMM_WORDS += ("reduce_scatter", "allreduce", "all_reduce", "broadcast", "barrier", "wait_tensor")
_COPY_OPS = {
    "aten::copy_",
    "aten::_to_copy",
    "aten::to",
    "aten::clone",
    "aten::cat",
    "aten::_chunk_cat",
    "aten::split_with_sizes_copy",
    "aten::zero_",
    "aten::fill_",
    "fsdp::all_gather_copy_in",
    "fsdp::split_with_sizes_copy",
    "fsdp::chunk_cat",
}
_COPY_KERNEL_WORDS = ("memcpy", "memset", "copy", "chunk_cat", "catarray", "split_with_sizes", "fillfunctor")


def _is_comm(name: str) -> bool:
    """A collective op or our wrapper around one; engine annotations (FSDP::all_gather) are not, their
    self time is Python around the collective."""
    if name.startswith("comm::"):
        return True
    if name.startswith(("FSDP::", "hfsdp::", "phase:")):
        return False
    low = name.lower()
    return any(w in low for w in _COMM_WORDS)


def _is_annotation(e) -> bool:
    """A record_function range mirrored on the GPU timeline (gpu_user_annotation), not a kernel."""
    if getattr(e, "is_user_annotation", False):
        return True
    activity = str(getattr(e, "activity_type", "") or "").lower()
    return "annotation" in activity or e.name.startswith(("FSDP::", "hfsdp::", "comm::", "phase:", "bench::"))


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _complement(covered: list[tuple[float, float]], windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of `windows` that no interval of `covered` (sorted, disjoint) overlaps."""
    out = []
    for lo, hi in windows:
        cursor = lo
        for a, b in covered:
            if b <= cursor or a >= hi:
                continue
            if a > cursor:
                out.append((cursor, a))
            cursor = max(cursor, b)
        if cursor < hi:
            out.append((cursor, hi))
    return out


def attribute_idle(events, gaps: list[tuple[float, float]]) -> list[tuple[str, float]]:
    """What the host was doing while the GPU ran nothing: idle time summed by 'phase | engine range | op'.

    For each gap, the innermost host range containing its midpoint, on the thread whose
    innermost range started last (during backward that is the autograd thread, not the
    main thread waiting on it). The GPU idles because the host has not yet launched
    the next kernel, so this names the host work the step waited for.
    """
    by_thread: dict[int, list] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and e.name != STEP_LABEL:
            by_thread.setdefault(e.thread, []).append((e.time_range.start, -e.time_range.end, e.name))
    mids = sorted(((a + b) / 2, b - a) for a, b in gaps)
    chains: list[list[list[str]]] = [[] for _ in mids]  # per gap: each thread's chain (outermost first)
    starts: list[list[float]] = [[] for _ in mids]
    for ranges in by_thread.values():
        ranges.sort()
        stack: list[tuple[float, float, str]] = []
        i = 0
        for g, (mid, _) in enumerate(mids):
            while i < len(ranges) and ranges[i][0] <= mid:
                start, neg_end, name = ranges[i]
                while stack and stack[-1][1] <= start:
                    stack.pop()
                stack.append((start, -neg_end, name))
                i += 1
            live = [r for r in stack if r[1] >= mid]
            if live:
                chains[g].append([r[2] for r in live])
                starts[g].append(live[-1][0])
    totals: dict[str, float] = {}
    for g, (_, length) in enumerate(mids):
        if not chains[g]:
            key = "no host range"
        else:
            chain = chains[g][max(range(len(starts[g])), key=starts[g].__getitem__)]
            every = [name for c in chains[g] for name in c]
            phase = next((n for n in every if n.startswith("phase:")), "-")
            engine = next((n for n in reversed(chain) if n.startswith(("hfsdp::", "FSDP::"))), "-")
            key = f"{phase} | {engine.split(' (')[0]} | {chain[-1][:60]}"
        totals[key] = totals.get(key, 0.0) + length
    return sorted(totals.items(), key=lambda kv: -kv[1])


def summarize_profile(prof, device_type: str) -> dict:
    """Seconds per profiled step of compute, communication, copies and uncovered time.

    CUDA: from the kernels on every stream. `comm_exposed` is time where a collective
    kernel runs and no compute or copy kernel runs on any stream; `idle` is step time
    with no kernel at all (host-bound time).
    CPU: from the self time of the operators on the main thread. Collectives are
    synchronous there, so `comm` is time the thread is blocked in them (including
    waiting for slower ranks); `python_and_hooks` is step time inside no operator:
    Python, hooks, the autograd engine's own work.
    """
    events = list(prof.events())
    # Only the host ranges: on CUDA kineto mirrors every record_function range on the GPU timeline
    # (gpu_user_annotation) under the same name, which would count each step twice.
    steps = [e for e in events if e.name == STEP_LABEL and e.device_type == torch.autograd.DeviceType.CPU]
    if not steps:
        return {"error": f"no '{STEP_LABEL}' ranges in the profile"}
    windows = _union((e.time_range.start, e.time_range.end) for e in steps)
    wall_us = _length(windows)
    per_step = 1e-6 / len(steps)
    if device_type == "cuda":
        kernels = {"comm": [], "copy": [], "compute": []}
        by_name: dict[str, float] = {}  # kernel time by (shortened) kernel name
        for e in events:
            if e.device_type != torch.autograd.DeviceType.CUDA or _is_annotation(e):
                continue
            low = e.name.lower() + " " + str(getattr(e, "activity_type", "") or "").lower()
            kind = "comm" if "nccl" in low else "copy" if any(w in low for w in _COPY_KERNEL_WORDS) else "compute"
            kernels[kind].append((e.time_range.start, e.time_range.end))
            by_name[e.name[:90]] = by_name.get(e.name[:90], 0.0) + (e.time_range.end - e.time_range.start)
        unions = {k: _intersect(_union(v), windows) for k, v in kernels.items()}
        busy = _union(unions["compute"] + unions["copy"])
        every = _union(busy + unions["comm"])
        comm_covered = _length(_intersect(unions["comm"], busy))
        idle = _complement(every, windows)
        out = {
            "source": "CUDA kernels, all streams",
            "step_s": wall_us * per_step,
            "compute_s": _length(unions["compute"]) * per_step,
            "copy_s": _length(unions["copy"]) * per_step,
            "comm_s": _length(unions["comm"]) * per_step,
            "comm_exposed_s": (_length(unions["comm"]) - comm_covered) * per_step,
            "idle_s": (wall_us - _length(every)) * per_step,
            "top_kernels_s": [(n, t * per_step) for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:20]],
            "idle_by_host_activity_s": [(k, t * per_step) for k, t in attribute_idle(events, idle)[:15]],
        }
    else:
        thread = steps[0].thread
        tallies = {"comm": 0.0, "copy": 0.0, "compute": 0.0, "annotations": 0.0}
        for e in events:
            if e.thread != thread or e.device_type != torch.autograd.DeviceType.CPU or e.name == STEP_LABEL:
                continue
            name = e.name
            if _is_comm(name):
                kind = "comm"
            elif name in _COPY_OPS:
                kind = "copy"
            elif name.startswith("aten::"):
                kind = "compute"
            else:
                kind = "annotations"  # record_function ranges, autograd nodes: their self time is Python/engine work
            tallies[kind] += e.self_cpu_time_total
        covered = sum(tallies.values()) - tallies["annotations"]
        out = {
            "source": "CPU operators, main thread (self time)",
            "step_s": wall_us * per_step,
            "compute_s": tallies["compute"] * per_step,
            "copy_s": tallies["copy"] * per_step,
            "comm_s": tallies["comm"] * per_step,
            "comm_exposed_s": tallies["comm"] * per_step,
            "python_and_hooks_s": (wall_us - covered) * per_step,
        }
    try:
        out["peak_step_alloc_mib"] = peak_step_allocation(prof, device_type) / 2**20
    except (AttributeError, RuntimeError):  # kineto event accessors differ between torch versions
        out["peak_step_alloc_mib"] = float("nan")
    top = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and (e.name.startswith(("FSDP::", "hfsdp::"))):
            key = e.name.split(" (")[0].split(" for ")[0]
            top[key] = top.get(key, 0.0) + (e.time_range.end - e.time_range.start) * per_step
    out["annotated_ranges_s"] = dict(sorted(top.items(), key=lambda kv: -kv[1]))
    out["steps"] = len(steps)
    return out


def peak_step_allocation(prof, device_type: str) -> float:
    """Largest rise of allocated `device_type` memory above its level at the start of a step (bytes).

    Needs `profile_memory=True`. On CPU this is the transient memory of a step (gathered
    parameters, activations, gradient buffers) that max RSS cannot show; persistent
    model state comes on top of it.
    """
    wanted = torch.autograd.DeviceType.CUDA if device_type == "cuda" else torch.autograd.DeviceType.CPU
    kineto = prof.profiler.kineto_results.events()
    cpu = torch.autograd.DeviceType.CPU
    steps = sorted((e.start_ns(), e.end_ns()) for e in kineto if e.name() == STEP_LABEL and e.device_type() == cpu)
    memory = sorted((e.start_ns(), e.nbytes()) for e in kineto if e.name() == "[memory]" and e.device_type() == wanted)
    peak, i = 0.0, 0
    for start, end in steps:
        while i < len(memory) and memory[i][0] < start:
            i += 1
        level = 0.0
        while i < len(memory) and memory[i][0] <= end:
            level += memory[i][1]
            peak = max(peak, level)
            i += 1
    return peak


def top_ops(prof, limit: int = 15) -> list[tuple[str, float]]:
    """The operators with the largest self CPU time (seconds summed over the profiled steps)."""
    rows = sorted(prof.key_averages(), key=lambda r: -r.self_cpu_time_total)[:limit]
    return [(r.key, r.self_cpu_time_total * 1e-6) for r in rows]


# -- tables ----------------------------------------------------------------------------------


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
