"""DiLoCo as an outer strategy, on gloo ranks, against single-process references.

(a) inner SGD without momentum or clipping, H = 1, outer SGD with lr 1 and no momentum is HSDP with the same SGD
    (1e-7), on 2x2 (every inner strategy), 2x3 and 3x2;
(b) the sharded outer step is `torch.optim.SGD` (Nesterov) run on whole flat buffers in one process, bit for bit,
    for H in {2, 5}, fp32, bf16 and int8 exchanges, one fragment and two;
(c) the bytes counted on each axis are docs/formulas.md's: nothing on dp_outer between outer steps, α(R)(Ψ/N)b twice
    per outer step of a fragment, the inner axis as the inner strategy alone;
plus the outer state's memory, per-instance clipping, experts on their own outer axis, the DTensor views and misuse.
Two spawned groups run every case: 4 ranks (2x2) and 6 ranks (2x3, 3x2).
"""

from __future__ import annotations

import math

import pytest
import torch

from hfsdp.core.outer.outer_codec import Codec
from hfsdp.core.outer.outer_config import INT8_BLOCK, DiLoCoConfig
from hfsdp.core.outer.outer_sync import fragments
from hfsdp.core.rules.config import ConfigError, LayoutConfig

from tests.support.diloco import MICROBATCHES, OuterReference, assemble, diloco_run
from tests.support.distributed import run_distributed
from tests.support.toy_models import make_toy, microbatch

ZERO3 = "optim_grads_params"
INNERS = ("no_shard", "optim", "optim_grads", ZERO3)
STEPS_A = 3
#: (a): H = 1, outer lr 1, no momentum: exactly one HSDP step per step.
EQUIVALENT = DiLoCoConfig(sync_every=1, lr=1.0, momentum=0.0)
#: (b), (c): name -> (instances, inner, DiLoCo settings, steps).
OUTER_4 = {
    "fp32 H=2": (2, ZERO3, DiLoCoConfig(sync_every=2), 10),
    "fp32 H=5": (2, ZERO3, DiLoCoConfig(sync_every=5), 10),
    "bf16 H=4 F=2": (2, ZERO3, DiLoCoConfig(sync_every=4, comm_dtype="bf16", fragments=2), 8),
    "int8 H=2 over ZeRO-1": (2, "optim", DiLoCoConfig(sync_every=2, comm_dtype="int8", nesterov=False), 6),
}
OUTER_6 = {
    "2x3 fp32 H=2": (2, ZERO3, DiLoCoConfig(sync_every=2), 10),
    "3x2 fp32 H=5": (3, ZERO3, DiLoCoConfig(sync_every=5), 10),
    "3x2 int8 H=5 F=2": (3, ZERO3, DiLoCoConfig(sync_every=5, comm_dtype="int8", fragments=2), 10),
    "2x3 fp32 H=2 over DDP": (2, "no_shard", DiLoCoConfig(sync_every=2, fragments=2), 6),
}


def _plain_sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def _equivalence(rank, world, layouts):
    out = {}
    for inner, instances in layouts:
        for outer, diloco in (("no_shard", None), ("diloco", EQUIVALENT)):
            run = diloco_run(rank, world, (outer, inner, instances), diloco, STEPS_A, _plain_sgd, record=True)
            out[outer, inner, instances] = run
    return out


def _outer_runs(rank, world, cases):
    out = {}
    for name, (instances, inner, diloco, steps) in cases.items():
        out[name] = diloco_run(rank, world, ("diloco", inner, instances), diloco, steps, record=True)
    return out


def _clip_norms(rank, world):
    """At step 0 (the same weights everywhere) each instance's clip_grad_norm_ returns the norm of its own gradient."""
    import torch.distributed as dist

    from hfsdp.core import clip_grad_norm_

    from tests.support.diloco import shard_toy

    sharded = shard_toy(world, "diloco", ZERO3, 3, DiLoCoConfig(sync_every=2))
    for index in range(MICROBATCHES):
        sharded.set_microbatch(index, MICROBATCHES)
        sharded(*microbatch(0, index, MICROBATCHES, rank, world)).backward()
    norm = clip_grad_norm_(sharded, 1e9).item()
    sharded.zero_grad()
    dist.barrier()
    return norm


