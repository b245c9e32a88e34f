"""The DiLoCo benchmark's results as a markdown table and an SVG plot (eval loss against outer-axis bytes).

    python bench/diloco_report.py results.jsonl docs/diloco.svg

Reads the JSON lines `bench_diloco.py` wrote, averages each run over its seeds (mean and sample standard
deviation), and compares it with HSDP: outer bytes as a ratio (how many times fewer), eval loss as a percentage.
The SVG is drawn by hand (no plotting library needed): log-scale bytes, one point per run with its spread.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path


def load(path: str) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            runs.setdefault(record["run"], []).append(record)
    return runs


def summary(runs: dict[str, list[dict]]) -> list[dict]:
    hsdp = runs.get("HSDP")
    base_loss = statistics.mean(r["eval_loss"] for r in hsdp) if hsdp else None
    base_bytes = statistics.mean(r["outer_bytes"] for r in hsdp) if hsdp else None
    rows = []
    for name, records in runs.items():
        losses = [r["eval_loss"] for r in records]
        outer = statistics.mean(r["outer_bytes"] for r in records)
        rows.append(
            {
                "run": name,
                "seeds": len(records),
                "steps": records[0]["steps"],
                "tokens": records[0]["tokens"],
                "outer_mb": outer / 1e6,
                "fewer": base_bytes / outer if base_bytes and outer else None,
                "eval": statistics.mean(losses),
                "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                "vs_hsdp": 100 * (statistics.mean(losses) / base_loss - 1) if base_loss else None,
                "seconds": statistics.mean(r["seconds"] for r in records),
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    head = "| run | seeds | steps | outer MB / rank | x fewer than HSDP | eval loss (mean ± std) | vs HSDP | s / run |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fewer = f"{r['fewer']:.0f}x" if r["fewer"] else "—"
        vs = f"{r['vs_hsdp']:+.2f}%" if r["vs_hsdp"] is not None and r["run"] != "HSDP" else "—"
        lines.append(
            f"| {r['run']} | {r['seeds']} | {r['steps']} | {r['outer_mb']:,.1f} | {fewer} | "
            f"{r['eval']:.4f} ± {r['std']:.4f} | {vs} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def svg(rows: list[dict], width: int = 640, height: int = 400) -> str:
    """Eval loss (y) against outer MB per rank (x, log scale), error bars of one standard deviation."""
    left, right, top, bottom = 70, 170, 20, 50
    xs = [math.log10(max(r["outer_mb"], 1e-6)) for r in rows]
    lo_y = min(r["eval"] - r["std"] for r in rows)
    hi_y = max(r["eval"] + r["std"] for r in rows)
    pad = (hi_y - lo_y) * 0.1 or 0.01
    lo_y, hi_y = lo_y - pad, hi_y + pad
    lo_x, hi_x = math.floor(min(xs)), math.ceil(max(xs)) if max(xs) > math.floor(min(xs)) else math.floor(min(xs)) + 1

    def px(x):
        return left + (x - lo_x) / (hi_x - lo_x) * (width - left - right)

    def py(y):
        return top + (hi_y - y) / (hi_y - lo_y) * (height - top - bottom)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" fill="none" '
        'stroke="#888"/>',
    ]
    for decade in range(lo_x, hi_x + 1):
        x = px(decade)
        out.append(f'<line x1="{x:.1f}" y1="{height - bottom}" x2="{x:.1f}" y2="{height - bottom + 4}" stroke="#888"/>')
        out.append(f'<text x="{x:.1f}" y="{height - bottom + 16}" text-anchor="middle">{10.0**decade:g}</text>')
    for k in range(5):
        y = lo_y + (hi_y - lo_y) * k / 4
        out.append(f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.3f}</text>')
    out.append(
        f'<text x="{(left + width - right) / 2:.0f}" y="{height - 10}" text-anchor="middle">'
        "outer-axis MB sent per rank (log)</text>"
    )
    out.append(f'<text x="14" y="{top + 10}" transform="rotate(-90 14 {top + 10})" text-anchor="end">eval loss</text>')
    colors = [
        "#d62728",
        "#1f77b4",
        "#2ca02c",
        "#9467bd",
        "#8c564b",
        "#e377c2",
        "#7f7f7f",
        "#bcbd22",
        "#17becf",
        "#ff7f0e",
        "#393b79",
        "#637939",
    ]
    for i, (r, x) in enumerate(zip(rows, xs, strict=True)):
        c = colors[i % len(colors)]
        cx, cy = px(x), py(r["eval"])
        out.append(
            f'<line x1="{cx:.1f}" y1="{py(r["eval"] - r["std"]):.1f}" x2="{cx:.1f}" '
            f'y2="{py(r["eval"] + r["std"]):.1f}" stroke="{c}"/>'
        )
        out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="{c}"/>')
        ly = top + 14 + 16 * i
        out.append(f'<circle cx="{width - right + 14}" cy="{ly - 4}" r="4" fill="{c}"/>')
        out.append(f'<text x="{width - right + 24}" y="{ly}">{r["run"]}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    rows = summary(load(argv[0]))
    print(table(rows))
    goal = next((r for r in rows if r["run"] == "DiLoCo H=50"), None)
    if goal and goal["vs_hsdp"] is not None:
        holds = goal["vs_hsdp"] <= 3 and (goal["fewer"] or 0) >= 50
        print(
            f"\nGoal (H=50 within 3% of HSDP's eval loss with >= 50x fewer outer bytes): "
            f"{goal['vs_hsdp']:+.2f}%, {goal['fewer']:.0f}x fewer -> {'holds' if holds else 'does not hold'}"
        )
    if len(argv) > 1:
        Path(argv[1]).write_text(svg(rows))
        print(f"wrote {argv[1]}")


if __name__ == "__main__":
    main()
