"""bench_step.py's rows and tables: every rank's measurements merged into one row, the rounds of one (layout,
engine) pooled, and the markdown report (step time, MFU, bandwidth floor, host phases, profile, loss agreement).
"""

from __future__ import annotations

import statistics

from _common import markdown_table
from _engine_base import engine_family


def merge_ranks(per_rank: list[dict]) -> dict:
    """One row from every rank's result: slowest median step, largest memory, rank 0's losses."""
    first = dict(per_rank[0])

    def biggest(key):
        values = [r[key] for r in per_rank if r.get(key) is not None]
        return max(values) if values else None

    first["median_step_s"] = biggest("median_step_s")
    first["min_step_s"] = max(min(r["step_times_s"]) for r in per_rank)
    first["tokens_per_s_per_rank"] = first["tokens_per_step_per_rank"] / first["median_step_s"]
    for key in ("model_state_bytes", "max_rss_mib", "cuda_peak_allocated_bytes", "comm_blocked_s_per_step"):
        first[key] = biggest(key)
    first["cpu_s_per_step"] = statistics.mean(r["cpu_s_per_step"] for r in per_rank)
    first["per_rank"] = [
        {k: r[k] for k in ("median_step_s", "step_times_s", "model_state_bytes", "max_rss_mib")}
        | {"cuda_peak_allocated_bytes": r["cuda_peak_allocated_bytes"]}
        | {k: r[k] for k in ("comm_blocked_s_per_step", "comm_blocked_s", "cpu_s_per_step", "cpu_s")}
        | {k: r[k] for k in ("timers_s_per_step", "timers_cpu_s_per_step")}
        for r in per_rank
    ]
    return first


def combine_rounds(rows: list[dict]) -> dict:
    """One row from the rounds of one (layout, engine): every rank's step times pooled, its median, the
    slowest rank's median; the largest memory; host timers averaged; losses and profile of round 0."""
    first = dict(rows[0])
    ranks = len(first["per_rank"])
    pooled = [[t for row in rows for t in row["per_rank"][r]["step_times_s"]] for r in range(ranks)]
    first["median_step_s"] = max(statistics.median(times) for times in pooled)
    first["min_step_s"] = max(min(times) for times in pooled)
    first["round_median_step_s"] = [row["median_step_s"] for row in rows]
    first["tokens_per_s_per_rank"] = first["tokens_per_step_per_rank"] / first["median_step_s"]
    for key in ("model_state_bytes", "max_rss_mib", "cuda_peak_allocated_bytes"):
        values = [row[key] for row in rows if row.get(key) is not None]
        first[key] = max(values) if values else None
    comm = [[t for row in rows for t in row["per_rank"][r]["comm_blocked_s"]] for r in range(ranks)]
    first["comm_blocked_s_per_step"] = max(statistics.median(times) for times in comm)
    cpu = [[t for row in rows for t in row["per_rank"][r]["cpu_s"]] for r in range(ranks)]
    first["cpu_s_per_step"] = statistics.mean(statistics.median(times) for times in cpu)
    for r in range(ranks):
        keys = {k for row in rows for k in row["per_rank"][r]["timers_s_per_step"]}
        first["per_rank"][r] = dict(first["per_rank"][r]) | {
            "step_times_s": pooled[r],
            "comm_blocked_s": comm[r],
            "cpu_s": cpu[r],
            "timers_s_per_step": {
                k: statistics.mean(row["per_rank"][r]["timers_s_per_step"].get(k, 0.0) for row in rows) for k in keys
            },
            "timers_cpu_s_per_step": {
                k: statistics.mean(row["per_rank"][r]["timers_cpu_s_per_step"].get(k, 0.0) for row in rows)
                for k in keys
            },
        }
    first["rounds"] = len(rows)
    first["loss_drift_between_rounds"] = max(
        (abs(a - b) for row in rows[1:] for a, b in zip(row["losses"], first["losses"], strict=True)), default=0.0
    )
    return first