def _experts(rank, world):
    """The middle layer's parameters as experts on their own (diloco) mesh train as when they are dense."""
    import torch.distributed as dist

    from hfsdp.core import sharding_of

    from tests.support.diloco import shard_toy
    from tests.support.toy_models import OPTIMIZERS

    out = {}
    for experts in (False, True):
        mark = (lambda name, param: name.startswith("layers.1.")) if experts else None
        sharded = shard_toy(world, "diloco", ZERO3, 2, DiLoCoConfig(sync_every=2), is_expert=mark, experts=experts)
        opt = OPTIMIZERS["adamw"](sharded.parameters())
        for step in range(4):
            for index in range(MICROBATCHES):
                sharded.set_microbatch(index, MICROBATCHES)
                sharded(*microbatch(step, index, MICROBATCHES, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        state = {k: v.clone() for k, v in sharded.state_dict().items()}
        out[experts] = {
            "state": state,
            "expert groups": sum(g.is_expert for g in sharding_of(sharded).groups),
            "synced": sum(s.group.is_expert for s in sharding_of(sharded).outer.states),
        }
        dist.barrier()
    return out


def _views_and_sync(rank, world):
    """DTensor views are per instance; sync_outer() makes every instance hold the global weights."""
    import torch.distributed as dist

    from hfsdp.core import sharding_of

    from tests.support.diloco import shard_toy
    from tests.support.toy_models import OPTIMIZERS

    sharded = shard_toy(world, "diloco", ZERO3, 2, DiLoCoConfig(sync_every=10))
    opt = OPTIMIZERS["adamw"](sharded.parameters())
    for step in range(3):  # mid-cycle: the instances differ
        sharded(*microbatch(step, 0, 1, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    sharding = sharding_of(sharded)
    views = sharding.sharded_buffers()[0]
    main = views["main"].full_tensor()
    group = sharding.groups[0]
    own = torch.equal(main[group.optim_range[0] : group.optim_range[1]], group.main)
    before = main.clone()
    sharded.sync_outer()
    after = sharding.sharded_buffers()[0]["main"].full_tensor()
    sharded.sync_outer()  # every fragment is synced since the last step: nothing to do (no momentum step either)
    again = torch.equal(sharding.sharded_buffers()[0]["main"].full_tensor(), after)
    every = [None] * world
    dist.all_gather_object(every, (before, after))
    return {
        "mesh": tuple(views["main"].device_mesh.mesh_dim_names),
        "own": own,
        "every": every,
        "again": again,
    }


def _misuse(rank, world):
    """fully_shard refuses DiLoCo settings without a diloco layout, a diloco layout without them, and offload."""
    from hfsdp.core import fully_shard
    from hfsdp.core.engine.mesh import build_meshes

    out = {}
    cases = {
        "no settings": (LayoutConfig(world_size=world, outer="diloco", instances=2), None, False),
        "no diloco layout": (LayoutConfig(world_size=world, outer="no_shard", instances=2), EQUIVALENT, False),
        "offload": (LayoutConfig(world_size=world, outer="diloco", instances=2), EQUIVALENT, True),
    }
    for name, (cfg, diloco, offload) in cases.items():
        model = make_toy()
        try:
            fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), diloco=diloco, offload=offload)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    return out


def _world4(rank, world):
    return {
        "equivalence": _equivalence(rank, world, [(inner, 2) for inner in INNERS]),
        "outer": _outer_runs(rank, world, OUTER_4),
        "experts": _experts(rank, world),
        "views": _views_and_sync(rank, world),
        "misuse": _misuse(rank, world),
    }


def _world6(rank, world):
    return {
        "equivalence": _equivalence(rank, world, [(ZERO3, 2), (ZERO3, 3)]),
        "outer": _outer_runs(rank, world, OUTER_6),
        "clip": _clip_norms(rank, world),
    }


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_world4, 4)


@pytest.fixture(scope="module")
def world6():
    return run_distributed(_world6, 6)


def _world(request, name):
    return request.getfixturevalue(name)


# -- (a) H = 1, outer lr 1: HSDP ------------------------------------------------------------------------------------

EQUIVALENCE_CASES = [("world4", inner, 2) for inner in INNERS] + [("world6", ZERO3, 2), ("world6", ZERO3, 3)]


@pytest.mark.parametrize(("world", "inner", "instances"), EQUIVALENCE_CASES)
def test_h1_outer_lr1_equals_hsdp_with_the_same_sgd(request, world, inner, instances):
    """Inner SGD (no momentum, no clipping), H = 1, outer SGD lr 1 without momentum: every instance's weights after
    every step equal HSDP's with the same SGD to 1e-7, on every inner strategy (2x2) and on 2x3 and 3x2."""
    ranks = _world(request, world)
    hsdp = [r["equivalence"]["no_shard", inner, instances] for r in ranks]
    diloco = [r["equivalence"]["diloco", inner, instances] for r in ranks]
    torch.testing.assert_close(torch.tensor(diloco[0]["losses"]), torch.tensor(hsdp[0]["losses"]), rtol=1e-6, atol=0)
    for step in range(STEPS_A):
        for g in range(len(hsdp[0]["after"][step])):
            expected = assemble([r["after"][step] for r in hsdp], "main", g, 1)[0]
            for got in assemble([r["after"][step] for r in diloco], "main", g, instances):
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)


