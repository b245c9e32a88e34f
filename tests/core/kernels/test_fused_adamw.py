"""`FusedAdamW` and its one-pass kernel against float64 and single-process torch references.

The kernel's two implementations (Triton, plain torch) must compute the same bits; the torch one is what
CPU CI runs, the Triton one runs here only under Triton's interpreter, and only where Triton imports
(`requires_triton`; the GPU script `bench/perf_session.sh` checks the compiled kernel the same way).
Both are checked against a float64 evaluation of the same formula. The optimizer is then checked where
it matters: every layout kind it writes compute weights for (a kept bf16 shard, a prestaged gather
input), with clipping inside the step (a norm that crosses the limit both ways too: steps below it are not
scaled), with two parameter groups, against torch's AdamW on the unsharded model, and through a checkpoint that
torch's AdamW loads.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hfsdp.core.kernels.adamw_kernel import AdamWScalars, adamw_run
from hfsdp.core.kernels.fused_adamw import FusedAdamW

from tests.support.distributed import run_distributed
from tests.support.toy_models import accumulated_loss, global_batch, make_toy, plain_steps

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton does not import here (CPU CI): the torch path runs")
LR, WD, CLIP, STEPS, MICRO = 1e-2, 0.1, 0.05, 3, 2
#: A limit the toy's gradient norm crosses both ways within CROSS_STEPS steps (3.5, 1.4, 1.8, 1.3, 2.2, ...): steps
#: above it are clipped, steps below it must keep their gradient as it is (a coefficient capped at 1).
CROSS, CROSS_STEPS = 1.5, 8


def _inputs(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    v = torch.rand(n, generator=gen) * 0.01
    return p, g * 0.1, m * 0.01, v


def _float64(p, g, m, v, coef, lr, beta1, beta2, eps, wd, step):
    """The formula in float64."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    g = g * coef
    p = p * (1 - lr * wd)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = v.sqrt() / (1 - beta2**step) ** 0.5 + eps
    return p - lr / (1 - beta1**step) * m / denom, m, v


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("step", [1, 7])
def test_torch_path_matches_float64_and_writes_the_rounded_weights(step):
    """Weights and moments within 1e-6 (relative norm) of float64, the update within 1e-4; the bf16 output is the
    parameter's own round-to-nearest cast, bit for bit, and every element of it is written."""
    p, g, m, v = _inputs(10_001, seed=step)
    old = p.clone()
    coef = torch.tensor([0.37])
    ref_p, ref_m, ref_v = _float64(p, g, m, v, 0.37, 3e-3, 0.9, 0.95, 1e-8, 0.1, step)
    out = torch.full((p.numel(),), float("nan"), dtype=torch.bfloat16)
    used = adamw_run(p, g, m, v, AdamWScalars.of(3e-3, 0.9, 0.95, 1e-8, 0.1, step), coef, out, backend="torch")
    assert used == "torch"
    assert _rel(p, ref_p) < 1e-6 and _rel(m, ref_m) < 1e-6 and _rel(v, ref_v) < 1e-6
    # The update alone (3e-3 against weights near 1, each rounded to 6e-8): a wrong bias correction is off by 10%.
    assert _rel(p - old, ref_p - old.double()) < 1e-4
    assert torch.equal(out, p.to(torch.bfloat16))


def test_bad_arguments_are_refused_together():
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError) as err:
        FusedAdamW(params, lr=-1.0, betas=(0.9, 1.5), max_grad_norm=0.0, backend="cuda")
    for part in ("lr must be", "betas must be", "max_grad_norm must be", "backend must be one of"):
        assert part in str(err.value)


def test_a_plain_module_trains_as_with_torch_adamw():
    """On ordinary tensors FusedAdamW is torch's AdamW to fp32 rounding (5 steps, rtol 1e-5), with its state."""
    models = [make_toy(), make_toy()]
    opts = [
        torch.optim.AdamW(models[0].parameters(), lr=LR, weight_decay=WD),
        FusedAdamW(models[1].parameters(), lr=LR, weight_decay=WD),
    ]
    for step in range(5):
        for model, opt in zip(models, opts, strict=True):
            model(*global_batch(step)).backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    state = opts[1].state_dict()["state"][0]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["step"].item() == 5.0


def _two_groups(named):
    """Two parameter groups: the weights decayed at LR, the biases undecayed at 3 LR (an ordinary AdamW recipe)."""
    named = list(named)
    weights = [p for n, p in named if n.endswith("weight")]
    biases = [p for n, p in named if not n.endswith("weight")]
    return [{"params": weights, "weight_decay": WD}, {"params": biases, "weight_decay": 0.0, "lr": 3 * LR}]