def floor_report(results: list[dict], meta: dict) -> list[str]:
    """Each engine's cost over the model alone against the bandwidth floor of its layout (`_floor.py`)."""
    bw = meta["copy_bandwidth"]["bytes_per_s"]
    model = next((r for r in results if r["engine"] == "model"), None)
    header = ["engine", "step (s)", "cost over the model alone (ms)", "bytes its kernels move (GB)"]
    header += ["at copy rate (ms)", "floor bytes (GB)", "floor (ms)", "cost / floor", "peak alloc MiB"]
    rows = []
    for r in results:
        if engine_family(r["engine"]) == "model":  # the floor itself, in bf16 or fp8
            continue
        cost = (r["median_step_s"] - model["median_step_s"]) if model else None
        moved, floor = r.get("bytes_moved"), r.get("bytes_floor")
        moved_b = sum(moved.values()) if moved else None
        floor_b = sum(floor.values()) if floor else None
        r["cost_s"], r["floor_s"] = cost, floor_b / bw if floor_b else None
        row = [r["engine"], r["median_step_s"], f"{cost * 1e3:.1f}" if cost is not None else "n/a"]
        row += [f"{moved_b / 1e9:.1f}" if moved_b else "n/a", f"{moved_b / bw * 1e3:.1f}" if moved_b else "n/a"]
        row += [f"{floor_b / 1e9:.1f}" if floor_b else "n/a", f"{floor_b / bw * 1e3:.1f}" if floor_b else "n/a"]
        row += [f"{cost / (floor_b / bw):.2f}x" if cost is not None and floor_b else "n/a"]
        row += [r["cuda_peak_allocated_bytes"] / 2**20 if r.get("cuda_peak_allocated_bytes") else "n/a"]
        rows.append(row)
    lines = [
        f"## The engine's cost against its bandwidth floor (copy bandwidth measured here: {bw / 1e12:.2f} TB/s)",
        "",
        markdown_table(header, rows),
        "",
    ]
    for r in results:
        if r.get("bytes_moved"):
            kinds = sorted(set(r["bytes_moved"]) | set(r["bytes_floor"]))
            moved, floor = r["bytes_moved"], r["bytes_floor"]
            parts = ", ".join(f"{k} {moved.get(k, 0) / 1e9:.2f}/{floor.get(k, 0) / 1e9:.2f}" for k in kinds)
            lines.append(f"- {r['engine']}: GB moved/floor by kind: {parts}")
    return [*lines, ""]