def test_diloco_sends_nothing_on_the_outer_axis_between_outer_steps_and_hsdp_does(world4):
    """With H = 1 every step syncs; the placements give the outer axis no gradient reduction: DiLoCo's dp_outer
    traffic is its all-to-all and all-gather, HSDP's its all-reduce."""
    hsdp = world4[0]["equivalence"]["no_shard", ZERO3, 2]["comms"][0]
    diloco = world4[0]["equivalence"]["diloco", ZERO3, 2]["comms"][0]
    assert {op for op, axis, *_ in hsdp if axis == "dp_outer"} == {"all_reduce"}
    assert {op for op, axis, *_ in diloco if axis == "dp_outer"} == {"all_to_all", "all_gather"}


# -- (b) the outer step against torch.optim.SGD on whole buffers ------------------------------------------------------

OUTER_CASES = [("world4", name) for name in OUTER_4] + [("world6", name) for name in OUTER_6]


def _config(world, name):
    return (OUTER_4 if world == "world4" else OUTER_6)[name]


@pytest.mark.parametrize(("world", "name"), OUTER_CASES)
def test_sharded_outer_step_equals_unsharded_sgd_bit_for_bit(request, world, name):
    """At every outer step, each rank's global weights, outer momentum and anchor, and every instance's new weights,
    are bit for bit what torch.optim.SGD (Nesterov unless said) computes on the whole flat buffers in one process
    from the instances' weights right before the step; between outer steps the global weights do not move."""
    instances, _, diloco, steps = _config(world, name)
    ranks = [r["outer"][name] for r in _world(request, world)]
    groups = len(ranks[0]["initial"])
    pieces = ranks[0]["initial"][0]["padded"] // (
        ranks[0]["initial"][0]["outer_range"][1] - ranks[0]["initial"][0]["outer_range"][0]
    )
    initial = [assemble([r["initial"] for r in ranks], "main", g, instances)[0] for g in range(groups)]
    reference = OuterReference(initial, diloco, pieces, instances)
    fragment = [ranks[0]["initial"][g]["fragment"] for g in range(groups)]
    syncs = 0
    for step in range(steps):
        due = [g for g in range(groups) if fragment[g] in diloco.due(step + 1)]
        if due:
            syncs += 1
            before = [
                [dict(s, main=m) for s, m in zip(r["after"][step], r["before_outer"][step], strict=True)] for r in ranks
            ]
            local = {g: assemble(before, "main", g, instances) for g in due}
            new = reference.sync(due, local)
        for rank_states in (r["after"][step] for r in ranks):
            for g, state in enumerate(rank_states):
                lo, hi = state["outer_range"]
                assert torch.equal(state["theta"], reference.theta[g].detach()[lo:hi]), (step, g, "theta")
                momentum = reference.momentum(g)
                if momentum is not None:
                    assert torch.equal(state["momentum"], momentum[lo:hi]), (step, g, "momentum")
                if state["anchor"] is not None:
                    olo, ohi = state["optim_range"]
                    assert torch.equal(state["anchor"], reference.anchor[g][olo:ohi]), (step, g, "anchor")
                if g in due:
                    olo, ohi = state["optim_range"]
                    assert torch.equal(state["main"], new[g][olo:ohi]), (step, g, "new weights")
    assert syncs == sum(bool(diloco.due(t)) for t in range(1, steps + 1)) > 0


