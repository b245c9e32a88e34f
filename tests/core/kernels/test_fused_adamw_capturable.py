"""FusedAdamW(capturable=True): the per-step scalars computed on the device from device step counts, so `step()`
never reads a tensor on the host (a CUDA graph can capture it; on the CPU the same code runs, "device" being the CPU).

Checked here on the CPU: the device-computed scalars are the host's `AdamWScalars.of` rounded to fp32, bit for bit,
over thousands of steps; so capturable=True gives capturable=False's weights, moments and step counts bit for bit
(plain tensors, and an hfsdp model on one gloo rank with fp32, bf16 and fp8 moments, a bf16 reduced gradient,
max_grad_norm, and a 0-dim tensor lr driven by an LR scheduler); no `.item()`, `float()`, `int()` or `bool()` of a
tensor happens inside a capturable step; checkpoints of a capturable optimizer save and load (into either mode); and
what cannot be capturable is refused.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from hfsdp.core.kernels.adamw_kernel import AdamWScalars, device_scalars, scalar_constants
from hfsdp.core.kernels.fused_adamw import FusedAdamW

from tests.support.distributed import run_distributed
from tests.support.toy_models import accumulated_loss

LR, WD, CLIP, STEPS = 3e-3, 0.1, 0.05, 4
MOMENTS = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "fp8": ("fp8", "fp8")}


@contextlib.contextmanager
def no_host_reads():
    """Make every way Python reads a tensor's value on the host raise (what a CUDA graph capture cannot do)."""
    names = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def refuse(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name} called inside a capturable step")

        return read

    try:
        for name in names:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


# -- the scalars -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95), (0.8, 0.99), (0.0, 0.5)])
def test_device_scalars_are_the_host_scalars_rounded_to_fp32(betas):
    """Every field, steps 1 to 5000, a few lrs and weight decays: the same fp32 bits as the host's doubles rounded
    (what the kernel and the torch path get from Python floats). Also from a float64 and an fp32 tensor lr."""
    steps = [torch.tensor(float(t), dtype=torch.float32) for t in range(5000)]
    for lr, wd, eps in ((1e-3, 0.1, 1e-8), (3e-4, 0.0, 1e-6), (0.1, 0.01, 1e-8), (7e-5, 0.05, 0.0)):
        rows = [(lr, *betas, eps, wd)] * len(steps)
        host = torch.tensor(
            [list(vars(AdamWScalars.of(lr, *betas, eps, wd, t + 1)).values()) for t in range(len(steps))],
            dtype=torch.float32,
        )
        consts = scalar_constants(rows, "cpu")
        assert torch.equal(device_scalars(steps, [None] * len(steps), consts), host)
        lr64 = torch.tensor(lr, dtype=torch.float64)
        assert torch.equal(device_scalars(steps, [lr64] * len(steps), consts), host)
        lr32 = torch.tensor(lr, dtype=torch.float32)  # an fp32 lr is its fp32 value, exactly as a float of it
        host32 = torch.tensor(
            [list(vars(AdamWScalars.of(float(lr32), *betas, eps, wd, t + 1)).values()) for t in range(50)],
            dtype=torch.float32,
        )
        assert torch.equal(device_scalars(steps[:50], [lr32] * 50, consts[:50]), host32)


# -- plain tensors ---------------------------------------------------------------------------------------------


def _plain(capturable: bool, moments: str, lr=LR):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((300,), (17, 29), (5,))]
    m, v = MOMENTS[moments]
    opt = FusedAdamW(params, lr=lr, weight_decay=WD, exp_avg_dtype=m, exp_avg_sq_dtype=v, capturable=capturable)
    return params, opt


def _state_bits(opt: FusedAdamW, params) -> list:
    """Each parameter's state as (dtype, its bytes): fp8 tensors do not pickle (the engine cases return these)."""
    out = []
    for p in params:
        entry = opt.checkpoint_state(p)
        out.append(
            {k: (str(v.dtype), v.detach().reshape(-1).view(torch.uint8).cpu().clone()) for k, v in entry.items()}
        )
    return out


def _same_state(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key][0] == y[key][0], key
            assert torch.equal(x[key][1], y[key][1]), key


