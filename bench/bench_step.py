"""One training step of a megatron-core GPT or a transformers Llama: hfsdp against PyTorch FSDP2 on the same
model, data, mesh and optimizer.

Launch with torchrun, one process per rank:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 bench/bench_step.py --device cpu \\
        --layers 4 --hidden 256 --heads 8 --vocab 1024 --seq-len 128 --micro-batch-size 2 \\
        --steps 10 --warmup 3 --layouts zero3:1x4,hsdp:2x2,hfsdp:2x2 --engines hfsdp,fsdp2
    torchrun --nproc-per-node 2 bench/bench_step.py --device cuda --dtype bf16 ...

Engines (each layout runs them one after the other in the same process group; the
previous model is freed before the next is built):

- `hfsdp`: `shard_megatron_model` (GPT; the mesh built through the megatron-core adapter)
  or `fully_shard(model, units=model.model.layers)` (Llama), `torch.optim.AdamW` over
  its main params (fused by default, --optimizer), `hfsdp.core.clip_grad_norm_`. bf16:
  fp32 main weights cast at each gather (or a bf16 shard where the optimizer shards
  more than the parameters), fp32 gradient reduction.
- `fsdp2`: `fully_shard` on every `model.decoder.layers[i]`, then on the root, with
  `MixedPrecisionPolicy(param_dtype=bf16 or None, reduce_dtype=fp32)`, on a DeviceMesh of
  the same shape from `init_device_mesh`; the same `torch.optim.AdamW` on its
  DTensors, `torch.nn.utils.clip_grad_norm_`. 1-D mesh ("dp_shard",) for R = 1 (FSDP);
  2-D ("dp_outer", "dp_shard") for R > 1, where FSDP2 does HSDP (replicate over
  dp_outer, shard over dp_shard). FSDP2 has no HFSDP: an `hfsdp:RxN` layout is compared
  with FSDP2 HSDP on the same mesh and labelled so. `zero2` maps to FSDP2 with
  reshard_after_forward=False (SHARD_GRAD_OP: parameters stay gathered from forward
  to backward but are sharded between steps, unlike ZeRO-2). FSDP2 has no
  ZeRO-1/DDP; those layouts run hfsdp only.
- `mfsdp`, `mfsdp2`: Megatron-FSDP's `fully_shard` and its experimental v2 (the
  `megatron-fsdp` package, not a dependency of hfsdp: install it beside), on the same
  mesh, data and AdamW; `_megatron_fsdp.py` says how each is set up and what differs.
- `plain`: the unsharded model on rank 0 alone (other ranks wait), fp32 parameters,
  the same torch.optim.AdamW, rank 0's share of the work (M microbatches of
  micro-batch-size). With --dtype bf16 it runs under torch.autocast(bf16) on CUDA; on
  CPU it runs plain fp32 (no autocast). It is the reference for the overhead of
  sharding on one device: compare it with hfsdp/fsdp2 at world size 1.
- `model`: the model alone on rank 0, its weights in the compute dtype, forward and
  backward with the gradients dropped: no optimizer, no clipping, no engine. It is the
  floor under every engine's step; an engine's step minus it is what the engine costs.
- `fsdp2+float8t`, `fsdp2+float8r`, `model+float8t`, `model+float8r`: FSDP2 and the model alone with the units'
  Linear layers in torchao's float8 (tensorwise, under FSDP2 with its fp8 all-gather and the scales precomputed
  after each step; or rowwise), as torchtitan runs it: the anchor for fp8 (issue 39). torchao is imported only for
  these rows (`_float8.py`); their losses are checked at a looser tolerance, fp8's rounding being no defect.

`--simulate-world N` runs a single process as one rank of an N-rank world on torch's
fake process group, whose collectives move no data. Every allocation is the real
rank's, so it measures per-rank peak memory of any layout (2x4, 4x2, 1x8) on one
device; step times then leave out communication and losses are meaningless (not
checked).

Gradient accumulation (M = global batch / (micro batch x dp) microbatches, 1 by
default): hfsdp averages over microbatches x dp internally; FSDP2 averages over dp
itself, so each FSDP2/plain microbatch loss is divided by M. FSDP2 reduce-scatters
every microbatch (as hfsdp does); with R > 1 its outer all-reduce runs on the last
microbatch only (`set_requires_all_reduce`), as hfsdp's does.

What is measured, per engine and layout (every rank measures; the table shows the
slowest rank's median and the largest memory):
- step time: wall time of one optimizer step (all microbatches, clipping, optimizer,
  zero_grad), synchronized at both ends on CUDA; median (and minimum, the estimate
  least disturbed by other load on a shared machine) over --steps after --warmup,
  pooled over --rounds;
- tokens/s per rank = micro-batch x M x seq-len / median step time;
- memory: CUDA `max_memory_allocated` over the timed steps; CPU max RSS (monotonic over
  the process, so it says little about engines after the first) and, on both, the
  bytes of persistent model state on the rank: hfsdp `state_bytes()` of model and
  optimizer; FSDP2 local shards of parameters + gradients + optimizer state;
- MFU (CUDA), by the field's definition (PaLM, Megatron-LM, torchtitan): model FLOPs (6 x matmul
  parameters + 12 x layers x hidden x seq, per token; recomputation not counted) over the datasheet's
  dense peak of the GPU in the run's dtype (H200 SXM bf16: 989 TFLOP/s; `--peak-tflops` for others),
  and beside it the same FLOPs over the matmul rate measured in the run ("of achievable");
- with `--floor` (CUDA): the bandwidth floor of each hfsdp engine's cost, the bytes its own kernels
  move per step and the fewest its layout must move (`_floor.py`), over the device-to-device copy
  bandwidth measured in the run, against the engine's cost (its step minus the `model` engine's);
- comm blocked: host time inside collective calls (hfsdp.core.buffers.collectives, the
  torch.distributed functions, Work.wait). On gloo calls are synchronous, so this is
  the exposed communication plus waiting for slower ranks; on NCCL it is launch time
  only, and the exposed communication comes from --profile (collective kernels with no
  compute/copy kernel on any stream);
- CPU s/step/rank: process CPU time (user + system, all threads) of one step up to the
  final synchronize, median per rank, mean over ranks. On CPU it is the work a rank
  does, which time-slicing on a shared or oversubscribed CPU does not inflate the way
  it inflates wall time (gloo waits sleep). On CUDA it is the host time to issue the
  step (plus any synchronizing call inside it, which spins): close to the step time
  means the step is host-bound.

This file is the command line and the step loop (`run_engine`, `_main`); the rest lives beside it, one module each:
`_engine_base.py` (the Engine step, TorchOptimizerEngine, the layout's DeviceMesh, device helpers), `_engine_hfsdp.py`
(hfsdp and its `hfsdp+...` variants), `_engine_fsdp2.py`, `_engine_megatron.py` (with `_megatron_fsdp.py`),
`_engine_plain.py` (`plain`, `model`), `_float8.py` (torchao's float8 for the `+float8t|r` rows), `_step_model.py`
(the model, Liger, compile and its recompile limit, FLOPs, the batches), `_step_probes.py` (phase timers, profile,
memory trace), `_step_report.py` (rows and tables) and `_loss_check.py` (the loss agreement every row must pass).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _ceilings import copy_bandwidth, datasheet_peak, matmul_tflops
from _common import CallTimers, install_comm_timers
from _engine_base import SINGLE_DEVICE_ENGINES, Layout, engine_family, free_memory, sync
from _engine_fsdp2 import Fsdp2Engine
from _engine_hfsdp import HfsdpEngine, is_variant
from _engine_megatron import MegatronFsdpEngine
from _engine_plain import ModelOnlyEngine, PlainEngine
from _float8 import (
    FLOAT8_ENGINES,
    FLOAT8_RECIPES,
    Float8Unavailable,
    float8_recipe,
    require_torchao,
    torchao_version,
)
from _loss_check import loss_checks
from _step_model import (
    LIGER_KERNELS,
    RECOMPILE_LIMIT,
    apply_liger,
    gpt_shape,
    llama_config,
    make_batches,
    raise_recompile_limit,
)
from _step_probes import install_phase_timers, profile_engine, trace_memory
from _step_report import combine_rounds, merge_ranks, report

#: Layout names -> (outer strategy, inner strategy).
LAYOUTS = {
    "zero3": ("no_shard", "optim_grads_params"),
    "fsdp": ("no_shard", "optim_grads_params"),
    "zero2": ("no_shard", "optim_grads"),
    "zero1": ("no_shard", "optim"),
    "ddp": ("no_shard", "no_shard"),
    "hsdp": ("no_shard", "optim_grads_params"),
    "hfsdp": ("optim", "optim_grads_params"),
}
ENGINES = ("hfsdp", "fsdp2", "mfsdp", "mfsdp2", "plain", "model")
#: FSDP2 and the model alone with torchao's float8 (`_float8.py`): fsdp2+float8t, fsdp2+float8r, model+float8t, ...
FLOAT8_NAMES = tuple(f"{engine}+{suffix}" for engine in FLOAT8_ENGINES for suffix in FLOAT8_RECIPES)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--simulate-world",
        type=int,
        default=0,
        help="run one process as rank --simulate-rank of a world of this size, on torch's fake process group "
        "(collectives move no data): per-rank memory of any layout on one device; step times then exclude "
        "communication and losses are meaningless",
    )
    p.add_argument("--simulate-rank", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt", help="megatron-core GPT or transformers Llama")
    p.add_argument("--kv-heads", type=int, default=None, help="llama: key/value heads (default: --heads)")
    p.add_argument("--ffn", type=int, default=None, help="llama: intermediate size (default: 8/3 hidden, to 256)")
    p.add_argument(
        "--fp8-min-size",
        type=float,
        default=2048,
        help="fp8 rows (hfsdp's +fp8t|g|r, torchao's +float8t|r) convert only the units' Linear layers with "
        "in*out/(in+out) at least this (hfsdp's default rule, so both convert the same layers; 0: every layer)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile every unit (every engine alike), with dynamo's recompile limit raised to "
        f"{RECOMPILE_LIMIT}: at its default of 8, 16 or more units compiled one by one can leave some of an "
        "engine's units silently eager",
    )
    p.add_argument(
        "--compile-style",
        choices=("module", "forward"),
        default="module",
        help="with --compile: unit.compile() (torchtitan's habit; default) or unit.forward = torch.compile(...) "
        "(what hfsdp train --compile does)",
    )
    p.add_argument("--optimizer", choices=("fused", "foreach"), default="fused", help="torch AdamW implementation")
    p.add_argument(
        "--liger",
        action="store_true",
        help="llama: Liger's Triton kernels (liger-kernel from the package registry) for every engine: RMSNorm, "
        "SwiGLU, RoPE, and the output projection fused with the cross-entropy (no logits tensor)",
    )
    p.add_argument(
        "--liger-without",
        default="",
        help="with --liger: Liger kernels to leave out, comma-separated from " + ", ".join(LIGER_KERNELS),
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="optimizer in host memory: hfsdp offload=True, FSDP2 CPUOffloadPolicy (parameters on the host too)",
    )
    p.add_argument(
        "--offload-fraction",
        default=None,
        help="hfsdp only: offload this fraction of the optimizer state (0..1), or 'auto' (what the GPU cannot hold)",
    )
    p.add_argument("--recompute", action="store_true", help="recompute every unit's activations in backward (both)")
    p.add_argument(
        "--build-on-device",
        action="store_true",
        help="initialise a Llama's weights on the device instead of the CPU (faster for large models; every engine "
        "of the run gets the same weights, but not those of a CPU-built run)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the GPU's datasheet dense peak in the run's dtype, the MFU denominator (default: from the table in "
        "_ceilings.py; H200 SXM bf16 989)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="CUDA: measure the copy bandwidth and report each hfsdp engine's cost against its bandwidth floor",
    )
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=None, help="default: micro-batch-size x dp (M = 1)")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps before the timed ones")
    p.add_argument(
        "--back-to-back",
        action="store_true",
        help="time the timed steps as one run, synchronised only at its two ends (each step's time: the run's over "
        "--steps), as a training loop that does not wait for the device between steps sees them; an optimizer "
        "step that overlaps the next forward (hfsdp+fused+prestage+overlap) shows its gain only so",
    )
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument(
        "--engines",
        default="hfsdp,fsdp2",
        help=f"comma-separated, from {', '.join(ENGINES)}, the hfsdp variants hfsdp+fused[+...], and with torchao "
        f"float8 (tensorwise with its fp8 all-gather, or rowwise) {', '.join(FLOAT8_NAMES)}",
    )
    p.add_argument("--layouts", default=None, help="comma-separated name:RxN (default zero3:1xWORLD)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--rounds", type=int, default=1, help="repeat every (layout, engine) run, alternating the order")
    p.add_argument("--loss-steps", type=int, default=3, help="first steps whose losses must agree between engines")
    p.add_argument(
        "--check-against",
        default=None,
        help="a JSON this script wrote for the same model, data and dtype: its reference row checks this run's "
        "losses too (for a run of one engine, e.g. FSDP2 alone at a size where both do not fit one process)",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    p.add_argument("--profile", action="store_true", help="profile --profile-steps extra steps per engine")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument(
        "--memory-trace",
        action="store_true",
        help="CUDA: after the timed steps, one more step recording allocated memory at every unit's forward and "
        "backward boundaries, and where the step's peak falls",
    )
    p.add_argument("--trace-dir", default=None, help="with --profile: write a chrome trace per engine and rank")
    p.add_argument(
        "--timers",
        choices=("auto", "on", "off"),
        default="auto",
        help="host timers around collectives and engine phases (auto: on for cpu, off for cuda, where they "
        "only see launch time; with --profile they are installed to annotate the trace either way)",
    )
    args = p.parse_args(argv)
    args.timing = args.timers == "on" or (args.timers == "auto" and args.device == "cpu")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.liger_without = tuple(k.strip() for k in args.liger_without.split(",") if k.strip())
    if set(args.liger_without) - set(LIGER_KERNELS):
        p.error(f"--liger-without: choose from {', '.join(LIGER_KERNELS)}, got {','.join(args.liger_without)}")
    if args.liger_without and not args.liger:
        p.error("--liger-without leaves kernels out of --liger; add --liger")
    unknown = [e for e in args.engines if e not in ENGINES and not is_variant(e) and not float8_recipe(e)]
    if unknown:
        p.error(
            f"--engines: unknown {unknown}; choose from {', '.join(ENGINES)}, or hfsdp variants "
            "hfsdp+fused, hfsdp+fused+clip, hfsdp+fused+clip+prestage[+overlap][+keep][+bf16m|+fp8m][+bf16g][+rem]"
            "[+fp8t|+fp8g|+fp8r] (FusedAdamW; the clip in its step; the gather input written by it; the step "
            "overlapping the next forward; the units' parameters kept gathered through backward; bf16 or fp8 "
            "moments; bf16 gradients; fp32 masters as bf16 plus a 16-bit remainder; fp8 compute), or torchao "
            f"float8 {', '.join(FLOAT8_NAMES)}"
        )
    float8 = ",".join(e for e in args.engines if float8_recipe(e))
    if float8 and args.model == "gpt":
        p.error(
            f"--engines {float8}: torchao's float8 converts torch.nn.Linear layers, and the megatron-core GPT's are "
            "megatron's own; use --model llama"
        )
    if float8:
        try:
            require_torchao()
        except Float8Unavailable as err:
            p.error(f"--engines {float8}: {err}")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        p.error(f"--peak-tflops must be a positive number of TFLOP/s, got {args.peak_tflops}")
    if args.offload_fraction is not None:
        try:
            args.offload_fraction = _offload_fraction(args.offload_fraction)
        except ValueError as err:
            p.error(f"--offload-fraction: {err}")
    if args.simulate_world and not 0 <= args.simulate_rank < args.simulate_world:
        p.error(f"--simulate-rank must be in 0..{args.simulate_world - 1}")
    return args


def _offload_fraction(text: str):
    if text == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"must be a number from 0 to 1 or 'auto', got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"must be a number from 0 to 1 or 'auto', got {text!r}")
    return value


def parse_layouts(text: str | None, world: int) -> list[Layout]:
    text = text or f"zero3:1x{world}"
    layouts = []
    for item in text.split(","):
        name, _, shape = item.strip().partition(":")
        if name not in LAYOUTS:
            raise SystemExit(f"--layouts: '{name}' is not a layout name; use one of {', '.join(LAYOUTS)}")
        try:
            r, n = (int(x) for x in shape.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--layouts: '{item}' must look like name:RxN, e.g. hfsdp:2x2") from None
        if r * n != world:
            raise SystemExit(f"--layouts: '{item}' has {r}x{n} = {r * n} ranks but the world size is {world}")
        if name in ("zero3", "fsdp") and r != 1:
            raise SystemExit(f"--layouts: '{item}': {name} shards over every rank, so R must be 1 (use hsdp:RxN)")
        if name in ("hsdp", "hfsdp") and r == 1:
            raise SystemExit(f"--layouts: '{item}': {name} needs R > 1 instances (use zero3:1x{n})")
        layouts.append(Layout(name, r, n, *LAYOUTS[name]))
    return layouts


# -- device --------------------------------------------------------------------------------


def init_distributed(args) -> torch.device:
    if args.simulate_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("fake", store=FakeStore(), rank=args.simulate_rank, world_size=args.simulate_world)
        return device
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def gather_objects(obj, args) -> list:
    """Every rank's `obj`, in rank order; a simulated rank has only its own (the fake group moves no data)."""
    if args.simulate_world:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- running one engine --------------------------------------------------------------------