# -- (c) bytes on each axis; memory ------------------------------------------------------------------------------------


def _alpha(n: int) -> float:
    return (n - 1) / n


@pytest.mark.parametrize(("world", "name"), OUTER_CASES)
def test_counted_bytes_per_axis_equal_the_formula(request, world, name):
    """dp_outer: nothing between outer steps; at the outer step of a fragment, per group an all-to-all and an
    all-gather of α(R)·(Ψ_g/N)·b bytes each (b = 4 fp32, 2 bf16, (L + 4⌈L/128⌉)/L int8 for the L elements of one
    rank's piece). dp_shard: the inner strategy's own traffic, as in HSDP's formula without its outer term."""
    instances, inner, diloco, steps = _config(world, name)
    ranks = _world(request, world)
    size = len(ranks)
    n = size // instances
    for rank, result in enumerate(ranks):
        run = result["outer"][name]
        geometry = run["initial"]
        for step in range(steps):
            records = run["comms"][step]
            due = diloco.due(step + 1)
            expected = 0.0
            for g in geometry:
                if g["fragment"] in due:
                    length = g["outer_range"][1] - g["outer_range"][0]
                    row = {"fp32": 4 * length, "bf16": 2 * length}.get(
                        diloco.comm_dtype, length + 4 * math.ceil(length / INT8_BLOCK)
                    )
                    expected += 2 * _alpha(instances) * instances * row
            outer = sum(_bytes(r) for r in records if r[1] == "dp_outer")
            assert outer == pytest.approx(expected, rel=1e-12, abs=0), (rank, step)
            assert {r[0] for r in records if r[1] == "dp_outer"} <= {"all_to_all", "all_gather"}
            inner_bytes = sum(_bytes(r) for r in records if r[1] == "dp_shard")
            assert inner_bytes == pytest.approx(_inner_formula(inner, geometry, n), rel=1e-12), (rank, step)


def _bytes(record) -> float:
    op, _, size, numel, element = record
    return (2 if op == "all_reduce" else 1) * _alpha(size) * numel * element


def _inner_formula(inner, geometry, n, b=4) -> float:
    """docs/formulas.md's inner column in fp32, per buffer (the root keeps its gathered parameters through backward;
    ZeRO-1/2 gather the new weights once a step, after the outer step where there is one)."""
    total = 0.0
    for g in geometry:
        padded = g["padded"]
        if inner == "no_shard":
            total += 2 * _alpha(n) * padded * b
        elif inner == "optim":
            total += _alpha(n) * padded * (b + b)
        elif inner == "optim_grads":
            total += _alpha(n) * padded * (MICROBATCHES * b + b)
        else:
            total += _alpha(n) * padded * MICROBATCHES * ((1 if g["root"] else 2) * b + b)
    return total


@pytest.mark.parametrize(("world", "name"), OUTER_CASES)
def test_outer_state_is_8_bytes_per_element_of_one_ranks_outer_piece(request, world, name):
    """θ_g and the momentum take 8·Ψ/(N·R) bytes a rank (4 without momentum), plus 4·Ψ/N for the anchor of a
    lossy exchange: never the 8·Ψ/N of a full copy."""
    _, _, diloco, _ = _config(world, name)
    for result in _world(request, world):
        run = result["outer"][name]
        per_element = 8 if diloco.momentum > 0 else 4
        expected = sum(
            per_element * (g["outer_range"][1] - g["outer_range"][0])
            + (4 * (g["optim_range"][1] - g["optim_range"][0]) if diloco.anchored else 0)
            for g in run["initial"]
        )
        assert run["outer_bytes"] == expected


def test_inner_state_is_hsdp_s(world4, world6):
    """The engine's own buffers of a DiLoCo layout are those of HSDP on the same mesh: the outer strategy adds only
    the outer state."""
    for ranks, cases in ((world4, [(inner, 2) for inner in INNERS]), (world6, [(ZERO3, 2), (ZERO3, 3)])):
        for inner, instances in cases:
            for r in ranks:
                eq = r["equivalence"]
                assert eq["diloco", inner, instances]["state_bytes"] == eq["no_shard", inner, instances]["state_bytes"]


