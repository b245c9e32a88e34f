"""What rank 0 shows while training: the bar keeps the step count and the time left at any terminal width."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from hfsdp.cli.rank.progress import _Bar, describe

RECORD = {"step": 137, "loss": 3.14159, "lr": 0.003, "grad_norm": 0.812, "tokens_per_s": 123456.0,
          "peak_memory_mb": 4321.0, "eval_loss": 3.2}  # fmt: skip


@pytest.mark.parametrize("width", [50, 80, 200])
def test_the_bar_keeps_the_step_count_and_the_time_left(width):
    """On an 80-column terminal (and narrower) the figures are cut with an ellipsis, never the step count or the
    time left; on a wide one everything shows; the line never wraps."""
    out = io.StringIO()
    bar = _Bar(1000, 0, console=Console(file=out, width=width, force_terminal=True, color_system=None))
    bar.progress.update(bar.task, completed=RECORD["step"], info=describe(RECORD))
    bar.progress.console.print(bar.progress.get_renderable())
    line = out.getvalue().rstrip("\n")
    assert "\n" not in line and len(line) <= width
    assert "137/1000" in line and re.search(r"(-:--:--|\d+:\d\d:\d\d)", line), line
    assert ("4,321 MiB" in line) == (width >= 160) and ("…" in line) == (width < 160)
