"""Who holds which flat range, on meshes whose two axes differ in size (pure Python, no processes).

On a square mesh (R == N) the two digits of a piece index have the same base, so
an index bug that uses one axis's size for both (`i*N + o` instead of `i*R + o`)
goes unseen. Real clusters are R x 8 with R != 8, so every check here runs on
2x4, 4x2, 3x2, 2x3, 4x8 and 16x8, against oracles that do not call the code under
test: the shard order written out by hand, and the semantics of the collectives
themselves (a reduce-scatter hands group rank j the j-th equal part of its input;
an all-gather concatenates the group's inputs in group-rank order).
"""

from __future__ import annotations

import itertools

import pytest

from hfsdp.ckpt.format.index import GroupSpec
from hfsdp.ckpt.format.pieces import plan_writes
from hfsdp.core.rules.comm_plan import plan_for
from hfsdp.core.rules.config import LayoutConfig
from hfsdp.core.rules.layout import dense_layout, expert_layout
from hfsdp.core.rules.placement import State
from hfsdp.core.rules.strategy import Strategy

MESHES = [(2, 4), (4, 2), (3, 2), (2, 3), (4, 8), (16, 8)]
PAIRS = [(o, i) for o, i in itertools.product(Strategy.sharding(), Strategy.sharding()) if o.level <= i.level]
NUMEL = 1001  # odd, so every mesh pads


def _cases():
    for (r, n), (outer, inner) in itertools.product(MESHES, PAIRS):
        if outer is Strategy.NO_SHARD and inner is Strategy.NO_SHARD and r * n > 8:
            continue  # nothing is sharded: the small meshes cover it
        yield pytest.param(r, n, outer, inner, id=f"{r}x{n}-{outer.value}-over-{inner.value}")


def _layout(r: int, n: int, outer: Strategy, inner: Strategy):
    return dense_layout(LayoutConfig(world_size=r * n, inner=inner, outer=outer, instances=r))


def _expected_range(r, n, outer, inner, state, o, i, padded):
    """The shard order by hand: the inner coordinate is the most significant digit of the piece index."""
    shards_outer = {"param": outer.shards_params, "grad": outer.shards_grads, "optim": outer.shards_optim}[state]
    shards_inner = {"param": inner.shards_params, "grad": inner.shards_grads, "optim": inner.shards_optim}[state]
    if shards_outer and shards_inner:
        index, count = i * r + o, r * n
    elif shards_inner:
        index, count = i, n
    elif shards_outer:
        index, count = o, r
    else:
        index, count = 0, 1
    length = padded // count
    return index * length, (index + 1) * length


def _part(span: tuple[int, int], parts: int, j: int) -> tuple[int, int]:
    length = (span[1] - span[0]) // parts
    return span[0] + j * length, span[0] + (j + 1) * length


def _reduced_range(layout, coord, padded: int) -> tuple[int, int]:
    """The range a rank holds after the plan's reductions, by reduce-scatter semantics alone: group rank j (the
    rank's coordinate on the axis) keeps the j-th equal part of its input; an all-reduce keeps it whole."""
    plan, current = plan_for(layout), (0, padded)
    for k in plan.microbatch_reduce:
        current = _part(current, layout.axes[k].size, coord[k])
    for k, op in plan.final_reduce:
        if op == "reduce_scatter":
            current = _part(current, layout.axes[k].size, coord[k])
    return current


