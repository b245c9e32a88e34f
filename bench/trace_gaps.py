"""Where a GPU waited, from a `hfsdp train --profile-dir` trace: busy time, idle time, and the longest idle gaps with
what the host was doing then.

A step time says how long a step took, not whether the GPU was busy all that while. This reads the Chrome trace
torch.profiler writes, takes the union of every kernel, copy and memset on every stream as "busy", and lists the
gaps between them longer than --min-gap-ms. For each gap it names the host operator whose launch ended it (the
kernel after the gap, through its correlation id, to the enclosing `cpu_op` on the launching thread) and the
outermost host operators that ran during it: a gap ended by `aten::to` or `aten::item` is the host waiting for
the device or copying, one inside a Python loop is launch cost.

Usage: python bench/trace_gaps.py TRACE.json[.gz] [--min-gap-ms 0.05] [--top 15] [--out gaps.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
from bisect import bisect_right
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: Path) -> list[dict]:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return json.loads(raw)["traceEvents"]


def busy_intervals(events: list[dict]) -> list[tuple[float, float, dict]]:
    """Every device event as (start, end, event), in start order (microseconds, the trace's unit)."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    return sorted(((e["ts"], e["ts"] + e.get("dur", 0), e) for e in device), key=lambda t: t[0])


def gaps(intervals: list[tuple[float, float, dict]]) -> tuple[float, list[tuple[float, float, dict]]]:
    """(busy time of the union, [(gap start, gap end, the event that ends the gap)])."""
    busy, found, reach = 0.0, [], None
    for start, end, event in intervals:
        if reach is None:
            busy, reach = end - start, end
            continue
        if start > reach:
            found.append((reach, start, event))
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return busy, found


class HostOps:
    """The host's `cpu_op` events per thread, to answer "which operator encloses time t on thread T"."""

    def __init__(self, events: list[dict]):
        ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        self.by_thread: dict[tuple, list[dict]] = {}
        for e in sorted(ops, key=lambda e: e["ts"]):
            self.by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        self.starts = {k: [e["ts"] for e in v] for k, v in self.by_thread.items()}
        self.launches = {
            e["args"]["correlation"]: e
            for e in events
            if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
        }

    def enclosing(self, thread: tuple, t: float) -> list[str]:
        """Names of the operators open at time t on `thread`, outermost first."""
        ops, starts = self.by_thread.get(thread, []), self.starts.get(thread, [])
        return [e["name"] for e in ops[: bisect_right(starts, t)] if e["ts"] + e.get("dur", 0) > t]

    def launcher_of(self, kernel: dict) -> str:
        launch = self.launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return "?"
        names = self.enclosing((launch.get("pid"), launch.get("tid")), launch["ts"])
        return " > ".join(names[-2:]) if names else launch["name"]

    def during(self, start: float, end: float) -> list[str]:
        """The outermost operators that overlap [start, end] on any thread."""
        seen = []
        for ops in self.by_thread.values():
            depth_end = -1.0
            for e in ops:
                e_end = e["ts"] + e.get("dur", 0)
                if e["ts"] >= end:
                    break
                if e["ts"] < depth_end:  # inside an operator already counted
                    continue
                depth_end = e_end
                if e_end > start and e["name"] not in seen:
                    seen.append(e["name"])
        return seen[:6]


def report(path: Path, min_gap_ms: float, top: int) -> dict:
    events = load(path)
    intervals = busy_intervals(events)
    if not intervals:
        return {"trace": str(path), "error": "no device events: a CPU run, or no CUDA activity was recorded"}
    busy, found = gaps(intervals)
    window = intervals[-1][1] - intervals[0][0]
    host = HostOps(events)
    long_ones = sorted((g for g in found if g[1] - g[0] >= min_gap_ms * 1e3), key=lambda g: g[0] - g[1])
    return {
        "trace": str(path),
        "window_ms": window / 1e3,
        "busy_ms": busy / 1e3,
        "idle_ms": (window - busy) / 1e3,
        "gaps": len(found),
        "idle_in_gaps_over_min_ms": sum(g[1] - g[0] for g in long_ones) / 1e3,
        "longest": [
            {
                "at_ms": (s - intervals[0][0]) / 1e3,
                "gap_ms": (e - s) / 1e3,
                "ended_by": f"{kernel['name'][:80]} (launched in {host.launcher_of(kernel)})",
                "host_during": host.during(s, e),
            }
            for s, e, kernel in long_ones[:top]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--min-gap-ms", type=float, default=0.05)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = report(args.trace, args.min_gap_ms, args.top)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if "error" in result:
        print(f"{args.trace}: {result['error']}")
        return
    print(
        f"{args.trace}: {result['window_ms']:.1f} ms from the first device event to the last; busy "
        f"{result['busy_ms']:.1f} ms, idle {result['idle_ms']:.1f} ms in {result['gaps']} gaps "
        f"({result['idle_in_gaps_over_min_ms']:.1f} ms in gaps of {args.min_gap_ms} ms or more)"
    )
    for g in result["longest"]:
        print(f"  +{g['at_ms']:9.2f} ms  idle {g['gap_ms']:7.3f} ms  ended by {g['ended_by']}")
        print(f"{'':14}host meanwhile: {', '.join(g['host_during'])}")


if __name__ == "__main__":
    main()
