"""`hfsdp train`'s start line (parameters, per-rank memory) and its refusal of a run that cannot fit, before launch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HFSDP = str(Path(sys.executable).parent / "hfsdp")
HUGE = ["--layers", "200", "--hidden", "8192", "--heads", "64", "--vocab", "128000", "--device", "cpu"]
#: A small model (0.12B) whose unfused attention over 16,384 tokens needs far more than any host per rank.
LONG = [
    "--layers",
    "4",
    "--hidden",
    "1024",
    "--heads",
    "16",
    "--vocab",
    "32000",
    "--seq-len",
    "16384",
    "--micro-batch-size",
    "1",
]


def test_a_model_no_rank_can_build_is_refused_before_any_rank_starts():
    """A 163B GPT on 4 CPU ranks: every rank would build it whole in fp32 before sharding it, 4 x 608 GiB on one
    host; the start line gives its size, then one paragraph refuses it (exit 2) saying so; no rank is started."""
    from hfsdp.planning.gpt_shape import gpt_shape

    done = subprocess.run([HFSDP, "train", *HUGE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    params = gpt_shape(layers=200, hidden=8192, heads=64, vocab=128000).params
    assert done.stdout.startswith(f"model: {params / 1e9:.2f}B parameters ({params:,}); ZeRO-3 1x4 needs about ")
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: memory: every rank builds the whole model in fp32 before sharding it: ")
    assert f"{4 * params / 2**30:.1f} GiB per rank" in line and "for the 4 ranks on this host" in line
    assert "starting" not in done.stdout and "Traceback" not in done.stderr


def test_a_run_that_cannot_fit_is_refused_before_any_rank_starts():
    """A 0.12B GPT over 16,384-token sequences on 4 CPU ranks: it builds, but its step cannot fit; the start line
    gives its size and need, then one paragraph refuses it (exit 2) saying what it would need, what a rank has, and
    that no 4-rank layout fits; no rank is started."""
    from hfsdp.cli.memory_check import GIB
    from hfsdp.planning.gpt_shape import gpt_shape
    from hfsdp.planning.model_shape import billions

    done = subprocess.run([HFSDP, "train", *LONG, "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    params = gpt_shape(layers=4, hidden=1024, heads=16, vocab=32000).params
    assert done.stdout.startswith(f"model: {billions(params)} parameters ({params:,}); ZeRO-3 1x4 needs about ")
    # fp32 compute: a rank holds a quarter of the fp32 parameters (params), gradients and 8 bytes of Adam per element
    assert f"params {params * 4 / 4 / GIB:.2f}" in done.stdout
    assert "starting" not in done.stdout
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: memory: this run would need about ")
    assert "shared by 4 ranks" in line and "no layout of 4 ranks fits" in line
    assert "Traceback" not in done.stderr
