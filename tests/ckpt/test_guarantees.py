"""What docs/checkpoints.md promises beyond refusing damage: which step a root means, what killed runs leave and
who removes it, destinations apart from sources, the read-back after writing, printable output, JSON errors,
old format versions, and verify/inspect without torch.

All offline, on synthetic checkpoints (tests/ckpt/test_errors.py has the table of damaged ones).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import hfsdp.ckpt.tensors.writer as writer_module
from hfsdp.ckpt import CheckpointError, export, inspect, read_index, reshard, resolve, verify
from hfsdp.ckpt.format.store import is_unpublished
from hfsdp.cli.commands.ckpt import app
from hfsdp.core.rules.config import LayoutConfig

from tests.support.ckpt_files import as_legacy_optimizer, edit_index, synthetic_checkpoint

runner = CliRunner()
SOURCE = {"world_size": 4, "instances": 2, "outer": "optim"}
TARGET = LayoutConfig(world_size=2)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good") / "ckpt"
    synthetic_checkpoint(path, SOURCE)
    return path


def test_latest_wins_over_a_newer_unpublished_step(good, tmp_path):
    """A root follows `latest` even when a newer complete step (an orphan of a crashed save) exists; without
    `latest`, the newest complete step is used; a step above `latest` is unpublished, one at or below it is not."""
    root = tmp_path / "root"
    for step in (3, 5):
        shutil.copytree(good, root / f"step-{step}")
    (root / "step-7").mkdir()  # a directory without an index is never a checkpoint
    (root / "latest").write_text("step-3\n")
    assert resolve(root) == root / "step-3"
    assert verify(root)["path"] == str(root / "step-3")
    assert is_unpublished(root, 5) and is_unpublished(root, 4) and not is_unpublished(root, 3)
    (root / "latest").unlink()
    assert resolve(root) == root / "step-5"
    assert is_unpublished(root, 3)


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


@pytest.mark.parametrize("kind", ["reshard", "export"])
def test_only_stale_staging_of_the_same_kind_and_destination_is_removed(good, tmp_path, kind):
    """A killed run's `.tmp-<kind>-dst-<nonce>/` is removed by the next run into dst; a live run's (locked), other
    destinations', other kinds', odd names, a symlink and everything else are left alone."""
    stale = tmp_path / f".tmp-{kind}-dst-0123abcd"
    live = tmp_path / f".tmp-{kind}-dst-89abcdef"
    untouched = [
        live,
        tmp_path / f".tmp-{kind}-other-0123abcd",
        tmp_path / f".tmp-{'export' if kind == 'reshard' else 'reshard'}-dst-0123abcd",
        tmp_path / f".tmp-{kind}-dst-0123abcd-x",
        tmp_path / f".tmp-{kind}-dst-nothex00",
        tmp_path / "keep",
    ]
    for path in [stale, *untouched]:
        path.mkdir()
        (path / "rank-00000.safetensors").write_text("half-written")
    target = tmp_path / "target-of-link"
    target.mkdir()
    (target / "precious").write_text("not hfsdp's")
    link = tmp_path / f".tmp-{kind}-dst-fedcba98"
    link.symlink_to(target)
    fd = _lock(live)
    try:
        if kind == "reshard":
            reshard(good, tmp_path / "dst", TARGET)
        else:
            export(good, tmp_path / "dst")
    finally:
        os.close(fd)
    assert not stale.exists()
    assert all((p / "rank-00000.safetensors").exists() for p in untouched)
    assert link.is_symlink() and (target / "precious").exists()
    verify(tmp_path / "dst") if kind == "reshard" else None


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize(
    "where",
    ["inside", "same", "spelled with ..", "through a symlink", "around the source", "inside the step of a root"],
)
def test_a_destination_inside_or_around_the_source_is_refused(good, tmp_path, where):
    """reshard and export refuse a DST that is SRC, lies inside it or contains it, however the path is spelled
    (relative parts and symlinks resolved), and write nothing."""
    src = tmp_path / "src"
    shutil.copytree(good, src / "step-3")
    (src / "latest").write_text("step-3\n")
    (tmp_path / "link").symlink_to(src)
    source, dst, words = {
        "inside": (src / "step-3", src / "step-3" / "sub", "lies inside the source"),
        "same": (src / "step-3", src / "step-3", "is the source"),
        "spelled with ..": (src / "step-3", src / "step-3" / ".." / "step-3" / "sub", "lies inside the source"),
        "through a symlink": (src / "step-3", tmp_path / "link" / "step-3" / "sub", "lies inside the source"),
        "around the source": (src / "step-3", src, "lies inside the destination"),
        "inside the step of a root": (src, src / "step-3" / "out", "lies inside the source"),
    }[where]
    before = _tree(tmp_path)
    for call in (lambda: reshard(source, dst, TARGET), lambda: export(source, dst)):
        with pytest.raises(CheckpointError, match=words):
            call()
    for args in (["reshard", str(source), str(dst), "--world-size", "2"], ["export", str(source), str(dst)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and words in result.output, result.output
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("kind", ["reshard", "export"])
def test_a_file_changed_on_disk_after_writing_fails_the_read_back(good, tmp_path, monkeypatch, kind):
    """A byte that changes between writing (and hashing) a file and reading it back is caught: CheckpointError,
    no DST, no staging left."""
    original = writer_module.TensorFileWriter.finish

    def finish_then_damage(self):
        entry = original(self)
        with open(self.path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0x01]))
        return entry

    monkeypatch.setattr(writer_module.TensorFileWriter, "finish", finish_then_damage)
    with pytest.raises(CheckpointError, match="reads back differently"):
        if kind == "reshard":
            reshard(good, tmp_path / "dst", TARGET)
        else:
            export(good, tmp_path / "dst")
    assert list(tmp_path.iterdir()) == []


def test_names_from_a_file_are_printed_escaped(good, tmp_path):
    """A tensor name with terminal escapes and a line break is printed escaped by inspect, kept exact in its JSON,
    and escaped in error messages."""
    src = tmp_path / "src"
    shutil.copytree(good, src)
    evil = "layers.0.up.weight\x1b[2J\x1b[31m\nFAKE LINE"

    def rename(data):
        text = json.dumps(data).replace('"layers.0.up.weight"', json.dumps(evil))
        data.clear()
        data.update(json.loads(text))

    edit_index(src, rename)
    text = runner.invoke(app, ["inspect", str(src)])
    assert text.exit_code == 0, text.output
    assert "\x1b" not in text.output and "\\x1b[2J\\x1b[31m\\nFAKE LINE" in text.output
    info = json.loads(runner.invoke(app, ["inspect", str(src), "--format", "json"]).stdout)
    assert evil in [t["name"] for t in info["tensors"]]

    edit_index(src, lambda d: d["tensors"]["main"][evil]["pieces"][0].__setitem__(1, "main/\x1b]0;title\x07"))
    result = runner.invoke(app, ["verify", str(src)])
    assert result.exit_code == 2 and "\x1b" not in result.output and "\x07" not in result.output
    assert "main/\\x1b]0;title\\x07" in result.output and result.output.count("\n") == 1
    assert str(CheckpointError("a\x1bb\nc\u202ed")) == "a\\x1bb\\nc\\u202ed"


def test_names_the_terminal_cannot_encode_are_escaped_not_a_traceback(good, tmp_path):
    """On an ASCII-only stdout, inspect prints a name with non-ASCII letters escaped instead of failing."""
    src = tmp_path / "src"
    shutil.copytree(good, src)

    def rename(data):
        text = json.dumps(data).replace('"layers.0.up.weight"', json.dumps("layers.0.up.w\u00e9ight"))
        data.clear()
        data.update(json.loads(text))

    edit_index(src, rename)
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    out = subprocess.run(
        [sys.executable, "-m", "hfsdp.cli", "ckpt", "inspect", str(src)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "layers.0.up.w\\xe9ight" in out.stdout


def test_json_format_answers_with_one_object(good, tmp_path):
    """verify and inspect --format json print one JSON object on stdout: the result with ok true, or ok false and
    the error (exit 2), nothing on stderr."""
    for command in ("verify", "inspect"):
        result = runner.invoke(app, [command, str(good), "--format", "json"])
        assert result.exit_code == 0 and json.loads(result.stdout)["ok"] is True
        failed = runner.invoke(app, [command, str(tmp_path / "nowhere"), "--format", "json"])
        assert failed.exit_code == 2 and failed.stderr == ""
        answer = json.loads(failed.stdout)
        assert answer == {"ok": False, "error": answer["error"]} and "not a checkpoint" in answer["error"]
    assert json.loads(runner.invoke(app, ["verify", str(good), "--format", "json"]).stdout)["version"] == 3


def test_version_2_index_without_its_own_checksum_is_read(good, tmp_path):
    """A version 2 index (no index checksum, no NumPy RNG state) verifies, inspects and reshards; verify and
    inspect say that its index is not checksummed."""
    src = tmp_path / "v2"
    shutil.copytree(good, src)
    (src / "index.json.checksum").unlink()
    edit_index(src, lambda d: (d.update(version=2), as_legacy_optimizer(d)), reseal=False)
    assert verify(src)["index_checksum"] is False and inspect(src)["version"] == 2
    result = runner.invoke(app, ["verify", str(src)])
    assert result.exit_code == 0 and "index not checksummed" in result.output
    reshard(src, tmp_path / "v3", TARGET)
    assert read_index(tmp_path / "v3").version == 3 and (tmp_path / "v3" / "index.json.checksum").is_file()


HEAVY = ("torch", "megatron", "megatron.core", "safetensors.torch")


def test_verify_and_inspect_import_neither_torch_nor_megatron(good):
    """`hfsdp ckpt verify` and `inspect`, and the library's verify and inspect, run without importing torch or
    megatron-core (which cost seconds of start-up)."""
    script = f"""
import sys
from hfsdp.cli.main import app
for command in ("verify", "inspect"):
    try:
        app(["ckpt", command, sys.argv[1]])
    except SystemExit as exit:
        assert exit.code == 0, (command, exit.code)
from hfsdp.ckpt import inspect, verify
verify(sys.argv[1]), inspect(sys.argv[1])
print("HEAVY", sorted(m for m in {HEAVY!r} if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", script, str(good)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout
