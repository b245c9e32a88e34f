"""The short table `bench/perf_session.sh` prints last, read from the JSON its phases wrote into OUT.

python bench/perf_summary.py OUT
"""

from __future__ import annotations

import json
import sys
from math import nan
from pathlib import Path


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _row(data, engine=None):
    if not data:
        return None
    rows = [r for r in data.get("results", []) if engine is None or r["engine"] == engine]
    return rows[0] if rows else None


def checks(out: Path) -> list[str]:
    data = _load(out / "checks.json")
    if data is None:
        return ["checks: no checks.json (the phase did not run or crashed; see check.log)"]
    failed = [c for c in data["checks"] if not c["ok"]]
    lines = [f"checks: {len(data['checks']) - len(failed)} of {len(data['checks'])} passed"]
    lines += [f"  FAIL {c['check']}: {c['detail']}" for c in failed]
    t = data.get("kernel_timing")
    if t:
        lines.append(
            f"kernel, {t['numel'] / 2**20:.0f}Mi elements: FusedAdamW+bf16 {t['fusedadamw_with_bf16_s'] * 1e3:.2f} ms "
            f"({t['fusedadamw_with_bf16_TBps']:.2f} TB/s), torch fused AdamW {t['torch_fused_adamw_s'] * 1e3:.2f} ms "
            f"({t['torch_fused_adamw_TBps']:.2f} TB/s), copy {t['copy_TBps']:.2f} TB/s"
        )
    return lines