def test_two_parameter_groups_on_a_plain_module_train_as_with_torch_adamw():
    """Two groups (decay on one, another lr on the other): each steps with its own options, as torch's AdamW does
    (5 steps, rtol 1e-5)."""
    models = [make_toy(), make_toy()]
    opts = [
        torch.optim.AdamW(_two_groups(models[0].named_parameters()), lr=LR),
        FusedAdamW(_two_groups(models[1].named_parameters()), lr=LR),
    ]
    for step in range(5):
        for model, opt in zip(models, opts, strict=True):
            model(*global_batch(step)).backward()
            opt.step()
            opt.zero_grad()
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=n)


INTERPRETED = textwrap.dedent(
    """
    import torch
    from hfsdp.core.kernels.adamw_kernel import AdamWScalars, adamw_run
    gen = torch.Generator().manual_seed(3)
    n = 5000  # not a multiple of the block: the mask is exercised
    base = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1,
            torch.randn(n, generator=gen) * 0.01, torch.rand(n, generator=gen) * 0.01]
    results = {}
    for backend in ("triton", "torch"):
        p, g, m, v = (t.clone() for t in base)
        out = torch.full((n,), float("nan"), dtype=torch.bfloat16)
        used = adamw_run(p, g, m, v, AdamWScalars.of(3e-3, 0.9, 0.95, 1e-8, 0.1, 4), torch.tensor([0.5]), out,
                         backend=backend)
        results[backend] = (used, p, m, v, out)
    (t_used, *t), (c_used, *c) = results["triton"], results["torch"]
    assert (t_used, c_used) == ("triton", "torch")
    same = [torch.equal(a, b) for a, b in zip(t, c)]
    # Rounding to bf16 of awkward values: ties to even, the largest finite, subnormals, infinities, NaN.
    special = torch.tensor([1.00390625, 1.01171875, -1.00390625, 3.3895313892515355e38, 1e-40, -1e-45,
                            float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 65504.0])
    special = torch.cat([special, torch.randn(4096 - special.numel(), generator=gen)])
    z = torch.zeros_like(special)
    out = torch.empty(special.numel(), dtype=torch.bfloat16)
    # decay 1 and zero moments leave p unchanged only if the update is exactly zero: lr 0 makes it so.
    adamw_run(special.clone(), z.clone(), z.clone(), z.clone() + 1.0, AdamWScalars.of(0.0, 0.9, 0.95, 1e-8, 0.0, 1),
              None, out, backend="triton")
    # NaN stays NaN (torch's own casts disagree on its bits: 0xFFFF vectorised on the CPU, 0x7FFF on CUDA).
    finite = ~torch.isnan(special)
    rounding = torch.equal(out.view(torch.int16)[finite], special.to(torch.bfloat16).view(torch.int16)[finite])
    rounding = rounding and bool(torch.isnan(out[~finite].float()).all())
    print("RESULT", same, rounding)
    """
)


