"""The hybrid mesh on 4 gloo processes: names, shape, coordinates, and the group check."""

from __future__ import annotations

import pytest

from tests.support.distributed import run_distributed


def _mesh_cases(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from hfsdp.core.engine.mesh import MeshMismatchError, build_meshes, check_axis
    from hfsdp.core.rules.config import LayoutConfig

    out = {}
    for instances in (2, 1):
        cfg = LayoutConfig(world_size=world, outer="optim" if instances > 1 else "no_shard", instances=instances)
        meshes = build_meshes(cfg, "cpu")
        mesh = meshes.dense
        groups = {n: sorted(dist.get_process_group_ranks(mesh.get_group(n))) for n in mesh.mesh_dim_names}
        out[instances] = {
            "names": tuple(mesh.mesh_dim_names),
            "shape": tuple(mesh.shape),
            "coord": tuple(mesh.get_coordinate()),
            "groups": groups,
            "expert": meshes.expert,
        }
    # The 2x2 mesh against groups laid out as megatron-core would (rows = instances) ...
    cfg = LayoutConfig(world_size=world, outer="optim", instances=2)
    mesh = build_meshes(cfg, "cpu").dense
    row = [2 * (rank // 2), 2 * (rank // 2) + 1]
    column = [rank % 2, rank % 2 + 2]
    check_axis(mesh, "dp_shard", row, "intra-instance")
    check_axis(mesh, "dp_outer", column, "inter-instance")
    # ... and against groups laid out transposed, which must be refused.
    try:
        check_axis(mesh, "dp_shard", column, "intra-instance")
        out["mismatch"] = None
    except MeshMismatchError as err:
        out["mismatch"] = str(err)
    moe = LayoutConfig(world_size=world, outer="optim", instances=2, ep=2, num_moe_experts=4)
    expert = build_meshes(moe, "cpu").expert
    out["expert"] = (
        tuple(expert.mesh_dim_names),
        tuple(expert.shape),
        sorted(dist.get_process_group_ranks(expert.get_group("expert_dp"))),
    )
    return out


@pytest.fixture(scope="module")
def mesh_results():
    return run_distributed(_mesh_cases, 4)


def test_hybrid_mesh_2x2_names_shape_and_coordinates(mesh_results):
    """A 2x2 mesh is ("dp_outer", "dp_shard") with rank r at (r // 2, r % 2): rows are instances."""
    for rank, result in enumerate(mesh_results):
        mesh = result[2]
        assert mesh["names"] == ("dp_outer", "dp_shard")
        assert mesh["shape"] == (2, 2)
        assert mesh["coord"] == (rank // 2, rank % 2)
        assert mesh["groups"]["dp_shard"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert mesh["groups"]["dp_outer"] == [rank % 2, rank % 2 + 2]


def test_single_instance_mesh_is_one_dimensional(mesh_results):
    """With one instance the dense mesh is the 1-D ("dp_shard",) over all 4 ranks, and no expert mesh exists."""
    for rank, result in enumerate(mesh_results):
        mesh = result[1]
        assert mesh["names"] == ("dp_shard",)
        assert mesh["shape"] == (4,)
        assert mesh["coord"] == (rank,)
        assert mesh["groups"]["dp_shard"] == [0, 1, 2, 3]
        assert mesh["expert"] is None


def test_mismatched_group_raises(mesh_results):
    """Checking the intra-instance axis against a transposed group raises and names both rank lists."""
    for result in mesh_results:
        assert result["mismatch"] is not None
        assert "dp_shard" in result["mismatch"] and "mis-map" in result["mismatch"]


def test_expert_mesh_follows_megatron_rank_order(mesh_results):
    """With ep=2 the expert mesh is ("expert_dp",) of size 2 and pairs ranks holding the same experts."""
    for rank, result in enumerate(mesh_results):
        names, shape, ranks = result["expert"]
        assert names == ("expert_dp",)
        assert shape == (2,)
        assert ranks == [rank % 2, rank % 2 + 2]
