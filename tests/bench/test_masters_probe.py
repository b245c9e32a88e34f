"""bench/masters_probe.py on a CPU (one gloo rank, a tiny Llama): hfsdp's gradients are its reference's bit for bit,
and with remainders it parts from its reference exactly where it does without them (the tiny model's init holds no
exact bf16 tie, so the two roundings agree everywhere)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = [str(ROOT / "packages" / p / "src") for p in ("core", "ckpt", "cli")]


def test_remainders_part_from_the_reference_where_the_fp32_masters_do():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(SRC))
    cmd = [sys.executable, str(ROOT / "bench" / "masters_probe.py"), "--device", "cpu", "--steps", "2", "--options", ""]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = re.split(r"^(fused(?:_rem)?): ", done.stdout, flags=re.M)[1:]
    found = dict(zip(runs[::2], runs[1::2], strict=True))
    assert set(found) == {"fused", "fused_rem"}, done.stdout
    for text in found.values():
        assert "step 1: gradients that differ 0;" in text, text
    steps = {name: re.findall(r"step \d: \S+ \S+ ([\d,]+)$", text, flags=re.M) for name, text in found.items()}
    assert len(steps["fused"]) == 2 and steps["fused"] == steps["fused_rem"], steps
