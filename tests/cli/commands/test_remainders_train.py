"""`hfsdp train --device cpu --store-param-remainders` (and the precision-aware optimizer's default, the flag unset):
FusedAdamW's torch path keeps the fp32 main weights as the bf16 shard plus a 16-bit remainder, the run trains, rank 0
says what was converted, and the checkpoint holds fp32 masters.
"""

from __future__ import annotations

import json
import math
import re
import subprocess

from hfsdp.cli.checks.plan_inputs import model_shape
from hfsdp.cli.settings.train_config import build_train_config
from hfsdp.planning.groups import groups_for

from tests.support.runs import HFSDP, LLAMA, records, tiny_llama

REMAINDERS = ["--use-precision-aware-optimizer", "--store-param-remainders", "--dtype", "bf16"]
LINE = re.compile(
    r"^store_param_remainders: (\d+) of (\d+) parameter groups keep their fp32 main weights as the bf16 shard plus a "
    r"16-bit remainder \(([\d,]+) bytes of remainders on rank 0\)(.*)$"
)
BY_DEFAULT = ", the precision-aware optimizer's default (--no-store-param-remainders turns it off)"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HFSDP, "train", *args], capture_output=True, text=True, timeout=300)


def _said(stdout: str, by_default: bool = False) -> tuple[int, int, int]:
    (line,) = [x for x in stdout.splitlines() if x.startswith("store_param_remainders: ")]  # rank 0's, once
    found = LINE.match(line)
    assert found and found[4] == (BY_DEFAULT if by_default else ""), line
    return int(found[1]), int(found[2]), int(found[3].replace(",", ""))


def test_zero1_trains_with_every_group_converted_and_saves_fp32_masters(tmp_path):
    """ZeRO-1 over 2 CPU ranks (the bf16 parameters kept whole, the optimizer over 2: where remainders save) trains a
    tiny Llama 8 steps: finite, falling losses; every parameter group of rank 0 holds a remainder, 2 bytes per element
    of its optimizer piece (the planner's `optim_len`); the checkpoint's main weights are fp32 (joined)."""
    model = tiny_llama(tmp_path)
    metrics, ck = tmp_path / "metrics.jsonl", tmp_path / "ck"
    args = [*model, "--nproc", "2", "--inner", "optim", "--steps", "8", "--lr", "1e-2", *REMAINDERS]
    done = _run(*args, "--metrics", str(metrics), "--save", str(ck))
    assert done.returncode == 0, done.stderr
    losses = [r["loss"] for r in records(metrics)]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-2:]) < sum(losses[:2]), losses

    converted, groups, held = _said(done.stdout)
    flags = {"use_precision_aware_optimizer": True, "store_param_remainders": True, "dtype": "bf16"}
    cfg = build_train_config({"device": "cpu", "model_config": model[1], "seq_len": 16, "nproc": 2, "inner": "optim",
                              **flags})  # fmt: skip
    planned = groups_for(model_shape(cfg), cfg.layout)
    assert converted == groups == len(planned) > 0
    assert held == 2 * sum(g.optim_len for g in planned)
    assert done.stdout.index("store_param_remainders: ") < done.stdout.index("done: ")

    inspect = subprocess.run([HFSDP, "ckpt", "inspect", str(ck), "--format", "json"], capture_output=True, text=True)
    assert inspect.returncode == 0, inspect.stderr
    dtypes = {tuple(sorted(t["dtypes"].items())) for t in json.loads(inspect.stdout)["tensors"]}
    # As without remainders: the bf16 weights the model computes with, and the fp32 masters joined from both halves.
    assert dtypes == {(("exp_avg", "float32"), ("exp_avg_sq", "float32"), ("main", "float32"), ("model", "bfloat16"))}


def test_fp8_matmuls_on_bf16_gathered_weights_train_with_it_by_default(tmp_path):
    """ZeRO-3 over 2 ranks with --fp8-format hybrid (every Linear whose dims fit, no fp8 gather) and the
    precision-aware optimizer, the flag left unset (Megatron's default, on): the rules accept it, the groups convert,
    rank 0 says it is the default and how to turn it off, and the run trains."""
    config, metrics = tmp_path / "llama.json", tmp_path / "metrics.jsonl"
    config.write_text(json.dumps({**LLAMA, "num_key_value_heads": 1}))
    unset = [x for x in REMAINDERS if x != "--store-param-remainders"]
    args = ["--model-config", str(config), "--seq-len", "16", "--device", "cpu", "--nproc", "2", "--steps", "6",
            "--lr", "1e-2", "--fp8-format", "hybrid", "--fp8-min-size", "0", *unset]  # fmt: skip
    done = _run(*args, "--metrics", str(metrics))
    assert done.returncode == 0, done.stderr
    assert any(x.startswith("fp8 (hybrid, tensorwise): 10 of 14 Linear layers") for x in done.stdout.splitlines())
    converted, groups, held = _said(done.stdout, by_default=True)
    assert converted == groups > 0 and held > 0
    losses = [r["loss"] for r in records(metrics)]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses), losses
