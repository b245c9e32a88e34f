"""Train the same GPT under several layouts with `hfsdp train` and compare their losses step by step.

Run on a GPU machine (NCCL) or on CPU (gloo); each layout is one `python -m hfsdp.cli train`
subprocess writing metrics to OUT_DIR, and the table compares every layout with the first.

    python bench/gpu_layouts.py --out-dir $OUT --device cuda --gpus 2 --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = {
    "1 rank": (1, []),
    "ZeRO-3 1x2": (2, []),
    "HSDP 2x1": (2, ["--instances", "2"]),
    "HFSDP 2x1": (2, ["--instances", "2", "--outer", "optim"]),
    "ZeRO-1 1x2": (2, ["--inner", "optim"]),
    "MoE ep2 ZeRO-3 1x2": (2, ["--moe-experts", "4", "--ep", "2"]),
    "MoE ep1 1 rank": (1, ["--moe-experts", "4"]),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", default="runs/layouts")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", default="", help="comma-separated layout names to run (default: all that fit)")
    model = "--layers 4 --hidden 512 --heads 8 --vocab 8192 --seq-len 512 --global-batch-size 8 --micro-batch-size 2"
    parser.add_argument("--model", default=model, help="hfsdp train flags that size the model and batch")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, (nproc, extra) in LAYOUTS.items():
        if nproc > args.gpus or (args.only and name not in args.only.split(",")):
            continue
        metrics = out / f"{name.replace(' ', '_')}.jsonl"
        cmd = [sys.executable, "-m", "hfsdp.cli", "train", "--nproc", str(nproc), "--device", args.device]
        cmd += [
            "--dtype",
            args.dtype,
            "--steps",
            str(args.steps),
            "--metrics",
            str(metrics),
            *args.model.split(),
            *extra,
        ]
        began = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        log = out / f"{name.replace(' ', '_')}.log"
        log.write_text(proc.stdout + proc.stderr)
        ok = proc.returncode == 0 and metrics.exists()
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if ok else []
        results[name] = {"ok": ok, "seconds": time.perf_counter() - began, "records": records}
        print(f"{name}: rc={proc.returncode} {time.perf_counter() - began:.1f}s", flush=True)
        if not ok:
            print(proc.stderr[-2000:], flush=True)
    (out / "layouts.json").write_text(json.dumps(results, indent=1))
    _table(results)
    return 0


def _table(results) -> None:
    dense = [n for n in results if "MoE" not in n and results[n]["ok"]]
    moe = [n for n in results if "MoE" in n and results[n]["ok"]]
    for group in (dense, moe):
        if not group:
            continue
        base = results[group[0]]["records"]
        print(f"\n| layout | losses | max rel diff vs {group[0]} | median tok/s | peak MiB |")
        print("|---|---|---|---|---|")
        for name in group:
            rec = results[name]["records"]
            diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(rec, base, strict=False))
            tps = sorted(r["tokens_per_s"] for r in rec[1:])[len(rec[1:]) // 2] if len(rec) > 1 else float("nan")
            losses = " ".join(f"{r['loss']:.4f}" for r in rec)
            print(f"| {name} | {losses} | {diff:.2e} | {tps:,.0f} | {max(r['peak_memory_mb'] for r in rec):,.0f} |")


if __name__ == "__main__":
    raise SystemExit(main())
