"""bench/gpu_habits.py, the GPU check of the FSDP2 habits, runs its every check on the CPU too (gloo, one process):
so the script a device session runs is known to work before the device is paid for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_habit_check_passes_on_the_cpu():
    """Meta flow, clip imported first, FSDP2's accumulation, frozen weights (fp32 and bf16) and DCP resumes
    (save and async_save)."""
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "bench/gpu_habits.py"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "7 passed, 0 failed", done.stdout
