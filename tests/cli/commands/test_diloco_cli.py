"""DiLoCo from the command line: the flags, the config file's `diloco` section, their rules, and real runs.

The rules are checked in-process (`validate-config` and `hfsdp train`'s resolver, no rank started); four launches
of a tiny transformers Llama on 4 processes show that `hfsdp train --outer diloco --sync-every 1 --outer-lr 1
--outer-momentum 0` with `--optimizer sgd --sgd-momentum 0` is HSDP, and that a resume from a save inside the cycle
continues the run exactly.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hfsdp.cli.main import app
from hfsdp.cli.settings.train_config import build_train_config
from hfsdp.core.rules.config import ConfigError

from tests.support.runs import HFSDP, LLAMA

runner = CliRunner()


def _problems(**flags) -> dict[str, str]:
    flags.setdefault("nproc", 4)
    with pytest.raises(ConfigError) as info:
        build_train_config(flags)
    return {p.field: p.message for p in info.value.problems}


# -- the rules, before any rank starts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "field", "says"),
    [
        ({"sync_every": 5}, "--sync-every", "is a DiLoCo setting"),
        ({"outer_comm_dtype": "int8", "outer": "optim", "instances": 2}, "--outer-comm-dtype", "is a DiLoCo setting"),
        ({"outer_nesterov": False}, "--outer-nesterov", "is a DiLoCo setting"),
        ({"outer": "diloco", "instances": 2}, "--sync-every", "needs --sync-every H"),
        ({"outer": "diloco", "instances": 1, "sync_every": 5}, "--outer", "one instance has nothing to sync"),
        ({"inner": "diloco", "instances": 2}, "--inner", "outer strategy only"),
        (
            {"outer": "diloco", "instances": 2, "sync_every": 4, "sync_fragments": 5, "layers": 8},
            "--sync-fragments",
            "at most 4 fragments",
        ),
        ({"outer": "diloco", "instances": 2, "sync_every": 9, "sync_fragments": 4}, "--sync-fragments", "3 units"),
        ({"outer": "diloco", "instances": 2, "sync_every": 5, "offload": "optim"}, "--offload", "cannot be combined"),
        ({"outer": "diloco", "instances": 2, "sync_every": 5, "outer_momentum": 1.0}, "--outer-momentum", "[0, 1)"),
        (
            {"outer": "diloco", "instances": 2, "sync_every": 5, "outer_comm_dtype": "fp8"},
            "--outer-comm-dtype",
            "fp32, bf16, int8",
        ),
        (
            {"outer": "diloco", "instances": 2, "sync_every": 5, "num_moe_experts": 4},
            "--expert-outer",
            "experts must train apart",
        ),
        ({"sgd_momentum": 0.5}, "--sgd-momentum", "applies to --optimizer sgd"),
        ({"optimizer": "lamb"}, "--optimizer", "must be one of adam, sgd"),
    ],
)
def test_bad_diloco_settings_are_refused_naming_the_flag(flags, field, says):
    """Each wrong combination is one problem under the flag that causes it, with what to do."""
    found = _problems(**flags)
    assert field in found, found
    assert says in found[field]


def test_diloco_settings_resolve_into_the_core_config():
    """The flags become `DiLoCoConfig` (paper defaults: Nesterov, lr 0.7, momentum 0.9); without diloco, none."""
    cfg = build_train_config(
        {
            "nproc": 4,
            "outer": "diloco",
            "instances": 2,
            "sync_every": 50,
            "outer_comm_dtype": "bf16",
            "layers": 4,
            "sync_fragments": 2,
        }
    )
    assert cfg.diloco.to_dict() == {
        "sync_every": 50,
        "lr": 0.7,
        "momentum": 0.9,
        "nesterov": True,
        "comm_dtype": "bf16",
        "fragments": 2,
    }
    assert cfg.layout.layout_name == "DiLoCo 2x2 (diloco over optim_grads_params)"
    assert build_train_config({"nproc": 4}).diloco is None


def test_validate_config_reads_the_diloco_section_and_summarises_its_cost(tmp_path):
    """A config file's `diloco` section sets the same settings; validate-config prints what the outer axis costs,
    and refuses the section without `outer_dp_sharding_strategy: diloco`."""
    good = tmp_path / "diloco.yaml"
    good.write_text(
        "parallel:\n  world_size: 8\nddp:\n  outer_dp_sharding_strategy: diloco\n"
        "  num_distributed_optimizer_instances: 4\ndiloco:\n  sync_every: 50\n  outer_comm_dtype: int8\n"
    )
    result = runner.invoke(app, ["validate-config", str(good), "--format", "json"])
    assert result.exit_code == 0, result.stdout
    diloco = json.loads(result.stdout)["summary"]["diloco"]
    assert diloco["sync_every"] == 50 and diloco["comm_dtype"] == "int8"
    assert diloco["outer_state_bytes_per_param"] == 8 / 8 + 4 / 2  # θ_g and momentum over N·R, the anchor over N
    assert diloco["outer_bytes_per_param_per_step"] == pytest.approx(2 * 0.75 * (1 + 4 / 128) / (2 * 50))
    text = runner.invoke(app, ["validate-config", str(good)]).stdout
    assert "DiLoCo: the instances train apart and meet every 50 steps" in text
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel:\n  world_size: 8\ndiloco:\n  sync_every: 50\n")
    result = runner.invoke(app, ["validate-config", str(bad)])
    assert result.exit_code == 1
    assert "diloco.sync_every 50 is a DiLoCo setting" in result.stdout
    assert "ddp.outer_dp_sharding_strategy to diloco" in result.stdout


def test_train_refuses_bad_settings_in_one_line_without_a_traceback():
    """`hfsdp train --sync-every 5` without diloco exits 1 with one paragraph, before any rank starts."""
    result = subprocess.run([HFSDP, "train", "--sync-every", "5"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.startswith("error: --sync-every 5 is a DiLoCo setting")
    assert "Traceback" not in result.stderr + result.stdout


def test_train_help_lists_the_diloco_and_optimizer_flags():
    """--help shows every new flag with its default, Nesterov as a switch pair."""
    out = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).stdout
    for flag in (
        "--sync-every",
        "--outer-lr",
        "--outer-momentum",
        "--no-outer-nesterov",
        "--outer-comm-dtype",
        "--sync-fragments",
        "--optimizer",
        "--sgd-momentum",
    ):
        assert flag in out, flag


# -- real runs ------------------------------------------------------------------------------------------------------


def _train(tmp_path: Path, name: str, *args: str) -> list[dict]:
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(LLAMA))
    metrics = tmp_path / f"{name}.jsonl"
    common = ["--model-config", str(config), "--seq-len", "16", "--device", "cpu", "--nproc", "4", "--instances", "2"]
    result = subprocess.run(
        [HFSDP, "train", *common, "--metrics", str(metrics), *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("diloco-cli")
    sgd = ["--optimizer", "sgd", "--sgd-momentum", "0", "--clip-grad", "0", "--weight-decay", "0", "--lr", "0.1"]
    out = {"root": root}
    out["hsdp"] = _train(root, "hsdp", "--steps", "5", *sgd)
    out["diloco h1"] = _train(
        root,
        "h1",
        "--steps",
        "5",
        *sgd,
        "--outer",
        "diloco",
        "--sync-every",
        "1",
        "--outer-lr",
        "1",
        "--outer-momentum",
        "0",
    )
    diloco = ["--outer", "diloco", "--sync-every", "3", "--outer-comm-dtype", "int8", "--lr", "1e-2"]
    out["whole"] = _train(root, "whole", "--steps", "5", *diloco, "--save", str(root / "ck"), "--save-every", "2")
    out["resumed"] = _train(root, "resumed", "--steps", "5", *diloco, "--load", str(root / "ck" / "step-2"))
    return out


def test_cli_diloco_h1_with_plain_sgd_is_hsdp(runs):
    """--outer diloco --sync-every 1 --outer-lr 1 --outer-momentum 0 with --optimizer sgd --sgd-momentum 0 and no
    clipping gives HSDP's losses at every step (1e-6)."""
    hsdp, h1 = runs["hsdp"], runs["diloco h1"]
    assert len(hsdp) == len(h1) == 5
    for a, b in zip(hsdp, h1, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert hsdp[-1]["loss"] < hsdp[0]["loss"]


def test_cli_resume_inside_the_cycle_continues_the_run_exactly(runs):
    """A save at step 2 of a 3-step cycle (int8 exchange), resumed with --load step-2, gives the uninterrupted run's
    losses for steps 3 to 5, bit for bit; inspect shows the strategy and H."""
    assert [r["loss"] for r in runs["resumed"]] == [r["loss"] for r in runs["whole"][2:]]
    out = runner.invoke(app, ["ckpt", "inspect", str(runs["root"] / "ck" / "step-2")]).stdout
    assert "DiLoCo 2x2" in out and "sync every 3 steps (H=3)" in out and "exchange int8" in out
