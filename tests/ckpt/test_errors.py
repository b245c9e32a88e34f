"""Every bad input gets one clear paragraph naming the file, a non-zero exit, no DST, and an untouched SRC.

One table of hostile checkpoints: each case damages a copy of a good synthetic
root (`latest` -> `step-3/`) in one way, and every reader must refuse it with a
CheckpointError naming the culprit: verify, inspect (damage to the index, the
root or names; inspect reads no shard), load on one rank (the model untouched),
reshard and export (no DST, no staging left, SRC unchanged), and the CLI
(exit 2, no traceback, JSON errors under --format json).

Damage a wrong-but-resealed index stands for (a tool that writes a consistent
index with wrong content) reaches the schema and structure checks; damage
without resealing must be caught by the index's own checksum first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from hfsdp.ckpt import CheckpointError, export, inspect, load_checkpoint, reshard, verify
from hfsdp.ckpt.live.model_state import unsharded_state
from hfsdp.cli.commands.ckpt import app
from hfsdp.core.rules.config import LayoutConfig

from tests.support.ckpt_files import (
    as_legacy_optimizer,
    edit_index,
    reseal_file,
    rewrite_header,
    synthetic_checkpoint,
    write_index_bytes,
)
from tests.support.ckpt_models import ZERO3, engine, local_state

runner = CliRunner()
SOURCE = {"world_size": 4, "instances": 2, "outer": "optim"}
STEP = "step-3"
WEIGHT = "layers.0.up.weight"
PYTHON_RNG = [3, [0] * 624 + [624], None]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("good") / "root"
    synthetic_checkpoint(root / STEP, SOURCE)
    (root / "latest").write_text(f"{STEP}\n")
    return root


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A one-rank gloo group in this process, for loads."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'init'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def edited(edit, culprit: str, reseal: bool = True):
    """A damage that edits the parsed index of the step (resealed unless told otherwise)."""

    def damage(root: Path) -> str:
        edit_index(root / STEP, edit, reseal)
        return culprit

    return damage


def raw_index(old: bytes, new: bytes, culprit: str = "index.json", reseal: bool = True):
    """A damage that replaces the first `old` in the index bytes by `new`."""

    def damage(root: Path) -> str:
        raw = (root / STEP / "index.json").read_bytes()
        assert old in raw, old
        write_index_bytes(root / STEP, raw.replace(old, new, 1), reseal)
        return culprit

    return damage


def main_pieces(data) -> list:
    return data["tensors"]["main"][WEIGHT]["pieces"]


def rng_record(**fields):
    """An edit giving rank 0 an RNG record (synthetic checkpoints have none): valid fields, then `fields`."""

    def edit(data):
        data["rng"] = {"0": {"file": "rank-00000.safetensors", "keys": [], "python": PYTHON_RNG, **fields}}

    return edit


# -- damage to the files ---------------------------------------------------------------------


def truncate(root: Path) -> str:
    path = root / STEP / "rank-00001.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "rank-00001.safetensors"


def flip_bit(root: Path) -> str:
    path = root / STEP / "rank-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x10
    path.write_bytes(bytes(data))
    return "rank-00002.safetensors"


def delete_shard(root: Path) -> str:
    (root / STEP / "rank-00003.safetensors").unlink()
    return "rank-00003.safetensors"


def symlinked_shard(root: Path) -> str:
    shard = root / STEP / "rank-00001.safetensors"
    outside = root / "elsewhere.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    return "rank-00001.safetensors"


def zero_length_header(root: Path) -> str:
    path = root / STEP / "rank-00000.safetensors"
    path.write_bytes(struct.pack("<Q", 0) + path.read_bytes()[8:])
    reseal_file(root / STEP, "rank-00000.safetensors")
    return "rank-00000.safetensors"


def header_edit(edit):
    def damage(root: Path) -> str:
        rewrite_header(root / STEP, "rank-00001.safetensors", edit)
        return "rank-00001.safetensors"

    return damage


def overlapping_tensors(header) -> None:
    first, second = sorted((v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0])[
        :2
    ]
    nbytes = math.prod(second["shape"]) * {"F32": 4, "BF16": 2}[second["dtype"]]
    second["data_offsets"] = [first["data_offsets"][0], first["data_offsets"][0] + nbytes]


def unknown_header_dtype(header) -> None:
    entry = next(v for k, v in header.items() if k.startswith("main/"))
    entry["dtype"] = "U32"


def offsets_past_the_end(header) -> None:
    last = max((v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][1])
    last["data_offsets"][1] += 4
    last["shape"][0] += 1


# -- damage to the root ------------------------------------------------------------------------


def latest_text(text: str, culprit: str):
    def damage(root: Path) -> str:
        (root / "latest").write_text(text)
        return culprit

    return damage


def latest_symlink(root: Path) -> str:
    (root / "latest").unlink()
    (root / "elsewhere").write_text(f"{STEP}\n")
    (root / "latest").symlink_to(root / "elsewhere")
    return "latest"


def symlinked_step(root: Path) -> str:
    shutil.move(root / STEP, root / "real-step")
    (root / STEP).symlink_to(root / "real-step")
    return STEP


def drop_index_checksum(root: Path) -> str:
    (root / STEP / "index.json.checksum").unlink()
    return "index.json"


def garble_index_checksum(root: Path) -> str:
    (root / STEP / "index.json.checksum").write_text("not a checksum\n")
    return "index.json.checksum"


def remove_index(root: Path) -> str:
    (root / STEP / "index.json").unlink()
    return "not a complete checkpoint"


def swap_pieces(data) -> None:
    main = data["tensors"]["main"]
    main[WEIGHT]["pieces"], main["layers.1.up.weight"]["pieces"] = (
        main["layers.1.up.weight"]["pieces"],
        main[WEIGHT]["pieces"],
    )


def lone_surrogate_name(root: Path) -> str:
    path = root / STEP / "index.json"
    write_index_bytes(root / STEP, path.read_bytes().replace(b'"layers.0.up.weight"', b'"layers.0.\\ud800.weight"'))
    return "surrogate"


def deeply_nested(depth: int):
    return raw_index(b'"extra": {', b'"extra": {"deep": ' + b"[" * depth + b"]" * depth + b", ")


def tensor_missing_from_a_kind(data) -> None:
    del data["tensors"]["exp_avg"][WEIGHT]


def optimizer_group(data) -> dict:
    return data["optimizer"]["param_groups"][0]


def edit_step(data, value: float) -> None:
    values = data["optimizer"]["scalars"]["step"]["values"]
    values[next(iter(values))] = value


def duplicate_member(data) -> None:
    data["groups"][1]["members"].append(data["groups"][0]["members"][0])


#: label -> (damage, words the message holds besides the culprit, whether it is damage to the index or the root,
#: which even inspect must refuse).
DAMAGE = {
    # item 1: the index's own checksum
    "edited lr": (edited(lambda d: optimizer_group(d)["hyper"].update(lr=1.0), "index.json", False), "checksum", True),
    "edited step": (edited(lambda d: edit_step(d, 9.0), "index.json", False), "checksum", True),
    "swapped pieces": (edited(swap_pieces, "index.json", False), "checksum", True),
    "bit flip in the step": (raw_index(b'"step": 3', b'"step": 2', reseal=False), "checksum", True),
    "bit flip to version 2": (raw_index(b'"version": 3', b'"version": 2', reseal=False), "checksum", True),
    "no index checksum": (drop_index_checksum, "no index.json.checksum", True),
    "garbled index checksum": (garble_index_checksum, "does not hold a checksum", True),
    "no index (a crashed save)": (remove_index, "index.json", True),
    # the files
    "truncated file": (truncate, "truncated", False),
    "bit-flipped file": (flip_bit, "checksum", False),
    "missing shard": (delete_shard, "missing", False),
    "symlinked shard": (symlinked_shard, "symbolic link", False),
    "resealed zero-length header": (zero_length_header, "not a valid safetensors file", False),
    "resealed overlapping tensors": (header_edit(overlapping_tensors), "overlaps", False),
    "resealed unknown header dtype": (header_edit(unknown_header_dtype), "dtype", False),
    "resealed offsets past the end": (header_edit(offsets_past_the_end), "cover", False),
    "index names a key the file lacks": (
        edited(lambda d: main_pieces(d)[0].__setitem__(1, "main/no.such.tensor"), "rank-00000.safetensors"),
        "disagrees",
        False,
    ),
    "index records another size": (
        edited(lambda d: d["files"]["rank-00000.safetensors"].update(bytes=12345), "rank-00000.safetensors"),
        "bytes",
        False,
    ),
    "RNG key the file lacks": (
        edited(rng_record(keys=["rng/torch_cpu"]), "rank-00000.safetensors"),
        "RNG state of rank 0",
        False,
    ),
    # item 2: the structure
    "group shape disagrees with its tensor": (
        edited(lambda d: d["groups"][0]["members"][0].__setitem__(1, [13, 15]), WEIGHT),
        "shape",
        True,
    ),
    "pieces leave a gap": (
        edited(lambda d: main_pieces(d)[0].__setitem__(3, main_pieces(d)[0][3] - 1), WEIGHT),
        "gap",
        True,
    ),
    "pieces overlap": (edited(lambda d: main_pieces(d)[1].__setitem__(2, 0), WEIGHT), "overlap", True),
    "piece in an unlisted file": (
        edited(lambda d: d["files"].pop("rank-00003.safetensors"), "rank-00003"),
        "lacks",
        True,
    ),
    "tensor missing from one kind": (edited(tensor_missing_from_a_kind, WEIGHT), "exp_avg", True),
    "parameter in two groups": (edited(duplicate_member, WEIGHT), "more than one group", True),
    "order lists another tensor": (edited(lambda d: d["order"].append("ghost"), "index.json"), "order", True),
    "optimizer state that is no kind": (
        edited(lambda d: d["optimizer"]["states"].append("momentum_buffer"), "momentum_buffer"),
        "optimizer",
        True,
    ),
    # item 3: names that leave the directory
    "piece file outside the directory": (
        edited(lambda d: main_pieces(d)[0].__setitem__(0, "../outside/rank-00000.safetensors"), "../outside"),
        "path separator",
        True,
    ),
    "absolute file name": (
        edited(lambda d: d["files"].update({"/etc/passwd": d["files"]["rank-00000.safetensors"]}), "/etc/passwd"),
        "path separator",
        True,
    ),
    "RNG file outside the directory": (edited(rng_record(file="../x.safetensors"), "../x.safetensors"), "rng", True),
    "latest leads out of the root": (latest_text("../x\n", "../x"), "lead out of the root", True),
    "latest is an absolute path": (latest_text("/tmp\n", "/tmp"), "lead out of the root", True),
    "latest names a missing step": (latest_text("step-9\n", "step-9"), "not a complete checkpoint", True),
    "latest is a symlink": (latest_symlink, "symbolic link", True),
    "step directory is a symlink": (symlinked_step, "symbolic link", True),
    # item 4: what used to raise other exceptions
    "1e999 as the step": (raw_index(b'"step": 3', b'"step": 1e999'), "out of range", True),
    "1e999 in extra": (raw_index(b'"consumed_samples": 72', b'"consumed_samples": 1e999'), "out of range", True),
    "NaN as the learning rate": (raw_index(b'"lr": 0.01', b'"lr": NaN'), "NaN", True),
    "an integer of 5000 digits": (raw_index(b'"step": 3', b'"step": ' + b"9" * 5000), "digits", True),
    "extra nested 100000 deep": (deeply_nested(100_000), "nested too deeply", True),
    "extra nested 100 deep": (deeply_nested(100), "deeper than 64", True),
    "duplicate key": (raw_index(b'"step": 3', b'"step": 3, "step": 4'), "twice", True),
    "not UTF-8": (raw_index(b'"consumed_samples"', b'"consumed\xffsamples"'), "UTF-8", True),
    "lone surrogate in a name": (lone_surrogate_name, "index.json", True),
    "unknown dtype": (edited(lambda d: d["tensors"]["main"][WEIGHT].update(dtype="uint16"), "uint16"), "dtype", True),
    "a list as a dtype": (edited(lambda d: d["groups"][0].update(dtype=["float32"]), "groups[0].dtype"), "list", True),
    "unknown layout key": (edited(lambda d: d["layout"].update(bogus=1), "bogus"), "layout", True),
    "invalid source layout": (
        edited(lambda d: d["layout"].update(inner="optim", outer="optim_grads_params"), "layout"),
        "not a valid layout",
        True,
    ),
    "world size of 2**40": (edited(lambda d: d["layout"].update(world_size=2**40), "world_size"), "layout", True),
    "a float where a count belongs": (edited(lambda d: d.update(step=3.0), "step"), "whole number", True),
    "true as a piece bound": (edited(lambda d: main_pieces(d)[0].__setitem__(2, True), "pieces[0][2]"), "whole", True),
    "a negative piece bound": (edited(lambda d: main_pieces(d)[0].__setitem__(2, -1), "pieces[0][2]"), "outside", True),
    "optimizer group without hyper": (edited(lambda d: optimizer_group(d).pop("hyper"), "hyper"), "optimizer", True),
    "a version 1-2 optimizer record in format 3": (edited(as_legacy_optimizer, "param_groups"), "optimizer", True),
    "optimizer group naming no parameter": (
        edited(lambda d: optimizer_group(d)["params"].append("nowhere.weight"), "nowhere.weight"),
        "optimizer",
        True,
    ),
    "optimizer step of 1e999": (raw_index(b'"values": {', b'"values": {"x": 1e999, '), "out of range", True),
    "malformed Python RNG state": (edited(rng_record(python=[3, [1, 2, 3], None]), "python"), "rng", True),
    "RNG position out of range": (edited(rng_record(python=[3, [0] * 624 + [625], None]), "python"), "position", True),
    "unknown RNG key": (edited(rng_record(keys=["rng/other"]), "rng/other"), "rng", True),
    "RNG of a rank beyond the layout": (
        edited(
            lambda d: d["rng"].update({"7": {"file": "rank-00000.safetensors", "keys": [], "python": PYTHON_RNG}}),
            "rank 7",
        ),
        "layout",
        True,
    ),
    "extra that is a list": (edited(lambda d: d.update(extra=[]), "extra"), "object", True),
    "rng that is a number": (edited(lambda d: d.update(rng=0), "rng"), "object", True),
    "extra.step that is no step": (edited(lambda d: d["extra"].update(step="abc"), "extra.step"), "whole number", True),
    "unknown top-level field": (edited(lambda d: d.update(surprise=1), "surprise"), "does not define", True),
    "future format version": (edited(lambda d: d.update(version=5), "version"), "reads format versions", True),
    "not an hfsdp index": (edited(lambda d: d.update(format="other"), "format"), "not an hfsdp", True),
    "garbage index": (raw_index(b"{", b"{not json"), "cannot be read", True),
    "unknown checksum algorithm": (
        edited(lambda d: d["files"]["rank-00001.safetensors"].update(checksum="md5:0123abcd"), "md5"),
        "algorithm",
        True,
    ),
}


def tree_hash(path: Path) -> str:
    """A digest of everything under `path`: names, file contents, link targets."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_symlink():
            h.update(os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("case", list(DAMAGE))
def test_hostile_checkpoint_is_refused_by_every_reader(good, one_rank, tmp_path, case):
    """verify, inspect, load, reshard and export (library and CLI) refuse it naming the culprit: no traceback, no
    DST, no staging left, SRC untouched, the model not loaded into."""
    damage, words, index_level = DAMAGE[case]
    src = tmp_path / "src"
    shutil.copytree(good, src, symlinks=True)
    culprit = damage(src)
    before = tree_hash(src)
    dst = tmp_path / "dst"

    def refused(label: str, call) -> None:
        with pytest.raises(CheckpointError) as err:
            call()
        message = str(err.value)
        assert culprit in message and words in message and "\n" not in message, (label, message)

    refused("verify", lambda: verify(src))
    if index_level:
        refused("inspect", lambda: inspect(src))
    else:
        inspect(src)  # reads the index only, which is intact
    sm, opt = engine(ZERO3)
    state, buffers = local_state(sm, opt), {n: t.clone() for n, t in unsharded_state(sm).items()}
    refused("load", lambda: load_checkpoint(src, sm, opt))
    for a, b in zip(state, local_state(sm, opt), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a), "a refused load changed the model"
    assert all(torch.equal(t, unsharded_state(sm)[n]) for n, t in buffers.items())
    refused("reshard", lambda: reshard(src, dst, LayoutConfig(world_size=3)))
    refused("export", lambda: export(src, dst))

    commands = [
        ["reshard", str(src), str(dst), "--world-size", "3", "--instances", "1", "--outer", "no_shard"],
        ["export", str(src), str(dst)],
        ["verify", str(src)],
        *([["inspect", str(src)]] if index_level else []),
    ]
    for args in commands:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert culprit in result.output and "Traceback" not in result.output, result.output
        assert "internal error" not in result.output, result.output
    for command in ["verify", "inspect"] if index_level else ["verify"]:
        result = runner.invoke(app, [command, str(src), "--format", "json"])
        assert result.exit_code == 2
        answer = json.loads(result.stdout)
        assert answer["ok"] is False and culprit in answer["error"], answer
    assert not dst.exists()
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


def test_an_index_over_the_size_limit_is_refused_unread(good, tmp_path, monkeypatch):
    """An index larger than the cap (256 MiB; lowered here) is refused with a message, before it is parsed."""
    import hfsdp.ckpt.format.index_file as index_file

    monkeypatch.setattr(index_file, "MAX_INDEX_BYTES", 1000)
    with pytest.raises(CheckpointError, match=r"index\.json is larger than 1000 bytes"):
        verify(good)


def test_an_index_hfsdp_would_refuse_is_never_written(tmp_path):
    """A NaN or a too deeply nested value in `extra` fails the save, before anything is published."""
    for label, extra in [("nan", {"loss": float("nan")}), ("deep", {"x": json.loads("[" * 70 + "]" * 70)})]:
        with pytest.raises(CheckpointError, match="extra"):
            synthetic_checkpoint(tmp_path / label, SOURCE, extra=extra)
        assert not (tmp_path / label).exists() and list(tmp_path.iterdir()) == []


ODD_VALUES = [None, True, 0, -1, 2**63, 3.5, "", "../x", "a\x1bb", [], [1], {}, {"a": 1}, "uint16", 10**30]


def _paths(node, prefix=()):
    """Every path into the parsed index (lists: their first two items)."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node[:2]) if isinstance(node, list) else ()
    for key, child in items:
        yield from _paths(child, (*prefix, key))


def _random_edit(data, rand) -> None:
    """Replace, drop or duplicate the value at one random path of the parsed index."""
    *path, key = rand.choice(list(_paths(data))[1:])
    parent = data
    for part in path:
        parent = parent[part]
    action = rand.random()
    if action < 0.6:
        parent[key] = rand.choice(ODD_VALUES)
    elif action < 0.8:
        parent.pop(key)
    elif isinstance(parent, dict):
        parent[f"{key}x"] = parent[key]
    else:
        parent.append(parent[key])


def _random_header_bytes(ckpt: Path, rand) -> None:
    name = f"rank-0000{rand.randrange(4)}.safetensors"
    raw = bytearray((ckpt / name).read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    for _ in range(rand.randint(1, 3)):
        raw[rand.randrange(8 + length)] = rand.choice([rand.randrange(256), *b'"1{]'])
    (ckpt / name).write_bytes(bytes(raw))
    reseal_file(ckpt, name)


def _read_with_every_reader(ckpt: Path, scratch: Path) -> None:
    """verify, inspect, reshard and export `ckpt`; a CheckpointError is a fine answer, anything else is not."""
    calls = (verify, inspect, lambda c: reshard(c, scratch / "dst", LayoutConfig(world_size=3)))
    for call in (*calls, lambda c: export(c, scratch / "out")):
        with contextlib.suppress(CheckpointError):
            call(ckpt)


@pytest.mark.parametrize("seed", range(2))
def test_random_damage_is_refused_or_read_but_never_raises_anything_else(good, tmp_path, seed):
    """Seeded random edits of the index and random bytes in a shard's header, both resealed: verify, inspect,
    reshard and export either succeed or raise CheckpointError, never another exception (a fuzz like this found
    a TypeError in the schema check)."""
    import random

    rand = random.Random(seed)
    for case in range(100):
        ckpt = tmp_path / f"c{case}"
        shutil.copytree(good / STEP, ckpt)
        if case % 2:
            _random_header_bytes(ckpt, rand)
        else:
            edit_index(ckpt, lambda data: [_random_edit(data, rand) for _ in range(rand.randint(1, 3))])
        _read_with_every_reader(ckpt, tmp_path)
        shutil.rmtree(ckpt)
        for leftover in ("dst", "out"):
            shutil.rmtree(tmp_path / leftover, ignore_errors=True)
