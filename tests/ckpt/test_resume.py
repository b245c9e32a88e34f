"""Checkpoints in training: save on one layout, resume on another (offline reshard and reshard on load).

Every resumed run is compared with a single-process torch.optim.AdamW run of the
same model on the same batches: within fp32 rounding across layouts, and bit for
bit when the layout does not change. Four process groups (6, 4, 2 and 3 ranks)
run all cases; the assertions run here, on what they return.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from hfsdp.ckpt import export, read_index, reshard, resolve
from hfsdp.ckpt.format.groups import retarget_groups
from hfsdp.ckpt.tensors.reader import CheckpointReader
from hfsdp.core.rules.config import LayoutConfig

from tests.support.ckpt_files import as_legacy_optimizer, edit_index
from tests.support.ckpt_models import GLOBAL_BATCH, HFSDP, MOE_EP1, MOE_EP2, NUM_EXPERTS, ZERO1, ZERO3, reference
from tests.support.ckpt_phases import load_phase, world4_phase, world6_phase
from tests.support.distributed import run_distributed

HSDP_2X1 = {"inner": "optim_grads_params", "outer": "no_shard", "instances": 2}
MOE_3 = {"inner": "optim", "num_moe_experts": NUM_EXPERTS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """All training runs: 6 ranks (the non-square save), 4 ranks (saves, same-layout resumes, 4-rank targets),
    then 2 and 3 ranks."""
    root = tmp_path_factory.mktemp("resume")
    out = {"root": root, **run_distributed(world6_phase, 6, str(root))[0]}
    reshard(root / "hfsdp3x2", root / "hfsdp3x2_to_2x2", LayoutConfig(world_size=4, **HFSDP), io_threads=2)
    out.update(run_distributed(world4_phase, 4, str(root))[0])
    reshard(root / "hfsdp", root / "hfsdp_to_hsdp2x1", LayoutConfig(world_size=2, **HSDP_2X1), io_threads=2)
    reshard(root / "hsdp", root / "hsdp_to_zero3x3", LayoutConfig(world_size=3, **ZERO3), io_threads=2)
    two = [
        ("hfsdp->hsdp 2x1 offline", str(root / "hfsdp_to_hsdp2x1"), HSDP_2X1, False),
        ("hfsdp->hsdp 2x1 on load", str(root / "hfsdp"), HSDP_2X1, False),
    ]
    errors = [("dense into moe", str(root / "hsdp"), MOE_EP1 | {"instances": 1, "outer": "no_shard"}, True)]
    on_two = run_distributed(load_phase, 2, two, errors)
    out.update(on_two[0])
    out["errors on every rank"] = [r["errors"] for r in on_two]
    as_version_2(resolve(root / "hsdp"), root / "hsdp_v2")
    three = [
        ("hsdp v2 (ShardedAdamW)->zero3 1x3", str(root / "hsdp_v2"), ZERO3, False),
        ("hsdp->zero3 1x3 offline", str(root / "hsdp_to_zero3x3"), ZERO3, False),
        ("hsdp->zero3 1x3 on load", str(root / "hsdp"), ZERO3, False),
        ("zero1->zero1 1x3 on load", str(root / "zero1"), ZERO1, False),
        ("moe_ep2->ep1 1x3 on load", str(root / "moe_ep2"), MOE_3, True),
    ]
    out.update({k: v for k, v in run_distributed(load_phase, 3, three)[0].items() if k != "errors"})
    return out


def as_version_2(src, dst) -> None:
    """A copy of checkpoint `src` as hfsdp 0.1 wrote it: index version 2 without its own checksum, and the optimizer
    record of its own ShardedAdamW (step count, hyper-parameters, state names)."""
    shutil.copytree(src, dst)
    (dst / "index.json.checksum").unlink()

    def legacy(data):
        as_legacy_optimizer(data)
        data["version"] = 2

    edit_index(dst, legacy, reseal=False)


@pytest.fixture(scope="module")
def refs():
    return {False: reference(False, 4), True: reference(True, 4)}


RESUMED = [
    ("hsdp->zero3 offline", False),
    ("hsdp->zero3 on load", False),
    ("zero1->hfsdp offline", False),
    ("zero1->hfsdp on load", False),
    ("hfsdp->hsdp 2x1 offline", False),
    ("hfsdp->hsdp 2x1 on load", False),
    ("hsdp v2 (ShardedAdamW)->zero3 1x3", False),
    ("hsdp->zero3 1x3 offline", False),
    ("hsdp->zero3 1x3 on load", False),
    ("zero1->zero1 1x3 on load", False),
    ("moe_ep2->ep1 offline", True),
    ("moe_ep2->ep1 on load", True),
    ("moe_ep1->ep2 offline", True),
    ("moe_ep1->ep2 on load", True),
    ("moe_ep2->ep1 1x3 on load", True),
    ("hfsdp3x2->hfsdp2x2 offline", False),
    ("hfsdp3x2->hfsdp2x2 on load", False),
]


@pytest.mark.parametrize(("label", "moe"), RESUMED)
def test_resume_on_another_layout_matches_uninterrupted_reference(runs, refs, label, moe):
    """Two steps on layout A, reshard to B, two steps on B: the losses of an uninterrupted 4-step run, and
    the module tensors the engine does not shard restored into a differently initialised model."""
    losses, states = refs[moe]
    result = runs[label]
    assert result["step_count"] == 2
    # the frozen parameter and the buffers (an expert's by global index) are the reference's after step 2
    assert result["unsharded"] and all(torch.equal(t, states[1][n]) for n, t in result["unsharded"].items())
    assert result["extra"] == {"consumed_samples": 2 * GLOBAL_BATCH, "step": 2}
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses[2:]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["hsdp", "zero1", "hfsdp", "hfsdp_bf16", "moe_ep2", "moe_ep1", "hfsdp3x2"])
def test_saved_runs_match_reference(runs, refs, name):
    """The runs that were saved trained like the single-process reference (bf16 compute within bf16 rounding)."""
    losses, _ = refs[name.startswith("moe")]
    got = runs[name]["first"] + runs[name]["second"]
    tol = 2e-2 if name.endswith("bf16") else 1e-5
    torch.testing.assert_close(torch.tensor(got), torch.tensor(losses), rtol=tol, atol=0)


@pytest.mark.parametrize("name", ["hsdp", "hfsdp_bf16", "moe_ep2", "hfsdp3x2"])
def test_same_layout_resume_is_bitwise(runs, name):
    """Resuming on the layout that saved gives bit-identical losses, weights and optimizer states."""
    uninterrupted, resumed = runs[name], runs[f"{name}->{name}"]
    assert resumed["losses"] == uninterrupted["second"]
    for a, b in zip(uninterrupted["state"], resumed["state"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_non_square_save_resharded_offline_resumes_to_the_reference_parameters(runs, refs):
    """HFSDP 3x2 (6 ranks) saved at step 2, resharded offline to HFSDP 2x2 (4 ranks), resumed for two steps and
    saved: every fp32 main weight and module tensor after step 4 is the single-process AdamW run's."""
    _, states = refs[False]
    assert read_index(resolve(runs["root"] / "hfsdp3x2")).config().layout_name.startswith("HFSDP 3x2")
    resumed = resolve(runs["root"] / "resumed2x2")
    index = read_index(resumed)
    assert index.config().layout_name.startswith("HFSDP 2x2") and index.step == 4
    with CheckpointReader(resumed, index) as reader:
        for name, expected in states[3].items():
            kind = "unsharded" if name in index.unsharded else "main"
            got = torch.empty(expected.numel(), dtype=expected.dtype)
            reader.read_into(kind, name, 0, got)
            torch.testing.assert_close(got.view(expected.shape), expected, rtol=1e-5, atol=1e-6, msg=name)


