"""`--adam-kernel`: which AdamW `hfsdp train` steps. FusedAdamW (the clip and the next forward's gather input in its
step) is the default on a GPU; on the CPU, with offload and with DiLoCo `auto` keeps torch's fused AdamW. Both
train the same run to fp32 rounding, and the logged gradient norm is the one before clipping either way."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from hfsdp.cli.rank.train_loop import _fused_adamw
from hfsdp.cli.settings.train_config import build_train_config
from hfsdp.core.rules.config import ConfigError

from tests.support.runs import HFSDP

SMALL = ["--layers", "1", "--hidden", "32", "--vocab", "64", "--seq-len", "16", "--device", "cpu", "--nproc", "2"]


def _config(**flags):
    return build_train_config({"nproc": 2, **flags})


@pytest.mark.parametrize(
    ("flags", "device", "fused"),
    [
        ({}, "cuda", True),
        ({}, "cpu", False),
        ({"offload": "optim"}, "cuda", False),
        ({"outer": "diloco", "instances": 2, "sync_every": 5}, "cuda", False),
        ({"adam_kernel": "torch"}, "cuda", False),
        ({"adam_kernel": "fused"}, "cpu", True),
    ],
)
def test_auto_picks_fused_adamw_where_it_is_the_faster(flags, device, fused):
    """auto: FusedAdamW on a GPU with the state on it and one step per optimizer step, else torch's fused AdamW."""
    assert _fused_adamw(_config(**flags), torch.device(device)) is fused


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ({"adam_kernel": "fused", "optimizer": "sgd"}, "chooses the AdamW of --optimizer adam"),
        ({"adam_kernel": "fused", "outer": "diloco", "instances": 2, "sync_every": 5}, "each instance clips"),
        ({"adam_kernel": "triton"}, "must be one of auto, fused, torch"),
    ],
)
def test_a_kernel_that_cannot_apply_is_refused_naming_the_flag(flags, says):
    with pytest.raises(ConfigError) as info:
        _config(**flags)
    found = {p.field: p.message for p in info.value.problems}
    assert says in found["--adam-kernel"], found


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ({"adam_kernel": "torch"}, "but --adam-kernel 'torch'"),
        ({"optimizer": "sgd"}, "but --optimizer 'sgd'"),
        ({"offload": "optim"}, "which --offload 'optim' does not use"),
        ({"outer": "diloco", "instances": 2, "sync_every": 5}, "which --outer 'diloco' does not use"),
        ({"dtype": "fp32"}, "drop it or use --dtype bf16"),
    ],
)
def test_overlap_step_without_fused_adamw_on_the_gpu_is_refused_naming_the_flag(flags, says):
    with pytest.raises(ConfigError) as info:
        _config(overlap_step=True, **{"dtype": "bf16", **flags})
    found = {p.field: p.message for p in info.value.problems}
    assert says in found["--overlap-step"], found


def test_overlap_step_reaches_fused_adamw():
    from hfsdp.cli.rank.train_loop import _optimizer
    from hfsdp.core import FusedAdamW

    params = [torch.nn.Parameter(torch.zeros(3))]
    for overlap in (False, True):
        cfg = _config(overlap_step=overlap, adam_kernel="fused", dtype="bf16")
        opt = _optimizer(cfg, [{"params": params}], torch.device("cpu"))
        assert isinstance(opt, FusedAdamW) and opt.overlap_next_forward is overlap and opt.prestage_gathers


def test_overlap_step_on_the_cpu_is_refused_before_launch():
    """On the CPU there is no side stream: the flag would do nothing, so it is refused before launch."""
    args = [HFSDP, "train", *SMALL, "--steps", "1", "--dtype", "bf16", "--overlap-step"]
    done = subprocess.run(args, capture_output=True, text=True)
    assert done.returncode != 0 and "--overlap-step overlaps FusedAdamW's step" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


def _train(tmp_path: Path, kernel: str) -> list[dict]:
    metrics = tmp_path / f"{kernel}.jsonl"
    args = [HFSDP, "train", *SMALL, "--steps", "4", "--lr", "1e-2", "--clip-grad", "0.05", "--adam-kernel", kernel]
    result = subprocess.run([*args, "--metrics", str(metrics)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_both_kernels_train_the_same_run(tmp_path):
    """FusedAdamW with the clip in its step trains what torch's AdamW after clip_grad_norm_ trains (a clip that binds
    every step), to fp32 rounding, and logs the same norm before clipping."""
    fused, plain = _train(tmp_path, "fused"), _train(tmp_path, "torch")
    assert [r["step"] for r in fused] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0.05 for r in plain), "the clip must bind for the test to mean anything"
    for a, b in zip(fused, plain, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
