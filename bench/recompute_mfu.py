"""MFU by the field's definition, recomputed from the raw numbers of earlier runs (their JSON under docs/results/).

Until the 2026-12 fix, `bench_step.py` divided model FLOPs by the matmul rate it measured in the run (718-814
TFLOP/s on an H200) instead of the datasheet's dense peak (989 TFLOP/s bf16). Each JSON keeps what both need:
the FLOPs per token, the tokens per second of every row, and the measured rate. This prints, for each row, the
recorded figure and the conventional one:

    python bench/recompute_mfu.py docs/results/h200-2026-12-01/*/*.json --peak-tflops 989
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows(path: Path, peak: float):
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "results" not in data:
        return
    rates = data.get("meta", {}).get("matmul_tflops_per_rank") or [None]
    for r in data["results"]:
        flops, tokens = r.get("flops_per_token"), r.get("tokens_per_s_per_rank")
        if not flops or not tokens:
            continue
        achieved = flops * tokens / 1e12
        yield {
            "file": str(path),
            "engine": r["engine"],
            "layout": r["layout"],
            "median_step_s": r["median_step_s"],
            "achieved_tflops": achieved,
            "measured_rate": rates[0],
            "recorded_mfu": r.get("mfu"),
            "mfu": achieved / peak,
            "of_achievable": achieved / rates[0] if rates[0] else None,
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="datasheet dense peak (H200 SXM bf16: 989)")
    args = p.parse_args(argv)
    if not args.peak_tflops > 0:
        p.error("--peak-tflops must be positive")
    peak = f"{args.peak_tflops:.0f}"
    print(f"| run | engine | layout | step (s) | achieved TFLOP/s | recorded | MFU (of {peak}) | of achievable |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for path in args.files:
        for r in rows(path, args.peak_tflops):
            recorded = f"{100 * r['recorded_mfu']:.1f}%" if r["recorded_mfu"] else "-"
            ach = f"{100 * r['of_achievable']:.1f}% of {r['measured_rate']:.0f}" if r["of_achievable"] else "-"
            run = "/".join(Path(r["file"]).parts[-2:])
            print(
                f"| {run} | {r['engine']} | {r['layout']} | {r['median_step_s']:.4f} | {r['achieved_tflops']:.0f} | "
                f"{recorded} | {100 * r['mfu']:.1f}% | {ach} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