def run_engine(
    engine_factory, batches, args, device, timers: CallTimers, dp: int, group_size: int, profile: bool
) -> dict:
    """Build, warm up, time, optionally profile one engine; return this rank's measurements."""
    free_memory(device)
    rss_before = max_rss_mib()
    began_setup = time.perf_counter()
    engine = engine_factory()
    sync(device)
    setup_s = time.perf_counter() - began_setup
    allocated_after_setup = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times, comm_times, cpu_times = [], [], [], []
    timers.reset()
    total_steps = args.warmup + args.steps
    run_began = None
    for step in range(total_steps):
        timers.enabled = step >= args.warmup and args.timing
        between = args.back_to_back and step > args.warmup  # no synchronisation between two timed steps
        if not between:
            sync(device)
        comm_before = timers.total("comm::")
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        if step == args.warmup:
            run_began = t0
        loss = engine.train_step(batches[step], measure_state=(step == 0))
        cpu = time.process_time() - cpu0  # before the sync: CUDA's synchronize spins, which is no work
        if not args.back_to_back or step < args.warmup or step == total_steps - 1:
            sync(device)
        elapsed = time.perf_counter() - t0
        losses.append(loss)
        if step >= args.warmup:
            times.append(elapsed)
            comm_times.append(timers.total("comm::") - comm_before)
            cpu_times.append(cpu)
    if args.back_to_back and times:
        times = [(time.perf_counter() - run_began) / len(times)] * len(times)
    timers.enabled = False
    timer_totals = timers.snapshot()
    peak_allocated = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None

    summary = profile_engine(engine, batches[total_steps:], args, device) if profile else None
    memory_trace = None
    if args.memory_trace and device.type == "cuda":
        try:
            memory_trace = trace_memory(engine, batches[-1], device)
        except Exception as err:  # a diagnostic must not lose the timings
            memory_trace = [(f"failed: {type(err).__name__}: {err}", 0.0, 0.0)]

    stacked = torch.stack(losses).float()
    if group_size > 1:
        dist.all_reduce(stacked, group=None)
    stacked = (stacked / dp).tolist()
    microbatch_tokens = sum(t.numel() for t, _ in batches[0])
    median = statistics.median(times)
    steps = max(len(times), 1)
    result = {
        "engine": engine.kind,
        "label": engine.label,
        "mesh": list(engine.mesh),
        "setup_s": setup_s,
        "step_times_s": times,
        "median_step_s": median,
        "tokens_per_step_per_rank": microbatch_tokens,
        "tokens_per_s_per_rank": microbatch_tokens / median,
        "losses": stacked,
        "params": engine.params,
        "flops_per_token": engine.flops_per_token,
        "bytes_moved": getattr(engine, "bytes_moved", None),
        "bytes_floor": getattr(engine, "bytes_floor", None),
        "offloaded_fraction": getattr(engine, "offloaded_fraction", None),
        "model_state_bytes": engine.state_bytes_measured,
        "max_rss_mib": max_rss_mib(),
        "max_rss_mib_before": rss_before,
        "cuda_allocated_after_setup_bytes": allocated_after_setup,
        "cuda_peak_allocated_bytes": peak_allocated,
        "comm_blocked_s_per_step": statistics.median(comm_times),
        "comm_blocked_s": comm_times,
        "cpu_s_per_step": statistics.median(cpu_times),
        "cpu_s": cpu_times,
        "timers_s_per_step": {k: v["seconds"] / steps for k, v in timer_totals.items()},
        "timers_cpu_s_per_step": {k: v["cpu_seconds"] / steps for k, v in timer_totals.items()},
        "timer_calls_per_step": {k: v["calls"] / steps for k, v in timer_totals.items()},
        "profile": summary,
        "memory_trace": memory_trace,
    }
    del engine
    free_memory(device)
    return result