def floor(out: Path) -> list[str]:
    data = _load(out / "floor3b.json")
    if data is None:
        return ["3.0B floor: no floor3b.json"]
    meta = data["meta"]
    bw = meta.get("copy_bandwidth", {}).get("bytes_per_s")
    rate = (meta.get("matmul_tflops_per_rank") or [None])[0]
    lines = [
        f"3.0B Llama, 1 GPU (copy bandwidth {bw / 1e12:.2f} TB/s, matmul {rate:.0f} TFLOP/s, MFU of "
        f"{meta.get('peak_tflops')} TFLOP/s)"
        if bw and rate
        else "3.0B Llama, 1 GPU",
        "| engine | step s | cost ms | GB moved | floor GB | floor ms | cost/floor | peak MiB | MFU | of achievable |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    model = _row(data, "model")
    for r in data["results"]:
        moved = sum(r["bytes_moved"].values()) / 1e9 if r.get("bytes_moved") else None
        fl = sum(r["bytes_floor"].values()) if r.get("bytes_floor") else None
        cost = (r["median_step_s"] - model["median_step_s"]) * 1e3 if model and r is not model else None
        floor_ms = fl / bw * 1e3 if fl and bw else None
        cells = [
            r["engine"],
            f"{r['median_step_s']:.4f}",
            f"{cost:.1f}" if cost is not None else "-",
            f"{moved:.0f}" if moved else "-",
            f"{fl / 1e9:.0f}" if fl else "-",
            f"{floor_ms:.1f}" if floor_ms else "-",
            f"{cost / floor_ms:.2f}x" if cost is not None and floor_ms else "-",
            f"{(r.get('cuda_peak_allocated_bytes') or 0) / 2**20:,.0f}",
            f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-",
            f"{100 * r['mfu_of_achievable']:.1f}%" if r.get("mfu_of_achievable") else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"ENGINE FAILED {line}" for line in data.get("failed", [])]
    bad = [c for c in data.get("loss_checks", []) if not c["ok"]]
    lines.append("loss checks: " + ("all ok" if not bad else "MISMATCH " + ", ".join(c["pair"] for c in bad)))
    return lines


def llama67(out: Path) -> list[str]:
    lines = ["6.7B Llama, 1 GPU, micro-batch 1, no recompute (each engine its own process)"]
    firsts = []
    lines += ["| run | engine | offload | step s | peak MiB | max RSS MiB | first loss |"]
    lines += ["|---|---|---|---:|---:|---:|---:|"]
    for name in ("h67", "f67", "o67full", "o67half", "fsdp2off67"):
        data = _load(out / f"{name}.json")
        if data is None:
            lines.append(f"| {name} | - | - | not run or failed (see {name}.log) | | | |")
            continue
        lines += [f"| {name} | ENGINE FAILED: {line} | | | | | |" for line in data.get("failed", [])]
        for r in data["results"]:
            off = r.get("offloaded_fraction")
            policy = "CPUOffloadPolicy" if "--offload" in data["meta"]["argv"] else "-"
            off = f"{off:.2f}" if off is not None else policy
            firsts.append((f"{name} {r['engine']}", r["losses"][0]))
            lines.append(
                f"| {name} | {r['engine']} | {off} | {r['median_step_s']:.4f} | "
                f"{(r.get('cuda_peak_allocated_bytes') or 0) / 2**20:,.0f} | {r.get('max_rss_mib', 0):,.0f} | "
                f"{r['losses'][0]:.5f} |"
            )
    if firsts:  # the same weights (built on the device from one seed) and data: the first losses must agree
        ref = firsts[0][1]
        worst = max(abs(x - ref) / abs(ref) for _, x in firsts)
        verdict = "ok" if worst <= 2e-2 else "MISMATCH"
        lines.append(f"first losses agree across processes within {worst:.1e} (bf16 bound 2e-2): {verdict}")
    return lines


def largest(out: Path) -> list[str]:
    data = _load(out / "largest.json")
    if data is None:
        return ["largest: no largest.json"]
    lines = ["largest Llama on 1 GPU (recompute, micro-batch 1, hfsdp offload='auto')"]
    for p in data["predictions"]:
        lines.append(
            f"  predicted {p['params'] / 1e9:.2f}B: offload {p['offload_fraction']:.2f}, hfsdp "
            f"{'fits' if p['hfsdp_fits'] else 'no'}, FSDP2 device {'fits' if p['fsdp2_fits_on_device'] else 'no'}, "
            f"FSDP2 CPUOffloadPolicy {'fits' if p['fsdp2_fits_with_cpu_offload'] else 'no'}"
        )
    for run in data["runs"]:
        lines.append(
            f"  {run['engine']} {run['name']}: rc {run['rc']}, step {run.get('median_step_s')}, offloaded "
            f"{run.get('offloaded_fraction')}, peak {run.get('peak_alloc_mib')} MiB, "
            f"max RSS {run.get('max_rss_mib')} MiB"
        )
    if data.get("fsdp2"):
        lines.append("  " + data["fsdp2"])
    return lines


def two(out: Path) -> list[str]:
    lines = []
    for name in ("two-llama", "two-gpt"):
        data = _load(out / f"{name}.json")
        if data is None:
            continue
        lines.append(f"{name}: 2 GPUs")
        for r in data["results"]:
            lines.append(
                f"  {r['engine']} {r['layout']}: {r['median_step_s']:.4f} s, peak "
                f"{(r.get('cuda_peak_allocated_bytes') or 0) / 2**20:,.0f} MiB"
            )
    return lines


#: Phases whose whole step-time table the summary repeats (engines side by side, each row's loss verdict in it).
TABLE_PHASES = (
    "default3b", "e095", "c095", "mfu3b", "mfu3bliger", "mfu3bmb4", "mfu3bm2", "c095m2", "c095mb8",
    "ligerdbg-fsdp2", "ligerkeep", "ligerplain", "ligernorms", "keep3b", "keep3bm2",
    "ligerdbg-hfsdp", "ov3b", "ov095", "ovc095",
)  # fmt: skip


def _records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def trains(out: Path) -> list[str]:
    """hfsdp train's own figures (the train3b, train095, train3bmb4, train095mb8 phases): the median step's MFU,
    and its losses against the eager run of the same phase (the reference)."""
    lines = []
    for name in ("train3b", "train3b-overlap", "train095", "train095-overlap", "train3bmb4", "train095mb8"):
        base = name.removesuffix("-overlap")
        compiled, eager = _records(out / f"{name}.jsonl"), _records(out / f"{base}-eager.jsonl")
        if not compiled:
            continue
        steady = sorted(compiled[1:] or compiled, key=lambda r: r["step_time_s"])
        median = steady[len(steady) // 2]
        pairs = [(r["loss"], e["loss"]) for r, e in zip(compiled, eager, strict=False)]
        worst = max((abs(a - b) / abs(b) for a, b in pairs), default=float("nan"))
        lines.append(
            f"{name}: hfsdp train compiled, median step {median['step_time_s']:.4f} s, "
            f"{median.get('model_tflops_per_gpu', nan):.1f} model TFLOP/s, MFU {median.get('mfu', nan):.1%}, "
            f"peak {median['peak_memory_mb']:,.0f} MiB; losses {[round(r['loss'], 5) for r in compiled[:4]]} against "
            f"eager {[round(e['loss'], 5) for e in eager[:4]]}: max rel diff {worst:.2e} over {len(pairs)} steps"
        )
        if eager and name == base:
            e_steady = sorted(eager[1:] or eager, key=lambda r: r["step_time_s"])
            e_median = e_steady[len(e_steady) // 2]
            lines.append(
                f"{name}-eager: median step {e_median['step_time_s']:.4f} s, MFU {e_median.get('mfu', nan):.1%}"
            )
    return lines


def probes(out: Path) -> list[str]:
    lines = []
    for name in ("probe095", "probe3b"):
        data = _load(out / f"{name}.json")
        if data is None:
            continue
        lines.append(f"{name}: AdamW over {data['elements'] / 1e9:.2f}B elements alone {data['adamw_ms']:.2f} ms")
        for part in ("forward", "forward_backward"):
            r = data[part]
            lines.append(
                f"  {part}: alone {r['compute_ms']:.2f} ms; with AdamW on a second stream {r['together_ms']:.2f} ms "
                f"(hidden {r['together_hidden']:.0%}), pipelined {r['pipelined_ms']:.2f} ms "
                f"(hidden {r['pipelined_hidden']:.0%})"
            )
    return lines


def tables(out: Path) -> list[str]:
    lines = []
    for name in TABLE_PHASES:
        data = _load(out / f"{name}.json")
        if data is None:
            continue
        step_table = data["table"].split("## Host time")[0].split("## Profile")[0].strip()
        lines += [f"### {name}: {' '.join(data['meta']['argv'][1:])}", "", step_table, ""]
        lines += [f"FAILED: {line}" for line in data.get("failed", [])]
    return lines


def main(argv=None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    lines = []
    status = out / "status.txt"
    if status.exists():
        lines += ["phases: " + "; ".join(line.strip() for line in status.read_text().splitlines() if line.strip())]
    for part in (checks, floor, llama67, largest, two, trains, probes, tables):
        try:
            lines += part(out)
        except Exception as err:  # a summary must not hide the other parts
            lines.append(f"{part.__name__}: could not summarise ({type(err).__name__}: {err})")
        lines.append("")
    text = "\n".join(lines)
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
