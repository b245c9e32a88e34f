"""FusedAdamW's moment dtypes (Megatron's precision-aware optimizer): bf16, fp16 and fp8 moments, bf16 gradients.

The torch path (what CPU runs, written to compute what the Triton kernel computes) is checked bit for bit against
a plain PyTorch reference written here from the formula: fp32 math, each moment rounded to its dtype (to nearest
even) after each update, fp8 with one power-of-two scale per block of 128 elements of each piece. In the engine
(gloo ranks): a bf16 gradient read from the reduced buffer gives the bits of the fp32 copies it replaces, a save
and resume on an HFSDP 2x3 layout continues bit for bit in every dtype, and a resume on 2x2 keeps the dtypes.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from hfsdp.core.kernels.adamw_kernel import SCALE_BLOCK, AdamWScalars, ScaleBlocks, adamw_run
from hfsdp.core.kernels.fused_adamw import FusedAdamW
from hfsdp.core.kernels.optimizer_dtypes import parse_state_dtype

from tests.support.distributed import run_distributed
from tests.support.toy_models import global_batch, make_toy, toy_steps

E4, E5, BF, F16, F32 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32
FP8_MAX = {E4: 448.0, E5: 57344.0}
#: (exp_avg dtype, exp_avg_sq dtype) as given to FusedAdamW (Megatron's names or torch dtypes).
OPTIONS = {
    "fp32/fp32": ("fp32", "fp32"),
    "bf16/bf16": ("bf16", torch.bfloat16),
    "fp16/fp16": ("fp16", "fp16"),
    "fp8/fp8": ("fp8", "fp8"),
    "bf16/fp8": (torch.bfloat16, torch.float8_e5m2),
    "fp8/fp32": (torch.float8_e4m3fn, "fp32"),
}
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1


def _dtypes(option: str) -> tuple[torch.dtype, torch.dtype]:
    return tuple(
        d if isinstance(d, torch.dtype) else parse_state_dtype(d, k)
        for d, k in zip(OPTIONS[option], ("exp_avg", "exp_avg_sq"), strict=True)
    )


# -- the reference ---------------------------------------------------------------------------------------------


class Moment:
    """A moment kept as the reference keeps it: values in `dtype`, and for fp8 a float scale per block of 128
    elements of each piece (`lengths`)."""

    def __init__(self, n: int, dtype: torch.dtype, lengths: list[int]):
        self.stored = torch.zeros(n, dtype=dtype)
        self.blocks = [
            (at + lo, min(SCALE_BLOCK, length - lo))
            for at, length in _starts(lengths)
            for lo in range(0, length, SCALE_BLOCK)
        ]
        self.scales = [1.0] * len(self.blocks)

    def values(self) -> torch.Tensor:
        out = self.stored.float()
        if self.stored.dtype in FP8_MAX:
            for (start, length), scale in zip(self.blocks, self.scales, strict=True):
                out[start : start + length] *= scale
        return out

    def store(self, values: torch.Tensor) -> None:
        if self.stored.dtype not in FP8_MAX:
            self.stored = values.to(self.stored.dtype)
            return
        fmax = FP8_MAX[self.stored.dtype]
        for i, (start, length) in enumerate(self.blocks):
            block = values[start : start + length]
            scale = _pow2_at_least(block.abs().max().item() / fmax)
            self.stored[start : start + length] = (block / scale).to(self.stored.dtype)
            self.scales[i] = scale


def _starts(lengths):
    at = 0
    for length in lengths:
        yield at, length
        at += length


def _pow2_at_least(x: float) -> float:
    """The smallest power of two >= x, between 2**-126 and 2**126 (math.frexp: exact)."""
    mantissa, exponent = math.frexp(x)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    e = exponent - 1 if mantissa == 0.5 else exponent
    return 2.0 ** min(max(e, -126), 126)


def reference_step(p, g, m: Moment, v: Moment, coef: float, step: int) -> torch.Tensor:
    """One AdamW step in fp32, one rounding per operation (the square root correctly rounded, through double)."""
    lr, (beta1, beta2) = LR, BETAS
    g = g.float() * torch.tensor(coef, dtype=torch.float32)
    m_new = m.values() * beta1 + g * (1 - beta1)
    v_new = v.values() * beta2 + (g * g) * (1 - beta2)
    denom = v_new.double().sqrt().float() * (1 / math.sqrt(1 - beta2**step)) + EPS
    p = p * (1 - lr * WD) - (m_new / denom) * (lr / (1 - beta1**step))
    m.store(m_new)
    v.store(v_new)
    return p


@pytest.mark.parametrize("grad_dtype", [F32, BF])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_dtype_option_steps_as_the_plain_reference_bit_for_bit(option, grad_dtype):
    """6 steps over a run of three pieces (blocks cut at each piece's start, the last ones short), the gradient
    clipped by 0.37 and ranging over 9 binades: weights, stored moments and fp8 scales equal the reference's."""
    m_dtype, v_dtype = _dtypes(option)
    lengths = [300, 77, 1000]
    n = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    spread = torch.exp(torch.linspace(-10, 0, n))  # 1e-6 .. 1 of each other: small moments beside large ones
    p = torch.randn(n, generator=gen)
    ref_p = p.clone()
    m, v = torch.zeros(n, dtype=m_dtype), torch.zeros(n, dtype=v_dtype)
    blocks = ScaleBlocks(lengths, "cpu")
    scales = tuple(torch.ones(blocks.count) if d in FP8_MAX else None for d in (m_dtype, v_dtype))
    ref_m, ref_v = Moment(n, m_dtype, lengths), Moment(n, v_dtype, lengths)
    for step in range(1, 7):
        g = (torch.randn(n, generator=gen) * spread * 1e-2).to(grad_dtype)
        used = adamw_run(
            p,
            g,
            m,
            v,
            AdamWScalars.of(LR, *BETAS, EPS, WD, step),
            torch.tensor([0.37]),
            None,
            "torch",
            scales=scales,
            blocks=blocks,
        )
        assert used == "torch"
        ref_p = reference_step(ref_p, g, ref_m, ref_v, 0.37, step)
    assert torch.equal(p, ref_p)
    for mine, ref, scale in ((m, ref_m, scales[0]), (v, ref_v, scales[1])):
        assert mine.dtype == ref.stored.dtype and torch.equal(
            mine.view(torch.uint8) if mine.dtype in FP8_MAX else mine,
            ref.stored.view(torch.uint8) if mine.dtype in FP8_MAX else ref.stored,
        )
        if scale is not None:
            assert scale.tolist() == ref.scales
            assert ref.stored.float().abs().max() > 0 and (ref.stored.float() != 0).float().mean() > 0.99  # no flush


def _plain_run(option, steps, opt=None, model=None):
    model = model or make_toy()
    opt = opt or FusedAdamW(
        model.parameters(),
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        exp_avg_dtype=OPTIONS[option][0],
        exp_avg_sq_dtype=OPTIONS[option][1],
        backend="torch",
    )
    for step in range(steps):
        model(*global_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("option", list(OPTIONS))
def test_fused_adamw_on_a_plain_module_steps_as_the_reference(option):
    """FusedAdamW over ordinary tensors (each one piece), 4 steps: the weights are the reference's bit for bit, its
    state dict holds each moment in its dtype (fp8 with a uint8 scale per element)."""
    m_dtype, v_dtype = _dtypes(option)
    model, opt = _plain_run(option, 4)
    ref = make_toy()
    moments = {
        n: (Moment(p.numel(), m_dtype, [p.numel()]), Moment(p.numel(), v_dtype, [p.numel()]))
        for n, p in ref.named_parameters()
    }
    for step in range(4):
        ref.zero_grad()
        ref(*global_batch(step)).backward()
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(reference_step(p.reshape(-1), p.grad.reshape(-1), *moments[n], 1.0, step + 1).view(p.shape))
    for (n, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), n
    state = opt.state_dict()["state"][0]
    assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == (m_dtype, v_dtype)
    for key, dtype in (("exp_avg", m_dtype), ("exp_avg_sq", v_dtype)):
        assert (f"{key}_scale" in state) == (dtype in FP8_MAX)
        if dtype in FP8_MAX:
            assert state[f"{key}_scale"].dtype == torch.uint8 and state[f"{key}_scale"].shape == state[key].shape


@pytest.mark.parametrize("option", ["bf16/bf16", "fp8/fp8", "bf16/fp8"])
def test_state_dicts_load_in_the_same_other_and_fp32_dtypes(option):
    """A state dict of the same dtypes loads bit for bit (the next steps equal the uninterrupted run's); one of
    torch's AdamW (fp32) and one of other low dtypes load converted once into this optimizer's dtypes."""
    m_dtype, v_dtype = _dtypes(option)
    model, opt = _plain_run(option, 2)
    saved = copy.deepcopy(opt.state_dict())  # its tensors are the optimizer's own, which the next steps change
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    _plain_run(option, 2, opt, model)  # uninterrupted: steps 3 and 4 (same batches as steps 1 and 2)

    resumed = make_toy()
    with torch.no_grad():
        for n, p in resumed.named_parameters():
            p.copy_(weights[n])
    opt2 = FusedAdamW(
        resumed.parameters(),
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        exp_avg_dtype=m_dtype,
        exp_avg_sq_dtype=v_dtype,
    )
    opt2.load_state_dict(saved)
    again = opt2.state_dict()["state"]
    for index, entry in saved["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim():
                assert again[index][key].dtype == value.dtype and torch.equal(
                    again[index][key].view(torch.uint8), value.view(torch.uint8)
                ), key
    _plain_run(option, 2, opt2, resumed)
    for (n, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), n

    for source in ("fp32/fp32", "fp16/fp16" if option != "fp16/fp16" else "bf16/bf16"):
        _, other = _plain_run(source, 2)
        into = FusedAdamW(make_toy().parameters(), exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype)
        into.load_state_dict(other.state_dict())
        for index, entry in into.state_dict()["state"].items():
            src = other.state_dict()["state"][index]
            for key, dtype in (("exp_avg", m_dtype), ("exp_avg_sq", v_dtype)):
                assert entry[key].dtype == dtype
                values = entry[key].float()
                if dtype in FP8_MAX:
                    values = values * (entry[f"{key}_scale"].to(torch.int32) << 23).view(torch.float32)
                tol = {BF: 2**-8, E4: 2**-4, E5: 2**-3}[dtype]  # half an ulp of the format, relative
                torch.testing.assert_close(values, src[key].float(), rtol=tol, atol=1e-30)


def test_bad_dtypes_are_refused_with_the_allowed_values():
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError) as err:
        FusedAdamW(params, exp_avg_dtype="fp4", exp_avg_sq_dtype=torch.float8_e4m3fn, lr=-1.0)
    text = str(err.value)
    assert "exp_avg_dtype must be one of fp32, bf16, fp16, fp8" in text and "'fp4'" in text
    assert "exp_avg_sq_dtype must be one of fp32, bf16, fp16, fp8" in text and "torch.float8_e5m2" in text
    assert "lr must be" in text  # refused together with the other arguments
    with pytest.raises(ValueError, match="exp_avg_sq_dtype must be one of fp32, bf16, fp16, fp8"):
        parse_state_dtype("int8", "exp_avg_sq")
    assert parse_state_dtype("fp8", "exp_avg") == E4 and parse_state_dtype("fp8", "exp_avg_sq") == E5
    assert parse_state_dtype("bf16", "exp_avg") == BF and parse_state_dtype("fp16", "exp_avg_sq") == F16


# -- in the engine: HFSDP 2x3 (6 gloo ranks), then 2x2 --------------------------------------------------------

ENGINE_OPTIONS = ["bf16/bf16", "fp8/fp8", "bf16/fp8"]
MICRO = 2


def _sharded(world, instances, mp):
    from hfsdp.core import LayoutConfig, build_meshes, fully_shard

    cfg = LayoutConfig(world_size=world, inner="optim_grads_params", outer="optim", instances=instances)
    model = make_toy()
    return fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp)


def _optimizer(sharded, option, cls=FusedAdamW):
    m, v = OPTIONS[option]
    return cls(
        sharded.parameters(),
        lr=LR,
        weight_decay=WD,
        max_grad_norm=0.05,
        exp_avg_dtype=m,
        exp_avg_sq_dtype=v,
        backend="torch",
    )


def _steps(sharded, opt, rank, world, start, count) -> list[float]:
    return toy_steps(sharded, opt, rank, world, start, count, MICRO)


def _snapshot(sharded, opt):
    from hfsdp.core import sharding_of

    pieces = [(p.name, p.param.detach().clone()) for p in sharding_of(sharded).main_params]
    state = {}
    for p in sharding_of(sharded).main_params:
        for key, value in opt.checkpoint_state(p.param).items():
            if isinstance(value, torch.Tensor) and value.dim():
                state[p.name, key] = (str(value.dtype), value.detach().reshape(-1).view(torch.uint8).clone())
    return pieces, state


class _CopyingFusedAdamW(FusedAdamW):
    """FusedAdamW stepping the fp32 copies of a bf16 gradient the engine makes for other optimizers."""

    _direct_grads = False


def _bf16_mp():
    from hfsdp.core import MixedPrecision

    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


def _ranks6(rank, world, root):
    from hfsdp.ckpt import load_checkpoint, save_checkpoint

    out = {}
    for kind, cls in (("direct", FusedAdamW), ("copies", _CopyingFusedAdamW)):
        sharded = _sharded(world, 2, _bf16_mp())
        opt = _optimizer(sharded, "fp8/fp8", cls)
        losses = _steps(sharded, opt, rank, world, 0, 3)
        out["grads", kind] = (losses, _snapshot(sharded, opt), opt.backends_used)
    for option in ENGINE_OPTIONS:
        sharded = _sharded(world, 2, _bf16_mp())
        opt = _optimizer(sharded, option)
        _steps(sharded, opt, rank, world, 0, 2)
        save_checkpoint(f"{root}/{option.replace('/', '-')}", sharded, opt, step=2)
        saved = _snapshot(sharded, opt)
        losses = _steps(sharded, opt, rank, world, 2, 2)
        out[option, "uninterrupted"] = (losses, _snapshot(sharded, opt), saved)
        sharded = _sharded(world, 2, _bf16_mp())
        opt = _optimizer(sharded, option)
        load_checkpoint(f"{root}/{option.replace('/', '-')}", sharded, opt)
        loaded = _snapshot(sharded, opt)
        losses = _steps(sharded, opt, rank, world, 2, 2)
        out[option, "resumed"] = (losses, _snapshot(sharded, opt), loaded)
    return out


def _ranks4(rank, world, root):
    from hfsdp.ckpt import load_checkpoint

    out = {}
    for option in ENGINE_OPTIONS:
        sharded = _sharded(world, 2, _bf16_mp())
        opt = _optimizer(sharded, option)
        load_checkpoint(f"{root}/{option.replace('/', '-')}", sharded, opt)
        dtypes = {(k, v[0]) for (_, k), v in _snapshot(sharded, opt)[1].items()}
        losses = _steps(sharded, opt, rank, world, 2, 2)
        out[option] = (losses, dtypes, {(k, v[0]) for (_, k), v in _snapshot(sharded, opt)[1].items()})
    sharded = _sharded(world, 2, _bf16_mp())
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR, weight_decay=WD)
    load_checkpoint(f"{root}/fp8-fp8", sharded, opt)
    states = [opt.state[p] for p in sharded.parameters() if p.numel()]
    out["torch"] = {(k, str(v.dtype)) for state in states for k, v in state.items() if v.dim()}
    fused = _optimizer(sharded, "fp8/fp8")
    _steps(sharded, fused, rank, world, 2, 1)
    direct = torch.optim.AdamW(sharded.parameters(), lr=LR, weight_decay=WD)
    direct.load_state_dict(fused.state_dict())  # torch casts the fp8 moments to fp32, scales lost
    try:
        _steps(sharded, direct, rank, world, 3, 1)
        out["direct"] = "stepped"
    except ValueError as err:
        out["direct"] = str(err)
    return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dtypes") / "ck")
    return run_distributed(_ranks6, 6, root), run_distributed(_ranks4, 4, root), root