def report(results: list[dict], checks: list[dict], args, meta: dict) -> str:
    cuda = args.device == "cuda"
    header = ["engine", "layout", "median step (s)", "min step (s)", "tokens/s/rank", "model state MiB/rank"]
    header += ["peak alloc MiB/rank"] if cuda else ["max RSS MiB/rank"]
    header += ["comm blocked s/step (host, median)", "comm blocked % of step", "CPU s/step/rank"]
    if cuda:
        peak = meta.get("peak_tflops")
        header += [f"MFU (of {peak:.0f} TFLOP/s datasheet peak)" if peak else "MFU (no datasheet peak known)"]
        header += ["of achievable (measured matmul rate)"]
    header += ["losses (checked in this run)"]
    verdict = {(c["layout"], c["engine"]): "ok" if c["ok"] else "**WRONG: not a result**" for c in checks}
    rows = []
    for r in results:
        state = r["model_state_bytes"] / 2**20 if r["model_state_bytes"] is not None else "n/a"
        mem = r["cuda_peak_allocated_bytes"] / 2**20 if cuda else r["max_rss_mib"]
        comm = r["comm_blocked_s_per_step"]
        row = [r["engine"], f"{r['layout']} — {r['label']}", r["median_step_s"], r["min_step_s"]]
        row += [r["tokens_per_s_per_rank"], state]
        row += [mem, comm, f"{100 * comm / r['median_step_s']:.1f}%"] if args.timing else [mem, "n/a", "n/a"]
        row += [r["cpu_s_per_step"]]
        if cuda:
            rate = meta.get("matmul_tflops_per_rank", [None])[0]
            achieved = r["flops_per_token"] * r["tokens_per_s_per_rank"]
            r["mfu"] = achieved / (peak * 1e12) if peak else None
            r["mfu_of_achievable"] = achieved / (rate * 1e12) if rate else None
            row += [f"{100 * r['mfu']:.1f}%" if peak else "n/a"]
            row += [f"{100 * r['mfu_of_achievable']:.1f}% of {rate:.0f}" if rate else "n/a"]
        unchecked = "unchecked (simulated)" if args.simulate_world else "reference" if checks else "unchecked (one row)"
        row += [verdict.get((r["layout"], r["engine"]), unchecked)]
        rows.append(row)
    lines = ["", "## Step time", "", markdown_table(header, rows), ""]
    if meta.get("copy_bandwidth"):
        lines += floor_report(results, meta)
    if args.simulate_world:
        lines[3:3] = [
            f"Simulated: rank {args.simulate_rank} of {args.simulate_world} on the fake process group. Memory is "
            "the real rank's; step times leave out all communication; losses are meaningless.",
            "",
        ]

    phase_keys = sorted({k for r in results for k in r["timers_s_per_step"]})
    if phase_keys:
        lines += ["## Host time per step by phase, wall / CPU (ms, inclusive, mean over ranks and steps)", ""]
        cols = [f"{r['engine']} {r['layout']}" for r in results]

        def cell(r, k):
            ranks = r["per_rank"]
            if all(k not in p["timers_s_per_step"] for p in ranks):
                return ""
            wall = statistics.mean(p["timers_s_per_step"].get(k, 0.0) for p in ranks)
            cpu = statistics.mean(p["timers_cpu_s_per_step"].get(k, 0.0) for p in ranks)
            return f"{1e3 * wall:.1f} / {1e3 * cpu:.1f}"

        prow = [[k] + [cell(r, k) for r in results] for k in phase_keys]
        lines += [markdown_table(["phase", *cols], prow), ""]

    profiled = [r for r in results if r.get("profile") and "error" not in r["profile"]]
    if profiled:
        keys = ["step_s", "compute_s", "copy_s", "comm_s", "comm_exposed_s"]
        keys += ["idle_s"] if cuda else ["python_and_hooks_s"]
        keys += ["peak_step_alloc_mib"]
        lines += [f"## Profile, s per step (rank 0; {profiled[0]['profile']['source']})", ""]
        prow = [[r["engine"], r["layout"]] + [r["profile"][k] for k in keys] for r in profiled]
        lines += [markdown_table(["engine", "layout", *keys], prow), ""]
        for r in profiled:
            ranges = ", ".join(f"{k} {v:.4f}" for k, v in list(r["profile"]["annotated_ranges_s"].items())[:8])
            ops = ", ".join(f"{k} {v:.3f}" for k, v in r["profile"]["top_self_cpu_ops_s"][:8])
            lines += [
                f"- {r['engine']} {r['layout']}: annotated ranges s/step: {ranges}",
                f"  top self-CPU ops (s total): {ops}",
            ]
            idle = r["profile"].get("idle_by_host_activity_s", [])[:8]
            if idle:
                lines += ["  GPU idle s/step, by what the host was doing (phase | engine range | op): "]
                lines += [f"    {t:.4f} {k}" for k, t in idle]
        lines += [""]

    if checks:
        lines += ["## Loss agreement (same init, same data)", ""]
        crow = []
        for c in checks:
            flag = "ok" if c["ok"] else "**MISMATCH**"
            crow.append(
                [
                    c["layout"],
                    c["pair"],
                    " ".join(f"{x:.6f}" for x in c["hfsdp"]),
                    " ".join(f"{x:.6f}" for x in c["reference"]),
                    f"{c['max_rel_diff_first_steps']:.2e}",
                    f"{c['max_rel_diff_all_steps']:.2e}",
                    c["rtol"],
                    flag,
                ]
            )
        header = ["layout", "pair", "row's losses", "reference losses", "max rel diff (first)", "(all steps)"]
        header += ["rtol", ""]
        lines += [markdown_table(header, crow), ""]
    return "\n".join(lines)
