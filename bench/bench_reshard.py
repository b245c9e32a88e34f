"""Checkpoint reshard and export throughput against `cp -r` and torch.distributed.checkpoint.

    .venv/bin/python bench/bench_reshard.py [--dir /tmp/hfsdp-bench] [--units 14] [--keep]

Builds a synthetic checkpoint (bf16 model weights, fp32 main weights and Adam
states; 14 units of 5.8 M parameters, 1.1 GB on disk) of layout HFSDP 2x4 on 8
ranks with `write_from_tensors` (the offline writer, same files as an online
save), then measures, each in a fresh process so peak RSS belongs to one
operation alone:

- `cp -r` of the checkpoint, and `cp -r` followed by an fsync of the copied
  files (`sync FILE...`), which is what reshard makes durable too;
- `reshard` to ZeRO-3 1x6 (uneven: 8 -> 6 ranks), with and without the final
  re-verification of the written checksums, at the default and a small budget;
- `export` to bf16 safetensors files;
- DCP: the same tensors as flat 1-D DTensors Shard(0) saved by 4 gloo ranks,
  then loaded by 3 ranks into Shard(0) (its reshard on load); seconds are the
  slowest rank's, memory the largest rank's.

Every source read comes from the page cache (the files were just written), as
for cp. Memory is the peak RSS of the process minus its RSS after imports. The
hfsdp and cp rows run interleaved, one of each per round after a `sync`, so
background load and write-back hit them alike; the last line gives the ratio
reshard / (cp + fsync) of each round.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HIDDEN, FFN = 1024, 2816
KINDS = ("model", "main", "exp_avg", "exp_avg_sq")
MIB = 1 << 20


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def groups_for(units: int, ep_rank=None):
    from hfsdp.ckpt import GroupSpec

    groups = []
    for u in range(units):
        members = (
            (f"layers.{u}.norm.weight", (HIDDEN,)),
            (f"layers.{u}.fc1.weight", (FFN, HIDDEN)),
            (f"layers.{u}.fc1.bias", (FFN,)),
            (f"layers.{u}.fc2.weight", (HIDDEN, FFN)),
        )
        groups.append(GroupSpec(u, False, "bfloat16", ep_rank, members))
    return groups


def build(path: Path, units: int) -> None:
    import torch

    from hfsdp.ckpt import write_from_tensors
    from hfsdp.core.rules.config import LayoutConfig

    cfg = LayoutConfig(world_size=8, instances=2, outer="optim")
    groups = groups_for(units)
    gen = torch.Generator().manual_seed(0)
    shapes = {n: s for g in groups for n, s in g.members}
    main = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    tensors = {
        "model": {n: t.bfloat16() for n, t in main.items()},
        "main": main,
        "exp_avg": {n: t * 0.1 for n, t in main.items()},
        "exp_avg_sq": {n: t * t for n, t in main.items()},
    }
    optimizer = {
        "type": "AdamW",
        "param_groups": [{"hyper": {"lr": 1e-4}, "params": list(shapes)}],
        "states": ["exp_avg", "exp_avg_sq"],
        "scalars": {"step": {"tensor": True, "values": dict.fromkeys(shapes, 10.0)}},
    }
    write_from_tensors(path, cfg, groups, tensors, step=10, optimizer=optimizer)


def op_reshard(src: str, dst: str, budget_mib: str, verify: str) -> dict:
    from hfsdp.ckpt import reshard
    from hfsdp.core.rules.config import LayoutConfig

    base = rss_mib()
    target = LayoutConfig(world_size=6)
    result = reshard(src, dst, target, memory_budget_bytes=int(budget_mib) * MIB, verify_result=verify == "1")
    return {"seconds": result.seconds, "bytes": result.bytes_written, "peak": rss_mib(), "base": base}


def op_export(src: str, dst: str) -> dict:
    from hfsdp.ckpt import export

    base = rss_mib()
    result = export(src, dst, "bf16")
    return {"seconds": result.seconds, "bytes": result.bytes_written, "peak": rss_mib(), "base": base}


def _dcp_worker(rank: int, world: int, port: int, mode: str, path: str, units: int, queue) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    base = rss_mib()
    state = {}
    for g in groups_for(units):
        for name, shape in g.members:
            n = math.prod(shape)
            for kind in KINDS:
                dtype = torch.bfloat16 if kind == "model" else torch.float32
                chunks = torch.empty(n).chunk(world)
                size = chunks[rank].numel() if rank < len(chunks) else 0
                piece = torch.randn(size).to(dtype) if mode == "save" else torch.empty(size, dtype=dtype)
                state[f"{kind}/{name}"] = DTensor.from_local(piece, mesh, [Shard(0)], shape=(n,), stride=(1,))
    dist.barrier()
    started = time.perf_counter()
    if mode == "save":
        dcp.save(state, checkpoint_id=path)
    else:
        dcp.load(state, checkpoint_id=path)
    dist.barrier()
    queue.put((rank, time.perf_counter() - started, rss_mib() - base, rss_mib()))
    dist.destroy_process_group()


def run_dcp(mode: str, path: str, world: int, units: int) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_dcp_worker, args=(r, world, port, mode, path, units, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    return {
        "seconds": max(r[1] for r in results),
        "delta": max(r[2] for r in results),
        "peak": max(r[3] for r in results),
        "total_delta": sum(r[2] for r in results),
    }


def child(*args: str) -> dict:
    """Run one operation in a fresh interpreter; it prints one JSON line."""
    out = subprocess.run([sys.executable, __file__, "_op", *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def timed(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - started


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cpu_pressure() -> str:
    """The kernel's CPU pressure (share of time some task waited for a CPU, last 60 s): how noisy the box was."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return line.split()[2].split("=")[1] + " %"
    except (OSError, IndexError):
        return "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/hfsdp-bench"))
    parser.add_argument("--units", type=int, default=14)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each operation; the table shows the median")
    parser.add_argument("--keep", action="store_true", help="keep the files afterwards")
    args = parser.parse_args()
    work: Path = args.dir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / "src"
    started = time.perf_counter()
    child("build", str(src), str(args.units))
    size = du(src)
    print(f"built {size / 1e9:.2f} GB in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    pressure_before = cpu_pressure()
    copy_and_fsync = f"cp -r {src} {work / 'cp'} && sync {work / 'cp'}/* {work / 'cp'}"

    def hfsdp(*op: str):
        def run():
            r = child(*op)
            return r["seconds"], f"{r['peak'] - r['base']:.0f} (peak {r['peak']:.0f})"

        return run

    exported = size * 2 // 14  # bf16 weights: 2 of the 14 bytes per parameter
    operations = [
        ("`cp -r`", size, lambda: (timed(["cp", "-r", str(src), str(work / "cp")]), "-")),
        ("`cp -r` + fsync of its files", size, lambda: (timed(["sh", "-c", copy_and_fsync]), "-")),
    ]
    for budget, verify in (("256", "1"), ("256", "0"), ("64", "1")):
        label = f"hfsdp reshard 8 -> 6, budget {budget} MiB" + ("" if verify == "1" else ", no re-verify")
        operations.append((label, size, hfsdp("reshard", str(src), str(work / "dst"), budget, verify)))
    operations.append(("hfsdp export bf16 (bytes written)", exported, hfsdp("export", str(src), str(work / "export"))))

    # Interleaved rounds: every operation once per round, so each sees the same
    # background load and the same state of the disk's write-back as its neighbours.
    results: dict[str, list] = {name: [] for name, _, _ in operations}
    for _ in range(args.repeat):
        for name, _, run in operations:
            subprocess.run(["sync"], check=True)
            results[name].append(run())
            for leftover in ("cp", "dst", "export"):
                shutil.rmtree(work / leftover, ignore_errors=True)
    rows = []
    for name, nbytes, _ in operations:
        seconds = sorted(r[0] for r in results[name])
        median = seconds[len(seconds) // 2]
        rows.append((name, median, seconds[0], nbytes / 1e9 / median, results[name][-1][1]))
    copy_times = [r[0] for r in results["`cp -r` + fsync of its files"]]
    reshard_times = [r[0] for r in results["hfsdp reshard 8 -> 6, budget 256 MiB"]]
    ratios = sorted(a / b for a, b in zip(reshard_times, copy_times, strict=True))

    def dcp_load():
        r = run_dcp("load", str(work / "dcp"), 3, args.units)
        return r["seconds"], f"{r['delta']:.0f} per rank (peak {r['peak']:.0f})"

    save = run_dcp("save", str(work / "dcp"), 4, args.units)
    dcp_size = du(work / "dcp")
    rows.append(
        (
            "DCP save, 4 gloo ranks (once)",
            save["seconds"],
            save["seconds"],
            dcp_size / 1e9 / save["seconds"],
            f"{save['delta']:.0f} per rank (peak {save['peak']:.0f})",
        )
    )
    loads = sorted(dcp_load() for _ in range(args.repeat))
    median = loads[len(loads) // 2]
    name = "DCP load 4 -> 3 ranks (reshard on load)"
    rows.append((name, median[0], loads[0][0], dcp_size / 1e9 / median[0], median[1]))
    if not args.keep:
        shutil.rmtree(work)

    print(f"\nCheckpoint of {size / 1e9:.2f} GB ({args.units} units, bf16 model + fp32 main, exp_avg, exp_avg_sq);")
    print(f"median of {args.repeat} interleaved rounds; CPU pressure (60 s) before {pressure_before}, ", end="")
    print(f"after {cpu_pressure()}.\n")
    print("| operation | seconds (median) | best | GB/s (median) | extra memory MiB (peak RSS) |")
    print("|---|---:|---:|---:|---|")
    for name, median, best, rate, mem in rows:
        print(f"| {name} | {median:.2f} | {best:.2f} | {rate:.2f} | {mem} |")
    print(
        f"\nreshard (256 MiB, verified) / (cp -r + fsync), per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
        f"median {ratios[len(ratios) // 2]:.2f}"
    )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_op":
        op, rest = sys.argv[2], sys.argv[3:]
        if op == "build":
            build(Path(rest[0]), int(rest[1]))
            print(json.dumps({}))
        else:
            print(json.dumps({"reshard": op_reshard, "export": op_export}[op](*rest)))
    else:
        main()