@requires_triton
def test_the_triton_kernel_computes_the_torch_paths_bits_under_the_interpreter():
    """The Triton kernel, run by Triton's interpreter on the CPU, gives the torch path's weights, moments and bf16
    output bit for bit, and rounds ties, subnormals and infinities to bf16 exactly as torch's cast does (NaN to
    a NaN)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT [True, True, True, True] True" in done.stdout, done.stdout


# -- in the engine: 2 gloo ranks --------------------------------------------------------------------------------

LAYOUTS = {
    "ZeRO-3 1x2 (no shard kept: the gather input is prestaged)": ("no_shard", "optim_grads_params", 1),
    "HFSDP 2x1 (a bf16 shard is kept and written by the step)": ("optim", "optim_grads_params", 2),
}


def _shard(world, layout, mp=None):
    from hfsdp.core import LayoutConfig, build_meshes, fully_shard

    outer, inner, instances = layout
    cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
    model = make_toy()
    return fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp)


def _train(sharded, opt, rank, world, steps, start=0, clip_apart=False):

    from hfsdp.core import clip_grad_norm_

    losses, norms = [], []
    for step in range(start, start + steps):
        losses.append(accumulated_loss(sharded, step, MICRO, rank, world))
        if clip_apart:
            norms.append(clip_grad_norm_(sharded, CLIP).item())
        opt.step()
        if clip_apart is False:  # None: no clipping at all
            norms.append(opt.grad_norm.item())
        opt.zero_grad()
    return losses, norms


def _pieces(sharded):
    from hfsdp.core import sharding_of

    return [(p.name, p.start, p.stop, p.param.detach().reshape(-1).clone()) for p in sharding_of(sharded).main_params]


def _compute_weights(sharded):
    """Per group: whether the compute-dtype weights the next forward reads equal the cast of the main weights,
    bit for bit (the kept shard, or the prestaged gather input), and which of the two it was."""
    from hfsdp.core import sharding_of
    from hfsdp.core.buffers.flat_layout import FlatLayout

    out = []
    for group in sharding_of(sharded).groups:
        if group.param_shard is not None:
            seen = group.param_shard[FlatLayout.within(group.param_range, group.optim_range)]
            out.append(("shard", torch.equal(seen, group.main.to(seen.dtype))))
        else:
            ready = group._gather_input_ready and group.unsharded.untyped_storage().nbytes() > 0
            seen = group.unsharded[slice(*group.param_range)] if ready else None
            out.append(("prestaged", ready and torch.equal(seen, group.main.to(seen.dtype))))
    return out


def _ranks(rank, world, root):
    from hfsdp.ckpt import load_checkpoint, save_checkpoint
    from hfsdp.core import MixedPrecision

    out = {}
    for name, layout in LAYOUTS.items():
        sharded = _shard(world, layout)
        opt = FusedAdamW(sharded.parameters(), lr=LR, weight_decay=WD, max_grad_norm=CLIP, prestage_gathers=True)
        losses, norms = _train(sharded, opt, rank, world, STEPS)
        out[name, "fp32"] = {"losses": losses, "norms": norms, "pieces": _pieces(sharded)}

        sharded = _shard(world, layout)
        opt = FusedAdamW(sharded.parameters(), lr=LR, weight_decay=WD, max_grad_norm=CROSS, prestage_gathers=True)
        losses, norms = _train(sharded, opt, rank, world, CROSS_STEPS)
        out[name, "crossing"] = {"losses": losses, "norms": norms, "pieces": _pieces(sharded)}

        sharded = _shard(world, layout)
        opt = FusedAdamW(_two_groups(sharded.named_parameters()), lr=LR, prestage_gathers=True)
        losses, _ = _train(sharded, opt, rank, world, STEPS, clip_apart=None)
        out[name, "two groups"] = {"losses": losses, "pieces": _pieces(sharded)}

        bf16 = MixedPrecision(param_dtype=torch.bfloat16)
        results = {}
        fused = {"max_grad_norm": CLIP, "prestage_gathers": True}
        for kind in ("fused", "torch"):
            sharded = _shard(world, layout, mp=bf16)
            if kind == "fused":
                opt = FusedAdamW(sharded.parameters(), lr=LR, weight_decay=WD, **fused)
            else:
                opt = torch.optim.AdamW(sharded.parameters(), lr=LR, weight_decay=WD)
            losses, _ = _train(sharded, opt, rank, world, STEPS, clip_apart=kind == "torch")
            results[kind] = {"losses": losses, "pieces": _pieces(sharded), "compute": _compute_weights(sharded)}
        out[name, "bf16"] = results

    # Save with FusedAdamW after 2 steps; torch's AdamW and FusedAdamW both resume it for the third step.
    layout = LAYOUTS["HFSDP 2x1 (a bf16 shard is kept and written by the step)"]
    sharded = _shard(world, layout)
    opt = FusedAdamW(sharded.parameters(), lr=LR, weight_decay=WD)
    _train(sharded, opt, rank, world, 2, clip_apart=True)
    save_checkpoint(root, sharded, opt, step=2)
    resumed = {}
    for kind, build in (("torch", torch.optim.AdamW), ("fused", FusedAdamW)):
        sharded = _shard(world, layout)
        opt = build(sharded.parameters(), lr=LR, weight_decay=WD)
        load_checkpoint(root, sharded, opt)
        losses, norms = _train(sharded, opt, rank, world, 1, start=2, clip_apart=True)
        resumed[kind] = {"losses": losses, "norms": norms, "pieces": _pieces(sharded)}
    out["resumed"] = resumed
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_distributed(_ranks, 2, str(tmp_path_factory.mktemp("fused") / "ck"))


def _assemble(ranks, shapes):
    full = {name: torch.full((shape.numel(),), float("nan")) for name, shape in shapes.items()}
    for pieces in ranks:
        for name, start, stop, values in pieces:
            full[name][start:stop] = values
    assert not any(torch.isnan(t).any() for t in full.values()), "some element is held by no rank"
    return {name: t.view(shapes[name]) for name, t in full.items()}


def _torch_reference(steps=STEPS, clip=CLIP, groups=False):
    model = make_toy()
    params = _two_groups(model.named_parameters()) if groups else model.parameters()
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    losses, norms = plain_steps(model, opt, lambda step: model(*global_batch(step)), steps, clip)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_as_torch(world2, key, ref_losses, ref_norms, ref_params) -> None:
    """Case `key`'s losses and norms (rank 0's; None: not clipped) and its parameters assembled from every rank's
    pieces equal torch's AdamW on the one-process model (rtol 1e-5)."""
    case = world2[0][key]
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    if ref_norms is not None:
        torch.testing.assert_close(torch.tensor(case["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    params = _assemble([r[key]["pieces"] for r in world2], {n: p.shape for n, p in ref_params.items()})
    for n, value in ref_params.items():
        torch.testing.assert_close(params[n], value, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_clipped_fused_steps_match_torch_adamw_on_the_unsharded_model(world2, name):
    """fp32, 3 steps x 2 microbatches, clipping at 0.05 inside the step: losses, global norms and parameters are
    those of torch's AdamW after clip_grad_norm_ on the one-process model (rtol 1e-5)."""
    _assert_as_torch(world2, (name, "fp32"), *_torch_reference())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_norm_crossing_the_limit_both_ways_is_clipped_only_above_it(world2, name):
    """fp32, 8 steps clipped at 1.5 while the global norm goes above and below it (crossing both ways): losses, norms
    and parameters are torch's AdamW after clip_grad_norm_ on the one-process model (rtol 1e-5), so a step below the
    limit leaves its gradient unscaled."""
    ref_losses, ref_norms, ref_params = _torch_reference(steps=CROSS_STEPS, clip=CROSS)
    pairs = list(itertools.pairwise(ref_norms))
    assert any(a > CROSS > b for a, b in pairs) and any(a < CROSS < b for a, b in pairs), ref_norms
    _assert_as_torch(world2, (name, "crossing"), ref_losses, ref_norms, ref_params)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_parameter_groups_match_torch_adamw_on_the_unsharded_model(world2, name):
    """fp32, 3 steps, weights decayed at lr 1e-2 and biases undecayed at 3e-2 (runs cut where the options change):
    losses and parameters are those of torch's AdamW with the same two groups on the one-process model (rtol 1e-5)."""
    ref_losses, _, ref_params = _torch_reference(clip=None, groups=True)
    _assert_as_torch(world2, (name, "two groups"), ref_losses, None, ref_params)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_weights_written_by_the_step_are_the_cast_of_the_main_weights(world2, name):
    """bf16 compute: after the last step the weights the next forward reads (the kept shard, or the prestaged
    gather input) equal the cast of the fp32 main weights bit for bit on every rank and group, and 3 steps
    train like hfsdp with torch's AdamW (losses rtol 1e-4, main weights 1e-5: the forward runs in bf16)."""
    kind = "prestaged" if "prestaged" in name else "shard"
    for rank in world2:
        assert rank[name, "bf16"]["fused"]["compute"] == [(kind, True)] * 4
    fused, plain = world2[0][name, "bf16"]["fused"], world2[0][name, "bf16"]["torch"]
    torch.testing.assert_close(torch.tensor(fused["losses"]), torch.tensor(plain["losses"]), rtol=1e-4, atol=0)
    shapes = {n: p.shape for n, p in make_toy().named_parameters()}
    got = _assemble([r[name, "bf16"]["fused"]["pieces"] for r in world2], shapes)
    want = _assemble([r[name, "bf16"]["torch"]["pieces"] for r in world2], shapes)
    for n in shapes:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


def test_a_fused_checkpoint_resumes_in_torch_adamw_and_in_fused_adamw(world2):
    """Saved by FusedAdamW at step 2 (state named as torch's AdamW names it), the checkpoint loads into
    torch.optim.AdamW and into FusedAdamW; both third steps give the uninterrupted reference's loss, norm and
    parameters."""
    ref_losses, ref_norms, ref_params = _torch_reference(steps=3)
    shapes = {n: p.shape for n, p in ref_params.items()}
    for kind in ("torch", "fused"):
        case = world2[0]["resumed"][kind]
        torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(ref_losses[2:]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(case["norms"]), torch.tensor(ref_norms[2:]), rtol=1e-5, atol=0)
        params = _assemble([r["resumed"][kind]["pieces"] for r in world2], shapes)
        for n, value in ref_params.items():
            torch.testing.assert_close(params[n], value, rtol=1e-5, atol=1e-6, msg=f"{kind} {n}")