def _step_both(ref, eager, opt, device, grads) -> None:
    """One step of `ref` over `eager` and of the capturable `opt` over `device` (no host read), the same gradients."""
    for p, q, g in zip(eager, device, grads, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    ref.step()
    with no_host_reads():
        opt.step()


@pytest.mark.parametrize("moments", sorted(MOMENTS))
def test_plain_tensors_step_as_without_capturable_bit_for_bit(moments):
    eager, ref = _plain(False, moments)
    device, opt = _plain(True, moments)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        _step_both(ref, eager, opt, device, [torch.randn(p.shape, generator=gen) * (1 + step) for p in eager])
    for p, q in zip(eager, device, strict=True):
        assert torch.equal(p, q)
    _same_state(_state_bits(ref, eager), _state_bits(opt, device))
    for p in device:
        step = opt.state[p]["step"]
        assert step.dtype == torch.float32 and step.dim() == 0 and float(step) == 6.0


def test_the_host_read_check_catches_the_plain_step():
    """`no_host_reads` is a real check: without capturable the step reads each step count on the host."""
    params, opt = _plain(False, "fp32")
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(AssertionError, match="inside a capturable step"), no_host_reads():
        opt.step()


def test_a_tensor_lr_changed_by_a_scheduler_is_read_at_each_step():
    """float lr + LambdaLR (capturable=False) against a float64 0-dim tensor lr + LambdaLR (capturable=True, the
    scheduler fills the tensor in place): the same bits."""
    eager, ref = _plain(False, "fp32")
    device, opt = _plain(True, "fp32", lr=torch.tensor(LR, dtype=torch.float64))
    lr_tensor = opt.param_groups[0]["lr"]

    def schedule(step):
        return 1.0 / (1 + step)

    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in (ref, opt)]
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in eager]
        for p, q, g in zip(eager, device, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        with no_host_reads():
            opt.step()
        for s in schedulers:
            s.step()
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == ref.param_groups[0]["lr"]
    for p, q in zip(eager, device, strict=True):
        assert torch.equal(p, q)


def test_a_state_dict_round_trip_puts_steps_where_each_mode_keeps_them():
    eager, ref = _plain(False, "bf16")
    device, opt = _plain(True, "bf16", lr=torch.tensor(LR, dtype=torch.float64))
    lr_tensor = opt.param_groups[0]["lr"]
    for p, q in zip(eager, device, strict=True):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    ref.step()
    opt.step()
    steps = [opt.state[q]["step"] for q in device]
    # Deep copies: torch's load keeps a CPU step tensor as it is, shared with the optimizer it came from.
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # a non-capturable state dict into a capturable optimizer
    assert [opt.state[q]["step"] for q in device] == steps  # the same tensors (a captured graph reads them)
    assert opt.param_groups[0]["lr"] is lr_tensor and opt.param_groups[0]["capturable"] is True
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # and back
    assert ref.param_groups[0]["capturable"] is False
    assert all(isinstance(ref.state[p]["step"], torch.Tensor) for p in eager)
    _step_both(ref, eager, opt, device, [torch.full_like(p, 0.5) for p in eager])
    for p, q in zip(eager, device, strict=True):
        assert torch.equal(p, q)
    _same_state(_state_bits(ref, eager), _state_bits(opt, device))


def test_what_cannot_be_capturable_is_refused():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"capturable=True cannot be combined with prestage_gathers=True"):
        FusedAdamW(p, capturable=True, prestage_gathers=True)
    with pytest.raises(ValueError, match=r"capturable=True cannot be combined with prestage_gathers=True"):
        FusedAdamW(p, capturable=True, prestage_gathers=True, overlap_next_forward=True)
    with pytest.raises(ValueError, match=r"capturable must be True or False"):
        FusedAdamW(p, capturable=1)
    with pytest.raises(ValueError, match=r"a float, not a tensor"):
        FusedAdamW(p, lr=torch.tensor(1e-3))  # a tensor lr only with capturable=True, as before
    with pytest.raises(ValueError, match=r"0-dim floating tensor"):
        FusedAdamW(p, lr=torch.tensor([1e-3]), capturable=True)


# -- in the engine: one gloo rank ---------------------------------------------------------------------------------


def _shard(mp=None, offload=False):
    from hfsdp.core import LayoutConfig, build_meshes, fully_shard

    from tests.support.toy_models import make_toy

    cfg = LayoutConfig(world_size=1, inner="optim_grads_params", outer="no_shard", instances=1)
    model = make_toy()
    return fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp, offload=offload)


def _snapshot(sharded, opt) -> dict:
    from hfsdp.core import sharding_of

    pieces = sharding_of(sharded).main_params
    return {
        "weights": [p.param.detach().clone() for p in pieces],
        "state": _state_bits(opt, [p.param for p in pieces]),
        "steps": [float(opt.state[p.param]["step"]) for p in pieces],
        "step_devices": sorted({str(opt.state[p.param]["step"].device) for p in pieces}),
    }


def _train(sharded, opt, steps, start=0, capturable=False, scheduler=None, addresses=None):
    from hfsdp.core import sharding_of

    norms = []
    for step in range(start, start + steps):
        accumulated_loss(sharded, step, 2, 0, 1)
        if addresses is not None:  # where each group's reduced gradient is, step by step
            addresses.append([g.grads.main_grad.data_ptr() for g in sharding_of(sharded).groups])
        with no_host_reads() if capturable else contextlib.nullcontext():
            opt.step()
        if opt.grad_norm is not None:
            norms.append(opt.grad_norm.clone())
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return norms


