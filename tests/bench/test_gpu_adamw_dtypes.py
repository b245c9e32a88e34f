"""bench/gpu_adamw_dtypes.py runs its every part on the CPU (the torch path against itself, gloo for FusedAdamW), its
bytes table is the dtypes' count, and its bit comparison reports where two runs differ."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_adamw_dtypes as script  # noqa: E402


def test_the_script_runs_every_part_on_the_cpu(tmp_path):
    """Two options that between them take both kernels' paths (a bf16 and an fp8 moment of each kind), every
    gradient dtype and variant (the masters as a bf16 half and a remainder among them), the timing loop and
    FusedAdamW on one gloo rank: all pass, all land in the JSON."""
    out = tmp_path / "adamw.json"
    cmd = [sys.executable, "-W", "ignore", "bench/gpu_adamw_dtypes.py", "--out", str(out), "--device", "cpu"]
    cmd += ["--backends", "torch,torch", "--options", "bf16/fp8,fp8/bf16", "--quick", "--steps", "2"]
    cmd += ["--numel", "4096", "--warmup", "1", "--repeat", "2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["failed"] == 0 and report["passed"] > 0
    cases = {c["case"] for c in report["bit_cases"]}
    assert len(cases) == 2 * 2 * 4 + 2  # options x gradients x variants, and the wide profile per option
    split = next(c for c in report["bit_cases"] if c["case"].startswith("bf16/fp8 grad=bf16 remainders"))
    assert not split["mismatch"] and split["finite"]  # the masters as a bf16 half and a remainder
    fp8_case = next(c for c in report["bit_cases"] if c["case"].startswith("fp8/bf16 grad=bf16 clip+bf16out"))
    assert fp8_case["used"] == ["torch"] and fp8_case["nonzero_moment_share"]["exp_avg"] > 0.5
    timed = [r for r in report["timing"] if "option" in r]
    assert {(r["option"], r["grad"], r["remainders"]) for r in timed} == {
        (o, g, k) for o in ("bf16/fp8", "fp8/bf16") for g in ("fp32", "bf16") for k in (False, True)
    }
    assert all(r["TBps"] > 0 and r["median_s"] > 0 for r in timed)
    assert [r["case"] for r in report["fused"]] == [
        f"FusedAdamW {o} reduce={r}" for o in ("bf16/fp8", "fp8/bf16") for r in ("fp32", "bf16")
    ] + [f"FusedAdamW {o} reduce=bf16 store_param_remainders" for o in ("bf16/fp8", "fp8/bf16")]
    assert "1 passed" not in done.stdout and done.stdout.strip().endswith(f"JSON: {out}")


def test_the_bytes_table_counts_each_dtype():
    """fp32 weights read and written, the gradient read, each moment read and written, the bf16 out written; fp8
    adds 8 bytes per 128 elements per fp8 moment (its scale) and 8 for the block table."""
    table = script.bytes_table()
    expected = {
        "fp32/fp32": (30, 28),
        "bf16/bf16": (22, 20),
        "fp16/fp16": (22, 20),
        "bf16/fp8": (20.125, 18.125),
        "fp8/fp8": (18.1875, 16.1875),
        "fp8/bf16": (20.125, 18.125),
    }
    assert {o: (row["fp32"], row["bf16"]) for o, row in table.items()} == expected
    assert script.bytes_per_element(torch.float32, torch.float32, torch.float32, out=None) == 28  # torch's fused


def test_a_difference_is_reported_with_its_first_index_and_values():
    a = torch.arange(10, dtype=torch.float32)
    b = a.clone()
    assert script.first_difference(a, b) is None
    b[3], b[7] = -0.0 + 3.0000002, 1.0
    diff = script.first_difference(a, b)
    assert (diff["count"], diff["index"], diff["values"][0]) == (2, 3, 3.0)
    zero = torch.zeros(4, dtype=torch.bfloat16)
    assert script.first_difference(zero, -zero)["bits"] == ["0000", "8000"]  # -0 is another bit pattern
    e4 = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    assert script.first_difference(e4, e4.float().mul(1.125).to(torch.float8_e4m3fn))["index"] == 0
