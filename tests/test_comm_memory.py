"""Real bytes sent and model-state bytes held, against DESIGN.md §4's formulas (plus padding)."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

MICROBATCHES = 4
LAYOUTS = {
    "DDP": ("no_shard", "no_shard", 1),
    "ZeRO-1": ("no_shard", "optim", 1),
    "ZeRO-2": ("no_shard", "optim_grads", 1),
    "ZeRO-3": ("no_shard", "optim_grads_params", 1),
    "HSDP": ("no_shard", "optim_grads_params", 2),
    "HFSDP": ("optim", "optim_grads_params", 2),
    "ZeRO-1 over ZeRO-2": ("optim", "optim_grads", 2),
    "ZeRO-2 over ZeRO-3": ("optim_grads", "optim_grads_params", 2),
}


def _measure(rank, world):
    import torch.distributed as dist

    from hfsdp.core.collectives import record_comms
    from hfsdp.core.config import LayoutConfig
    from hfsdp.core.flat_group import MixedPrecision
    from hfsdp.core.mesh import build_meshes
    from hfsdp.core.optimizer import ShardedAdamW
    from hfsdp.core.sharded_model import fully_shard

    from toy_models import make_toy, microbatch

    out = {}
    for name, (outer, inner, instances) in LAYOUTS.items():
        cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
        model = make_toy()
        # Compute in bf16 and reduce in fp32, so the formula's b_p and b_g differ.
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp)
        opt = ShardedAdamW(sharded.groups)
        with record_comms() as log:
            for index in range(MICROBATCHES):
                sharded.set_microbatch(index, MICROBATCHES)
                sharded(*microbatch(0, index, MICROBATCHES, rank, world)).float().backward()
            opt.step()
        groups = [
            {"padded": g.padded, "root": g.unit_index == len(sharded.units) - 1, "state": g.state_bytes()}
            for g in sharded.groups
        ]
        out[name] = {
            "records": [(r.op, r.axis, r.group_size, r.numel, r.element_size) for r in log.records],
            "bytes": {axis: log.bytes_sent(axis) for axis in ("dp_shard", "dp_outer")},
            "outer_reductions": log.count("dp_outer", "reduce_scatter") + log.count("dp_outer", "all_reduce"),
            "outer_gathers": log.count("dp_outer", "all_gather"),
            "groups": groups,
            "optim_state": opt.state_bytes(),
        }
        dist.barrier()
    # Memory in the formula's own precision: bf16 params and grads, fp32 main weights and Adam.
    for name, (outer, inner, instances) in LAYOUTS.items():
        cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
        model = make_toy()
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp)
        opt = ShardedAdamW(sharded.groups)
        out[name]["memory"] = sharded.state_bytes() + opt.state_bytes()
        out[name]["padded_total"] = sum(g.padded for g in sharded.groups)
    return out


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_measure, 4)


def _alpha(n: int) -> float:
    return (n - 1) / n


def _expected_inner(name: str, padded: int, root: bool, n: int, m: int, b_p: int = 2, b_g: int = 4) -> float:
    """DESIGN.md §4's inner-axis bytes for one buffer; the root keeps its parameters through backward (one gather)."""
    kind = LAYOUTS[name][1]
    if kind == "no_shard":
        return 2 * _alpha(n) * padded * b_g
    if kind == "optim":
        return _alpha(n) * padded * (b_g + b_p)
    if kind == "optim_grads":
        return _alpha(n) * padded * (m * b_g + b_p)
    gathers = 1 if root else 2
    return _alpha(n) * padded * m * (gathers * b_p + b_g)


@pytest.mark.parametrize("name", ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "HSDP", "HFSDP"])
def test_inner_axis_bytes_match_the_formula(measured, name):
    """Bytes each rank sends over dp_shard in one step of 4 microbatches equal §4's table, buffer by buffer."""
    n = 4 if LAYOUTS[name][2] == 1 else 2
    for result in measured:
        case = result[name]
        expected = sum(_expected_inner(name, g["padded"], g["root"], n, MICROBATCHES) for g in case["groups"])
        assert case["bytes"]["dp_shard"] == pytest.approx(expected, rel=1e-12)


def test_outer_axis_bytes_match_the_formula(measured):
    """HSDP all-reduces the inner shard over dp_outer (2α(R)Ψ/N·b_g); HFSDP reduce-scatters and all-gathers it."""
    for result in measured:
        shard = sum(g["padded"] for g in result["HSDP"]["groups"]) / 2
        assert result["HSDP"]["bytes"]["dp_outer"] == pytest.approx(2 * _alpha(2) * shard * 4)
        assert result["HFSDP"]["bytes"]["dp_outer"] == pytest.approx(_alpha(2) * shard * (4 + 2))
        for one_instance in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"):
            assert result[one_instance]["bytes"]["dp_outer"] == 0


@pytest.mark.parametrize("name", ["HSDP", "HFSDP", "ZeRO-1 over ZeRO-2", "ZeRO-2 over ZeRO-3"])
def test_outer_axis_reduces_once_per_step(measured, name):
    """With 4 microbatches each buffer sees exactly one gradient reduction over dp_outer per optimizer step."""
    for result in measured:
        case = result[name]
        assert case["outer_reductions"] == len(case["groups"])
        gathers_after_step = 0 if name == "HSDP" else len(case["groups"])
        assert case["outer_gathers"] == gathers_after_step


@pytest.mark.parametrize("name", ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "HSDP", "HFSDP", "ZeRO-1 over ZeRO-2"])
def test_model_state_bytes_match_the_formula(measured, name):
    """Per-rank params, grads, main weights and Adam state take Ψ·(2/s_p + 2/s_g + 12/s_o) bytes, padding included."""
    from hfsdp.core.config import LayoutConfig
    from hfsdp.core.layout import dense_layout

    outer, inner, instances = LAYOUTS[name]
    layout = dense_layout(LayoutConfig(world_size=4, inner=inner, outer=outer, instances=instances))
    for result in measured:
        assert result[name]["memory"] == pytest.approx(result[name]["padded_total"] * layout.bytes_per_param())


def test_outer_grad_sharding_keeps_the_inner_gradient_shard(measured):
    """With an outer axis that shards grads, the gradient buffer stays at the inner shard (Ψ/N) between microbatches.

    The outer reduction happens once per step, so the buffer cannot shrink to Ψ/(N·R) before the last
    microbatch; the memory formula's 2/s_g term is then 2/N, which is what is measured.
    """
    for result in measured:
        case = result["ZeRO-2 over ZeRO-3"]
        padded = case["padded_total"]
        expected = padded * (2 / 2 + 2 / 2 + 12 / 4)
        assert case["memory"] == pytest.approx(expected)


def test_hfsdp_holds_less_than_hsdp(measured):
    """HFSDP's model state per rank is smaller than HSDP's on the same 2x2 mesh (4/N + 12/(N·R) < 16/N)."""
    for result in measured:
        assert result["HFSDP"]["memory"] < result["HSDP"]["memory"]
        torch.testing.assert_close(
            torch.tensor(result["HFSDP"]["memory"] / result["HSDP"]["memory"]),
            torch.tensor((4 / 2 + 12 / 4) / (16 / 2)),
        )
