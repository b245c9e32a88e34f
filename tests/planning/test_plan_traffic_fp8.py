"""The planner's collectives with the fp8 gather against the collectives counter of real runs, record for record.

One spawned gloo group of 6 ranks trains the fp8 toy (tests/support/fp8_models.py: three units of 3,440
parameters, 3,072 of them the weights of two Float8Linear layers, hybrid tensorwise, bf16 compute, converted with
`min_size=0`: at the default size rule the toy's layers would all stay bf16) on every
layout of 6 ranks (the four one-axis layouts, and every valid pair of sharding strategies on 2x3 and 3x2:
ZeRO-3 x6, HSDP 2x3, HFSDP 3x2 and 2x3 among them), with `fp8_param_gather` on and off, for two optimizer steps of
two microbatches, counting each step's collectives with `record_comms`. The planner sees only each unit's
parameter count and its fp8 weights (elements and how many), and predicts every collective of a step: the fp8
group's gathers at one byte per element, its amax all-reduce (one fp32 per weight, once per step, over each axis
that shards parameters), the rest at the compute dtype's two bytes. Each step's records and bytes per axis equal
the prediction exactly, the first step (whose amaxes are the initial weights') and the second alike.
"""

from __future__ import annotations

import itertools

import pytest

from hfsdp.core.rules.config import LayoutConfig
from hfsdp.core.rules.strategy import Strategy
from hfsdp.planning.groups import groups_for
from hfsdp.planning.model_shape import ModelShape, UnitParams
from hfsdp.planning.traffic import AMAX, bytes_per_axis, step_collectives

from tests.support.distributed import run_distributed

WORLD, STEPS, MICROBATCHES = 6, 2, 2
PAIRS = [(o, i) for o, i in itertools.product(Strategy.sharding(), Strategy.sharding()) if o.level <= i.level]
LAYOUTS = [("no_shard", inner.value, 1) for inner in Strategy.sharding()]
LAYOUTS += [(o.value, i.value, r) for r in (2, 3) for o, i in PAIRS]
#: The four layouts issue 39 names, each with its units kept from forward to backward too, and FusedAdamW (whose
#: prestaged gathers leave the fp8 group alone) on two of them.
NAMED = {
    "ZeRO-3 x6": ("no_shard", "optim_grads_params", 1),
    "HSDP 2x3": ("no_shard", "optim_grads_params", 2),
    "HFSDP 3x2": ("optim", "optim_grads_params", 3),
    "HFSDP 2x3": ("optim", "optim_grads_params", 2),
}
#: (outer, inner, instances, fp8 gather, reshard units after forward, optimizer)
CASES = [(*layout, gather, True, "AdamW") for layout in LAYOUTS for gather in (True, False)]
CASES += [(*layout, gather, False, "AdamW") for layout in NAMED.values() for gather in (True, False)]
CASES += [(*NAMED[name], True, True, "FusedAdamW") for name in ("HFSDP 3x2", "HSDP 2x3")]


def _count(rank, world):
    import torch
    import torch.distributed as dist

    from hfsdp.core import Float8Config, FusedAdamW, MixedPrecision, build_meshes, convert_to_float8, fully_shard
    from hfsdp.core.buffers.collectives import record_comms

    from tests.support.fp8_models import make_fp8_toy, run_microbatches

    out = {}
    for case in CASES:
        outer, inner, instances, gather, resharded, optimizer = case
        cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
        model = make_fp8_toy()
        convert_to_float8(model, Float8Config("hybrid", "tensorwise"), units=list(model.layers), min_size=0)
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp,
                              reshard_after_forward=resharded, fp8_param_gather=gather)  # fmt: skip
        if optimizer == "FusedAdamW":
            opt = FusedAdamW(sharded.parameters(), lr=1e-2, backend="torch", prestage_gathers=True)
        else:
            opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
        steps = []
        for step in range(STEPS):
            with record_comms() as log:
                run_microbatches(sharded, step, rank, world, MICROBATCHES)
                opt.step()
            opt.zero_grad()
            steps.append(
                {
                    "records": sorted((r.op, r.axis, r.group_size, r.numel, r.element_size) for r in log.records),
                    "bytes": {axis: log.bytes_sent(axis) for axis in {r.axis for r in log.records}},
                }
            )
        out[case] = steps
        dist.barrier()
    return out


def _fp8_toy_shape() -> ModelShape:
    """The fp8 toy as the planner sees it: each unit's parameters, and the elements and number of its fp8 weights
    (what `convert_to_float8` converted, with the runs' min size: 0, as the toy's layers are far below the default);
    the root is everything else."""
    from hfsdp.core import Float8Config, convert_to_float8
    from hfsdp.core.fp8.linear import Float8Linear

    from tests.support.fp8_models import make_fp8_toy

    model = make_fp8_toy()
    convert_to_float8(model, Float8Config("hybrid", "tensorwise"), units=list(model.layers), min_size=0)
    units = []
    for i, block in enumerate(model.layers):
        weights = [m.weight for m in block.modules() if isinstance(m, Float8Linear)]
        total = sum(p.numel() for p in block.parameters())
        units.append(UnitParams(f"layers.{i}", total, fp8=sum(w.numel() for w in weights), fp8_weights=len(weights)))
    root = sum(p.numel() for p in model.parameters()) - sum(u.dense for u in units)
    units.append(UnitParams("root", root))
    return ModelShape("toy", len(units) - 1, 32, 1, 1, 32, 48, 1, "LayerNorm", False, tuple(units))


