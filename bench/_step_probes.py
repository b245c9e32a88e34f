"""bench_step.py's diagnostics beside the timed steps: host timers around each engine's phases, a profile of a few
extra steps, and a memory trace at every unit's boundaries. None of them runs inside the timed steps unless asked.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from _common import STEP_LABEL, CallTimers, summarize_profile, top_ops
from _engine_base import sync
from _step_model import units_of


def install_phase_timers(timers: CallTimers) -> None:
    """Inclusive host time of each engine's phases (labels 'hfsdp:...' and 'fsdp2:...')."""
    from hfsdp.core.buffers.flat_group import FlatParamGroup
    from hfsdp.core.buffers.grad_buffer import GradBuffer
    from hfsdp.core.engine.unit import ShardedUnit

    try:  # FSDP2's private module; its path and method names may move between torch versions
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        FSDPParamGroup = None

    timers.wrap(FlatParamGroup, "start_unshard", "hfsdp::start_unshard (all-gather)")
    timers.wrap(GradBuffer, "accumulate", "hfsdp::accumulate grads (copy-in, reductions)")
    timers.wrap(FlatParamGroup, "publish_main_weights", "hfsdp::publish_main_weights (cast, gather)")
    timers.wrap(ShardedUnit, "pre_forward", "hfsdp::pre_forward hook", family="hfsdp-hook")
    timers.wrap(ShardedUnit, "post_forward", "hfsdp::post_forward hook", family="hfsdp-hook")
    if FSDPParamGroup is None:
        return
    timers.wrap(FSDPParamGroup, "unshard", "FSDP::unshard (copy-in, all-gather)")
    timers.wrap(FSDPParamGroup, "wait_for_unshard", "FSDP::wait_for_unshard (copy-out)")
    timers.wrap(FSDPParamGroup, "post_backward", "FSDP::post_backward (copy-in, reduce-scatter)")
    timers.wrap(FSDPParamGroup, "finalize_backward", "FSDP::finalize_backward")
    timers.wrap(FSDPParamGroup, "pre_forward", "FSDP::pre_forward hook", family="fsdp-hook")
    timers.wrap(FSDPParamGroup, "post_forward", "FSDP::post_forward hook", family="fsdp-hook")


def trace_memory(engine, microbatches, device) -> list[tuple[str, float, float]]:
    """One step with a mark at every unit's forward and backward boundaries: (mark, allocated MiB, peak MiB since
    the previous mark). Shows which phase holds a step's peak and how much each engine holds there."""
    model = engine.model.module if engine.kind == "hfsdp" else engine.model
    marks: list[tuple[str, float, float]] = []

    def mark(label):
        marks.append(
            (label, torch.cuda.memory_allocated(device) / 2**20, torch.cuda.max_memory_allocated(device) / 2**20)
        )
        torch.cuda.reset_peak_memory_stats(device)

    handles = []
    for i, unit in enumerate(units_of(model)):
        handles.append(unit.register_forward_pre_hook(lambda *_, i=i: mark(f"fwd {i} start")))
        handles.append(unit.register_full_backward_pre_hook(lambda *_, i=i: mark(f"bwd {i} start")))
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        engine.train_step(microbatches)
        torch.cuda.synchronize(device)
        mark("step end")
    finally:
        for handle in handles:
            handle.remove()
    return marks


def profile_engine(engine, batches, args, device) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    engine.timers.annotating = True
    try:
        with profile(activities=activities, profile_memory=True) as prof:
            for microbatches in batches:
                sync(device)
                with record_function(STEP_LABEL):
                    engine.train_step(microbatches)
                    sync(device)
    finally:
        engine.timers.annotating = False
    try:
        summary = summarize_profile(prof, device.type)
        summary["top_self_cpu_ops_s"] = top_ops(prof)
    except Exception as err:  # a profiler API that differs between torch versions must not lose the timings
        summary = {"error": f"{type(err).__name__}: {err}"}
        print(f"rank {dist.get_rank()}: could not summarize the profile of {engine.kind}: {summary['error']}")
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        tag = "".join(c if c.isalnum() else "_" for c in engine.label)[:48]
        prof.export_chrome_trace(os.path.join(args.trace_dir, f"{engine.kind}-{tag}-rank{dist.get_rank()}.json"))
    return summary
