"""The engine on 4 gloo ranks against a single-process plain-PyTorch reference.

One spawned group runs every case; the tests below assert on what it returns.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from hfsdp.core.strategy import Strategy

from distributed import run_distributed
from toy_models import reference_run

STEPS, MICROBATCHES = 3, 2
PAIRS = [(o, i) for o, i in itertools.product(Strategy, Strategy) if o.level <= i.level]


def _train(rank, world, inner, outer, instances, steps=STEPS, microbatches=MICROBATCHES, clip=None, sgd=None):
    import torch.distributed as dist

    from hfsdp.core.clip import clip_grad_norm_
    from hfsdp.core.config import LayoutConfig
    from hfsdp.core.mesh import build_meshes
    from hfsdp.core.optimizer import ShardedAdamW, ShardedSGD
    from hfsdp.core.sharded_model import fully_shard

    from toy_models import make_toy, microbatch

    cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
    model = make_toy()
    sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers))
    if sgd is None:
        opt = ShardedAdamW(sharded.groups, lr=1e-2, weight_decay=0.1)
    else:
        opt = ShardedSGD(sharded.groups, lr=1e-2, momentum=sgd, weight_decay=0.1)
    losses, norms = [], []
    for step in range(steps):
        total = torch.zeros(())
        for index in range(microbatches):
            sharded.set_microbatch(index, microbatches)
            loss = sharded(*microbatch(step, index, microbatches, rank, world))
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (microbatches * world))
        if clip is not None:
            norms.append(clip_grad_norm_(sharded.groups, clip).item())
        opt.step()
        opt.zero_grad()
    return sharded, opt, losses, norms


def _full_params(sharded) -> dict[str, torch.Tensor]:
    params = {}
    for group, views in zip(sharded.groups, sharded.sharded_buffers(), strict=True):
        full = views["main"].full_tensor()
        for slot in group.slots:
            params[slot.name] = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
    return params


def _equivalence_cases(rank, world):
    out = {}
    layouts = [(o, i, 2) for o, i in PAIRS] + [(Strategy.NO_SHARD, i, 1) for i in Strategy]
    for outer, inner, instances in layouts:
        sharded, _, losses, _ = _train(rank, world, inner, outer, instances)
        views = sharded.sharded_buffers()[0]
        out[(outer.value, inner.value, instances)] = {
            "losses": losses,
            "params": _full_params(sharded),
            "mesh": tuple(views["param"].device_mesh.mesh_dim_names),
            "placements": {k: tuple(v.placements) for k, v in views.items()},
        }
    _, _, losses, norms = _train(rank, world, "optim_grads_params", "optim", 2, clip=0.05)
    out["clip"] = {"losses": losses, "norms": norms}
    sharded, _, losses, _ = _train(rank, world, "optim_grads_params", "optim", 2, sgd=0.9)
    out["sgd"] = {"losses": losses, "params": _full_params(sharded)}
    return out


@pytest.fixture(scope="module")
def equivalence():
    return run_distributed(_equivalence_cases, 4)


@pytest.fixture(scope="module")
def reference():
    return reference_run(STEPS)


@pytest.mark.parametrize("outer,inner", PAIRS, ids=[f"{o.value}-over-{i.value}" for o, i in PAIRS])
def test_hybrid_layout_matches_single_process_reference(equivalence, reference, outer, inner):
    """3 steps x 2 microbatches on a 2x2 mesh give the reference's losses and final parameters (fp32, rtol 1e-5)."""
    ref_losses, ref_params, _ = reference
    for result in equivalence:
        case = result[(outer.value, inner.value, 2)]
        torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in ref_params.items():
            torch.testing.assert_close(case["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("outer,inner", PAIRS, ids=[f"{o.value}-over-{i.value}" for o, i in PAIRS])
def test_hybrid_layout_matches_one_instance(equivalence, outer, inner):
    """Splitting 4 ranks into 2 instances leaves the losses and parameters of one instance of the inner strategy."""
    case = equivalence[0][(outer.value, inner.value, 2)]
    single = equivalence[0][("no_shard", inner.value, 1)]
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    for name, value in single["params"].items():
        torch.testing.assert_close(case["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("outer,inner", PAIRS, ids=[f"{o.value}-over-{i.value}" for o, i in PAIRS])
def test_sharded_state_carries_the_table_placements(equivalence, outer, inner):
    """Params, grads and optimizer state are DTensors on ("dp_outer", "dp_shard") with the table's placements."""
    table = {
        Strategy.NO_SHARD: (Replicate(), Partial(), Replicate()),
        Strategy.OPTIM: (Replicate(), Partial(), Shard(0)),
        Strategy.OPTIM_GRADS: (Replicate(), Shard(0), Shard(0)),
        Strategy.OPTIM_GRADS_PARAMS: (Shard(0), Shard(0), Shard(0)),
    }
    case = equivalence[0][(outer.value, inner.value, 2)]
    assert case["mesh"] == ("dp_outer", "dp_shard")
    for k, kind in enumerate(("param", "grad", "main")):
        assert case["placements"][kind] == (table[outer][k], table[inner][k]), kind


def test_hsdp_and_hfsdp_placements_are_the_documented_ones(equivalence):
    """HSDP params are (Replicate, Shard(0)); HFSDP optimizer state is (Shard(0), Shard(0))."""
    hsdp = equivalence[0][("no_shard", "optim_grads_params", 2)]["placements"]
    hfsdp = equivalence[0][("optim", "optim_grads_params", 2)]["placements"]
    assert hsdp["param"] == (Replicate(), Shard(0))
    assert hfsdp["param"] == (Replicate(), Shard(0))
    assert hfsdp["main"] == (Shard(0), Shard(0))


def test_clipped_global_norm_equals_reference_norm(equivalence):
    """Clipping on HFSDP computes the reference's global norm and then trains to the reference's losses."""
    ref_losses, _, ref_norms = reference_run(STEPS, clip=0.05)
    clip = equivalence[0]["clip"]
    torch.testing.assert_close(torch.tensor(clip["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(clip["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)


def test_sharded_sgd_matches_torch_sgd(equivalence):
    """ShardedSGD (momentum 0.9, weight decay) on HFSDP 2x2 gives torch.optim.SGD's losses and parameters."""
    ref_losses, ref_params, _ = reference_run(STEPS, sgd_momentum=0.9)
    sgd = equivalence[0]["sgd"]
    torch.testing.assert_close(torch.tensor(sgd["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, value in ref_params.items():
        torch.testing.assert_close(sgd["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
