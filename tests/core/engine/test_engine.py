"""The engine on gloo ranks against a single-process plain-PyTorch reference.

Every layout trains the toy model with `torch.optim` optimizers stepping its main params, and is compared
with the same optimizer on the unsharded model: AdamW (whose update is scale-invariant, so the exact
global gradient norm is compared too) and SGD with momentum and clipping (which a wrongly scaled gradient
changes). Two spawned groups run every case: 4 ranks (all 2x2 and 1x4 layouts, optimizer groups and
schedules, bf16) and 6 ranks (the non-square meshes 2x3 and 3x2, where `instances != ranks per instance`
exposes index bugs a square mesh hides).
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from hfsdp.core import sharding_of
from hfsdp.core.rules.strategy import Strategy

from tests.support.distributed import run_distributed
from tests.support.toy_models import OPTIMIZERS, global_batch, make_toy, plain_steps, reference_run

STEPS, MICROBATCHES, CLIP = 3, 2, 0.05
PAIRS = [(o, i) for o, i in itertools.product(Strategy.sharding(), Strategy.sharding()) if o.level <= i.level]
LAYOUTS_4 = [(o.value, i.value, 2) for o, i in PAIRS] + [("no_shard", i.value, 1) for i in Strategy.sharding()]
HYBRIDS_6 = {
    "HSDP": ("no_shard", "optim_grads_params"),
    "HFSDP": ("optim", "optim_grads_params"),
    "ZeRO-2 over ZeRO-3": ("optim_grads", "optim_grads_params"),
}
LAYOUTS_6 = [(*HYBRIDS_6[name], r) for name in HYBRIDS_6 for r in (2, 3)]
LAYOUTS_1 = [("no_shard", "optim_grads_params", 1), ("no_shard", "no_shard", 1)]  # one rank: no collective at all
RUNS = {"adamw": None, "sgd": CLIP}  # optimizer -> clip (None: the norm is measured, not applied)


def _layout_id(layout) -> str:
    outer, inner, instances = layout
    return f"{outer}-over-{inner}-{instances}x"


# -- what every rank runs ----------------------------------------------------------------------------


def _shard(world, layout, mp=None, offload=False, **options):
    from hfsdp.core import fully_shard
    from hfsdp.core.engine.mesh import build_meshes
    from hfsdp.core.rules.config import LayoutConfig

    outer, inner, instances = layout
    cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
    model = make_toy()
    return fully_shard(
        model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp, offload=offload, **options
    )


def _train(sharded, opt, rank, world, steps=STEPS, clip=None, schedule=None, start=0):
    """Train `steps` steps of MICROBATCHES from step `start`; return the global losses and gradient norms."""
    from hfsdp.core import clip_grad_norm_, global_grad_norm

    from tests.support.toy_models import accumulated_loss

    losses, norms = [], []
    for step in range(start, start + steps):
        losses.append(accumulated_loss(sharded, step, MICROBATCHES, rank, world))
        norm = clip_grad_norm_(sharded, clip) if clip is not None else global_grad_norm(sharded)
        norms.append(norm.item())
        opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()
    return losses, norms


def _pieces(sharded) -> list[tuple[str, int, int, torch.Tensor]]:
    """This rank's main params: (global name, start, stop, fp32 values) — the parent assembles whole tensors."""
    return [(p.name, p.start, p.stop, p.param.detach().reshape(-1).clone()) for p in sharding_of(sharded).main_params]


def _grad_pieces(sharded) -> list[tuple[str, int, int, torch.Tensor]]:
    return [
        (p.name, p.start, p.stop, p.param.grad.detach().reshape(-1).clone())
        for p in sharding_of(sharded).main_params
        if p.holds
    ]


def _layout_runs(rank, world, layouts):
    from hfsdp.core.rules.placement import State

    from tests.support.toy_models import microbatch

    out = {}
    for layout in layouts:
        for optimizer, clip in RUNS.items():
            sharded = _shard(world, layout)
            opt = OPTIMIZERS[optimizer](sharded.parameters())
            losses, norms = _train(sharded, opt, rank, world, clip=clip)
            out[layout, optimizer] = {"losses": losses, "norms": norms, "pieces": _pieces(sharded)}
        for index in range(MICROBATCHES):  # one more step's gradients, so that the gradient view exists
            sharded.set_microbatch(index, MICROBATCHES)
            sharded(*microbatch(STEPS, index, MICROBATCHES, rank, world)).backward()
        views = sharding_of(sharded).sharded_buffers()[0]
        group = sharding_of(sharded).groups[0]
        main = views["main"].full_tensor()
        out[layout, "views"] = {
            "mesh": tuple(views["param"].device_mesh.mesh_dim_names),
            "placements": {k: tuple(v.placements) for k, v in views.items()},
            "main": {s.name: main[s.offset : s.offset + s.numel].view(s.shape).clone() for s in group.slots},
            "optim shard factor": group.layout.shard_factor(State.OPTIM),
        }
    return out