def _same(a, b) -> bool:
    (pa, sa), (pb, sb) = a, b
    return (
        all(n == m and torch.equal(x, y) for (n, x), (m, y) in zip(pa, pb, strict=True))
        and sa.keys() == sb.keys()
        and all(sa[k][0] == sb[k][0] and torch.equal(sa[k][1], sb[k][1]) for k in sa)
    )


def test_a_bf16_gradient_read_from_the_buffer_gives_the_bits_of_the_fp32_copies(engine):
    """bf16 reduction, fp8 moments, clipped, 3 steps on HFSDP 2x3: stepping from the bf16 reduced gradient (no fp32
    copy made) gives every rank the same weights, moments and scales, bit for bit, as stepping the fp32 copies."""
    for rank in engine[0]:
        direct, copies = rank["grads", "direct"], rank["grads", "copies"]
        assert direct[0] == copies[0]
        assert _same(direct[1], copies[1])


@pytest.mark.parametrize("option", ENGINE_OPTIONS)
def test_a_resume_on_the_same_layout_continues_bit_for_bit(engine, option):
    """HFSDP 2x3, bf16 compute and reduction, saved after 2 steps: the loaded state equals the saved one in dtype
    and bits (fp8 scales included), and the next 2 steps give the uninterrupted run's losses, weights and state."""
    for rank in engine[0]:
        (losses, after, saved), (r_losses, r_after, loaded) = rank[option, "uninterrupted"], rank[option, "resumed"]
        assert _same(saved, loaded)
        assert losses == r_losses and _same(after, r_after)
    m, v = _dtypes(option)
    kinds = {(k, d) for (_, k), (d, _) in engine[0][0][option, "resumed"][2][1].items()}
    expect = {("exp_avg", str(m)), ("exp_avg_sq", str(v))} | {
        (f"{k}_scale", "torch.uint8") for k, d in (("exp_avg", m), ("exp_avg_sq", v)) if d in FP8_MAX
    }
    assert kinds == expect