def test_load_of_another_model_fails_on_every_rank(runs):
    """Loading a dense model's checkpoint into the MoE model raises a clear error naming a missing tensor."""
    messages = [errors["dense into moe"] for errors in runs["errors on every rank"]]
    assert messages[0] is not None and all(m == messages[0] for m in messages)
    assert "another model" in messages[0] and "local_experts" in messages[0]


def test_offline_expert_regrouping_matches_the_online_structure(runs):
    """Re-split expert groups are exactly the groups an online save of the target ep records."""
    root = runs["root"]
    ep1, ep2 = read_index(resolve(root / "moe_ep1")), read_index(resolve(root / "moe_ep2"))
    assert retarget_groups(ep2.groups, NUM_EXPERTS, 1) == ep1.groups
    assert retarget_groups(ep1.groups, NUM_EXPERTS, 2) == ep2.groups
    assert read_index(root / "moe_ep2_to_ep1").groups == ep1.groups


@pytest.mark.parametrize(("name", "moe"), [("hsdp", False), ("moe_ep2", True)])
def test_export_equals_reference_parameters(runs, refs, tmp_path, name, moe):
    """Exported weights after step 2 are the reference model's state dict (parameters, frozen parameters,
    buffers), under its own names and in its own order."""
    _, params = refs[moe]
    out = tmp_path / "export"
    export(runs["root"] / name, out, "fp32", max_shard_bytes=2000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    loaded = {}
    for file in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(out / file))
    assert list(index["weight_map"]) == list(params[1])  # the model's own order
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in params[1].values())
    for key, value in params[1].items():
        torch.testing.assert_close(loaded[key], value, rtol=1e-5, atol=1e-6)


def test_round_trip_of_a_trained_checkpoint_is_byte_identical(runs, tmp_path):
    """MoE ep2 on 4 ranks -> ep1 on 3 ranks -> ep2 on 4 ranks: every tensor of every kind is byte-identical."""
    src = resolve(runs["root"] / "moe_ep2")
    reshard(src, tmp_path / "b", LayoutConfig(world_size=3, **MOE_3), io_threads=2)
    reshard(tmp_path / "b", tmp_path / "c", LayoutConfig(world_size=4, **MOE_EP2), io_threads=2)
    assert _tensors(src) == _tensors(tmp_path / "c")


def _tensors(path) -> dict[tuple[str, str], bytes]:
    index = read_index(path)
    out = {}
    with CheckpointReader(path, index) as reader:
        for kind, entries in index.tensors.items():
            for name, entry in entries.items():
                flat = torch.empty(math.prod(entry.shape), dtype=getattr(torch, entry.dtype))
                reader.read_into(kind, name, 0, flat)
                out[kind, name] = flat.view(torch.uint8).numpy().tobytes()
    return out
