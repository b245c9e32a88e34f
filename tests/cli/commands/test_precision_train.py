"""`hfsdp train --device cpu` with Megatron's precision-aware optimizer: FusedAdamW's torch path trains in the dtypes
asked, its checkpoint holds them, and a resume into other dtypes converts once and says so."""

from __future__ import annotations

import json
import math
import subprocess
from types import SimpleNamespace

from tests.support.runs import HFSDP, records, tiny_llama

PRECISION = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "fp8"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HFSDP, "train", *args], capture_output=True, text=True, timeout=300)


def _moment_dtypes(ckpt) -> set[tuple]:
    done = subprocess.run([HFSDP, "ckpt", "inspect", str(ckpt), "--format", "json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["optimizer"]["type"] == "AdamW"
    return {tuple(sorted(t["dtypes"].items())) for t in info["tensors"]}


def test_cpu_training_keeps_the_state_in_the_dtypes_asked_and_a_resume_converts_once(tmp_path):
    """Two CPU ranks train a tiny Llama 8 steps with bf16 moments, fp8 second moments and bf16 gradient reduction:
    the loss is finite and falls, and every tensor of the checkpoint has fp32 main weights, a bf16 exp_avg, an
    e5m2 exp_avg_sq and its E8M0 scale. Resumed with the default (fp32) state, the resume line says the moments were
    converted once, and the next checkpoint holds them in fp32."""
    model = tiny_llama(tmp_path)
    metrics, ck = tmp_path / "metrics.jsonl", tmp_path / "ck"
    common = [*model, "--nproc", "2", "--lr", "1e-2", "--save", str(ck)]
    first = _run(*common, "--steps", "8", *PRECISION, "--main-grads-dtype", "bf16", "--metrics", str(metrics))
    assert first.returncode == 0, first.stderr
    losses = [r["loss"] for r in records(metrics)]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    saved = {
        "model": "float32",
        "main": "float32",
        "exp_avg": "bfloat16",
        "exp_avg_sq": "float8_e5m2",
        "exp_avg_sq_scale": "uint8",
    }
    assert _moment_dtypes(ck) == {tuple(sorted(saved.items()))}

    again = _run(*common, "--steps", "10", "--load", str(ck))
    assert again.returncode == 0, again.stderr
    (line,) = [x for x in again.stdout.splitlines() if x.startswith("resumed from ")]
    assert line.endswith(
        "; optimizer state converted once into this run's dtypes (exp_avg bf16 -> fp32, exp_avg_sq fp8 -> fp32)"
    )
    fp32 = {"model": "float32", "main": "float32", "exp_avg": "float32", "exp_avg_sq": "float32"}
    assert _moment_dtypes(ck) == {tuple(sorted(fp32.items()))}


def test_the_resume_line_names_a_conversion_only_where_the_dtypes_differ():
    """`moment_conversion` against a checkpoint index's moment dtypes: nothing for the same dtypes, for SGD or for a
    weights-only checkpoint; each moment that differs, by Megatron's names, for FusedAdamW and torch's AdamW."""
    import torch

    from hfsdp.cli.rank.resume import moment_conversion
    from hfsdp.core import FusedAdamW

    def index(exp_avg: str, exp_avg_sq: str) -> dict:
        entry = lambda dtype: {"w": SimpleNamespace(dtype=dtype)}  # noqa: E731
        return {"main": entry("float32"), "exp_avg": entry(exp_avg), "exp_avg_sq": entry(exp_avg_sq)}

    params = [torch.nn.Parameter(torch.zeros(4))]
    fused = FusedAdamW(params, exp_avg_dtype="bf16", exp_avg_sq_dtype="fp8")
    assert moment_conversion(index("bfloat16", "float8_e5m2"), fused) is None
    assert moment_conversion(index("float32", "float8_e5m2"), fused).endswith("(exp_avg fp32 -> bf16)")
    torch_adamw = torch.optim.AdamW(params)
    assert moment_conversion(index("float32", "float32"), torch_adamw) is None
    assert moment_conversion(index("float16", "float32"), torch_adamw).endswith("(exp_avg fp16 -> fp32)")
    assert moment_conversion({"main": {}}, fused) is None
    assert moment_conversion(index("bfloat16", "bfloat16"), torch.optim.SGD(params, lr=0.1)) is None