def _engine_cases(rank, world, root):
    from hfsdp.ckpt import load_checkpoint, save_checkpoint
    from hfsdp.core import MixedPrecision, sharding_of

    out = {}
    cases = {
        "fp32 moments, clipped": ("fp32", None, CLIP),
        "bf16 moments, bf16 gradients read from the buffer, clipped": ("bf16", torch.bfloat16, CLIP),
        "fp8 moments, clipped": ("fp8", None, CLIP),
        "fp8 moments, bf16 gradients, not clipped": ("fp8", torch.bfloat16, None),
    }
    for name, (moments, reduce, clip) in cases.items():
        runs = {}
        for capturable in (False, True):
            mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce) if reduce else None
            sharded = _shard(mp)
            m, v = MOMENTS[moments]
            opt = FusedAdamW(
                sharded.parameters(), lr=LR, weight_decay=WD, max_grad_norm=clip, exp_avg_dtype=m,
                exp_avg_sq_dtype=v, capturable=capturable,
            )  # fmt: skip
            addresses = []
            norms = _train(sharded, opt, STEPS, capturable=capturable, addresses=addresses)
            kept = [g.grads.keep_storage for g in sharding_of(sharded).groups]
            runs[capturable] = {**_snapshot(sharded, opt), "norms": norms, "addresses": addresses, "kept": kept}
        out[name] = runs

    # A 0-dim float64 lr tensor on a warmup-then-decay schedule (capturable) against the same schedule on floats.
    runs = {}
    for capturable in (False, True):
        sharded = _shard()
        lr = torch.tensor(LR, dtype=torch.float64) if capturable else LR
        opt = FusedAdamW(sharded.parameters(), lr=lr, weight_decay=WD, max_grad_norm=CLIP, capturable=capturable)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.9**s)
        _train(sharded, opt, STEPS + 1, capturable=capturable, scheduler=scheduler)
        runs[capturable] = _snapshot(sharded, opt)
    out["scheduled tensor lr"] = runs

    # Checkpoints: a capturable optimizer saves after 2 steps; a capturable one and a plain one both resume it.
    sharded = _shard()
    opt = FusedAdamW(sharded.parameters(), lr=LR, weight_decay=WD, exp_avg_dtype="fp8", capturable=True)
    _train(sharded, opt, 2, capturable=True)
    save_checkpoint(root, sharded, opt, step=2)
    _train(sharded, opt, 1, start=2, capturable=True)
    resumed = {"straight": _snapshot(sharded, opt)}
    for capturable in (True, False):
        sharded = _shard()
        lr = torch.tensor(1.0, dtype=torch.float64) if capturable else 1.0  # the checkpoint's lr replaces it
        opt = FusedAdamW(sharded.parameters(), lr=lr, weight_decay=WD, exp_avg_dtype="fp8", capturable=capturable)
        load_checkpoint(root, sharded, opt)
        lr_kept = opt.param_groups[0]["lr"] is lr
        _train(sharded, opt, 1, start=2, capturable=capturable)
        resumed[capturable] = {**_snapshot(sharded, opt), "lr": float(opt.param_groups[0]["lr"]), "kept": lr_kept}
    out["resumed"] = resumed

    refusals = {}
    try:
        FusedAdamW(_shard(offload=True).parameters(), lr=LR, capturable=True)
    except ValueError as err:
        refusals["offload"] = str(err)
    out["refusals"] = refusals
    return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return run_distributed(_engine_cases, 1, str(tmp_path_factory.mktemp("capturable") / "ck"))[0]


def _same_snapshots(a: dict, b: dict) -> None:
    for x, y in zip(a["weights"], b["weights"], strict=True):
        assert torch.equal(x, y)
    _same_state(a["state"], b["state"])
    assert a["steps"] == b["steps"]


@pytest.mark.parametrize(
    "name",
    [
        "fp32 moments, clipped",
        "bf16 moments, bf16 gradients read from the buffer, clipped",
        "fp8 moments, clipped",
        "fp8 moments, bf16 gradients, not clipped",
        "scheduled tensor lr",
    ],
)
def test_an_hfsdp_model_trains_as_without_capturable_bit_for_bit(engine, name):
    plain, device = engine[name][False], engine[name][True]
    _same_snapshots(plain, device)
    assert plain["steps"] == [float(STEPS + (name == "scheduled tensor lr"))] * len(plain["steps"])
    assert plain["step_devices"] == ["cpu"] and device["step_devices"] == ["cpu"]
    for x, y in zip(plain.get("norms", []), device.get("norms", []), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    "name", ["fp32 moments, clipped", "bf16 moments, bf16 gradients read from the buffer, clipped"]
)
def test_a_capturable_step_reads_its_gradients_at_one_address_every_step(engine, name):
    """A captured step replays the addresses it read: under capturable=True every group keeps its gradient buffer
    (freed after each step otherwise)."""
    plain, device = engine[name][False], engine[name][True]
    assert all(device["kept"]) and not any(plain["kept"])
    assert len(device["addresses"]) == STEPS
    assert all(step == device["addresses"][0] for step in device["addresses"])


def test_a_capturable_checkpoint_resumes_in_either_mode(engine):
    resumed = engine["resumed"]
    _same_snapshots(resumed["straight"], resumed[True])
    _same_snapshots(resumed["straight"], resumed[False])
    assert resumed[True]["kept"] and resumed[True]["lr"] == LR  # the tensor lr is filled, not replaced
    assert resumed[False]["lr"] == LR


def test_an_offloaded_group_is_refused(engine):
    assert "FusedAdamW(capturable=True) cannot step a group offloaded to host memory" in engine["refusals"]["offload"]
