"""megatron-core GPT (local spec, CPU shim) under hfsdp on 4 gloo ranks, against a one-process reference."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from tests.support.distributed import run_distributed
from tests.support.gpt_models import SHAPE, train_reference, train_sharded

STEPS, MICROBATCHES, CLIP = 3, 2, 0.5
MOE = dict(SHAPE, num_moe_experts=4, moe_router_topk=2)
DENSE_CASES = {
    "HSDP 2x2": dict(outer="no_shard", instances=2),
    "HFSDP 2x2": dict(outer="optim", instances=2),
    "ZeRO-3 1x4": dict(),
}
MOE_CASES = {
    "HSDP ep2": dict(outer="no_shard", instances=2, ep=2),
    "HFSDP ep2": dict(outer="optim", instances=2, ep=2),
    "HFSDP ep2 experts no_shard": dict(outer="optim", instances=2, ep=2, expert_strategy="no_shard"),
    "HFSDP ep2 experts optim": dict(outer="optim", instances=2, ep=2, expert_strategy="optim"),
    "HFSDP ep2 experts optim_grads": dict(outer="optim", instances=2, ep=2, expert_strategy="optim_grads"),
    "HFSDP ep1 expert outer optim": dict(outer="optim", instances=2, expert_instances=2, expert_outer="optim"),
}


def _all_cases(rank, world):
    out = {name: train_sharded(rank, world, kw, STEPS, MICROBATCHES) for name, kw in DENSE_CASES.items()}
    for name, kw in MOE_CASES.items():
        out[name] = train_sharded(rank, world, kw, STEPS, MICROBATCHES, shape=MOE, clip=CLIP)
    return out


def _references(rank, world):
    return {"dense": train_reference(rank, world, STEPS), "moe": train_reference(rank, world, STEPS, MOE, CLIP)}


@pytest.fixture(scope="module")
def sharded():
    return run_distributed(_all_cases, 4)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_references, 1)[0]


@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_gpt_losses_match_single_process(sharded, reference, name):
    """A megatron-core GPT trains to the one-process reference's losses over 3 steps (fp32, rtol 1e-5)."""
    for result in sharded:
        losses = torch.tensor(result[name]["losses"])
        torch.testing.assert_close(losses, torch.tensor(reference["dense"]["losses"]), rtol=1e-5, atol=0)


def test_gpt_dense_meshes(sharded):
    """Hybrid layouts put every GPT parameter on ("dp_outer", "dp_shard"); one instance uses ("dp_shard",)."""
    for result in sharded:
        assert result["HSDP 2x2"]["meshes"] == {("dp_outer", "dp_shard")}
        assert result["HFSDP 2x2"]["meshes"] == {("dp_outer", "dp_shard")}
        assert result["ZeRO-3 1x4"]["meshes"] == {("dp_shard",)}


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_moe_losses_and_clipped_norm_match_single_process(sharded, reference, name):
    """MoE (allgather dispatcher) matches the reference holding every expert: losses and clipped global norms."""
    for result in sharded:
        case = result[name]
        torch.testing.assert_close(
            torch.tensor(case["losses"]), torch.tensor(reference["moe"]["losses"]), rtol=1e-5, atol=0
        )
        torch.testing.assert_close(
            torch.tensor(case["norms"]), torch.tensor(reference["moe"]["norms"]), rtol=1e-5, atol=0
        )


@pytest.mark.parametrize("name", [n for n in MOE_CASES if "expert outer" not in n])
def test_experts_never_get_an_outer_axis(sharded, name):
    """With EP=2 and two instances the model's meshes are exactly the hybrid dense mesh and ("expert_dp",)."""
    for result in sharded:
        case = result[name]
        assert case["meshes"] == {("dp_outer", "dp_shard"), ("expert_dp",)}
        assert case["expert_meshes"] == {("expert_dp",)}


def test_expert_strategy_sets_expert_placements(sharded):
    """The expert strategy alone decides expert placements; the default is the inner strategy (ZeRO-3)."""
    for result in sharded:
        assert result["HFSDP ep2"]["expert_param_placements"] == {(Shard(0),)}
        assert result["HFSDP ep2 experts no_shard"]["expert_param_placements"] == {(Replicate(),)}
        assert result["HFSDP ep2 experts optim_grads"]["expert_param_placements"] == {(Replicate(),)}


def test_opt_in_expert_outer_axis(sharded):
    """expert_instances=2 gives experts ("expert_dp_outer", "expert_dp") with the outer strategy's placements."""
    for result in sharded:
        case = result["HFSDP ep1 expert outer optim"]
        assert case["expert_meshes"] == {("expert_dp_outer", "expert_dp")}
        assert case["expert_param_placements"] == {(Replicate(), Shard(0))}
        assert case["expert_optim_placements"] == {(Shard(0), Shard(0))}
