"""The DiLoCo quality bench: seeds run side by side give what they give in turn, and the report reads them."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--instances", "2", "--seeds", "0", "1", "--steps", "12", "--rows", "2", "--eval-rows", "4"]
TINY += ["--hidden", "32", "--layers", "1", "--heads", "2", "--ffn", "64", "--seq", "32", "--sync-every", "3"]
TINY += ["--only", "HSDP", "DiLoCo H=3"]


def bench(out: Path, *extra: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "packages" / "core" / "src"))
    cmd = [sys.executable, str(ROOT / "bench" / "bench_diloco.py"), *TINY, *extra, "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def test_parallel_seeds_equal_seeds_in_turn_and_the_report_compares_them(tmp_path):
    in_turn = bench(tmp_path / "turn.jsonl")
    side_by_side = bench(tmp_path / "parallel.jsonl", "--parallel-seeds")

    def key(records):
        return sorted((r["run"], r["seed"], r["eval_loss"], r["outer_bytes"]) for r in records)

    assert len(in_turn) == 4 and key(side_by_side) == key(in_turn)
    by_run = {(r["run"], r["seed"]): r for r in in_turn}
    assert by_run[("DiLoCo H=3", 0)]["outer_bytes"] < by_run[("HSDP", 0)]["outer_bytes"]
    sys.path.insert(0, str(ROOT / "bench"))
    from diloco_report import load, summary

    rows = {r["run"]: r for r in summary(load(str(tmp_path / "parallel.jsonl")))}
    assert rows["DiLoCo H=3"]["seeds"] == 2 and rows["HSDP"]["vs_hsdp"] == 0.0
