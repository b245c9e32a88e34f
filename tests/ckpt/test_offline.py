"""Offline checkpoint machinery in one process: write plans, expert regrouping, reshard round trips, reading.

Checkpoints here are synthetic (random tensors written through the same plan as
an online save), so these tests need no process group.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil

import pytest
import torch

from hfsdp.ckpt import CheckpointError, export, inspect, read_index, reshard, verify
from hfsdp.ckpt.format.groups import merged_order, retarget_groups
from hfsdp.ckpt.format.index import GroupSpec
from hfsdp.ckpt.format.pieces import plan_writes
from hfsdp.ckpt.tensors.reader import CheckpointReader
from hfsdp.core.rules.config import LayoutConfig

from tests.support.ckpt_files import as_legacy_optimizer, edit_index, synthetic_checkpoint, synthetic_groups
from tests.support.ckpt_models import NUM_EXPERTS

LAYOUTS = [
    {"world_size": 4, "instances": 2},  # HSDP 2x2: optimizer replicated over the outer axis
    {"world_size": 4, "instances": 2, "outer": "optim"},  # HFSDP 2x2
    {"world_size": 4, "inner": "optim"},  # ZeRO-1 1x4
    {"world_size": 3, "inner": "no_shard"},  # DDP over 3: everything replicated
    {"world_size": 4, "ep": 2, "num_moe_experts": NUM_EXPERTS, "expert_strategy": "optim_grads"},
    {"world_size": 3, "num_moe_experts": NUM_EXPERTS, "inner": "optim"},
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_plan_writes_every_element_once_and_spreads_replicas(layout):
    """Each element of each parameter is written by exactly one rank, and replicas share the writing."""
    cfg = LayoutConfig(**layout)
    groups = synthetic_groups(bool(cfg.num_moe_experts), cfg.ep)
    plan = plan_writes(cfg, groups)
    covered: dict[str, list[tuple[int, int]]] = {}
    for items in plan.values():
        for it in items:
            covered.setdefault(it.name, []).append((it.start, it.stop))
    shapes = {n: s for g in groups for n, s in g.members}
    assert covered.keys() == shapes.keys()
    for name, ranges in covered.items():
        position = 0
        for start, stop in sorted(ranges):
            assert start == position, name
            position = stop
        assert position == math.prod(shapes[name]), name
    written = [sum(it.numel for it in items) for items in plan.values()]
    assert all(written), f"some rank writes nothing: {written}"
    biggest = max(math.prod(s) for s in shapes.values())
    assert max(written) - min(written) <= 2 * biggest


def test_round_trip_reshard_is_byte_identical(tmp_path):
    """A -> B -> A (uneven world, ep change, bf16 model weights) reproduces A's files byte for byte."""
    a = {"world_size": 4, "instances": 2, "outer": "optim", "ep": 2, "num_moe_experts": NUM_EXPERTS}
    b = {"world_size": 3, "inner": "optim", "num_moe_experts": NUM_EXPERTS}
    synthetic_checkpoint(tmp_path / "a", a, moe=True)
    reshard(tmp_path / "a", tmp_path / "b", LayoutConfig(**b), io_threads=3)
    reshard(tmp_path / "b", tmp_path / "c", LayoutConfig(**a), io_threads=1)
    verify(tmp_path / "b")
    assert _file_hashes(tmp_path / "a") == _file_hashes(tmp_path / "c")
    first, back = read_index(tmp_path / "a"), read_index(tmp_path / "c")
    assert first.tensors == back.tensors and first.groups == back.groups and first.files == back.files
    assert first.unsharded == back.unsharded
    assert read_index(tmp_path / "b").files.keys() == {f"rank-{r:05d}.safetensors" for r in range(3)}
    # whole module tensors: dense ones in rank 0's file, an expert's in the file of its ep rank's first rank
    homes = {name: entry.pieces[0].file for name, entry in first.unsharded.items()}
    assert homes["shift"] == homes["layers.1.local_experts.1.gain"] == "rank-00000.safetensors"
    assert homes["layers.1.local_experts.2.gain"] == "rank-00001.safetensors"