# -- main ----------------------------------------------------------------------------------


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    args = parse_args(argv)
    device = init_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        return _main(args, device, rank, world)
    finally:
        dist.destroy_process_group()


def _main(args, device, rank, world) -> int:
    from hfsdp.core.rules.config import LayoutConfig

    layouts = parse_layouts(args.layouts, world)
    compute_dtype = torch.bfloat16 if args.dtype == "bf16" else None
    shape = gpt_shape(args) if args.model == "gpt" else llama_config(args)
    if args.liger:
        apply_liger(args.liger_without)
    timers = CallTimers()
    if args.timing or args.profile:
        install_comm_timers(timers)
        install_phase_timers(timers)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv,
        "args": {k: v for k, v in vars(args).items()},
        "world_size": world,
        "device": args.device,
        "torch": torch.__version__,
        "host": platform.node(),
        "cpu_threads_per_rank": torch.get_num_threads(),
        "shape": asdict(shape) if args.model == "gpt" else shape.to_dict(),
    }
    if args.compile:  # every engine's units compiled under the same raised limit (maybe_compile raises it too)
        meta["dynamo_recompile_limit"] = raise_recompile_limit()
    if any(float8_recipe(e) for e in args.engines):
        meta["torchao"] = torchao_version()
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
        rate = matmul_tflops(device, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
        rates = gather_objects(rate, args)
        meta["matmul_tflops_per_rank"] = rates
        meta["matmul_dtype"] = args.dtype
        peak = args.peak_tflops or datasheet_peak(meta["gpu"], args.dtype)
        meta["peak_tflops"] = peak
        meta["peak_source"] = "--peak-tflops" if args.peak_tflops else "datasheet table (bench/_ceilings.py)"
        if args.floor:
            meta["copy_bandwidth"] = copy_bandwidth(device)
        if rank == 0:
            print(f"measured dense {args.dtype} matmul rate (8192^3) per rank, TFLOP/s: {[f'{r:.0f}' for r in rates]}")
            print(f"MFU denominator: {peak} TFLOP/s dense {args.dtype} ({meta['peak_source']}, {meta['gpu']})")
            if args.floor:
                bw = meta["copy_bandwidth"]
                print(
                    f"measured device-to-device copy bandwidth (read + write): {bw['bytes_per_s'] / 1e12:.2f} TB/s "
                    f"median, {bw['best_bytes_per_s'] / 1e12:.2f} best; copy correct: {bw['copy_correct']}"
                )
    elif args.floor:  # on a CPU only to try the report: host bandwidth, no GPU figure
        meta["copy_bandwidth"] = copy_bandwidth(device, gib=0.25, repeats=5)

    runs: dict[tuple[str, str], list[dict]] = {}
    failed: list[str] = []  # engines that raised (one process only; the others still run)
    extra = args.profile_steps if args.profile else 0
    gbs = args.global_batch_size or args.micro_batch_size * world
    batches_by_layout = {}
    for round_index in range(args.rounds):
        for layout in layouts:
            cfg = LayoutConfig(
                world_size=world,
                inner=layout.inner,
                outer=layout.outer,
                instances=layout.instances,
                global_batch_size=gbs,
                micro_batch_size=args.micro_batch_size,
            )
            count = cfg.num_microbatches
            if layout.tag not in batches_by_layout:
                steps = args.warmup + args.steps + extra
                batches_by_layout[layout.tag] = make_batches(shape, steps, gbs, count, rank, cfg.dp, device)
            batches = batches_by_layout[layout.tag]
            kinds = [k for k in args.engines if engine_family(k) not in SINGLE_DEVICE_ENGINES]
            if round_index % 2:
                kinds.reverse()  # alternate the order, so drift in the machine's load favours no engine
            for kind in kinds:
                if engine_family(kind) == "fsdp2" and layout.inner not in ("optim_grads_params", "optim_grads"):
                    if rank == 0 and round_index == 0:
                        print(f"[{layout.tag}] {kind}: skipped, FSDP2 has no {layout.inner} (ZeRO-1/DDP) equivalent")
                    continue
                factory = partial(make_engine, kind, args, timers, compute_dtype, cfg, shape, device, layout)
                if rank == 0:
                    print(
                        f"[round {round_index}] [{layout.tag}] {kind}: {count} microbatch(es) of "
                        f"{args.micro_batch_size} per step",
                        flush=True,
                    )
                profile = args.profile and round_index == 0
                try:
                    mine = run_engine(factory, batches, args, device, timers, cfg.dp, world, profile)
                except Exception as err:
                    if world > 1:  # the other ranks may be inside a collective: stop them all
                        raise
                    # One process: the engines after this one can still be measured.
                    failed.append(f"[{layout.tag}] {kind}: {type(err).__name__}: {err}")
                    print(f"!!! ENGINE FAILED {failed[-1]}", flush=True)
                    traceback.print_exc()
                    free_memory(device)
                    continue
                mine["layout"] = layout.tag
                row = merge_ranks(gather_objects(mine, args))
                runs.setdefault((layout.tag, kind), []).append(row)
                if rank == 0:
                    print(
                        f"[round {round_index}] [{layout.tag}] {kind}: median step {row['median_step_s']:.4f} s, "
                        f"losses {[round(x, 5) for x in row['losses'][: args.loss_steps]]}",
                        flush=True,
                    )
    results = [combine_rounds(rows) for rows in runs.values()]

    for kind in [k for family in SINGLE_DEVICE_ENGINES for k in args.engines if engine_family(k) == family]:
        if not args.simulate_world:
            results.extend(run_single_device(kind, args, device, rank, world, shape, compute_dtype, timers, extra))

    checks = [] if args.simulate_world else loss_checks(results, args, world)
    if rank == 0:
        text = report(results, checks, args, meta)
        print(text, flush=True)
        bad = [c for c in checks if not c["ok"]]
        for c in bad:
            print(
                f"!!! LOSS MISMATCH [{c['layout']}] {c['pair']}: max relative difference "
                f"{c['max_rel_diff_first_steps']:.3e} over the first {args.loss_steps} steps > rtol {c['rtol']}",
                flush=True,
            )
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            record = {"meta": meta, "results": results, "loss_checks": checks, "table": text, "failed": failed}
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
            print(f"wrote {args.out}")
        for line in failed:
            print(f"!!! ENGINE FAILED {line}", flush=True)
    dist.barrier()
    return 1 if failed or any(not c["ok"] for c in checks) else 0


def make_engine(kind: str, args, timers, compute_dtype, cfg, shape, device, layout: Layout | None):
    """The engine `kind` (a name from --engines) on this layout (None for the unsharded engines)."""
    family = engine_family(kind)
    common = (args, timers, compute_dtype, cfg, shape, device)
    if family == "hfsdp":
        return HfsdpEngine(*common, kind if kind != "hfsdp" else None)
    if family in ("mfsdp", "mfsdp2"):
        return MegatronFsdpEngine(*common, layout, kind)
    if family == "fsdp2":
        return Fsdp2Engine(*common, layout, float8=float8_recipe(kind))
    if family == "plain":
        return PlainEngine(*common)
    return ModelOnlyEngine(*common, float8=float8_recipe(kind))


def run_single_device(kind, args, device, rank, world, shape, compute_dtype, timers, extra) -> list[dict]:
    """The unsharded model (`plain` or `model`) on rank 0 alone; every other rank waits at a barrier."""
    from hfsdp.core.rules.config import LayoutConfig
    from hfsdp.models.megatron.adapter import initialize_parallel

    if args.model == "gpt":  # collective: every rank builds megatron-core's groups (a Llama needs none)
        initialize_parallel(LayoutConfig(world_size=world))
    out = []
    if rank == 0:
        per_rank = (args.global_batch_size or args.micro_batch_size * world) // world  # samples per rank and step
        count = per_rank // args.micro_batch_size
        cfg = LayoutConfig(world_size=1, global_batch_size=per_rank, micro_batch_size=args.micro_batch_size)
        batches = make_batches(shape, args.warmup + args.steps + extra, per_rank, count, 0, 1, device)
        if world > 1:
            print(f"{kind}: runs on rank 0 while the other ranks wait; on a shared CPU it gets more cores")
        print(f"[{kind}] {count} microbatch(es) of {args.micro_batch_size} per step", flush=True)
        factory = partial(make_engine, kind, args, timers, compute_dtype, cfg, shape, device, None)
        mine = run_engine(factory, batches, args, device, timers, 1, 1, args.profile)
        mine["layout"] = "1x1"
        out.append(merge_ranks([mine]))
    dist.barrier()
    return out


if __name__ == "__main__":
    sys.exit(main())
