"""bench/trace_gaps.py on a hand-made trace: the union of device events as busy time, gaps between them, and the
host operator whose launch ended each gap."""

from __future__ import annotations

import gzip
import json

from bench.trace_gaps import report


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def test_busy_idle_and_what_ended_the_longest_gap(tmp_path):
    events = [
        _x("aten::mm", "cpu_op", 0, 10),
        _x("cudaLaunchKernel", "cuda_runtime", 2, 1, correlation=1),
        _x("gemm_a", "kernel", 5, 100, tid=7, correlation=1),
        _x("gemm_b", "kernel", 50, 100, tid=8, correlation=2),  # overlaps gemm_a on another stream
        _x("cudaLaunchKernel", "cuda_runtime", 20, 1, correlation=2),
        _x("aten::item", "cpu_op", 160, 230),
        _x("aten::to", "cpu_op", 400, 60),
        _x("cudaMemcpyAsync", "cuda_runtime", 450, 5, correlation=3),
        _x("Memcpy HtoD", "gpu_memcpy", 455, 20, tid=7, correlation=3),
        _x("small", "kernel", 480, 5, tid=7, correlation=4),
    ]
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    result = report(path, min_gap_ms=0.001, top=5)
    assert result["window_ms"] == 0.48  # 5 us to 485 us
    assert result["busy_ms"] == (145 + 20 + 5) / 1e3
    assert result["gaps"] == 2
    longest = result["longest"][0]
    assert longest["gap_ms"] == 0.305 and longest["ended_by"].startswith("Memcpy HtoD (launched in aten::to)")
    assert longest["host_during"] == ["aten::item", "aten::to"]
    assert result["longest"][1]["gap_ms"] == 0.005