@pytest.mark.parametrize("option", ENGINE_OPTIONS)
def test_a_resume_on_another_world_size_keeps_the_dtypes(engine, option):
    """Saved on 2x3, loaded on 2x2: the moments keep their dtypes (fp8 requantized on the new blocks), the index
    and `ckpt inspect` record them; the next loss is the uninterrupted run's to 4e-3 (the weights are loaded
    exactly; the forward is bf16 over other per-rank batches: about one bf16 ulp), the one after to 1e-2 (fp8
    moments rebuilt on other blocks: requantized, so rounded anew)."""
    from hfsdp.ckpt.format.index_file import read_index
    from hfsdp.ckpt.format.store import resolve

    m, v = _dtypes(option)
    want = {("exp_avg", str(m)), ("exp_avg_sq", str(v))} | {
        (f"{k}_scale", "torch.uint8") for k, d in (("exp_avg", m), ("exp_avg_sq", v)) if d in FP8_MAX
    }
    for rank in engine[1]:
        _, loaded, after = rank[option]
        assert loaded == want and after == want
    ref = engine[0][0][option, "uninterrupted"][0]
    losses = engine[1][0][option][0]
    torch.testing.assert_close(losses[0], ref[0], rtol=4e-3, atol=0)  # exact weights, bf16 forward: ~1 bf16 ulp
    torch.testing.assert_close(losses[1], ref[1], rtol=1e-2, atol=0)  # after a step with requantized fp8 moments
    index = read_index(resolve(f"{engine[2]}/{option.replace('/', '-')}"))
    recorded = {
        (kind, next(iter(entries.values())).dtype)
        for kind, entries in index.tensors.items()
        if kind.startswith("exp_avg")
    }
    assert recorded == {(k, d.removeprefix("torch.")) for k, d in want}


def test_torch_adamw_refuses_to_step_fp8_moments_loaded_without_their_scales(engine):
    """`AdamW.load_state_dict(fused.state_dict())` cannot apply FusedAdamW's fp8 scales: the first step refuses it."""
    for rank in engine[1]:
        assert "holds 'exp_avg_scale'" in rank["direct"] or "holds 'exp_avg_sq_scale'" in rank["direct"]
        assert "hfsdp.ckpt.load_checkpoint" in rank["direct"]


def test_torch_adamw_loads_fp8_moments_dequantized(engine):
    """torch.optim.AdamW loading the fp8 checkpoint on 2x2 gets fp32 moments (dequantized) and no scale entries."""
    for rank in engine[1]:
        assert rank["torch"] == {("exp_avg", "torch.float32"), ("exp_avg_sq", "torch.float32")}
