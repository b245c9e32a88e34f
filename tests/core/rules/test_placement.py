"""The placement table, the placements it composes for every layout, and the geometry of the meshes."""

from __future__ import annotations

import itertools

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from hfsdp.core.rules.config import ConfigError, LayoutConfig
from hfsdp.core.rules.layout import dense_layout, expert_layout
from hfsdp.core.rules.placement import PLACEMENT_TABLE, AxisPlacements, Independent, State, compose, describe, is_shard
from hfsdp.core.rules.strategy import Strategy

S = Strategy
ALL = list(Strategy.sharding())  # diloco's row is tested in test_diloco.py
R, P, S0 = Replicate(), Partial(), Shard(0)

#: What one axis of each strategy does to (param, grad, optim, outer), written out by hand from docs/formulas.md.
EXPECTED_AXIS = {
    S.NO_SHARD: (R, P, R, R),
    S.OPTIM: (R, P, S0, S0),
    S.OPTIM_GRADS: (R, S0, S0, S0),
    S.OPTIM_GRADS_PARAMS: (S0, S0, S0, S0),
    S.DILOCO: (Independent(), Independent(), Independent(), S0),
}


def hybrid(outer: Strategy, inner: Strategy, world_size: int = 4, instances: int = 2, **kwargs) -> LayoutConfig:
    return LayoutConfig(world_size=world_size, inner=inner, outer=outer, instances=instances, **kwargs)


# The table ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", list(Strategy))
def test_placement_table_row(strategy):
    """Each strategy's row places param, grad, optimizer and outer state as docs/formulas.md says."""
    row = PLACEMENT_TABLE[strategy]
    assert isinstance(row, AxisPlacements)
    assert (row.param, row.grad, row.optim, row.outer) == EXPECTED_AXIS[strategy]
    assert tuple(row.of(s) for s in State) == EXPECTED_AXIS[strategy]


def test_table_covers_exactly_the_four_strategies():
    """There is one row per strategy (the four and diloco) and no other."""
    assert set(PLACEMENT_TABLE) == set(Strategy)


def test_compose_accepts_names_and_keeps_outer_first():
    """compose takes strategy names too and puts the outer axis's placement first."""
    placements = compose(["optim", "optim_grads_params"])
    assert placements.param == (R, S0)
    assert placements.grad == (P, S0)
    assert placements.optim == (S0, S0)
    assert placements.of(State.OPTIM) == placements.optim


def test_describe_and_is_shard():
    """describe renders placements as people write them; is_shard is true only for Shard."""
    assert describe((R, S0)) == "(Replicate(), Shard(0))"
    assert describe((P, Shard(1))) == "(Partial(), Shard(1))"
    assert [is_shard(p) for p in (R, P, S0)] == [False, False, True]


# All 16 (outer, inner) pairs ----------------------------------------------------------------------


@pytest.mark.parametrize(("outer", "inner"), list(itertools.product(ALL, ALL)))
def test_every_outer_inner_pair(outer, inner):
    """A pair is rejected iff the outer axis shards more; otherwise its 2x2 placements are outer row then inner row."""
    if outer.level > inner.level:
        with pytest.raises(ConfigError) as info:
            hybrid(outer, inner)
        assert [p.field for p in info.value.problems] == ["outer"]
        assert "cross instances" in info.value.problems[0].message
        return
    mesh = dense_layout(hybrid(outer, inner))
    assert mesh.names == ("dp_outer", "dp_shard")
    assert mesh.shape == (2, 2)
    for k, state in enumerate(State):
        assert mesh.placements.of(state) == (EXPECTED_AXIS[outer][k], EXPECTED_AXIS[inner][k]), state


def test_hsdp_placements():
    """HSDP replicates parameters across instances and shards them inside one."""
    p = dense_layout(hybrid(S.NO_SHARD, S.OPTIM_GRADS_PARAMS)).placements
    assert (p.param, p.grad, p.optim) == ((R, S0), (P, S0), (R, S0))


