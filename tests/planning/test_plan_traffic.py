"""The planner's collectives of one step against the collectives counter of a real run, record for record.

One spawned gloo group per world size (4, 6, 8) runs every layout of the meshes 2x2, 2x3, 3x2,
2x4 and 4x2 (every valid pair of the four sharding strategies, and the four one-axis layouts of the world;
DiLoCo, which the planner does not propose, is counted against its formula in tests/core/outer/test_diloco.py) for one
optimizer step of two microbatches, counting every collective with `record_comms`. The toy
model's sizes are odd, so every group pads. The planner sees only the model's per-unit
parameter counts.
"""

from __future__ import annotations

import itertools

import pytest

from hfsdp.core.rules.config import LayoutConfig
from hfsdp.core.rules.strategy import Strategy
from hfsdp.planning.groups import groups_for
from hfsdp.planning.model_shape import ModelShape, UnitParams
from hfsdp.planning.traffic import bytes_per_axis, step_collectives

from tests.support.distributed import run_distributed

MICROBATCHES = 2
MESHES = {4: [(2, 2)], 6: [(2, 3), (3, 2)], 8: [(2, 4), (4, 2)]}
PAIRS = [(o, i) for o, i in itertools.product(Strategy.sharding(), Strategy.sharding()) if o.level <= i.level]


def _layouts(world: int) -> list[tuple[str, str, int]]:
    out = [("no_shard", inner.value, 1) for inner in Strategy.sharding()]
    out += [(o.value, i.value, r) for r, _ in MESHES[world] for o, i in PAIRS]
    return out


#: (compute dtype, root resharded after forward, units resharded after forward): bf16 with the root kept (the GPT's
#: default), fp32 with it freed, bf16 with every unit kept (`reshard_after_forward=False`).
VARIANTS = (("bf16", False, True), ("fp32", True, True), ("bf16", False, False))


def _count(rank, world):
    import torch
    import torch.distributed as dist

    from hfsdp.core import fully_shard
    from hfsdp.core.buffers.collectives import record_comms
    from hfsdp.core.buffers.mixed_precision import MixedPrecision
    from hfsdp.core.engine.mesh import build_meshes

    from tests.support.toy_models import make_toy, microbatch

    out = {}
    for (outer, inner, instances), (dtype, root_resharded, units_resharded) in itertools.product(
        _layouts(world), VARIANTS
    ):
        cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
        model = make_toy()
        mp = MixedPrecision(param_dtype=torch.bfloat16 if dtype == "bf16" else None, reduce_dtype=torch.float32)
        options = {"reshard_root_after_forward": root_resharded, "reshard_after_forward": units_resharded}
        sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp, **options)
        opt = torch.optim.AdamW(sharded.parameters())
        with record_comms() as log:
            for index in range(MICROBATCHES):
                sharded.set_microbatch(index, MICROBATCHES)
                sharded(*microbatch(0, index, MICROBATCHES, rank, world)).float().backward()
            opt.step()
        out[(outer, inner, instances, dtype, root_resharded, units_resharded)] = {
            "records": sorted((r.op, r.axis, r.group_size, r.numel, r.element_size) for r in log.records),
            "bytes": {axis: log.bytes_sent(axis) for axis in {r.axis for r in log.records}},
        }
        dist.barrier()
    return out


def _toy_shape() -> ModelShape:
    """The toy model as the planner sees it: the parameter count of each unit (its blocks, then the root)."""
    from tests.support.toy_models import make_toy

    model = make_toy()
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.layers]
    root = sum(p.numel() for p in model.parameters()) - sum(blocks)
    units = [UnitParams(f"layers.{i}", n) for i, n in enumerate(blocks)] + [UnitParams("root", root)]
    return ModelShape("toy", len(blocks), 16, 1, 1, 16, 13, 1, "LayerNorm", False, tuple(units))


@pytest.fixture(scope="module", params=sorted(MESHES))
def counted(request):
    world = request.param
    return world, run_distributed(_count, world)


def test_planned_collectives_equal_the_counted_ones(counted):
    """For every layout, dtype and reshard policy (root, units), the planner's collectives of a step are the
    counted ones, exactly (op, axis, group size, elements, element size), and so are the bytes per axis, padding
    included."""
    world, ranks = counted
    shape = _toy_shape()
    checked = 0
    for key, case in ranks[0].items():
        outer, inner, instances, dtype, root_resharded, units_resharded = key
        cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
        planned = step_collectives(groups_for(shape, cfg), MICROBATCHES, 2 if dtype == "bf16" else 4, 4,
                                   root_resharded=root_resharded, units_resharded=units_resharded)  # fmt: skip
        assert sorted(c.record() for c in planned) == case["records"], key
        by_axis = bytes_per_axis(planned)
        assert set(by_axis) == set(case["bytes"]), key
        for axis, sent in case["bytes"].items():
            assert by_axis[axis] == pytest.approx(sent, rel=1e-12), (key, axis)
        checked += 1
    assert checked == len(_layouts(world)) * len(VARIANTS)
    for other in ranks[1:]:  # every rank sends the same: the plan is per rank, not rank 0's alone
        assert {k: v["records"] for k, v in other.items()} == {k: v["records"] for k, v in ranks[0].items()}