def _world4_cases(rank, world, root):
    out = _layout_runs(rank, world, LAYOUTS_4)
    out["sgd saved"] = _sgd_save(rank, world, root)
    out["groups and schedule"] = _groups_and_schedule(rank, world)
    out["adafactor"] = _adafactor(rank, world)
    out["misuse"] = _misuse(rank, world)
    out["bf16"] = {name: _bf16_step(rank, world, layout) for name, layout in BF16_LAYOUTS.items()}
    out["offload"] = _offloaded(rank, world)
    out["root resharded"] = _root_resharded(rank, world)
    out["edges"] = _edges(rank, world)
    return out


def _root_resharded(rank, world):
    """HFSDP 2x2 with reshard_root_after_forward: after forward the root holds no gathered parameters (its next
    gather is for backward), and training matches the reference."""
    from hfsdp.core import LayoutConfig, build_meshes, fully_shard

    from tests.support.toy_models import microbatch

    cfg = LayoutConfig(world_size=world, outer="optim", instances=2)
    model = make_toy()
    sharded = fully_shard(
        model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), reshard_root_after_forward=True
    )
    root = sharding_of(sharded).units[-1].groups[0]
    sharded(*microbatch(0, 0, 1, rank, world))  # forward only: the root keeps nothing gathered
    held_after_forward = root.unsharded.untyped_storage().nbytes()
    sharded.zero_grad()
    opt = OPTIMIZERS["sgd"](sharded.parameters())
    losses, norms = _train(sharded, opt, rank, world, clip=CLIP)
    return {"held after forward": held_after_forward, "losses": losses, "norms": norms, "pieces": _pieces(sharded)}


# -- edges a planted bug slipped past: a clip limit above the norm, a parameter without a gradient -------------

EDGE_LAYOUTS = {
    "ZeRO-3 1x4": ("no_shard", "optim_grads_params", 1),
    "DDP 1x4": ("no_shard", "no_shard", 1),
    "ZeRO-1 1x4": ("no_shard", "optim", 1),
    "HSDP 2x2": ("no_shard", "optim_grads_params", 2),
    "HFSDP 2x2": ("optim", "optim_grads_params", 2),
}
LOOSE_CLIP = 1e3  # far above every gradient norm of the toy: clipping must leave the gradients alone


def _with_unused(model):
    """The toy with a parameter no forward reaches (an unused branch of unit 1, initialised from its own seed)."""
    torch.manual_seed(5)
    model.layers[1].unused = torch.nn.Linear(16, 16)
    return model


@contextmanager
def _poisoned():
    """Every fresh gradient buffer filled with NaN, so an element the engine forgets to write shows."""
    from hfsdp.core.buffers.grad_buffer import GradBuffer

    original = GradBuffer._empty
    GradBuffer._empty = lambda self, extent: original(self, extent).fill_(float("nan"))
    try:
        yield
    finally:
        GradBuffer._empty = original


def _edges(rank, world):
    from hfsdp.core import LayoutConfig, build_meshes, fully_shard

    out = {}
    for name, layout in EDGE_LAYOUTS.items():
        sharded = _shard(world, layout)
        opt = OPTIMIZERS["sgd"](sharded.parameters())
        losses, norms = _train(sharded, opt, rank, world, clip=LOOSE_CLIP)
        out[name, "loose clip"] = {"losses": losses, "norms": norms, "pieces": _pieces(sharded)}
        outer, inner, instances = layout
        cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
        model = _with_unused(make_toy())
        with _poisoned():
            sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers))
            opt = OPTIMIZERS["sgd"](sharded.parameters())
            losses, _ = _train(sharded, opt, rank, world, steps=2)
        out[name, "unused"] = {"losses": losses, "pieces": _pieces(sharded)}
    return out


