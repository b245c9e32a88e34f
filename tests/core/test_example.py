"""The README's engine example (`examples/train_fully_shard.py`) runs as written under torchrun: it trains, saves,
and a resume on another layout continues the run to the uninterrupted run's losses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_fully_shard.py"


def _torchrun(nproc: int, *args: str) -> list[float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), str(EXAMPLE), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return [float(v) for v in re.findall(r"^step \d+ loss (\S+)$", result.stdout, re.M)]


def test_the_engine_example_trains_saves_and_resumes_on_another_layout(tmp_path):
    """HFSDP 2x1 for 6 steps, uninterrupted; the same for 4 steps with a save, resumed on ZeRO-3 1x2 to step 6:
    the resumed steps' losses equal the uninterrupted run's (rtol 1e-5), and the loss fell."""
    whole = _torchrun(2, "--instances", "2", "--steps", "6")
    first = _torchrun(2, "--instances", "2", "--steps", "4", "--save", str(tmp_path / "ck"))
    rest = _torchrun(2, "--steps", "6", "--load", str(tmp_path / "ck"))
    assert len(whole) == 6 and first == whole[:4] and len(rest) == 2
    for got, want in zip(rest, whole[4:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (rest, whole)
    assert whole[-1] < whole[0]