# -- fragments, the codec ----------------------------------------------------------------------------------------------


def test_fragments_are_contiguous_non_empty_and_balanced():
    """Units are cut into F contiguous runs, none empty, minimising the largest run (checked against every cut)."""
    import itertools

    sizes = [5, 1, 1, 8, 2, 2, 7]
    for count in range(1, len(sizes) + 1):
        got = fragments(sizes, count)
        assert got == sorted(got) and set(got) == set(range(count))
        largest = max(sum(s for s, f in zip(sizes, got, strict=True) if f == k) for k in range(count))
        best = min(
            max(sum(sizes[a:b]) for a, b in itertools.pairwise((0, *cuts, len(sizes))))
            for cuts in itertools.combinations(range(1, len(sizes)), count - 1)
        )
        assert largest == best
    with pytest.raises(ValueError, match="more than the model's 7 units"):
        fragments(sizes, 8)


def test_fragments_sync_at_staggered_steps_once_per_cycle():
    """Each fragment syncs once every H steps, at its own offset; with F = 1 every H steps."""
    assert [t for t in range(1, 13) if DiLoCoConfig(sync_every=4).due(t)] == [4, 8, 12]
    cfg = DiLoCoConfig(sync_every=6, fragments=3)
    assert [(t, cfg.due(t)) for t in range(1, 13) if cfg.due(t)] == [
        (2, [0]),
        (4, [1]),
        (6, [2]),
        (8, [0]),
        (10, [1]),
        (12, [2]),
    ]


def test_codec_fp32_is_exact_and_bf16_rounds_to_nearest_even():
    """fp32 rows travel as they are; bf16 rows as torch's round-to-nearest-even cast."""
    rows = torch.randn(3, 300)
    assert torch.equal(Codec("fp32", 300).decode(Codec("fp32", 300).encode(rows)), rows)
    bf16 = Codec("bf16", 300)
    assert torch.equal(bf16.decode(bf16.encode(rows)), rows.to(torch.bfloat16).float())


def test_codec_int8_is_per_block_scaled_rounding():
    """int8: per block of 128 elements of a row (the last shorter), q = round(x / (max|x| / 127)) and back; each
    element within half a step of the block; a zero block stays zero. Checked against a plain loop."""
    torch.manual_seed(0)
    rows = torch.randn(2, 300) * torch.tensor([[1.0], [1e-3]])
    rows[1, 256:] = 0
    codec = Codec("int8", 300)
    payload = codec.encode(rows)
    assert payload.dtype == torch.uint8 and payload.shape == (2, 300 + 4 * 3)
    got = codec.decode(payload)
    for r in range(2):
        for start in range(0, 300, INT8_BLOCK):
            block = rows[r, start : start + INT8_BLOCK]
            amax = block.abs().max()
            scale = amax / 127 if amax > 0 else torch.tensor(1.0)
            expected = torch.round(block / scale).clamp(-127, 127) * scale
            assert torch.equal(got[r, start : start + INT8_BLOCK], expected)
            assert (got[r, start : start + INT8_BLOCK] - block).abs().max() <= scale / 2 + 1e-12


# -- clipping, experts, views, misuse --------------------------------------------------------------------------------


def test_each_instance_clips_by_its_own_gradient_norm(world6):
    """On 3x2 every instance's clip_grad_norm_ is the norm of the gradient of its own data's mean loss (the
    one-process model on that data), not a norm over all instances."""
    for o in range(3):
        model = make_toy()
        losses = [model(*microbatch(0, i, MICROBATCHES, r, 6)) for i in range(MICROBATCHES) for r in (2 * o, 2 * o + 1)]
        torch.stack(losses).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
        for rank in (2 * o, 2 * o + 1):
            assert world6[rank]["clip"] == pytest.approx(norm, rel=1e-5)
    assert len({round(world6[r]["clip"], 6) for r in range(6)}) == 3


