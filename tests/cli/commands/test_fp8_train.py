"""`hfsdp train --device cpu` with fp8 (issue 39): a tiny Hugging Face Llama's Linear layers multiply in fp8
(`torch._scaled_mm` runs on the CPU) with `--fp8-min-size 0`, the start says how many were converted, and the run
trains to the end. At the default min size (2048) no layer of so small a model is large enough to gain: the start
says that fp8 is off for this model and why, and the run trains in bf16, with `--fp8-param-gather` too."""

from __future__ import annotations

import json
import math
import re
import subprocess

from tests.support.runs import HFSDP, LLAMA, records

#: One key/value head of 8 channels: k_proj and v_proj have 8 outputs, not a multiple of 16, and stay bf16.
ONE_KV_HEAD = {**LLAMA, "num_key_value_heads": 1}
#: Linear layers in the units: q, k, v, o, gate, up, down in each of the 2 layers; k and v stay bf16.
CONVERTED, LINEARS = 10, 14
#: Every layer whose dims fit, however small (the default, 2048, converts none of this model's).
FORCED = ("--fp8-min-size", "0")


def _train(tmp_path, *fp8: str) -> tuple[subprocess.CompletedProcess, list[float]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config, metrics = tmp_path / "llama.json", tmp_path / "metrics.jsonl"
    config.write_text(json.dumps(ONE_KV_HEAD))
    args = ["--model-config", str(config), "--seq-len", "16", "--device", "cpu", "--nproc", "2", "--dtype", "bf16",
            "--steps", "8", "--lr", "1e-2", "--metrics", str(metrics), *fp8]  # fmt: skip
    done = subprocess.run([HFSDP, "train", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done, [r["loss"] for r in records(metrics)]


def _summary(stdout: str, fmt: str, recipe: str) -> str:
    (line,) = [x for x in stdout.splitlines() if x.startswith("fp8 (")]  # printed once, by rank 0
    assert line.startswith(f"fp8 ({fmt}, {recipe}): ")
    found = re.search(r"(\d+) of (\d+) Linear layers", line)
    assert found and (int(found[1]), int(found[2])) == (CONVERTED, LINEARS), line
    return line


def test_hybrid_fp8_converts_the_units_linears_says_so_and_trains(tmp_path):
    done, losses = _train(tmp_path, "--fp8-format", "hybrid", *FORCED)
    line = _summary(done.stdout, "hybrid", "tensorwise")
    assert "16" in line.split(":", 1)[1]  # why k_proj and v_proj stay in bf16
    assert "fp8 is off" not in line
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    assert done.stdout.index(line) < done.stdout.index("done: ")


def test_the_fp8_gather_trains_too(tmp_path):
    done, losses = _train(tmp_path, "--fp8-format", "e4m3", "--fp8-param-gather", *FORCED)
    _summary(done.stdout, "e4m3", "tensorwise")
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-2:]) < sum(losses[:2]), losses


def test_at_the_default_min_size_nothing_is_converted_and_the_run_trains_in_bf16(tmp_path):
    """The start line says 0 layers were converted, why, and how to force fp8; the losses are a bf16 run's, bit for
    bit (no layer multiplies in fp8), with and without --fp8-param-gather (which then gathers nothing in fp8)."""
    _, bf16 = _train(tmp_path / "bf16")
    for fp8 in (["--fp8-format", "hybrid"], ["--fp8-format", "e4m3", "--fp8-param-gather"]):
        done, losses = _train(tmp_path / fp8[1], *fp8)
        (line,) = [x for x in done.stdout.splitlines() if x.startswith("fp8 (")]
        assert line.startswith(f"fp8 ({fp8[1]}, tensorwise): 0 of {LINEARS} Linear layers in the units multiply in fp8")
        assert "too small to gain: in*out/(in+out) below 2048" in line, line
        assert line.endswith(
            ". fp8 is off for this model: no layer is large enough to gain from it, so it trains in bf16; "
            "--fp8-min-size 0 forces fp8."
        ), line
        assert losses == bf16, (fp8, losses, bf16)
