"""Every bad input gets one clear paragraph naming the file, a non-zero exit, no DST, and an untouched SRC.

Each case damages a copy of a good synthetic checkpoint, then runs the library
(reshard, export, verify) and the CLI (`hfsdp ckpt reshard/export/verify`) on it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hfsdp.ckpt import CheckpointError, export, reshard, verify
from hfsdp.cli.ckpt import app
from hfsdp.core.config import LayoutConfig

from ckpt_models import synthetic_checkpoint

runner = CliRunner()
SOURCE = {"world_size": 4, "instances": 2, "outer": "optim"}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("good") / "ckpt"
    synthetic_checkpoint(root, SOURCE)
    return root


def truncate(ckpt: Path) -> str:
    path = ckpt / "rank-00001.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "rank-00001.safetensors"


def flip_bit(ckpt: Path) -> str:
    path = ckpt / "rank-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x10
    path.write_bytes(bytes(data))
    return "rank-00002.safetensors"


def delete_shard(ckpt: Path) -> str:
    (ckpt / "rank-00003.safetensors").unlink()
    return "rank-00003.safetensors"


def _edit_index(ckpt: Path, edit) -> None:
    path = ckpt / "index.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def rename_key_in_index(ckpt: Path) -> str:
    def edit(data):
        piece = data["tensors"]["main"]["layers.0.up.weight"]["pieces"][0]
        piece[1] = "main/no.such.tensor"

    _edit_index(ckpt, edit)
    return "rank-00000.safetensors"


def shift_piece_in_index(ckpt: Path) -> str:
    def edit(data):
        data["tensors"]["main"]["layers.2.down.weight"]["pieces"][0][3] -= 1

    _edit_index(ckpt, edit)
    return "layers.2.down.weight"


def wrong_size_in_index(ckpt: Path) -> str:
    _edit_index(ckpt, lambda data: data["files"]["rank-00000.safetensors"].update(bytes=12345))
    return "rank-00000.safetensors"


def unknown_checksum_algorithm(ckpt: Path) -> str:
    _edit_index(ckpt, lambda data: data["files"]["rank-00001.safetensors"].update(checksum="md5:0123abcd"))
    return "index.json"


def garbage_index(ckpt: Path) -> str:
    (ckpt / "index.json").write_text("{not json")
    return "index.json"


def no_index(ckpt: Path) -> str:
    (ckpt / "index.json").unlink()
    return "not a checkpoint"


DAMAGE = {
    "truncated file": (truncate, "truncated"),
    "bit-flipped file": (flip_bit, "checksum"),
    "missing shard": (delete_shard, "missing"),
    "index names a key the file lacks": (rename_key_in_index, "disagrees"),
    "index pieces leave a gap": (shift_piece_in_index, "index"),
    "index records another size": (wrong_size_in_index, "bytes"),
    "unreadable index": (garbage_index, "cannot be read"),
    "unknown checksum algorithm": (unknown_checksum_algorithm, "md5"),
    "no index (a crashed save)": (no_index, "no index.json"),
}


def tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_source_is_refused_everywhere(good, tmp_path, case):
    """reshard, export and verify (library and CLI) refuse it, name the file, leave no DST and SRC untouched."""
    damage, words = DAMAGE[case]
    src = tmp_path / "src"
    shutil.copytree(good, src)
    culprit = damage(src)
    before = tree_hash(src)

    calls = {
        "reshard": lambda: reshard(src, tmp_path / "dst", LayoutConfig(world_size=3)),
        "export": lambda: export(src, tmp_path / "dst"),
        "verify": lambda: verify(src),
    }
    for label, call in calls.items():
        with pytest.raises(CheckpointError) as err:
            call()
        message = str(err.value)
        assert culprit in message and words in message, (label, message)
        assert "\n" not in message

    dst = str(tmp_path / "dst")
    commands = [
        ["reshard", str(src), dst, "--world-size", "3", "--instances", "1", "--outer", "no_shard"],
        ["export", str(src), dst],
        ["verify", str(src)],
    ]
    for args in commands:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert culprit in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "dst").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"], "a temporary directory was left behind"
    assert tree_hash(src) == before


def test_existing_destination_is_never_overwritten(good, tmp_path):
    """reshard and export refuse an existing DST and leave both it and SRC as they were."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    before = tree_hash(good)
    with pytest.raises(CheckpointError, match="already exists"):
        reshard(good, dst, LayoutConfig(world_size=2))
    with pytest.raises(CheckpointError, match="already exists"):
        export(good, dst)
    result = runner.invoke(app, ["reshard", str(good), str(dst), "--world-size", "2"])
    assert result.exit_code == 2 and str(dst) in result.output and "already exists" in result.output
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]
    assert tree_hash(good) == before


def test_a_directory_that_is_not_a_checkpoint(tmp_path):
    """A plain directory, or a path that does not exist, is named as not a checkpoint."""
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "nowhere"):
        result = runner.invoke(app, ["verify", str(path)])
        assert result.exit_code == 2 and "not a checkpoint" in result.output and str(path) in result.output


def test_reshard_cannot_change_the_number_of_experts(tmp_path):
    """A target with another expert count describes another model: refused before anything is written."""
    synthetic_checkpoint(tmp_path / "moe", {"world_size": 4, "ep": 2, "num_moe_experts": 4}, moe=True)
    with pytest.raises(CheckpointError, match="4 experts"):
        reshard(tmp_path / "moe", tmp_path / "dst", LayoutConfig(world_size=4, ep=2, num_moe_experts=8))
    assert not (tmp_path / "dst").exists()