def test_experts_train_apart_on_their_own_outer_axis_like_dense_weights(world4):
    """Parameters on the expert mesh (expert_outer diloco over the same instances) are synced the same way: the run
    equals the one where they are dense."""
    dense, experts = world4[0]["experts"][False], world4[0]["experts"][True]
    assert experts["expert groups"] == experts["synced"] == 1 and dense["expert groups"] == 0
    for key, value in dense["state"].items():
        torch.testing.assert_close(experts["state"][key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_views_are_per_instance_and_sync_outer_makes_the_instances_agree(world4):
    """Between outer steps a DTensor view lives on the instance's own mesh (dp_shard) and reassembles its weights;
    sync_outer() leaves every instance with the same weights, and a second call changes nothing."""
    views = [r["views"] for r in world4]
    assert all(v["mesh"] == ("dp_shard",) and v["own"] for v in views)
    before = [v["every"][rank][0] for rank, v in enumerate(views)]
    after = [v["every"][rank][1] for rank, v in enumerate(views)]
    assert not torch.equal(before[0], before[2])  # instances 0 and 1 differ mid-cycle
    assert all(torch.equal(a, after[0]) for a in after)
    assert all(v["again"] for v in views)


def test_fully_shard_refuses_diloco_misuse(world4):
    """Settings without a diloco layout, a diloco layout without settings, and offload are each one clear error."""
    misuse = world4[0]["misuse"]
    assert "DiLoCoConfig(sync_every=H)" in misuse["no settings"]
    assert "outer strategy is not 'diloco'" in misuse["no diloco layout"]
    assert "offload=True cannot be combined" in misuse["offload"]


# -- the vocabulary, without ranks -------------------------------------------------------------------------------------


def test_diloco_row_and_plan_give_the_outer_axis_no_per_step_collective():
    """diloco's row is Independent for param, grad and optim and Shard(0) for the outer state; the plan of diloco
    over ZeRO-3 has no outer reduction or gather, syncs over dp_outer, and a step reduces over N ranks."""
    from hfsdp.core.rules.comm_plan import plan_for
    from hfsdp.core.rules.layout import dense_layout
    from hfsdp.core.rules.placement_names import State

    layout = dense_layout(LayoutConfig(world_size=6, outer="diloco", instances=3))
    assert [layout.placement_names(s) for s in State] == [
        ("Independent()", "Shard(0)"),
        ("Independent()", "Shard(0)"),
        ("Independent()", "Shard(0)"),
        ("Shard(0)", "Shard(0)"),
    ]
    plan = plan_for(layout)
    assert plan.final_reduce == () and plan.post_step_gather == () and plan.outer_sync == (0,)
    assert plan.param_gather == (1,) and plan.microbatch_reduce == (1,)
    assert layout.reduced_size == 2 and layout.outer_bytes_per_param() == 8 / 6
    assert layout.outer_bytes_per_param(anchored=True) == 8 / 6 + 4 / 2
    assert layout.outer_bytes_per_param(momentum=False) == 4 / 6  # plain averaging keeps no momentum buffer


def test_diloco_config_rules():
    """DiLoCo is outer-only, needs R > 1, and with experts both meshes train apart over the same instances; its
    settings are checked with full sentences."""
    with pytest.raises(ConfigError, match="outer strategy only"):
        LayoutConfig(world_size=4, inner="diloco", instances=2)
    with pytest.raises(ConfigError, match="one instance has nothing to sync"):
        LayoutConfig(world_size=4, outer="diloco")
    with pytest.raises(ConfigError, match="experts must train apart"):
        LayoutConfig(world_size=4, outer="diloco", instances=2, num_moe_experts=2)
    LayoutConfig(
        world_size=4, outer="diloco", instances=2, num_moe_experts=2, expert_outer="diloco", expert_instances=2
    )
    for inner in INNERS:
        assert LayoutConfig(world_size=4, outer="diloco", inner=inner, instances=2).layout_name.startswith("DiLoCo")
    with pytest.raises(ConfigError) as info:
        DiLoCoConfig(sync_every=0, lr=-1, momentum=1.0, comm_dtype="fp8", fragments=0)
    assert [p.field for p in info.value.problems] == ["sync_every", "lr", "momentum", "comm_dtype", "fragments"]
    with pytest.raises(ConfigError, match="at most 4 fragments"):
        DiLoCoConfig(sync_every=4, fragments=5)
    assert not DiLoCoConfig(sync_every=1, momentum=0.0).uses_nesterov