def test_hfsdp_placements():
    """HFSDP shards optimizer state over both axes, parameters and gradients over the inner one only."""
    p = dense_layout(hybrid(S.OPTIM, S.OPTIM_GRADS_PARAMS)).placements
    assert (p.param, p.grad, p.optim) == ((R, S0), (P, S0), (S0, S0))
    assert describe(p.optim) == "(Shard(0), Shard(0))"


@pytest.mark.parametrize("inner", ALL)
def test_one_instance_gives_a_1d_mesh(inner):
    """With one instance the dense mesh is the 1-D ("dp_shard",) with the inner strategy's placements."""
    mesh = dense_layout(LayoutConfig(world_size=4, inner=inner))
    assert (mesh.names, mesh.shape) == (("dp_shard",), (4,))
    assert mesh.placements.param == (EXPECTED_AXIS[inner][0],)


@pytest.mark.parametrize(("outer", "inner"), [(o, i) for o, i in itertools.product(ALL, ALL) if o.level <= i.level])
def test_experts_never_get_an_outer_axis_by_default(outer, inner):
    """Expert parameters live on the 1-D ("expert_dp",) mesh with the inner strategy, whatever the dense outer axis."""
    mesh = expert_layout(hybrid(outer, inner, world_size=8, ep=2, num_moe_experts=4))
    assert (mesh.names, mesh.shape) == (("expert_dp",), (4,))
    for k, state in enumerate(State):
        assert mesh.placements.of(state) == (EXPECTED_AXIS[inner][k],)


@pytest.mark.parametrize("expert", ALL)
def test_expert_strategy_sets_expert_placements(expert):
    """An explicit expert strategy decides the expert placements independently of the dense ones."""
    cfg = hybrid(S.OPTIM, S.OPTIM_GRADS_PARAMS, world_size=8, ep=2, num_moe_experts=4, expert_strategy=expert)
    mesh = expert_layout(cfg)
    assert mesh.placements.optim == (EXPECTED_AXIS[expert][2],)
    assert mesh.placements.param == (EXPECTED_AXIS[expert][0],)


def test_expert_outer_axis_when_asked_for():
    """expert_instances > 1 gives experts their own ("expert_dp_outer", "expert_dp") mesh."""
    cfg = LayoutConfig(
        world_size=8, ep=2, num_moe_experts=4, expert_strategy="optim_grads", expert_instances=2, expert_outer="optim"
    )
    mesh = expert_layout(cfg)
    assert (mesh.names, mesh.shape) == (("expert_dp_outer", "expert_dp"), (2, 2))
    assert mesh.placements.optim == (S0, S0)
    assert mesh.placements.grad == (P, S0)


# Pieces and ranges on the 2x2 mesh ----------------------------------------------------------------


def test_coords_are_row_major():
    """Rank r sits at (r // N, r % N): row o holds the ranks of instance o."""
    assert dense_layout(hybrid(S.OPTIM, S.OPTIM_GRADS_PARAMS)).coords() == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize(("o", "i"), list(itertools.product(range(2), range(2))))
def test_hfsdp_pieces(o, i):
    """On HFSDP 2x2 the rank at (o, i) holds optimizer piece i*2+o of 4 and gradient/param piece i of 2."""
    mesh = dense_layout(hybrid(S.OPTIM, S.OPTIM_GRADS_PARAMS))
    assert mesh.piece(State.OPTIM, (o, i)) == (i * 2 + o, 4)
    assert mesh.piece(State.GRAD, (o, i)) == (i, 2)
    assert mesh.piece(State.PARAM, (o, i)) == (i, 2)


def test_replicated_state_is_one_piece():
    """A state no axis shards is the single piece 0 of 1 on every rank."""
    mesh = dense_layout(hybrid(S.NO_SHARD, S.NO_SHARD))
    assert {mesh.piece(s, c) for s in State for c in mesh.coords()} == {(0, 1)}


