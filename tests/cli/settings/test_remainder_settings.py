"""`--store-param-remainders` / `train.store_param_remainders` (Megatron's store_param_remainders): the flag and the
key, off by default; its rules before launch (exit 1, one paragraph under the flag or key naming the fix), in
`validate-config`, `train` and `plan` alike; and what an accepted value becomes in the run and in the summaries."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from typer.testing import CliRunner

from hfsdp.cli.main import app
from hfsdp.cli.settings.settings import BY_NAME
from hfsdp.cli.settings.train_config import build_file_config, build_train_config

from tests.support.runs import HFSDP, LLAMA
from tests.support.settings import train_problems

runner = CliRunner()
FLAG = "--store-param-remainders"
#: What the option needs: the precision-aware optimizer and bf16 compute.
ON = {"store_param_remainders": True, "use_precision_aware_optimizer": True, "dtype": "bf16"}


def _validate(tmp_path, sections: dict):
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"parallel": {"world_size": 4}, **sections}))
    result = runner.invoke(app, ["validate-config", str(path), "--format", "json"])
    return result, json.loads(result.output)


def test_the_flag_and_key_are_megatrons_name_on_by_default_with_the_precision_aware_optimizer():
    """As Megatron's: unset, it is on wherever the precision-aware optimizer runs with bf16 compute and fp32 masters
    on the device, and off elsewhere, without a refusal; set, it is what was said."""
    setting = BY_NAME["store_param_remainders"]
    assert (setting.flag, setting.key, setting.default, setting.panel) == (
        FLAG,
        "train.store_param_remainders",
        None,
        "Optimizer precision",
    )
    aware = {"device": "cpu", "use_precision_aware_optimizer": True, "dtype": "bf16"}
    assert build_train_config({"device": "cpu"}).store_param_remainders is False
    assert build_train_config({"device": "cpu", "dtype": "bf16"}).store_param_remainders is False
    assert build_train_config(aware).store_param_remainders is True
    assert build_train_config({**aware, "store_param_remainders": False}).store_param_remainders is False
    assert build_train_config({**aware, "store_param_remainders": True}).store_param_remainders is True
    for where_it_cannot_run in ({"dtype": "fp32"}, {"offload": "optim"}, {"overlap_step": True}):  # (fp16: refused)
        assert build_train_config({**aware, **where_it_cannot_run}).store_param_remainders is False


#: (flags beside ON, what the message must say). Each rule alone, under the flag, naming the fix.
REFUSALS = {
    "precision-aware optimizer": (
        {"use_precision_aware_optimizer": False},
        ["which is off (--use-precision-aware-optimizer false);", "add --use-precision-aware-optimizer,",
         f"or drop {FLAG}."],
    ),
    "fp32 compute": (
        {"dtype": "fp32"},
        ["needs bf16 compute, but --dtype 'fp32' computes", "add --dtype bf16, or drop"],
    ),
    "fp16 masters": (
        {"main_params_dtype": "fp16"},
        ["--main-params-dtype 'fp16' asks for other masters", "set --main-params-dtype to fp32 (the default)"],
    ),
    "offload": (
        {"offload": "optim"},
        ["--offload 'optim' keeps the main weights in host memory", "drop --offload, or drop"],
    ),
    "overlap step": (
        {"overlap_step": True},
        ["cannot be combined with --overlap-step true:", "nothing to overlap; drop --overlap-step, or drop"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS))
def test_each_rule_is_one_paragraph_under_the_flag(case):
    flags, needles = REFUSALS[case]
    problems = train_problems({**ON, **flags})
    message = problems[FLAG]
    assert message.startswith(f"{FLAG} true "), message
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_what_is_refused_beside_it_is_still_refused_under_its_own_flag():
    """--main-params-dtype fp16 and DiLoCo with the precision-aware optimizer have rules of their own: fp16 masters
    are reported under both flags, one paragraph each; DiLoCo under the precision-aware optimizer's alone (the
    remainders themselves work with DiLoCo's outer step)."""
    problems = train_problems({**ON, "main_params_dtype": "fp16"})
    assert set(problems) == {FLAG, "--main-params-dtype"}
    problems = train_problems({**ON, "outer": "diloco", "instances": 2, "sync_every": 5})
    assert set(problems) == {"--use-precision-aware-optimizer"}  # refused there; remainders work with DiLoCo


def test_fp8_matmuls_and_the_fp8_gather_are_accepted(tmp_path):
    """fp8 weights are quantized from the kept bf16 shard, gathered in fp8 or not (trained on the CPU:
    test_remainders_train.py, and bit for bit against fp32 masters in core's test_param_remainders_engine.py)."""
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(LLAMA))
    for gather in (False, True):
        flags = {"device": "cpu", **ON, "fp8": "hybrid", "model_config": str(config), "fp8_param_gather": gather}
        cfg = build_train_config(flags)
        assert cfg.store_param_remainders and cfg.fp8 == "hybrid" and cfg.fp8_param_gather == gather


