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
    from hfsdp.cli.checks.memory_check import GIB
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


def offload_run(monkeypatch, *, gpu_gib, host_gib, **flags):
    """A TrainConfig and its estimate on a pretend machine: a GPU of `gpu_gib` (None: the CPU) and `host_gib` of
    host memory available."""
    import hfsdp.cli.checks.memory_check as memory_check
    from hfsdp.cli.settings.train_config import build_train_config

    gpu = None if gpu_gib is None else int(gpu_gib * 2**30)
    monkeypatch.setattr(memory_check, "_gpu_total", lambda cfg: gpu)
    monkeypatch.setattr(memory_check, "_host_available", lambda: int(host_gib * 2**30))
    base = dict(layers=4, hidden=1024, heads=16, vocab=32000, seq_len=256, dtype="bf16", offload="optim")
    cfg = build_train_config({**base, "device": "cpu" if gpu is None else "auto", **flags})
    shape, mem = memory_check.estimate(cfg)
    return memory_check, cfg, shape, mem


def test_offloaded_state_the_host_cannot_hold_is_refused_before_launch(monkeypatch):
    """DDP over 8 local ranks with all of AdamW offloaded: every rank keeps 16 bytes per parameter in host memory
    (fp32 main weights, two moments, the staged gradient), 8 x 16 x 0.116B = 13.8 GiB; a host with 12 GiB available
    refuses it in one paragraph naming the flag and the figures, one with 20 GiB lets it start. Half offloaded
    halves the need."""
    from hfsdp.planning.gpt_shape import gpt_shape

    params = gpt_shape(layers=4, hidden=1024, heads=16, vocab=32000).params
    flags = dict(nproc=8, inner="no_shard", offload_fraction="1")
    memory_check, cfg, shape, mem = offload_run(monkeypatch, gpu_gib=80, host_gib=12, **flags)
    assert abs(mem.host - 16 * params) < 16 * 64 * 8  # padding: at most a few elements per group
    problem = memory_check.check(cfg, mem, shape, local_ranks=8)
    assert problem is not None and problem.field == "memory"
    text = problem.message
    assert text.startswith("--offload optim keeps 100% of the optimizer state in host memory (--offload-fraction): ")
    assert (
        f"{16 * params / 2**30:.1f} GiB per rank" in text and f"{8 * mem.host / 2**30:.1f} GiB for the 8 ranks" in text
    )
    assert "12.0 GiB available" in text and "offload a smaller share (--offload-fraction)" in text
    memory_check, cfg, shape, mem = offload_run(monkeypatch, gpu_gib=80, host_gib=20, **flags)
    assert memory_check.check(cfg, mem, shape, local_ranks=8) is None
    memory_check, cfg, shape, mem = offload_run(
        monkeypatch, gpu_gib=80, host_gib=12, **{**flags, "offload_fraction": "0.5"}
    )
    assert (
        memory_check.offloaded_share(cfg, shape) == 0.5 and memory_check.check(cfg, mem, shape, local_ranks=8) is None
    )


def test_auto_offload_is_estimated_by_the_engines_own_rule(monkeypatch):
    """--offload-fraction auto on one GPU, ZeRO-3 1x1, bf16: a kept element costs 16 bytes on the device (12 of
    AdamW state and main weights, 4 of gradient), an offloaded one 6 (bf16 shard and gradient), and the engine
    offloads the smallest share that brings the total under 90% of the GPU: (16 P - 0.9 G) / (10 P). On the CPU it
    offloads nothing, as the engine does."""
    from hfsdp.planning.gpt_shape import gpt_shape

    params = gpt_shape(layers=4, hidden=1024, heads=16, vocab=32000).params
    gpu = 1.5  # GiB: 0.12B parameters need 1.9 GB kept whole
    memory_check, cfg, shape, _ = offload_run(monkeypatch, gpu_gib=gpu, host_gib=64, nproc=1, offload_fraction="auto")
    expected = (16 * params - 0.9 * int(gpu * 2**30)) / (10 * params)
    assert 0 < expected < 1 and abs(memory_check.offloaded_share(cfg, shape) - expected) < 1e-12
    memory_check, cfg, shape, _ = offload_run(monkeypatch, gpu_gib=None, host_gib=64, nproc=1, offload_fraction="auto")
    assert memory_check.offloaded_share(cfg, shape) == 0.0
