"""`hfsdp plan --store-param-remainders`: the fp32 main weights as the bf16 shard plus a 16-bit remainder, counted in
every layout, against measured bytes and against docs/formulas.md's rule by hand.

Measured: one spawned gloo group of 6 ranks shards the toy model (odd sizes: every group pads) on DDP, ZeRO-1,
ZeRO-2 and ZeRO-3 over 6, HSDP 2x3 and HFSDP 2x3 and 3x2, bf16 compute, with `FusedAdamW` as `hfsdp train` builds it
(`store_param_remainders` on and off), and takes one optimizer step. On rank 0, the engine's model-state bytes
(`Sharding.state_bytes()`: the kept bf16 shard, the gradient piece, the fp32 main weights or their remainders)
equal the planner's parameters, gradients and optimizer state less the moments, exactly, padding included; and the
groups whose whole buffer is built each time their unit runs are the planner's `transient_unsharded` ones (with
remainders, a group that gathers nothing computes with its kept shard itself).

By hand: the 70B Llama on 1,024 x 8 GPUs (no padding), where remainders save 2 bytes per element of the optimizer
piece beside a kept bf16 shard (HFSDP, ZeRO-1/2: 2/8,192 bytes per parameter over the whole domain) and leave the
model state of HSDP, ZeRO-3 and DDP as it was.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hfsdp.cli.main import app
from hfsdp.core.rules.config import LayoutConfig
from hfsdp.planning.activations import Activations
from hfsdp.planning.groups import groups_for, kinds
from hfsdp.planning.memory import Settings, memory, moment_bytes, transient_unsharded

from tests.cli.commands.test_plan import LLAMA_70B, NODES, _hand_70b
from tests.planning.test_plan_traffic import _toy_shape
from tests.support.distributed import run_distributed

WORLD, MICROBATCHES = 6, 2
#: name -> (outer, inner, instances) on 6 ranks.
LAYOUTS = {
    "DDP x6": ("no_shard", "no_shard", 1),
    "ZeRO-1 x6": ("no_shard", "optim", 1),
    "ZeRO-2 x6": ("no_shard", "optim_grads", 1),
    "ZeRO-3 x6": ("no_shard", "optim_grads_params", 1),
    "HSDP 2x3": ("no_shard", "optim_grads_params", 2),
    "HFSDP 2x3": ("optim", "optim_grads_params", 2),
    "HFSDP 3x2": ("optim", "optim_grads_params", 3),
}
#: Where the parameter shard is larger than the optimizer piece, so a bf16 shard was kept beside the fp32 masters.
SAVES = {"ZeRO-1 x6", "ZeRO-2 x6", "HFSDP 2x3", "HFSDP 3x2"}


def _measure(rank, world):
    import torch
    import torch.distributed as dist

    from hfsdp.core import FusedAdamW, MixedPrecision, build_meshes, fully_shard, sharding_of

    from tests.support.toy_models import make_toy, microbatch

    out = {}
    for name, (outer, inner, instances) in LAYOUTS.items():
        for remainders in (False, True):
            cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
            model = make_toy()
            mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp)
            opt = FusedAdamW(sharded.parameters(), lr=1e-2, backend="torch", prestage_gathers=True,
                             store_param_remainders=remainders)  # fmt: skip
            for index in range(MICROBATCHES):
                sharded.set_microbatch(index, MICROBATCHES)
                sharded(*microbatch(0, index, MICROBATCHES, rank, world)).float().backward()
            opt.step()
            opt.zero_grad()
            sharding = sharding_of(sharded)
            out[(name, remainders)] = {
                "state_bytes": sharding.state_bytes(),
                "remainders": [g.remainder is not None for g in sharding.groups],
                # unit -> whether its whole buffer is built when it runs, and whether it is the kept shard itself
                "transient": {g.unit_index: g.transient_unsharded for g in sharding.groups},
                "shard_is_unsharded": {
                    g.unit_index: g.param_shard is not None
                    and g.unsharded.untyped_storage().data_ptr() == g.param_shard.untyped_storage().data_ptr()
                    for g in sharding.groups
                },
            }
            dist.barrier()
    return out


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_measure, WORLD)


def _planned(name: str, remainders: bool) -> tuple[int, dict[int, bool]]:
    """The planner's model-state bytes on rank 0 without the moments (parameters, gradients, main weights), and
    which units' buffers are transient."""
    outer, inner, instances = LAYOUTS[name]
    cfg = LayoutConfig(world_size=WORLD, inner=inner, outer=outer, instances=instances)
    shape = _toy_shape()
    groups = groups_for(shape, cfg)
    run = Settings(seq=1, micro_batch=1, microbatches=MICROBATCHES, compute_bytes=2, store_param_remainders=remainders)
    mem = memory(shape, groups, Activations(0, 0, 0, 0, True), run)
    moments = sum(n * 2 * moment_bytes("fp32", g.optim_real) for g, n in kinds(groups))
    grads = sum(g.grad_len * run.reduce_bytes for g in groups)
    transient = {g.unit: transient_unsharded(g, 2, False, remainders) for g in groups}
    return mem.params + grads + mem.optimizer - moments, transient


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_planned_model_state_is_the_measured_one_with_and_without_remainders(measured, name):
    for remainders in (False, True):
        case = measured[0][(name, remainders)]
        assert all(case["remainders"]) if remainders else not any(case["remainders"])
        planned, transient = _planned(name, remainders)
        assert case["state_bytes"] == planned, (name, remainders)
        assert case["transient"] == transient, (name, remainders)
    for rank in measured[1:]:  # every rank's pieces are padded to the same length
        assert rank[(name, True)]["state_bytes"] == measured[0][(name, True)]["state_bytes"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_remainders_save_2_bytes_per_optimizer_element_only_beside_a_kept_shard(measured, name):
    """ZeRO-1/2 and HFSDP: 2 bytes per element of rank 0's optimizer piece less; ZeRO-3, HSDP and DDP: the same bytes.
    Where nothing is gathered (DDP, ZeRO-1/2) the units compute with the kept shard itself: DDP's, which cast its
    fp32 main weights into a buffer each time a unit ran, now does too."""
    outer, inner, instances = LAYOUTS[name]
    cfg = LayoutConfig(world_size=WORLD, inner=inner, outer=outer, instances=instances)
    groups = groups_for(_toy_shape(), cfg)
    optim = sum(g.optim_len for g in groups)
    saved = measured[0][(name, False)]["state_bytes"] - measured[0][(name, True)]["state_bytes"]
    assert saved == (2 * optim if name in SAVES else 0), name
    gathered = {g.unit: g.gathers_params for g in groups}
    assert measured[0][(name, True)]["shard_is_unsharded"] == {u: not g for u, g in gathered.items()}, name
    if name == "DDP x6":
        assert not any(measured[0][(name, False)]["shard_is_unsharded"].values())


# -- the 70B Llama on 1,024 x 8, by hand ----------------------------------------------------------------------------

BASE = ["--nodes", str(NODES), "--seq-len", "4096", "--micro-batch-size", "1", "--dtype", "bf16", "--recompute"]
PRECISION = ["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16",
             "--exp-avg-sq-dtype", "bf16"]  # fmt: skip
GPUS = 8


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[bool, dict]:
    path = tmp_path_factory.mktemp("llama70b") / "config.json"
    path.write_text(json.dumps(LLAMA_70B))
    out = {}
    for remainders in (False, True, None):  # None: unset, the precision-aware optimizer's default
        flags = {False: ["--no-store-param-remainders"], True: ["--store-param-remainders"], None: []}[remainders]
        args = ["plan", "--model-config", str(path), *BASE, *PRECISION, *flags, "--format", "json"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        out[remainders] = json.loads(result.output)
    return out


def _memory(plan: dict, name: str) -> dict:
    (row,) = [r for r in plan["layouts"] if r["layout"] == name]
    return row["memory_bytes"]


def _state(memory: dict) -> int:
    return memory["params"] + memory["grads"] + memory["optimizer"]


def test_70b_hfsdp_zero1_and_zero2_save_2_bytes_per_element_of_the_optimizer_piece(plans):
    """HFSDP 1024x8 keeps its bf16 shard over 8 and its remainder over 8,192; ZeRO-1/2 over all 8,192 ranks keep the
    bf16 parameters whole (s_p = 1) and the remainder over 8,192: 2Ψ/8,192 bytes less each."""
    *_, layer, root = _hand_70b()
    psi = 80 * layer + root
    world = NODES * GPUS
    for name in ("HFSDP 1024x8", "ZeRO-1 1x8192", "ZeRO-2 1x8192"):
        before, after = _memory(plans[False], name), _memory(plans[True], name)
        assert after["params"] == before["params"], name
        assert before["optimizer"] - after["optimizer"] == 2 * psi // world, name
        assert after["comm_buffers"] == before["comm_buffers"], name
    hfsdp = _memory(plans[True], "HFSDP 1024x8")
    assert hfsdp["params"] == 2 * psi // GPUS
    # bf16 moments and the remainder: 2 + 2 + 2 bytes per element of rank 0's optimizer piece.
    assert hfsdp["optimizer"] == sum(n * 6 * e for e, n in [(layer // world, 80), (root // world, 1)])


def test_70b_hsdp_zero3_and_ddp_keep_the_same_model_state(plans):
    """Where no bf16 shard was kept (s_p = s_o), the shard (2 bytes) and the remainder (2) replace the fp32 main
    weights (4): the same model state. HSDP and ZeRO-3 still gather each unit; DDP's units compute with the kept
    shard, so its cast buffers are gone."""
    *_, layer, root = _hand_70b()
    psi = 80 * layer + root
    for name, shards in (("HSDP 1024x8", GPUS), ("ZeRO-3 1x8192", NODES * GPUS), ("DDP 1x8192", 1)):
        before, after = _memory(plans[False], name), _memory(plans[True], name)
        assert _state(after) == _state(before), name
        assert before["params"] == 0 and after["params"] == 2 * psi // shards, name
        if name == "DDP 1x8192":
            assert before["comm_buffers"] > 0 and after["comm_buffers"] == 0
        else:
            assert after["comm_buffers"] == before["comm_buffers"], name


def test_the_plan_says_it_planned_remainders(plans, tmp_path):
    assert plans[True]["step"]["store_param_remainders"] is True
    assert plans[False]["step"]["store_param_remainders"] is False
    assert plans[None] == plans[True]  # as Megatron's, on by default with the precision-aware optimizer
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_70B))
    args = ["plan", "--model-config", str(path), *BASE, *PRECISION, "--store-param-remainders"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "fp32 main weights kept as the bf16 shard plus a 16-bit remainder." in result.output


def test_plan_refuses_remainders_as_train_does(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_70B))
    result = CliRunner().invoke(app, ["plan", "--model-config", str(path), *BASE, "--store-param-remainders"])
    assert result.exit_code == 1
    assert "--store-param-remainders true keeps the fp32 main weights" in result.output
    assert "add --use-precision-aware-optimizer" in result.output
