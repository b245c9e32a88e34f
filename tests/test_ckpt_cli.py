"""`hfsdp ckpt reshard/export/inspect/verify` through typer's CliRunner on the sub-app.

The error paths of damaged checkpoints are in test_ckpt_errors.py; here: the
happy paths, the defaults taken from the source, and invalid target layouts.
"""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from hfsdp.ckpt import read_index
from hfsdp.cli.ckpt import app

from ckpt_models import NUM_EXPERTS, synthetic_checkpoint

runner = CliRunner()
MOE = {"world_size": 4, "instances": 2, "outer": "optim", "ep": 2, "num_moe_experts": NUM_EXPERTS}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "src"
    synthetic_checkpoint(path, MOE, moe=True)
    return path


def test_reshard_keeps_unspecified_options_and_prints_a_summary(src, tmp_path):
    """Only --world-size and --ep change; instances, strategies and experts come from the source."""
    dst = tmp_path / "dst"
    result = runner.invoke(app, ["reshard", str(src), str(dst), "--world-size", "2", "--ep", "1", "--io-threads", "2"])
    assert result.exit_code == 0, result.output
    assert "GB/s" in result.output and "HFSDP 2x1" in result.output
    layout = read_index(dst).layout
    assert layout["world_size"] == 2 and layout["ep"] == 1 and layout["instances"] == 2
    assert layout["outer"] == "optim" and layout["num_moe_experts"] == NUM_EXPERTS
    assert runner.invoke(app, ["verify", str(dst)]).exit_code == 0


def test_reshard_to_an_invalid_layout_lists_every_problem(src, tmp_path):
    """An invalid target exits 1 with the config's own messages and writes nothing."""
    dst = tmp_path / "dst"
    result = runner.invoke(app, ["reshard", str(src), str(dst), "--world-size", "3", "--outer", "optim_grads_params"])
    assert result.exit_code == 1
    assert "instances" in result.output and "ep 2 does not divide" in result.output and "Traceback" not in result.output
    assert not dst.exists()


def test_reshard_requires_the_world_size(src, tmp_path):
    """--world-size has no default: a reshard must say where it goes."""
    result = runner.invoke(app, ["reshard", str(src), str(tmp_path / "dst")])
    assert result.exit_code != 0 and "world-size" in result.output


def test_export_writes_hf_style_files(src, tmp_path):
    """export --dtype fp32 --max-shard-size writes model-*-of-* files and their index."""
    out = tmp_path / "out"
    result = runner.invoke(app, ["export", str(src), str(out), "--dtype", "fp32", "--max-shard-size", "1"])
    assert result.exit_code == 0, result.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in out.glob("model-*-of-*.safetensors")}
    assert "layers.1.local_experts.3.fc2.bias" in index["weight_map"]


def test_inspect_text_and_json(src):
    """inspect prints the layout and tensors for people, one JSON object for scripts."""
    text = runner.invoke(app, ["inspect", str(src)])
    assert text.exit_code == 0
    assert "HFSDP 2x2" in text.output and "layers.0.local_experts.2.fc1.weight" in text.output
    as_json = runner.invoke(app, ["inspect", str(src), "--format", "json"])
    info = json.loads(as_json.output)
    assert info["layout"]["ep"] == 2 and len(info["files"]) == 4


def test_verify_reports_an_intact_checkpoint(src):
    """verify exits 0 and says what it checked."""
    result = runner.invoke(app, ["verify", str(src)])
    assert result.exit_code == 0 and "intact" in result.output


def test_the_sub_app_mounts_under_ckpt():
    """The lead registers the sub-app with add_typer(..., name="ckpt"): the commands answer there."""
    root = typer.Typer()
    root.add_typer(app, name="ckpt")

    @root.command()
    def other() -> None:
        """A second command keeps `root` a group, as in hfsdp.cli.main."""

    result = runner.invoke(root, ["ckpt", "--help"])
    assert result.exit_code == 0
    for command in ("reshard", "export", "inspect", "verify"):
        assert command in result.output
