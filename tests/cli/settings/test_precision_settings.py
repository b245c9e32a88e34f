"""Megatron's precision-aware optimizer settings: flags and `train.*` keys, Megatron's rules before launch (exit 1,
one paragraph naming the flag or key and the fix), and what the accepted values become in the run."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hfsdp.cli.main import app
from hfsdp.cli.settings.settings import BY_NAME, MOMENT_DTYPES, PRECISION_DTYPES
from hfsdp.cli.settings.train_config import build_file_config, build_train_config
from hfsdp.core.kernels.optimizer_dtypes import STATE_DTYPE_NAMES
from hfsdp.core.rules.config import ConfigError

PRECISION = {"use_precision_aware_optimizer": True}


def _problems(flags: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        build_train_config({"device": "cpu", **flags})
    return {p.field: p.message for p in err.value.problems}


def _validate(tmp_path, train: dict):
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"parallel": {"world_size": 4}, "train": train}))
    return CliRunner().invoke(app, ["validate-config", str(path), "--format", "json"])


def test_the_five_settings_are_megatrons_flags_and_keys_all_fp32_by_default():
    cfg = build_train_config({"device": "cpu"})
    assert cfg.use_precision_aware_optimizer is False
    for name in PRECISION_DTYPES:
        setting = BY_NAME[name]
        assert setting.flag == "--" + name.replace("_", "-") and setting.key == f"train.{name}"
        assert getattr(cfg, name) == "fp32"
    assert BY_NAME["use_precision_aware_optimizer"].key == "train.use_precision_aware_optimizer"
    assert set(MOMENT_DTYPES) == set(STATE_DTYPE_NAMES)  # the CLI's names are the kernel's (settings import no torch)


@pytest.mark.parametrize("name", ["main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"])
def test_a_dtype_other_than_fp32_without_the_flag_is_refused(name):
    flag = "--" + name.replace("_", "-")
    value = "bf16"
    (message,) = _problems({name: value}).values()
    assert message.startswith(f"{flag} 'bf16' needs the precision-aware optimizer, which is off")
    assert "add --use-precision-aware-optimizer" in message and f"or set {flag} to fp32" in message
    assert build_train_config({"device": "cpu", name: value, **PRECISION}).values[name] == value


def test_an_unknown_dtype_is_refused_listing_the_allowed_values():
    problems = _problems({**PRECISION, "exp_avg_dtype": "fp64", "main_grads_dtype": "fp16"})
    assert problems["--exp-avg-dtype"] == "--exp-avg-dtype must be one of fp32, fp16, bf16, fp8; got 'fp64'."
    assert problems["--main-grads-dtype"] == "--main-grads-dtype must be one of fp32, bf16; got 'fp16'."


def test_fp16_main_params_are_refused_as_not_implemented_with_or_without_the_flag():
    for flags in ({"main_params_dtype": "fp16"}, {**PRECISION, "main_params_dtype": "fp16"}):
        (message,) = _problems(flags).values()
        assert "--main-params-dtype 'fp16' is not implemented" in message
        assert "fp32 masters are used" in message and "set --main-params-dtype to fp32" in message


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"optimizer": "sgd"}, "use --optimizer adam"),
        ({"adam_kernel": "torch"}, "use --adam-kernel fused (or auto)"),
        ({"outer": "diloco", "instances": 2, "sync_every": 5}, "train without DiLoCo"),
    ],
)
def test_the_precision_aware_optimizer_needs_fused_adamw(flags, needle):
    problems = _problems({**PRECISION, "exp_avg_dtype": "bf16", **flags})
    message = problems["--use-precision-aware-optimizer"]
    assert message.startswith("--use-precision-aware-optimizer true ") and needle in message


def test_offload_and_the_fused_kernel_are_accepted():
    """FusedAdamW steps offloaded state on the CPU (its torch path) in every dtype: offload is not refused."""
    cfg = build_train_config({"device": "cpu", **PRECISION, "exp_avg_sq_dtype": "fp8", "offload": "optim"})
    assert cfg.offload == "optim" and cfg.exp_avg_sq_dtype == "fp8"
    build_train_config({"device": "cpu", **PRECISION, "adam_kernel": "fused", "exp_avg_dtype": "bf16"})


def test_config_file_values_are_refused_by_key_with_exit_1(tmp_path):
    result = _validate(tmp_path, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp4", "main_params_dtype": "fp16"})
    assert result.exit_code == 1, result.output
    errors = {e["field"]: e["message"] for e in json.loads(result.output)["errors"]}
    assert errors["train.exp_avg_dtype"].startswith("train.exp_avg_dtype 'fp8' needs the precision-aware optimizer")
    assert "add train.use_precision_aware_optimizer: true" in errors["train.exp_avg_dtype"]
    assert errors["train.exp_avg_sq_dtype"] == "train.exp_avg_sq_dtype must be one of fp32, fp16, bf16, fp8; got 'fp4'."
    assert "set train.main_params_dtype to fp32" in errors["train.main_params_dtype"]

    result = _validate(
        tmp_path, {"use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "adam_kernel": "torch"}
    )
    assert result.exit_code == 1
    (error,) = json.loads(result.output)["errors"]
    assert (
        error["field"] == "train.use_precision_aware_optimizer" and "use train.adam_kernel: fused" in error["message"]
    )


def test_a_valid_file_lists_the_settings_and_train_accepts_it(tmp_path):
    train = {"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16", "exp_avg_dtype": "bf16",
             "exp_avg_sq_dtype": "fp8"}  # fmt: skip
    result = _validate(tmp_path, train)
    assert result.exit_code == 0, result.output
    settings = json.loads(result.output)["summary"]["settings"]
    for key, value in train.items():
        assert settings[f"train.{key}"] == {"value": value, "default": False}
    cfg = build_file_config(str(tmp_path / "run.yaml"))
    assert (cfg.main_grads_dtype, cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype) == ("bf16", "bf16", "fp8")


def test_the_accepted_values_become_the_runs_reduction_and_optimizer():
    """--main-grads-dtype bf16 is MixedPrecision(reduce_dtype=bf16); the precision-aware optimizer is FusedAdamW even
    where --adam-kernel auto picks torch's AdamW (the CPU, offload), with the moment dtypes asked for."""
    from hfsdp.cli.rank.build_model import mixed_precision
    from hfsdp.cli.rank.train_loop import _fused_adamw, _optimizer
    from hfsdp.core import FusedAdamW

    flags = {
        "device": "cpu",
        **PRECISION,
        "main_grads_dtype": "bf16",
        "exp_avg_dtype": "bf16",
        "exp_avg_sq_dtype": "fp8",
    }
    cfg = build_train_config(flags)
    assert mixed_precision(cfg).reduce_dtype is torch.bfloat16
    assert mixed_precision(build_train_config({"device": "cpu"})).reduce_dtype is torch.float32
    cpu = torch.device("cpu")
    assert _fused_adamw(cfg, cpu) and not _fused_adamw(build_train_config({"device": "cpu"}), cpu)
    opt = _optimizer(cfg, [torch.nn.Parameter(torch.zeros(4))], cpu)
    assert isinstance(opt, FusedAdamW) and opt.dtypes == (torch.bfloat16, torch.float8_e5m2)


def test_auto_offload_is_told_the_moments_bytes():
    """`hfsdp train` tells fully_shard what its optimizer's state costs per element, so `--offload-fraction auto`
    counts bf16 / fp8 moments (fp8 with its scale per 128), not fp32's 8 bytes."""
    from hfsdp.cli.rank.build_model import optimizer_state_bytes

    cfg = build_train_config({"device": "cpu", **PRECISION, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "fp8"})
    assert optimizer_state_bytes(cfg) == 2 + 1 + 4 / 128
    assert optimizer_state_bytes(build_train_config({"device": "cpu"})) == 8
