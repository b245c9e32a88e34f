"""The largest Llama one GPU trains with hfsdp (recompute, `offload="auto"`): predict which candidate sizes fit, try the
largest predicted to fit first, stop at the first that trains; then FSDP2 at that size if it is predicted to fit.

    python bench/largest_model.py --out OUT --budget-s 200 [--host-gib 128]

Each attempt is its own process (`torchrun ... bench/bench_step.py --engines hfsdp`), so a run killed for memory
takes nothing else with it. The prediction uses the per-element bytes of `hfsdp.core.offload.offload_plan` (one GPU,
ZeRO-3, bf16: 16 bytes on the device per element kept there, 6 per element offloaded, 16 on the host per
element offloaded) and, for FSDP2, 16 bytes per parameter on the device without offload and on the host
with CPUOffloadPolicy. Activations with recompute and micro-batch 1 are left to the 10% reserve.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

#: (name, layers, hidden, ffn, heads): Llama-2 13B's shape, a 36-layer cut of it, and a 48-layer 4096-wide one.
CANDIDATES = [
    ("13.0B", 40, 5120, 13824, 40),
    ("11.8B", 36, 5120, 13824, 40),
    ("10.0B", 48, 4096, 11008, 32),
]
VOCAB = 32000
RESERVE = 0.10  # of the device, for activations and the allocator (offload_plan.RESERVE_FRACTION)
HOST_OVERHEAD_GIB = 8.0  # the process, CUDA's pinned staging, the page cache


def params(layers: int, hidden: int, ffn: int) -> int:
    return layers * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden) + 2 * VOCAB * hidden + hidden


def predict(n: int, gpu_bytes: float, host_bytes: float) -> dict:
    budget = gpu_bytes * (1 - RESERVE)
    fraction = 0.0 if 16 * n <= budget else min(1.0, (16 * n - budget) / (10 * n))
    device_need = n * (16 * (1 - fraction) + 6 * fraction)
    host_need = 16 * fraction * n + HOST_OVERHEAD_GIB * 2**30
    return {
        "params": n,
        "offload_fraction": fraction,
        "device_need_gb": device_need / 1e9,
        "host_need_gb": host_need / 1e9,
        "hfsdp_fits": device_need <= budget * (1 + 1e-9) and host_need <= host_bytes,  # f solves it exactly
        "fsdp2_fits_on_device": 16 * n <= budget,
        "fsdp2_fits_with_cpu_offload": 16 * n + HOST_OVERHEAD_GIB * 2**30 <= host_bytes and 2 * n <= budget,
    }


def attempt(name: str, shape, engine: str, extra: list[str], out: str, timeout: float) -> dict:
    _, layers, hidden, ffn, heads = shape
    json_path = os.path.join(out, f"largest-{name}-{engine}.json")
    cmd = ["torchrun", "--nproc-per-node", "1", "bench/bench_step.py", "--device", "cuda", "--model", "llama"]
    cmd += ["--layers", str(layers), "--hidden", str(hidden), "--ffn", str(ffn), "--heads", str(heads)]
    cmd += ["--vocab", str(VOCAB), "--seq-len", "2048", "--micro-batch-size", "1", "--dtype", "bf16", "--recompute"]
    cmd += ["--build-on-device", "--steps", "2", "--warmup", "1", "--engines", engine, "--out", json_path, *extra]
    began = time.time()
    with open(os.path.join(out, f"largest-{name}-{engine}.log"), "w") as log:
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = {"name": name, "engine": engine, "rc": rc, "seconds": time.time() - began, "cmd": " ".join(cmd)}
    if rc == 0 and os.path.exists(json_path):
        with open(json_path) as f:
            row = json.load(f)["results"][0]
        result.update(
            median_step_s=row["median_step_s"],
            peak_alloc_mib=(row.get("cuda_peak_allocated_bytes") or 0) / 2**20,
            offloaded_fraction=row.get("offloaded_fraction"),
            max_rss_mib=row.get("max_rss_mib"),
            losses=row.get("losses"),
        )
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--host-gib", type=float, default=128.0, help="the machine's host memory (its lent size)")
    p.add_argument("--fsdp2-timeout-s", type=float, default=120.0)
    p.add_argument(
        "--fsdp2-anyway",
        action="store_true",
        help="also run FSDP2 (CPUOffloadPolicy) at the size hfsdp trained when it is predicted not to fit, to measure "
        "how it fails (it may be killed for memory: it runs in its own process)",
    )
    args = p.parse_args(argv)
    began = time.time()
    # From nvidia-smi: a CUDA context in this process would hold memory the attempts then lack.
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    gpu_bytes = float(subprocess.run(query, capture_output=True, text=True, check=True).stdout.split()[0]) * 2**20
    host_bytes = args.host_gib * 2**30
    plans = [(c, predict(params(*c[1:4]), gpu_bytes, host_bytes)) for c in CANDIDATES]
    memory = f"GPU {gpu_bytes / 2**30:.1f} GiB, host {args.host_gib:.0f} GiB"
    print(f"{memory}; predictions (hfsdp offload='auto', recompute):")
    for (name, *_), plan in plans:
        print(
            f"  {name}: {plan['params'] / 1e9:.2f}B params, offload {plan['offload_fraction']:.2f}, device "
            f"{plan['device_need_gb']:.0f} GB, host {plan['host_need_gb']:.0f} GB: hfsdp "
            f"{'fits' if plan['hfsdp_fits'] else 'does not fit'}; FSDP2 "
            f"{'fits' if plan['fsdp2_fits_on_device'] else 'does not fit'} on the device, "
            f"{'fits' if plan['fsdp2_fits_with_cpu_offload'] else 'does not fit'} with CPUOffloadPolicy",
            flush=True,
        )
    report = {"gpu_bytes": gpu_bytes, "host_gib": args.host_gib, "predictions": [p_ for _, p_ in plans], "runs": []}
    trained = None
    for shape, plan in plans:
        left = args.budget_s - (time.time() - began)
        if not plan["hfsdp_fits"]:
            continue
        if left < 60:
            print(f"no time left for {shape[0]} ({left:.0f} s)", flush=True)
            break
        run = attempt(shape[0], shape, "hfsdp", ["--offload-fraction", "auto"], args.out, left)
        report["runs"].append(run)
        step = run.get("median_step_s")
        print(f"hfsdp {shape[0]}: rc {run['rc']} after {run['seconds']:.0f} s, step {step}", flush=True)
        if run["rc"] == 0:
            trained = (shape, plan)
            break
    if trained is not None:
        shape, plan = trained
        extra = [] if plan["fsdp2_fits_on_device"] else ["--offload"]
        left = args.budget_s - (time.time() - began)
        if plan["fsdp2_fits_on_device"] or plan["fsdp2_fits_with_cpu_offload"]:
            if left > 60:
                run = attempt(shape[0], shape, "fsdp2", extra, args.out, min(left, args.fsdp2_timeout_s))
                report["runs"].append(run)
                print(f"fsdp2 {shape[0]}: rc {run['rc']}, step {run.get('median_step_s')}", flush=True)
        else:
            report["fsdp2"] = (
                f"FSDP2 at {shape[0]}: predicted not to fit (16 bytes per parameter, "
                f"{16 * plan['params'] / 1e9:.0f} GB, on the device without offload and on the host with "
                "CPUOffloadPolicy)"
            )
            print(report["fsdp2"], flush=True)
            if args.fsdp2_anyway and left > 100:
                run = attempt(shape[0], shape, "fsdp2", ["--offload"], args.out, min(left - 10, args.fsdp2_timeout_s))
                report["runs"].append(run)
                report["fsdp2"] += f"; run anyway with CPUOffloadPolicy: rc {run['rc']} after {run['seconds']:.0f} s"
                print(report["fsdp2"], flush=True)
    with open(os.path.join(args.out, "largest.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0 if trained is not None else 1


if __name__ == "__main__":
    sys.exit(main())