@pytest.mark.parametrize("layout", list(EDGE_LAYOUTS))
def test_a_clip_limit_above_the_norm_leaves_the_gradients_alone(world4, layout):
    """Clipping at a limit far above the gradient norm is the unclipped run (the coefficient is clamped at 1):
    losses, norms and parameters equal the reference clipped at the same limit, which torch leaves unscaled."""
    ref_losses, ref_params, ref_norms = reference_run(STEPS, "sgd", clip=LOOSE_CLIP)
    assert max(ref_norms) < LOOSE_CLIP
    case = world4[0]["edges"][layout, "loose clip"]
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(case["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    shapes = {n: p.shape for n, p in ref_params.items()}
    params = _assemble([r["edges"][layout, "loose clip"]["pieces"] for r in world4], shapes)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _unused_reference(steps: int):
    """The toy with its unused parameter in one process; a parameter without a gradient gets a zero one (the
    engine's flat buffers hold a zero gradient for it, as Megatron's do, so momentum and decay apply)."""
    model = _with_unused(make_toy())
    opt = OPTIMIZERS["sgd"](model.parameters())
    losses = []
    for step in range(steps):
        loss = model(*global_batch(step))
        loss.backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", list(EDGE_LAYOUTS))
def test_a_parameter_without_a_gradient_gets_a_zero_one(world4, layout):
    """A parameter no forward reaches, in gradient buffers poisoned with NaN: its gradient is exactly zero on every
    microbatch (never what the allocator held), so losses and parameters equal the reference, where it gets a zero
    gradient."""
    ref_losses, ref_params = _unused_reference(2)
    case = world4[0]["edges"][layout, "unused"]
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    shapes = {n: p.shape for n, p in ref_params.items()}
    params = _assemble([r["edges"][layout, "unused"]["pieces"] for r in world4], shapes)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _world6_cases(rank, world, root):
    out = _layout_runs(rank, world, LAYOUTS_6)
    out["sgd resumed"] = _sgd_resume(rank, world, root)
    out["moe"] = {name: _moe_run(rank, world, layout) for name, layout in MOE_LAYOUTS.items()}
    out["kept gathered"] = {layout: _kept_gathered(rank, world, layout) for layout in KEPT_LAYOUTS}
    return out


#: ZeRO-3 inner axes of 3 and 2 ranks, under an HFSDP and an HSDP outer axis.
KEPT_LAYOUTS = [("optim", "optim_grads_params", 2), ("no_shard", "optim_grads_params", 3)]


def _kept_gathered(rank, world, layout):
    """reshard_after_forward=False: each unit's gathered parameters held from its forward through its backward,
    freed after it, and the same training as the reference."""
    from tests.support.toy_models import microbatch

    sharded = _shard(world, layout, reshard_after_forward=False)
    units = sharding_of(sharded).units[:-1]

    def held() -> list[int]:
        return [group.unsharded.untyped_storage().nbytes() for unit in units for group in unit.groups]

    sharded.set_microbatch(0, 1)
    loss = sharded(*microbatch(0, 0, 1, rank, world))
    after_forward = held()
    loss.backward()
    after_backward = held()
    sharded.zero_grad()
    opt = OPTIMIZERS["sgd"](sharded.parameters())
    losses, norms = _train(sharded, opt, rank, world, clip=RUNS["sgd"])
    return {"after forward": after_forward, "after backward": after_backward, "losses": losses, "norms": norms,
            "pieces": _pieces(sharded)}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("engine-checkpoints")


@pytest.fixture(scope="module")
def world4(checkpoints):
    return run_distributed(_world4_cases, 4, str(checkpoints / "sgd"))


@pytest.fixture(scope="module")
def world1():
    return run_distributed(_layout_runs, 1, LAYOUTS_1)


@pytest.fixture(scope="module")
def world6(checkpoints, world4):  # after world4: it resumes world4's checkpoint
    return run_distributed(_world6_cases, 6, str(checkpoints / "sgd"))


def _sgd_save(rank, world, root):
    """torch SGD with momentum on HFSDP 2x2: 2 steps, then a checkpoint (main weights and momentum buffers)."""
    from hfsdp.ckpt import save_checkpoint

    sharded = _shard(world, ("optim", "optim_grads_params", 2))
    opt = OPTIMIZERS["sgd"](sharded.parameters())
    losses, _ = _train(sharded, opt, rank, world, steps=2, clip=CLIP)
    save_checkpoint(root, sharded, opt, step=2)
    return losses


def _sgd_resume(rank, world, root):
    """The SGD checkpoint of 4 ranks loaded into HSDP 3x2 on 6 (reshard on load), then one more step."""
    from hfsdp.ckpt import load_checkpoint

    sharded = _shard(world, ("no_shard", "optim_grads_params", 3))
    opt = OPTIMIZERS["sgd"](sharded.parameters())
    step = load_checkpoint(root, sharded, opt)["step"]
    losses, norms = _train(sharded, opt, rank, world, steps=1, clip=CLIP, start=step)
    return {"step": step, "losses": losses, "norms": norms, "pieces": _pieces(sharded)}


def _assemble(ranks: list[list[tuple[str, int, int, torch.Tensor]]], shapes: dict) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's pieces; replicas of a piece must agree bit for bit, and nothing is left out."""
    full = {name: torch.full((math.prod(shape),), float("nan")) for name, shape in shapes.items()}
    for pieces in ranks:
        for name, start, stop, values in pieces:
            seen = full[name][start:stop]
            assert torch.isnan(seen).all() or torch.equal(seen, values), f"replicas of {name} disagree"
            full[name][start:stop] = values
    for name, tensor in full.items():
        assert not torch.isnan(tensor).any(), f"no rank holds part of {name}"
    return {name: tensor.view(shapes[name]) for name, tensor in full.items()}


def _check_against_reference(results, layout, optimizer):
    ref_losses, ref_params, ref_norms = reference_run(STEPS, optimizer, clip=RUNS[optimizer] or math.inf)
    case = results[0][layout, optimizer]
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(case["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    params = _assemble([r[layout, optimizer]["pieces"] for r in results], {n: p.shape for n, p in ref_params.items()})
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


# -- every layout against the reference ---------------------------------------------------------------


@pytest.mark.parametrize("optimizer", list(RUNS))
@pytest.mark.parametrize("layout", LAYOUTS_4, ids=[_layout_id(x) for x in LAYOUTS_4])
def test_every_layout_matches_the_single_process_reference(world4, layout, optimizer):
    """3 steps x 2 microbatches on 4 ranks give the reference's losses, exact global gradient norms and final
    parameters (fp32, rtol 1e-5): AdamW with the norm measured, SGD with momentum and clipping at 0.05."""
    _check_against_reference(world4, layout, optimizer)


@pytest.mark.parametrize("optimizer", list(RUNS))
@pytest.mark.parametrize("layout", LAYOUTS_1, ids=[_layout_id(x) for x in LAYOUTS_1])
def test_one_rank_with_gradient_accumulation_matches_the_single_process_reference(world1, layout, optimizer):
    """On one rank no reduction runs, so the mean over microbatches is the engine's scaling alone: 2 microbatches
    per step must still give the reference's losses, norms and parameters."""
    _check_against_reference(world1, layout, optimizer)


@pytest.mark.parametrize("optimizer", list(RUNS))
@pytest.mark.parametrize("layout", LAYOUTS_6, ids=[_layout_id(x) for x in LAYOUTS_6])
def test_non_square_meshes_match_the_single_process_reference(world6, layout, optimizer):
    """HSDP, HFSDP and ZeRO-2 over ZeRO-3 on 2x3 and 3x2 meshes (6 ranks) give the reference's losses, norms
    and parameters: a piece index built with the wrong axis size cannot pass here."""
    _check_against_reference(world6, layout, optimizer)


@pytest.mark.parametrize("layout", KEPT_LAYOUTS, ids=[_layout_id(x) for x in KEPT_LAYOUTS])
def test_units_kept_gathered_through_backward_free_them_after_and_train_the_same(world6, layout):
    """fully_shard(reshard_after_forward=False) on 2x3 and 3x2: every unit still holds its gathered parameters
    after the forward and none after the backward, and SGD with clipping gives the reference's losses, norms and
    parameters."""
    for r in world6:
        case = r["kept gathered"][layout]
        assert all(n > 0 for n in case["after forward"]) and not any(case["after backward"]), case
    results = [{(layout, "sgd"): r["kept gathered"][layout]} for r in world6]
    _check_against_reference(results, layout, "sgd")


def test_reshard_after_forward_takes_only_a_bool():
    """FSDP2 also takes an int (reshard onto a smaller group); hfsdp does not, and says so at once."""
    from hfsdp.core import LayoutConfig, fully_shard

    model = make_toy()
    with pytest.raises(ValueError, match="reshard_after_forward must be True or False"):  # before any mesh is read
        fully_shard(model, LayoutConfig(world_size=1), None, units=list(model.layers), reshard_after_forward=8)


@pytest.mark.parametrize("optimizer", list(RUNS))
@pytest.mark.parametrize("outer,inner", PAIRS, ids=[f"{o.value}-over-{i.value}" for o, i in PAIRS])
def test_hybrid_layout_matches_one_instance(world4, outer, inner, optimizer):
    """Splitting 4 ranks into 2 instances leaves the losses and parameters of one instance of the inner strategy."""
    case = world4[0][(outer.value, inner.value, 2), optimizer]
    single = world4[0][("no_shard", inner.value, 1), optimizer]
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)


TABLE = {
    Strategy.NO_SHARD: (Replicate(), Partial(), Replicate()),
    Strategy.OPTIM: (Replicate(), Partial(), Shard(0)),
    Strategy.OPTIM_GRADS: (Replicate(), Shard(0), Shard(0)),
    Strategy.OPTIM_GRADS_PARAMS: (Shard(0), Shard(0), Shard(0)),
}


@pytest.mark.parametrize("outer,inner", PAIRS, ids=[f"{o.value}-over-{i.value}" for o, i in PAIRS])
def test_sharded_state_carries_the_table_placements(world4, outer, inner):
    """Params, grads and optimizer state are DTensors on ("dp_outer", "dp_shard") with the table's placements, and
    the main weights' DTensor reassembles (full_tensor) to the same values the main params hold."""
    layout = (outer.value, inner.value, 2)
    views = world4[0][layout, "views"]
    assert views["mesh"] == ("dp_outer", "dp_shard")
    for k, kind in enumerate(("param", "grad", "main")):
        assert views["placements"][kind] == (TABLE[outer][k], TABLE[inner][k]), kind
    shapes = {name: value.shape for name, value in views["main"].items()}
    pieces = _assemble([[x for x in r[layout, "sgd"]["pieces"] if x[0] in shapes] for r in world4], shapes)
    for name, value in views["main"].items():
        torch.testing.assert_close(value, pieces[name], rtol=0, atol=0, msg=name)


def test_hsdp_and_hfsdp_placements_are_the_documented_ones(world4):
    """HSDP params are (Replicate, Shard(0)); HFSDP optimizer state is (Shard(0), Shard(0))."""
    hsdp = world4[0][("no_shard", "optim_grads_params", 2), "views"]["placements"]
    hfsdp = world4[0][("optim", "optim_grads_params", 2), "views"]["placements"]
    assert hsdp["param"] == (Replicate(), Shard(0))
    assert hfsdp["param"] == (Replicate(), Shard(0))
    assert hfsdp["main"] == (Shard(0), Shard(0))


# -- any torch.optim optimizer, with parameter groups and a schedule ---------------------------------------


def _lr_lambda(step: int) -> float:
    """Linear warmup over 2 steps, then cosine decay to 10% at step 6."""
    if step < 2:
        return (step + 1) / 2
    progress = min(1.0, (step - 2) / 4)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _fused_adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def _groups_and_schedule(rank, world):
    from hfsdp.core import param_groups

    out = {}
    for layout in [("optim", "optim_grads_params", 2), ("no_shard", "optim", 1)]:
        sharded = _shard(world, layout)
        opt = _fused_adamw(param_groups(sharded, weight_decay=0.1))
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
        losses, _ = _train(sharded, opt, rank, world, steps=5, schedule=schedule)
        out[layout] = {
            "losses": losses,
            "pieces": _pieces(sharded),
            "lrs": [g["lr"] for g in opt.param_groups],
            "group names": {
                g["name"]: {p.name for p in sharding_of(sharded).main_params if any(p.param is q for q in g["params"])}
                for g in opt.param_groups
            },
        }
    return out


def _reference_groups_and_schedule():
    from hfsdp.core.engine.weight_decay import megatron_no_decay

    model = make_toy()
    decay = [p for n, p in model.named_parameters() if not megatron_no_decay(n, p.shape)]
    plain = [p for n, p in model.named_parameters() if megatron_no_decay(n, p.shape)]
    opt = _fused_adamw([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}])
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
    losses = []
    for step in range(5):
        loss = model(*global_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, [g["lr"] for g in opt.param_groups]


@pytest.mark.parametrize("layout", [("optim", "optim_grads_params", 2), ("no_shard", "optim", 1)], ids=_layout_id)
def test_fused_adamw_with_parameter_groups_and_a_schedule_matches_the_reference(world4, layout):
    """torch.optim.AdamW(fused=True) over `param_groups` (no weight decay for biases and 1-D parameters, as
    Megatron does) with a LambdaLR warmup + cosine schedule gives the unsharded run's losses, parameters and lrs."""
    ref_losses, ref_params, ref_lrs = _reference_groups_and_schedule()
    case = world4[0]["groups and schedule"][layout]
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert case["lrs"] == pytest.approx(ref_lrs, rel=1e-12)
    no_decay = set().union(*(r["groups and schedule"][layout]["group names"]["no_decay"] for r in world4))
    assert no_decay == {n for n in ref_params if n.endswith(".bias")}
    results = [r["groups and schedule"][layout]["pieces"] for r in world4]
    params = _assemble(results, {n: p.shape for n, p in ref_params.items()})
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _adafactor(rank, world):
    from hfsdp.core import register_elementwise

    out = {}
    sharded = _shard(world, ("no_shard", "no_shard", 1))  # every main param is a whole parameter
    opt = torch.optim.Adafactor(sharded.parameters(), lr=1e-2)
    out["ddp"] = {"losses": _train(sharded, opt, rank, world)[0], "pieces": _pieces(sharded)}
    sharded = _shard(world, ("optim", "optim_grads_params", 2))
    opt = torch.optim.Adafactor(sharded.parameters(), lr=1e-2)
    try:
        _train(sharded, opt, rank, world, steps=1)
        out["hfsdp"] = None
    except TypeError as err:
        out["hfsdp"] = str(err)

    class MySGD(torch.optim.SGD):
        """A user's own optimizer, declared elementwise."""

    sharded = _shard(world, ("optim", "optim_grads_params", 2))
    opt = register_elementwise(MySGD)(sharded.parameters(), lr=1e-2, momentum=0.9)
    out["declared"] = _train(sharded, opt, rank, world)[0]
    return out


def test_a_whole_tensor_optimizer_is_exact_where_every_piece_is_whole(world4):
    """torch.optim.Adafactor (row/column factored, RMS-scaled) steps whole parameters under DDP and matches the
    unsharded Adafactor run."""
    model = make_toy()
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    ref_losses, _ = plain_steps(model, opt, lambda step: model(*global_batch(step)), STEPS)
    case = world4[0]["adafactor"]["ddp"]
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    params = _assemble(
        [r["adafactor"]["ddp"]["pieces"] for r in world4], {n: p.shape for n, p in model.named_parameters()}
    )
    for name, value in model.named_parameters():
        torch.testing.assert_close(params[name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_whole_tensor_optimizer_on_partial_pieces_is_refused(world4):
    """On HFSDP Adafactor would see only pieces of matrices; its first step raises, naming it and the fix."""
    for result in world4:
        message = result["adafactor"]["hfsdp"]
        assert message is not None and "Adafactor" in message and "register_elementwise" in message


def test_a_user_optimizer_declared_elementwise_steps_pieces(world4):
    """A user's own optimizer class declared with register_elementwise trains on HFSDP like torch's SGD."""
    ref_losses, _, _ = reference_run(STEPS, "sgd")
    ref = torch.optim.SGD  # MySGD has SGD's arithmetic with momentum 0.9 and no weight decay
    model = make_toy()
    losses, _ = plain_steps(
        model, ref(model.parameters(), lr=1e-2, momentum=0.9), lambda step: model(*global_batch(step)), STEPS
    )
    torch.testing.assert_close(
        torch.tensor(world4[0]["adafactor"]["declared"]), torch.tensor(losses), rtol=1e-5, atol=0
    )
    assert losses != ref_losses  # weight decay differs: the comparison is not vacuous


# -- misuse is refused, discarded gradients are dropped ---------------------------------------------------------


def _misuse(rank, world):
    from tests.support.toy_models import microbatch

    out = {}
    sharded = _shard(world, ("optim", "optim_grads_params", 2))
    opt = OPTIMIZERS["sgd"](sharded.parameters())
    sharded(*microbatch(0, 0, 1, rank, world)).backward()
    try:
        sharded(*microbatch(0, 0, 1, rank, world)).backward()
        out["second backward"] = None
    except RuntimeError as err:
        out["second backward"] = str(err)
    # Discard that step's gradients (as a loss-spike skip does), then train the step on its own batch.
    opt.zero_grad()
    losses, _ = _train(sharded, opt, rank, world, steps=1)
    out["after discard"] = {"losses": losses, "pieces": _pieces(sharded)}
    return out


def test_backward_after_the_last_microbatch_without_a_step_is_refused(world4):
    """A second backward after a step's last microbatch, before step or zero_grad, raises instead of adding to
    gradients that were already reduced over every rank."""
    for result in world4:
        message = result["misuse"]["second backward"]
        assert message is not None and "optimizer.step()" in message and "set_microbatch" in message


def test_gradients_discarded_by_zero_grad_do_not_leak_into_the_next_step(world4):
    """After optimizer.zero_grad() discards a step's gradients, the next step equals a fresh first step."""
    ref_losses, ref_params, _ = reference_run(1, "sgd")
    case = world4[0]["misuse"]["after discard"]
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    params = _assemble(
        [r["misuse"]["after discard"]["pieces"] for r in world4], {n: p.shape for n, p in ref_params.items()}
    )
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


# -- bf16 compute: fp32 main weights and fp32-reduced gradients -------------------------------------------------

BF16_LAYOUTS = {
    "HSDP 2x2 (gathers cast the main weights)": ("no_shard", "optim_grads_params", 2),
    "HFSDP 2x2 (keeps a bf16 parameter shard)": ("optim", "optim_grads_params", 2),
    "ZeRO-1 1x4 (keeps a bf16 parameter copy)": ("no_shard", "optim", 1),
}


OFFLOADED = [("no_shard", "optim_grads_params", 2), ("optim", "optim_grads_params", 2)]


def _offloaded(rank, world):
    """The main weights and optimizer state in host memory (on CPU the copies are host to host, but the path is
    the GPU's: a separate fp32 main copy, gradients staged before the step, weights copied back after)."""
    from hfsdp.core import MixedPrecision

    out = {}
    for layout in OFFLOADED:
        for optimizer, clip in RUNS.items():
            sharded = _shard(world, layout, offload=True)
            opt = OPTIMIZERS[optimizer](sharded.parameters())
            losses, norms = _train(sharded, opt, rank, world, clip=clip)
            separate = all(g.main.data_ptr() != g.param_shard.data_ptr() for g in sharding_of(sharded).groups)
            out[layout, optimizer] = {
                "losses": losses,
                "norms": norms,
                "pieces": _pieces(sharded),
                "separate": separate,
            }
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out["bf16"] = _bf16_step(rank, world, ("no_shard", "optim_grads_params", 2), offload=True, mp=mp)
    return out


def _bf16_step(rank, world, layout, offload=False, mp=None):
    """One step of bf16 compute with fp32 reduction: main weights before, reduced gradients, main weights after."""
    from hfsdp.core import MixedPrecision

    mp = mp or MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    sharded = _shard(world, layout, mp=mp, offload=offload)
    opt = OPTIMIZERS["adamw"](sharded.parameters())
    before = _pieces(sharded)
    grads = {}

    def keep_grads(optimizer, args, kwargs):
        grads["pieces"] = _grad_pieces(sharded)

    handle = opt.register_step_pre_hook(keep_grads)
    _train(sharded, opt, rank, world, steps=1)
    handle.remove()
    return {"before": before, "grads": grads["pieces"], "after": _pieces(sharded)}


def _bf16_reference(world: int):
    """What a correct bf16 step computes: bf16 copies of the fp32 weights run each rank's microbatch, the bf16
    gradients are upcast, scaled by 1/(microbatches * world) and summed in fp32, and AdamW steps the fp32 weights."""
    from tests.support.toy_models import microbatch

    master = make_toy()
    grads = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
    for index in range(MICROBATCHES):
        for rank in range(world):
            bf16 = make_toy().to(torch.bfloat16)
            bf16.load_state_dict({n: p.to(torch.bfloat16) for n, p in master.state_dict().items()})
            x, y = microbatch(0, index, MICROBATCHES, rank, world)
            bf16(x.to(torch.bfloat16), y.to(torch.bfloat16)).float().backward()
            for n, p in bf16.named_parameters():
                grads[n] += p.grad.float() / (MICROBATCHES * world)
    before = {n: p.detach().clone() for n, p in master.named_parameters()}
    opt = OPTIMIZERS["adamw"](master.parameters())
    for n, p in master.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    return before, grads, {n: p.detach().clone() for n, p in master.named_parameters()}


@pytest.mark.parametrize("name", list(BF16_LAYOUTS))
def test_bf16_step_keeps_fp32_main_weights_and_reduces_in_fp32(world4, name):
    """After one bf16 step the fp32 main weights start from the fp32 initial weights (not bf16-rounded ones), the
    reduced gradients equal fp32 sums of bf16 microbatch gradients, and AdamW steps the fp32 weights, at rtol 1e-5:
    rounding the main weights to bf16 anywhere (0.4% relative) fails this."""
    ref_before, ref_grads, ref_after = _bf16_reference(4)
    shapes = {n: t.shape for n, t in ref_before.items()}
    got = {key: _assemble([r["bf16"][name][key] for r in world4], shapes) for key in ("before", "grads", "after")}
    for n in shapes:
        torch.testing.assert_close(got["before"][n], ref_before[n], rtol=0, atol=0, msg=n)
        torch.testing.assert_close(got["grads"][n], ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)
        torch.testing.assert_close(got["after"][n], ref_after[n], rtol=1e-5, atol=1e-7, msg=n)


# -- mixture of experts on non-square expert domains ---------------------------------------------------------------

MOE_LAYOUTS = {
    # ep 2 on 6 ranks: dense HFSDP 3x2, experts ZeRO-3 over expert_dp = 3
    "ep2 dense 3x2": {"ep": 2, "instances": 3, "outer": "optim"},
    # ep 1: dense HSDP 2x3, experts on an opt-in outer axis of 3 (expert mesh 3x2)
    "ep1 expert outer 3x2": {"instances": 2, "expert_instances": 3, "expert_outer": "optim"},
}


def _moe_run(rank, world, layout):
    import torch.distributed as dist

    from hfsdp.core import LayoutConfig, build_meshes, clip_grad_norm_, fully_shard
    from hfsdp.core.rules.expert_naming import ExpertNaming

    from tests.support import ckpt_models as cm

    cfg = LayoutConfig(world_size=world, num_moe_experts=cm.NUM_EXPERTS, **layout)
    ep_rank = rank % cfg.ep
    model = cm.Toy(True, cfg.ep, ep_rank, cm._ep_group(cfg.ep), 0)
    naming = ExpertNaming(cm.NUM_EXPERTS, cfg.ep, ep_rank)
    sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), expert_naming=naming)
    opt = OPTIMIZERS["sgd"](sharded.parameters())
    losses, norms = [], []
    b = cm.GLOBAL_BATCH // (MICROBATCHES * world)
    for step in range(STEPS):
        x, y = cm.data(step)
        total = torch.zeros(())
        for index in range(MICROBATCHES):
            sharded.set_microbatch(index, MICROBATCHES)
            c = index * world + rank
            loss = sharded(x[c * b : (c + 1) * b], y[c * b : (c + 1) * b])
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (MICROBATCHES * world))
        norms.append(clip_grad_norm_(sharded, CLIP).item())
        opt.step()
        opt.zero_grad()
    return {
        "losses": losses,
        "norms": norms,
        "pieces": _pieces(sharded),
        "expert mesh": sharding_of(sharded).meshes.expert_layout.shape,
    }


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_moe_on_non_square_expert_domains_matches_the_reference(world6, name):
    """MoE with expert_dp = 3 (ep 2 on 6 ranks) and with a 3x2 opt-in expert mesh trains to the losses, clipped
    global norms and parameters of a one-process model holding every expert."""
    from tests.support import ckpt_models as cm

    model = cm.Toy(moe=True)
    opt = OPTIMIZERS["sgd"](model.parameters())
    ref_losses, ref_norms = plain_steps(model, opt, lambda step: model(*cm.data(step)), STEPS, CLIP)
    case = world6[0]["moe"][name]
    assert case["expert mesh"] == ((3,) if "ep2" in name else (3, 2))
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(case["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    shapes = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
    params = _assemble([r["moe"][name]["pieces"] for r in world6], shapes)
    for n in shapes:
        torch.testing.assert_close(params[n], dict(model.named_parameters())[n].detach(), rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("optimizer", list(RUNS))
@pytest.mark.parametrize("layout", OFFLOADED, ids=[_layout_id(x) for x in OFFLOADED])
def test_offloaded_optimizer_matches_the_reference(world4, layout, optimizer):
    """With the fp32 main weights and optimizer state offloaded (a main copy apart from the parameter shard,
    gradients staged to the host before the step, weights copied back after), losses, norms and parameters are
    the reference's."""
    results = [{(layout, optimizer): r["offload"][layout, optimizer]} for r in world4]
    assert all(r[layout, optimizer]["separate"] for r in results)
    _check_against_reference(results, layout, optimizer)


def test_offloaded_bf16_step_keeps_fp32_main_weights(world4):
    """An offloaded bf16 HSDP step computes the same fp32 gradients and main weights as the bf16 reference."""
    ref_before, ref_grads, ref_after = _bf16_reference(4)
    shapes = {n: t.shape for n, t in ref_before.items()}
    got = {key: _assemble([r["offload"]["bf16"][key] for r in world4], shapes) for key in ("before", "grads", "after")}
    for n in shapes:
        torch.testing.assert_close(got["before"][n], ref_before[n], rtol=0, atol=0, msg=n)
        torch.testing.assert_close(got["grads"][n], ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)
        torch.testing.assert_close(got["after"][n], ref_after[n], rtol=1e-5, atol=1e-7, msg=n)


def test_a_root_resharded_after_forward_frees_its_parameters_and_trains_the_same(world4):
    """With reshard_root_after_forward the root's gathered parameters are freed after forward (as every unit's
    are), and SGD with clipping still gives the reference's losses, norms and parameters."""
    layout = ("optim", "optim_grads_params", 2)
    assert all(r["root resharded"]["held after forward"] == 0 for r in world4)
    results = [{(layout, "sgd"): r["root resharded"]} for r in world4]
    _check_against_reference(results, layout, "sgd")


def test_sgd_momentum_checkpoint_reshards_onto_another_world(world4, world6):
    """torch SGD's momentum buffers are checkpointed piece by piece: 2 steps on HFSDP 2x2 (4 ranks), loaded into
    HSDP 3x2 (6 ranks), one more step: the reference's third loss, clipped norm and parameters."""
    ref_losses, ref_params, ref_norms = reference_run(STEPS, "sgd", clip=CLIP)
    assert world4[0]["sgd saved"] == pytest.approx(ref_losses[:2], rel=1e-5)
    case = world6[0]["sgd resumed"]
    assert case["step"] == 2
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(ref_losses[2:]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(case["norms"]), torch.tensor(ref_norms[2:]), rtol=1e-5, atol=0)
    params = _assemble([r["sgd resumed"]["pieces"] for r in world6], {n: p.shape for n, p in ref_params.items()})
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_an_fp16_gradient_reduction_is_refused():
    """Gradients are summed unscaled before the once-per-step scaling, which needs fp32's range."""
    from hfsdp.core import MixedPrecision

    with pytest.raises(ValueError, match=r"reduce_dtype=torch.float16\) is not supported"):
        MixedPrecision(reduce_dtype=torch.float16)
    assert MixedPrecision(reduce_dtype=torch.bfloat16).reduce_dtype == torch.bfloat16