def test_resharded_tensors_equal_the_written_ones(tmp_path):
    """Every kind of every tensor (buffers and frozen parameters too) reads back, after a reshard from 4 to 3
    ranks, as the tensor written."""
    tensors = synthetic_checkpoint(tmp_path / "a", {"world_size": 4, "instances": 2})
    reshard(tmp_path / "a", tmp_path / "b", LayoutConfig(world_size=3, inner="optim_grads"))
    index = read_index(tmp_path / "b")
    with CheckpointReader(tmp_path / "b", index) as reader:
        for kind, entries in tensors.items():
            for name, full in entries.items():
                got = torch.empty(full.numel(), dtype=full.dtype)
                reader.read_into(kind, name, 0, got)
                assert torch.equal(got, full.reshape(-1)), (kind, name)


def test_reader_chunks_stay_within_the_limit_and_cross_pieces(tmp_path):
    """Reading a range that spans several files in small chunks returns exactly that range."""
    tensors = synthetic_checkpoint(tmp_path / "a", {"world_size": 4, "inner": "optim"})
    index = read_index(tmp_path / "a")
    name = "layers.0.up.weight"
    assert len(index.tensors["main"][name].pieces) > 1
    with CheckpointReader(tmp_path / "a", index, max_mapped_bytes=64) as reader:
        chunks = list(reader.chunks("main", name, 5, 200, 7))
    assert max(c.numel() for c in chunks) <= 7
    assert torch.equal(torch.cat(chunks), tensors["main"][name].reshape(-1)[5:200])


def test_expert_regrouping_reproduces_module_order():
    """Experts of two MoE layers in one group are re-split by global index, in the target model's own order."""

    def names(ep: int, rank: int) -> list[str]:
        local = NUM_EXPERTS // ep
        out = []
        for layer in range(2):
            for j in range(local):
                out += [f"l.{layer}.local_experts.{rank * local + j}.{p}" for p in ("w1", "b1", "w2")]
        return out

    def groups(ep: int) -> list[GroupSpec]:
        shapes = {"w1": (3, 2), "b1": (3,), "w2": (2, 3)}
        return [GroupSpec(0, True, "float32", e, tuple((n, shapes[n[-2:]]) for n in names(ep, e))) for e in range(ep)]

    for source, target in [(2, 1), (1, 4), (4, 2), (2, 4)]:
        assert retarget_groups(groups(source), NUM_EXPERTS, target) == groups(target), (source, target)
    assert merged_order([names(2, 0), names(2, 1)]) == names(1, 0)


def test_export_writes_size_split_files_in_the_requested_dtype(tmp_path):
    """bf16 export: files no larger than the limit unless one tensor is, every tensor the cast main weight."""
    from safetensors.torch import load_file

    tensors = synthetic_checkpoint(tmp_path / "a", {"world_size": 4, "ep": 2, "num_moe_experts": 4}, moe=True)
    result = export(tmp_path / "a", tmp_path / "out", "bf16", max_shard_bytes=1500)
    files = sorted((tmp_path / "out").glob("*.safetensors"))
    assert result.files == len(files) > 1
    loaded = {}
    for f in files:
        part = load_file(f)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 1500 or len(part) == 1
        loaded.update(part)
    assert loaded.keys() == tensors["main"].keys() | tensors["unsharded"].keys()
    for name, value in tensors["main"].items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], value.to(torch.bfloat16))
    # buffers and frozen parameters: floating ones cast like the weights, the int64 counter kept as it is
    for name, value in tensors["unsharded"].items():
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert loaded[name].dtype == expected.dtype and torch.equal(loaded[name], expected), name


def test_inspect_describes_layout_tensors_and_files(tmp_path):
    """inspect reports the layout, step, optimizer, every tensor with its dtypes, and every file."""
    synthetic_checkpoint(tmp_path / "a", {"world_size": 4, "instances": 2, "outer": "optim"})
    info = inspect(tmp_path / "a")
    assert info["layout"]["name"].startswith("HFSDP 2x2")
    assert info["step"] == 3 and info["extra"] == {"consumed_samples": 72}
    assert info["kinds"] == ["model", "main", "exp_avg", "exp_avg_sq"]
    weight = next(t for t in info["tensors"] if t["name"] == "layers.1.up.weight")
    assert weight["shape"] == [13, 16] and weight["dtypes"]["model"] == "bfloat16"
    assert info["total_bytes"] == sum(f["bytes"] for f in info["files"])