@pytest.mark.parametrize(("outer", "inner"), [(S.OPTIM, S.OPTIM_GRADS_PARAMS), (S.OPTIM_GRADS, S.OPTIM_GRADS)])
def test_optimizer_range_is_inside_gradient_range(outer, inner):
    """Each rank's optimizer range lies inside its gradient range, and the optimizer ranges tile the buffer."""
    mesh = dense_layout(hybrid(outer, inner))
    padded = mesh.padded_numel(10)
    assert padded == 12
    optim_ranges = []
    for coord in mesh.coords():
        g0, g1 = mesh.shard_range(State.GRAD, coord, padded)
        o0, o1 = mesh.shard_range(State.OPTIM, coord, padded)
        assert g0 <= o0 < o1 <= g1, coord
        optim_ranges.append((o0, o1))
    assert sorted(optim_ranges) == [(0, 3), (3, 6), (6, 9), (9, 12)]


def test_shard_range_of_hfsdp_rank():
    """The rank at (o=1, i=0) of HFSDP 2x2 holds gradient [0, 6) and optimizer [3, 6) of a 12-element buffer."""
    mesh = dense_layout(hybrid(S.OPTIM, S.OPTIM_GRADS_PARAMS))
    assert mesh.shard_range(State.GRAD, (1, 0), 12) == (0, 6)
    assert mesh.shard_range(State.OPTIM, (1, 0), 12) == (3, 6)


# Memory per parameter (docs/formulas.md) -------------------------------------------------------------


@pytest.mark.parametrize(("world_size", "instances"), [(4, 2), (8, 2), (16, 4), (16, 2)])
def test_bytes_per_param_hsdp(world_size, instances):
    """HSDP holds 14/N bytes of model state per parameter: its parameter and optimizer shards are the same range,
    so no bf16 shard is kept beside the fp32 main weights (gathers cast them)."""
    n = world_size // instances
    mesh = dense_layout(hybrid(S.NO_SHARD, S.OPTIM_GRADS_PARAMS, world_size=world_size, instances=instances))
    assert mesh.bytes_per_param() == pytest.approx(14 / n)


@pytest.mark.parametrize(("world_size", "instances"), [(4, 2), (8, 2), (16, 4), (16, 2)])
def test_bytes_per_param_hfsdp(world_size, instances):
    """HFSDP holds 4/N + 12/(N*R) bytes of model state per parameter."""
    n, r = world_size // instances, instances
    mesh = dense_layout(hybrid(S.OPTIM, S.OPTIM_GRADS_PARAMS, world_size=world_size, instances=instances))
    assert mesh.bytes_per_param() == pytest.approx(4 / n + 12 / (n * r))


@pytest.mark.parametrize("world_size", [1, 4, 16])
def test_bytes_per_param_zero3_and_ddp(world_size):
    """ZeRO-3 over all D ranks holds 14/D bytes per parameter, DDP 14: no bf16 copy of what the fp32 main weights
    already hold in the same range."""
    assert dense_layout(LayoutConfig(world_size=world_size)).bytes_per_param() == pytest.approx(14 / world_size)
    assert dense_layout(LayoutConfig(world_size=world_size, inner="no_shard")).bytes_per_param() == 14


def test_bytes_per_param_zero1_zero2_and_custom_sizes():
    """ZeRO-1 and ZeRO-2 divide only what they shard and keep the bf16 parameter copy their post-step gather fills;
    element sizes can be overridden (fp32: the parameter shard is the main weights, counted once)."""
    assert dense_layout(LayoutConfig(world_size=4, inner="optim")).bytes_per_param() == pytest.approx(2 + 2 + 3)
    assert dense_layout(LayoutConfig(world_size=4, inner="optim_grads")).bytes_per_param() == pytest.approx(2 + 0.5 + 3)
    mesh = dense_layout(LayoutConfig(world_size=4))
    assert mesh.bytes_per_param(param_bytes=4, grad_bytes=4, optim_bytes=12) == pytest.approx(4)