@pytest.mark.parametrize("r,n,outer,inner", list(_cases()))
def test_every_rank_holds_the_range_of_the_shard_order(r, n, outer, inner):
    """Rank (o, i) holds piece i*R + o when both axes shard (i when only the inner axis does, o when only the
    outer); every element of the padded buffer is held by exactly world / pieces ranks."""
    layout = _layout(r, n, outer, inner)
    padded = layout.padded_numel(NUMEL)
    assert padded % (r * n) == 0 and padded >= NUMEL
    for state in ("param", "grad", "optim"):
        held = [0] * padded
        for o, i in itertools.product(range(r), range(n)):
            got = layout.shard_range(State(state), (o, i), padded)
            assert got == _expected_range(r, n, outer, inner, state, o, i, padded), (state, o, i)
            assert 0 <= got[0] < got[1] <= padded
            for k in range(*got):
                held[k] += 1
        assert set(held) == {r * n // layout.shard_factor(State(state))}, state


@pytest.mark.parametrize("r,n,outer,inner", list(_cases()))
def test_ranges_nest_optimizer_in_gradient_in_parameter(r, n, outer, inner):
    """A rank's optimizer piece lies inside its gradient piece, which lies inside its parameter piece."""
    layout = _layout(r, n, outer, inner)
    padded = layout.padded_numel(NUMEL)
    for coord in layout.coords():
        p, g, o = (layout.shard_range(s, coord, padded) for s in (State.PARAM, State.GRAD, State.OPTIM))
        assert p[0] <= g[0] <= o[0] < o[1] <= g[1] <= p[1], coord


@pytest.mark.parametrize("r,n,outer,inner", list(_cases()))
def test_reductions_follow_reduce_scatter_semantics_and_end_on_the_optimizer_piece(r, n, outer, inner):
    """The engine's reductions, replayed on ranges: each reduce-scatter over axis k hands the rank its group rank's
    (its coordinate's) equal part of the input range, and the last one leaves exactly the optimizer piece."""
    layout = _layout(r, n, outer, inner)
    padded = layout.padded_numel(NUMEL)
    for coord in layout.coords():
        assert _reduced_range(layout, coord, padded) == layout.shard_range(State.OPTIM, coord, padded), coord


@pytest.mark.parametrize("r,n,outer,inner", list(_cases()))
def test_gathers_follow_all_gather_semantics(r, n, outer, inner):
    """Each all-gather over axis k (parameters before compute, new weights after the step) concatenates the pieces
    of the ranks along k in coordinate order, and ends on the whole buffer (or on the parameter piece)."""
    layout = _layout(r, n, outer, inner)
    plan, padded = plan_for(layout), layout.padded_numel(NUMEL)

    def gathered(start_state: State, axes: tuple[int, ...]):
        pieces = {c: layout.shard_range(start_state, c, padded) for c in layout.coords()}
        for k in axes:
            grown = {}
            for c in layout.coords():
                inputs = [pieces[(*c[:k], j, *c[k + 1 :])] for j in range(layout.axes[k].size)]
                assert all(a[1] == b[0] for a, b in itertools.pairwise(inputs)), (k, c, inputs)
                grown[c] = (inputs[0][0], inputs[-1][1])
            pieces = grown
        return pieces

    for c, span in gathered(State.PARAM, plan.param_gather).items():
        assert span == (0, padded), c
    for c, span in gathered(State.OPTIM, plan.post_step_gather).items():
        assert span == layout.shard_range(State.PARAM, c, padded), c


@pytest.mark.parametrize("r,n", MESHES, ids=[f"{r}x{n}" for r, n in MESHES])
def test_checkpoint_plan_writes_every_element_once_from_a_rank_that_holds_it(r, n):
    """On HSDP and HFSDP R x N, the save plan writes each element of each parameter exactly once, and only from a
    rank whose optimizer piece holds it."""
    groups = [
        GroupSpec(0, False, "float32", None, (("a.weight", (7, 13)), ("a.bias", (7,)))),
        GroupSpec(1, False, "float32", None, (("b.weight", (5, 3, 11)),)),
    ]
    for outer in (Strategy.NO_SHARD, Strategy.OPTIM):
        cfg = LayoutConfig(world_size=r * n, outer=outer, instances=r)
        layout = dense_layout(cfg)
        written = {name: [0] * (13 * 7 if name == "a.weight" else 7 if name == "a.bias" else 165) for name in NAMES}
        for rank, items in plan_writes(cfg, groups).items():
            coord = layout.coords()[rank]
            for item in items:
                group = next(g for g in groups if item.name in dict(g.members))
                offset = next(off for name, off, _ in group.offsets() if name == item.name)
                lo, hi = layout.shard_range(State.OPTIM, coord, layout.padded_numel(group.numel))
                assert lo <= offset + item.start and offset + item.stop <= hi, (rank, item)
                for k in range(item.start, item.stop):
                    written[item.name][k] += 1
        for name, counts in written.items():
            assert set(counts) == {1}, (outer, name)


NAMES = ("a.weight", "a.bias", "b.weight")


@pytest.mark.parametrize("world,ep,expert_instances", [(6, 2, 1), (6, 1, 3), (6, 1, 2), (8, 2, 2), (12, 3, 2)])
def test_expert_meshes_on_non_square_domains(world, ep, expert_instances):
    """Expert meshes with expert_dp = world / ep not square (and an opt-in outer axis of another size) still give
    every rank a distinct optimizer piece per replica set, covering each expert buffer exactly as often as it has
    replicas."""
    cfg = LayoutConfig(
        world_size=world,
        ep=ep,
        num_moe_experts=6 if ep == 3 else 4,
        expert_instances=expert_instances,
        expert_outer="optim" if expert_instances > 1 else "no_shard",
    )
    layout = expert_layout(cfg)
    assert layout.size == world // ep
    padded = layout.padded_numel(NUMEL)
    for state in State:
        held = [0] * padded
        for coord in layout.coords():
            lo, hi = layout.shard_range(state, coord, padded)
            for k in range(lo, hi):
                held[k] += 1
        assert set(held) == {layout.size // layout.shard_factor(state)}, state
    for coord in layout.coords():
        assert _reduced_range(layout, coord, padded) == layout.shard_range(State.OPTIM, coord, padded)