@pytest.fixture(scope="module")
def counted():
    return run_distributed(_count, WORLD, timeout=900)


def test_the_toys_fp8_weights_are_most_of_each_unit():
    shape = _fp8_toy_shape()
    assert [(u.dense, u.fp8, u.fp8_weights) for u in shape.units[:-1]] == [(3440, 3072, 2)] * 3
    assert shape.root.dense == 321 and shape.root.fp8 == 0


def test_planned_fp8_collectives_equal_the_counted_ones(counted):
    """Every layout of 6 ranks, fp8 gather on and off, units resharded or kept, AdamW or FusedAdamW: each step's
    planned collectives are the counted ones exactly (op, axis, group size, elements, element size), and so are the
    bytes per axis, padding included; every rank sends the same."""
    shape = _fp8_toy_shape()
    for case, steps in counted[0].items():
        outer, inner, instances, gather, resharded, _ = case
        cfg = LayoutConfig(world_size=WORLD, inner=inner, outer=outer, instances=instances)
        planned = step_collectives(groups_for(shape, cfg, gather), MICROBATCHES, 2, 4, units_resharded=resharded)
        by_axis = bytes_per_axis(planned)
        for step in steps:
            assert sorted(c.record() for c in planned) == step["records"], case
            assert set(by_axis) == set(step["bytes"]), case
            for axis, sent in step["bytes"].items():
                assert by_axis[axis] == pytest.approx(sent, rel=1e-12), (case, axis)
    assert len(counted[0]) == len(CASES)
    for other in counted[1:]:
        assert other == counted[0]


def test_the_fp8_gathers_are_one_byte_and_the_amaxes_one_fp32_per_weight(counted):
    """On the four named layouts the fp8 group's gathers move one byte per element on each axis that gathers, the
    amax all-reduce is one per fp8 group and step of 2 fp32 per axis that shards the pieces quantized (the
    parameters', or on HFSDP the optimizer's: both axes), and the post-step gather (HFSDP's outer axis) moves one
    byte per element too."""
    shape = _fp8_toy_shape()
    for name, (outer, inner, instances) in NAMED.items():
        cfg = LayoutConfig(world_size=WORLD, inner=inner, outer=outer, instances=instances)
        groups = groups_for(shape, cfg, True)
        assert [g.numel for g in groups] == [3072, 368] * 3 + [321], name
        planned = step_collectives(groups, MICROBATCHES, 2, 4)
        fp8 = [c for c in planned if groups[c.group].fp8_weights]
        gathers = [c for c in fp8 if c.phase in ("forward", "backward")]
        assert len(gathers) == 3 * MICROBATCHES * 2 and {c.element_size for c in gathers} == {1}, name
        amax = [c for c in fp8 if c.phase == AMAX]
        axes = ("dp_outer", "dp_shard") if outer == "optim" else ("dp_shard",)
        found = sorted((c.op, c.axis, c.numel, c.element_size) for c in amax)
        assert found == sorted([("all_reduce", axis, 2, 4) for axis in axes] * 3), name
        post = {c.element_size for c in fp8 if c.phase == "post_step"}
        assert post == ({1} if outer == "optim" else set()), name
        step = counted[0][(outer, inner, instances, True, True, "AdamW")][-1]
        assert sorted(c.record() for c in planned) == step["records"], name


def test_the_inner_axis_sends_formulas_md_zero3_term_with_fp8_weights(counted):
    """dp_shard's measured bytes are docs/formulas.md's ZeRO-3 term with the fp8 weights apart, written out by hand
    from the padded groups: per microbatch α(N)·(gathers·(P_8·1 + P_c·b_p) + P·b_g) with two gathers per layer unit
    and one for the root (kept from forward to backward), plus per step 2·α(N)·4 bytes per fp8 weight."""
    shape = _fp8_toy_shape()
    for name, (outer, inner, instances) in NAMED.items():
        cfg = LayoutConfig(world_size=WORLD, inner=inner, outer=outer, instances=instances)
        groups = groups_for(shape, cfg, True)
        p8, pc, root = groups[0].padded, groups[1].padded, groups[-1].padded
        alpha = (cfg.inner_size - 1) / cfg.inner_size
        per_microbatch = 3 * 2 * (p8 * 1 + pc * 2) + root * 2 + (3 * (p8 + pc) + root) * 4
        by_hand = alpha * MICROBATCHES * per_microbatch + 2 * alpha * 4 * 3 * 2
        measured = counted[0][(outer, inner, instances, True, True, "AdamW")][-1]["bytes"]["dp_shard"]
        assert measured == pytest.approx(by_hand, rel=1e-12), name
