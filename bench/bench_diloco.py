"""DiLoCo's quality against its outer-axis traffic: eval loss of a small Llama on Python's source, R instances.

Every run trains the same model (`diloco_data.Llama`, 10.8M parameters) on the same tokens (per seed: the same
random windows of the standard library's bytes, each instance its own 1/R of every global batch) for the same
number of steps, then evaluates on held-out files. HSDP (`no_shard` over ZeRO-3: the outer axis all-reduces every
step) against DiLoCo (`diloco` over ZeRO-3) at H in {10, 50, 100, 500}, fp32/bf16/int8 exchanges, and fragments.
The outer-axis bytes are what hfsdp's collectives counter counts on rank 0 (`record_comms`, axis dp_outer),
the final `sync_outer()` of a DiLoCo run included.

How ranks share the hardware: R processes, one instance each (N = 1), gloo collectives. With --device cuda they
all use GPU 0 (gloo moves CUDA tensors through host memory; NCCL refuses two ranks on one GPU), time-sharing it;
with --device cpu each gets an equal share of the host's cores. One launch runs the whole sweep (seed-major, one
JSON line per run, flushed at once, so a time limit keeps what finished). `--steps auto` first times a few steps
of HSDP and DiLoCo and picks the largest step count (a multiple of 50) whose sweep fits `--budget-s`.

    python bench/bench_diloco.py --device cuda --out results.jsonl         # the sweep (see docs/benchmarks.md)
    python bench/bench_diloco.py --smoke                                   # a tiny CPU check of the whole path
    python bench/diloco_report.py results.jsonl docs/diloco.svg            # the table and the plot
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diloco_data import Llama, Shape, batch, eval_windows, stdlib_bytes


@dataclass(frozen=True)
class Run:
    name: str
    outer: str  # "no_shard" (HSDP) or "diloco"
    sync_every: int = 1
    comm_dtype: str = "fp32"
    fragments: int = 1


SWEEP = [
    Run("HSDP", "no_shard"),
    *(Run(f"DiLoCo H={h}", "diloco", h) for h in (10, 50, 100, 500)),
    Run("DiLoCo H=50 bf16", "diloco", 50, "bf16"),
    Run("DiLoCo H=50 int8", "diloco", 50, "int8"),
    Run("DiLoCo H=50 F=5", "diloco", 50, "fp32", 5),
    Run("DiLoCo H=50 F=5 int8", "diloco", 50, "int8", 5),
]
SMOKE = [Run("HSDP", "no_shard"), Run("DiLoCo H=2", "diloco", 2), Run("DiLoCo H=5 F=2 int8", "diloco", 5, "int8", 2)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", default="auto", help="steps per run, or 'auto' (fit --budget-s)")
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--budget-s", type=float, default=300.0, help="wall time the sweep may take, with --steps auto")
    p.add_argument("--rows", type=int, default=8, help="sequences per instance per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate (every DiLoCo run)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo's outer Nesterov momentum (0: plain SGD)")
    p.add_argument("--eval-rows", type=int, default=64)
    p.add_argument("--out", default="diloco_results.jsonl")
    p.add_argument("--only", nargs="*", help="names of the runs to do (default: the whole sweep)")
    p.add_argument("--sync-every", type=int, nargs="*", default=[], help="more DiLoCo runs (fp32) at these H")
    p.add_argument(
        "--parallel-seeds",
        action="store_true",
        help="run the seeds side by side, each its own group of ranks (a small model leaves the GPU mostly idle)",
    )
    p.add_argument("--smoke", action="store_true", help="a tiny model, 2 instances, 20 steps, on the CPU")
    for field, default in asdict(Shape()).items():
        if field != "vocab":
            p.add_argument(f"--{field}", type=int, default=default, help=f"the model's {field} (default {default})")
    args = p.parse_args(argv)
    args.shape = Shape(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn, seq=args.seq)
    args.groups = 1  # groups of ranks sharing the host's cores (one per seed with --parallel-seeds; set in main)
    extra = [Run(f"DiLoCo H={h}", "diloco", h) for h in args.sync_every]
    sweep = SWEEP + [r for r in extra if r.name not in {s.name for s in SWEEP}]
    args.runs = [r for r in sweep if not args.only or r.name in args.only]
    if args.smoke:
        args.device, args.instances, args.seeds, args.steps, args.rows, args.eval_rows = "cpu", 2, [0], "20", 2, 8
        args.shape, args.runs = Shape(hidden=64, layers=2, heads=2, ffn=128, seq=64), SMOKE
    return args


# -- one rank ---------------------------------------------------------------------------------------------------------


def _schedule(step: int, steps: int) -> float:
    """Linear warmup over 5% of the steps, then cosine to 10%: the same for every run."""
    warm = max(1, steps // 20)
    if step < warm:
        return (step + 1) / warm
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def _model(args, run: Run, seed: int, device):
    from hfsdp.core import DiLoCoConfig, LayoutConfig, MixedPrecision, build_meshes, fully_shard

    torch.manual_seed(seed)
    model = Llama(args.shape).to(device)
    cfg = LayoutConfig(world_size=args.instances, outer=run.outer, instances=args.instances)
    diloco = None
    if run.outer == "diloco":
        diloco = DiLoCoConfig(
            sync_every=run.sync_every,
            comm_dtype=run.comm_dtype,
            fragments=run.fragments,
            lr=args.outer_lr,
            momentum=args.outer_momentum,
        )
    mp = MixedPrecision(param_dtype=torch.bfloat16 if device.type == "cuda" else None)
    sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp, diloco=diloco)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(sharded.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    return sharded, opt


def train_run(args, run: Run, seed: int, steps: int, data, device, rank: int) -> dict:
    """Train one run; every rank returns the same summary (loss, eval loss, bytes on rank 0's axes)."""
    import torch.distributed as dist

    from hfsdp.core import clip_grad_norm_
    from hfsdp.core.buffers.collectives import record_comms

    train, held = data
    sharded, opt = _model(args, run, seed, device)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, steps))
    began = time.perf_counter()
    losses = []
    with record_comms() as log:
        for step in range(steps):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
            tokens, labels = batch(train, args.rows * args.instances, args.shape.seq, gen)
            rows = slice(rank * args.rows, (rank + 1) * args.rows)  # instance `rank`'s share (N = 1)
            loss = sharded(tokens[rows].to(device), labels[rows].to(device))
            loss.backward()
            clip_grad_norm_(sharded, 1.0)
            opt.step()
            opt.zero_grad()
            schedule.step()
            losses.append(loss.detach())
        if run.outer == "diloco":
            sharded.sync_outer()  # the fragments mid-cycle meet once more: every instance holds the global weights
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    tail = torch.stack(losses[-max(1, steps // 10) :]).float().mean().reshape(1).cpu()
    tokens, labels = eval_windows(held, args.eval_rows, args.shape.seq)
    share = slice(rank * args.eval_rows // args.instances, (rank + 1) * args.eval_rows // args.instances)
    with torch.no_grad():
        evaluated = sharded(tokens[share].to(device), labels[share].to(device)).float().reshape(1).cpu()
    both = torch.cat([tail, evaluated])
    dist.all_reduce(both)
    both /= args.instances
    return {
        "run": run.name,
        **asdict(run),
        "seed": seed,
        "steps": steps,
        "shape": asdict(args.shape),
        "outer_lr": args.outer_lr if run.outer == "diloco" else None,
        "outer_momentum": args.outer_momentum if run.outer == "diloco" else None,
        "instances": args.instances,
        "tokens": steps * args.rows * args.instances * args.shape.seq,
        "train_loss": both[0].item(),
        "eval_loss": both[1].item(),
        "outer_bytes": log.bytes_sent("dp_outer"),
        "inner_bytes": log.bytes_sent("dp_shard"),
        "outer_collectives": log.count("dp_outer"),
        "seconds": seconds,
    }


def _calibrate(args, data, device, rank) -> int:
    """Time a few steps of HSDP and DiLoCo H=10; the most steps (a multiple of 50) whose sweep fits the budget."""
    probe = 10
    cost = {}
    for run in (SWEEP[0], SWEEP[1]):
        train_run(args, run, 0, 3, data, device, rank)  # warm up (allocator, kernels)
        cost[run.outer] = train_run(args, run, 0, probe, data, device, rank)["seconds"] / probe
    per_seed = sum(cost[r.outer] for r in args.runs)
    overhead = 2.0 * len(args.runs) * len(args.seeds)  # model build and evaluation, per run
    steps = int((args.budget_s - overhead) / (per_seed * len(args.seeds)) // 50 * 50)
    return max(50, min(args.max_steps, steps)), cost


def rank_main(rank: int, args, data_path: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.instances))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // (args.instances * args.groups)))
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=args.instances)
    data = torch.load(data_path)
    started = time.perf_counter()
    if args.steps == "auto":
        steps, cost = _calibrate(args, data, device, rank)
        if rank == 0:
            print(f"calibrated: {cost} s/step -> {steps} steps per run", flush=True)
    else:
        steps = int(args.steps)
    out = open(args.out, "a") if rank == 0 else None  # noqa: SIM115
    for seed in args.seeds:
        for run in args.runs:
            result = train_run(args, run, seed, steps, data, device, rank)
            if out is not None:
                out.write(json.dumps(result) + "\n")
                out.flush()
                print(
                    f"{result['run']:<22} seed {seed}: eval {result['eval_loss']:.4f} train {result['train_loss']:.4f}"
                    f" outer {result['outer_bytes'] / 1e6:9.1f} MB  {result['seconds']:6.1f} s "
                    f"(total {time.perf_counter() - started:6.0f} s)",
                    flush=True,
                )
    dist.destroy_process_group()


def main(argv=None) -> None:
    import torch.multiprocessing as mp

    from hfsdp.core import LayoutConfig

    args = parse_args(argv)
    LayoutConfig(world_size=args.instances, outer="diloco", instances=args.instances)  # refuse a bad count early
    train, held, info = stdlib_bytes()
    params = sum(p.numel() for p in Llama(args.shape).parameters())
    print(f"corpus: {info}; model {params / 1e6:.1f}M parameters; {args.instances} instances on {args.device}")
    Path(args.out).write_text("")
    with tempfile.TemporaryDirectory() as tmp:
        data_path = os.path.join(tmp, "data.pt")
        torch.save((train, held), data_path)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", 29500 + os.getpid() % 1000))
        # One group of ranks for all the seeds, or with --parallel-seeds one per seed, each on its own port; every
        # group's rank 0 appends whole lines to --out.
        seed_groups = [[seed] for seed in args.seeds] if args.parallel_seeds else [args.seeds]
        groups = []
        for i, seeds in enumerate(seed_groups):
            os.environ["MASTER_PORT"] = str(port + i)
            group_args = replace_args(args)
            group_args.seeds, group_args.groups = seeds, len(seed_groups)
            groups.append(mp.spawn(rank_main, args=(group_args, data_path), nprocs=args.instances, join=False))
        try:
            for group in groups:
                while not group.join():
                    pass
        except BaseException:  # one group failed (or Ctrl-C): stop the others rather than wait for them
            for proc in (proc for group in groups for proc in group.processes if proc.is_alive()):
                proc.terminate()
            raise
    print(f"wrote {args.out}")


def replace_args(args):
    """The namespace as the ranks get it (dataclasses and plain values only: it is pickled)."""
    return argparse.Namespace(**{**vars(args), "runs": [replace(r) for r in args.runs]})


if __name__ == "__main__":
    main()
