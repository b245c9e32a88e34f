"""`hfsdp ckpt reshard/export/inspect/verify` through typer's CliRunner on the sub-app.

The error paths of damaged checkpoints are in tests/ckpt/test_errors.py; here: the
happy paths, the defaults taken from the source, and invalid target layouts.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hfsdp.ckpt import read_index
from hfsdp.cli.commands.ckpt import app

from tests.support.ckpt_files import synthetic_checkpoint
from tests.support.ckpt_models import NUM_EXPERTS

runner = CliRunner()
MOE = {"world_size": 4, "instances": 2, "outer": "optim", "ep": 2, "num_moe_experts": NUM_EXPERTS}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "src"
    return path, synthetic_checkpoint(path, MOE, moe=True)


@pytest.fixture(scope="module")
def src(written):
    return written[0]


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


def test_export_writes_hf_style_files(written, tmp_path):
    """export --dtype fp32 --max-shard-size writes model-*-of-* files and their index, and every exported tensor
    is the checkpoint's fp32 main weight (or whole module tensor) of that name, exactly, in its shape."""
    from safetensors.torch import load_file

    src, tensors = written
    out = tmp_path / "out"
    result = runner.invoke(app, ["export", str(src), str(out), "--dtype", "fp32", "--max-shard-size", "1"])
    assert result.exit_code == 0, result.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = {p.name for p in out.glob("model-*-of-*.safetensors")}
    assert set(index["weight_map"].values()) == files
    exported = {name: t for f in files for name, t in load_file(out / f).items()}
    expected = {**tensors["main"], **tensors["unsharded"]}
    assert exported.keys() == expected.keys() == index["weight_map"].keys()
    for name, value in expected.items():
        assert torch.equal(exported[name], value), name


def test_inspect_text_and_json(src):
    """inspect prints the layout and tensors for people, one JSON object for scripts."""
    text = runner.invoke(app, ["inspect", str(src)])
    assert text.exit_code == 0
    assert "HFSDP 2x2" in text.output and "layers.0.local_experts.2.fc1.weight" in text.output
    as_json = runner.invoke(app, ["inspect", str(src), "--format", "json"])
    info = json.loads(as_json.output)
    assert info["layout"]["ep"] == 2 and len(info["files"]) == 4


def test_verify_reports_an_intact_checkpoint(src):
    """verify exits 0 and says what it checked: every file the index lists and all their bytes."""
    result = runner.invoke(app, ["verify", str(src)])
    assert result.exit_code == 0 and "intact" in result.output
    files = read_index(src).files
    assert f"{len(files)} files" in result.output
    assert f"{sum(f.stat().st_size for f in src.glob('*.safetensors')):,} bytes" in result.output


def test_the_ckpt_commands_answer_under_the_hfsdp_command(src):
    """`hfsdp ckpt ...` of the installed command's app reaches every sub-command: its help lists them all, and
    verify through it checks the checkpoint."""
    from hfsdp.cli.main import app as hfsdp

    listing = runner.invoke(hfsdp, ["ckpt", "--help"])
    assert listing.exit_code == 0
    assert all(command in listing.output for command in ("reshard", "export", "import", "inspect", "verify"))
    result = runner.invoke(hfsdp, ["ckpt", "verify", str(src)])
    assert result.exit_code == 0 and "intact" in result.output


def test_an_empty_destination_directory_is_accepted_and_a_taken_one_refused_before_torch(src, tmp_path):
    """`mkdir out; hfsdp ckpt export ck out` works (an empty directory holds nothing to overwrite). A
    destination with something in it is refused before torch is imported (it took 3-6 s), and left alone; with
    stderr not a terminal the commands print no progress bar and no stray empty line."""
    import subprocess
    import sys
    from pathlib import Path

    hfsdp = str(Path(sys.executable).parent / "hfsdp")
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run([hfsdp, "ckpt", "export", str(src), str(out)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert (out / "model.safetensors.index.json").is_file()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    probe = (
        "import sys; from typer.testing import CliRunner; from hfsdp.cli.main import app; "
        "r = CliRunner().invoke(app, ['ckpt', *sys.argv[1:]]); print(r.exit_code, 'torch' in sys.modules); "
        "print(r.output)"
    )
    for command, extra in (("export", []), ("reshard", ["--world-size", "2"]), ("import", ["--world-size", "2"])):
        args = [command, str(src), str(tmp_path / "taken"), *extra]
        done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True)
        first, message = done.stdout.split("\n", 1)
        assert first == "2 False", done.stdout + done.stderr
        assert "already exists" in message and "an empty directory is fine" in message
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["mine.txt"]


def test_reshard_keeps_the_runs_global_batch_or_refuses_with_the_sizes_that_work(tmp_path):
    """A checkpoint of a run with global batch 16 (micro-batch 2) on 4 ranks: resharded to 2 ranks it keeps batch
    16; to 3 ranks, where 16 does not split, it is refused (exit 1, nothing written) naming the numbers of ranks
    and micro-batch sizes that work; --global-batch-size 12 changes the run's batch and the reshard goes through."""
    src = tmp_path / "src"
    synthetic_checkpoint(src, {"world_size": 4, "global_batch_size": 16, "micro_batch_size": 2})
    kept = runner.invoke(app, ["reshard", str(src), str(tmp_path / "two"), "--world-size", "2"])
    assert kept.exit_code == 0, kept.output
    assert read_index(tmp_path / "two").layout["global_batch_size"] == 16
    refused = runner.invoke(app, ["reshard", str(src), str(tmp_path / "three"), "--world-size", "3"])
    assert refused.exit_code == 1
    assert "the checkpoint's global batch 16 does not split over 3 ranks with --micro-batch-size 2" in refused.output
    assert "Numbers of ranks that split it with --micro-batch-size 2: 1, 2, 4, 8" in refused.output
    assert "micro-batch sizes that split it over 3 ranks: none" in refused.output
    assert "Traceback" not in refused.output and not (tmp_path / "three").exists()
    told = runner.invoke(app, ["reshard", str(src), str(tmp_path / "twelve"), "--world-size", "3",
                               "--global-batch-size", "12"])  # fmt: skip
    assert told.exit_code == 0, told.output
    assert read_index(tmp_path / "twelve").layout["global_batch_size"] == 12