def test_the_config_file_key_is_refused_by_key_with_exit_1(tmp_path):
    result, out = _validate(tmp_path, {"train": {"store_param_remainders": True}})
    assert result.exit_code == 1, result.output
    ((field, message),) = [(e["field"], e["message"]) for e in out["errors"]]
    assert field == "train.store_param_remainders"
    assert message.startswith("train.store_param_remainders true keeps the fp32 main weights")
    assert "add train.use_precision_aware_optimizer: true, or drop train.store_param_remainders." in message

    train = {"store_param_remainders": True, "use_precision_aware_optimizer": True}
    result, out = _validate(tmp_path, {"train": train})
    assert result.exit_code == 1
    ((field, message),) = [(e["field"], e["message"]) for e in out["errors"]]
    assert field == "train.store_param_remainders"
    assert "but train.dtype 'fp32' (the default) computes" in message and "add train.dtype: bf16" in message

    result, out = _validate(tmp_path, {"train": {**train, "dtype": "bf16", "offload": "optim"}})
    assert result.exit_code == 1
    (error,) = out["errors"]
    assert error["field"] == "train.store_param_remainders" and "drop train.offload" in error["message"]

    result, out = _validate(tmp_path, {"train": {**train, "store_param_remainders": "yes"}})
    assert result.exit_code == 1
    (error,) = out["errors"]
    assert error == {
        "field": "train.store_param_remainders",
        "message": "train.store_param_remainders must be true or false; got the text 'yes'.",
    }


def test_a_valid_file_lists_the_key_and_counts_its_bytes_per_parameter(tmp_path):
    """HFSDP 2x2 with bf16 moments: 2/2 + 2/2 + (4 + 2 + 2)/4 = 4 bytes per parameter with fp32 masters; with
    remainders the bf16 shard stays and the master's 4 bytes are 2: 3.5. HSDP 2x2: 2/2 + (4 + 4)/2 = 5 either way
    (the shard, now kept, and the remainder are the fp32 master's 4 bytes)."""
    moments = {"use_precision_aware_optimizer": True, "dtype": "bf16", "exp_avg_dtype": "bf16",
               "exp_avg_sq_dtype": "bf16"}  # fmt: skip
    per_param = {}
    for outer in ("optim", "no_shard"):
        for remainders in (False, True):
            sections = {
                "ddp": {"num_distributed_optimizer_instances": 2, "outer_dp_sharding_strategy": outer},
                "train": {**moments, "store_param_remainders": remainders},
            }
            result, out = _validate(tmp_path, sections)
            assert result.exit_code == 0, result.output
            summary = out["summary"]
            assert summary["settings"]["train.store_param_remainders"] == {"value": remainders, "default": False}
            assert ("plus 2-byte remainders" in summary["bytes_per_param_assumes"]) is remainders
            per_param[outer, remainders] = summary["dense"]["bytes_per_param"]
    assert per_param == {("optim", False): 4, ("optim", True): 3.5, ("no_shard", False): 5, ("no_shard", True): 5}
    cfg = build_file_config(str(tmp_path / "run.yaml"))
    assert cfg.store_param_remainders is True


def test_train_refuses_it_before_any_rank_starts():
    began = time.monotonic()
    done = subprocess.run([HFSDP, "train", "--device", "cpu", "--nproc", "2", FLAG, "--use-precision-aware-optimizer"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1
    assert f"{FLAG} true keeps each fp32 main weight" in done.stderr and "add --dtype bf16" in done.stderr
    assert "Traceback" not in done.stderr and "starting" not in done.stdout
    assert time.monotonic() - began < 60


def test_the_run_builds_fused_adamw_with_it_and_plans_its_bytes(monkeypatch):
    """The optimizer `hfsdp train` builds gets store_param_remainders; the plan's settings (the start line and the
    memory check) count it."""
    import torch

    from hfsdp.cli.checks.plan_inputs import model_shape, step_settings
    from hfsdp.cli.rank.train_loop import _optimizer

    seen = []
    monkeypatch.setattr("hfsdp.core.FusedAdamW", lambda params, **options: seen.append(options))
    cfg = build_train_config({"device": "cpu", **ON})
    _optimizer(cfg, [], torch.device("cpu"))
    _optimizer(build_train_config({"device": "cpu", "use_precision_aware_optimizer": True}), [], torch.device("cpu"))
    assert [options["store_param_remainders"] for options in seen] == [True, False]
    assert step_settings(cfg, model_shape(cfg)).store_param_remainders is True