def test_version_1_index_with_sha256_digests_is_still_verified(tmp_path):
    """An index written by hfsdp 0.1 (version 1, bare sha256 digests, no index checksum) is verified with sha256
    and reshards."""
    synthetic_checkpoint(tmp_path / "a", {"world_size": 4, "instances": 2})
    (tmp_path / "a" / "index.json.checksum").unlink()
    index_path = tmp_path / "a" / "index.json"
    data = json.loads(index_path.read_text())
    data["version"] = 1
    as_legacy_optimizer(data)
    data["files"] = {
        name: {"sha256": digest, "bytes": (tmp_path / "a" / name).stat().st_size}
        for name, digest in _file_hashes(tmp_path / "a").items()
        if name.endswith(".safetensors")
    }
    for meta in data["rng"].values():
        meta.pop("numpy", None)
    index_path.write_text(json.dumps(data))

    verify(tmp_path / "a")
    reshard(tmp_path / "a", tmp_path / "b", LayoutConfig(world_size=3))
    assert all(f.checksum.startswith("xxh3_128:") for f in read_index(tmp_path / "b").files.values())

    shard = tmp_path / "a" / "rank-00001.safetensors"
    damaged = bytearray(shard.read_bytes())
    damaged[-3] ^= 0x01
    shard.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match=r"rank-00001\.safetensors does not match its checksum.*sha256:"):
        verify(tmp_path / "a")


def _file_hashes(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_load_refuses_a_model_whose_buffers_differ_from_the_checkpoint(tmp_path):
    """A buffer or frozen parameter missing on either side, or of another shape, is named (checked on gathered
    shapes, so every rank raises the same error)."""
    from hfsdp.ckpt.live.load import _check_unsharded

    synthetic_checkpoint(tmp_path / "a", {"world_size": 2})
    index = read_index(tmp_path / "a")
    good = [("input_scale", (8,)), ("shift", (16,)), ("forward_calls", ())]
    _check_unsharded(tmp_path, index, [good, good])
    cases = [
        ([good[:2]], "has buffer or frozen parameter 'forward_calls', which the model lacks"),
        ([[*good, ("extra", (1,))]], "has no buffer or frozen parameter 'extra' of the model"),
        ([[good[0], ("shift", (15,)), good[2]]], "'shift' has shape [15] in the model but [16]"),
    ]
    for gathered, words in cases:
        with pytest.raises(CheckpointError) as err:
            _check_unsharded(tmp_path, index, gathered)
        assert words in str(err.value)


def test_a_destination_beside_the_source_with_the_same_prefix_is_accepted(tmp_path):
    """`ck` -> `ck-out` (and `ck.hf`) is beside the source, not inside it: a string-prefix test would refuse it."""
    synthetic_checkpoint(tmp_path / "ck", {"world_size": 2})
    reshard(tmp_path / "ck", tmp_path / "ck-out", LayoutConfig(world_size=3, inner="optim"))
    verify(tmp_path / "ck-out")
    export(tmp_path / "ck", tmp_path / "ck.hf", format="megatron")
    assert any((tmp_path / "ck.hf").glob("*.safetensors"))


def test_an_index_with_its_pieces_out_of_order_reads_the_same_tensors(tmp_path):
    """The format does not order a tensor's pieces: an index listing them in reverse (resealed) verifies, reads
    every tensor as written and reshards to the same files as the original."""
    tensors = synthetic_checkpoint(tmp_path / "a", {"world_size": 4, "instances": 2, "outer": "optim"})
    shutil.copytree(tmp_path / "a", tmp_path / "shuffled")

    def reverse(data):
        for kinds in (data["tensors"], {"unsharded": data.get("unsharded", {})}):
            for entries in kinds.values():
                for entry in entries.values():
                    entry["pieces"].reverse()

    edit_index(tmp_path / "shuffled", reverse)
    assert any(len(e.pieces) > 1 for e in read_index(tmp_path / "shuffled").tensors["main"].values())
    verify(tmp_path / "shuffled")
    index = read_index(tmp_path / "shuffled")
    with CheckpointReader(tmp_path / "shuffled", index) as reader:
        for kind, entries in tensors.items():
            for name, full in entries.items():
                got = torch.empty(full.numel(), dtype=full.dtype)
                reader.read_into(kind, name, 0, got)
                assert torch.equal(got, full.reshape(-1)), (kind, name)
    target = LayoutConfig(world_size=3, inner="optim_grads")
    reshard(tmp_path / "a", tmp_path / "a3", target)
    reshard(tmp_path / "shuffled", tmp_path / "s3", target)
    assert _file_hashes(tmp_path / "a3") == _file_hashes(tmp_path / "s3")
