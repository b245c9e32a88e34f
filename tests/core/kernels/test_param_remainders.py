"""Exact fp32 masters as a bf16 weight plus a 16-bit remainder (`store_param_remainders`): the split, the kernel.

The split and join are checked over every 16-bit remainder under a spread of upper halves (both signs, the edge
exponents, mantissas at both ends): join(split(x)) is x bit for bit, and the bf16 half is x rounded to nearest,
ties away from zero (torch's cast, except at exact ties). `adamw_run` on the two halves gives, bit for bit, the
fp32 run's new master (joined) and its split, in every moment dtype, with the clip coefficient and a bf16 gradient.
"""

from __future__ import annotations

import pytest
import torch

from hfsdp.core.buffers.param_remainders import join_master, split_master, write_master
from hfsdp.core.kernels.adamw_kernel import SCALE_BLOCK, AdamWScalars, adamw_run, is_fp8

E4, E5, BF, F32 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32


def _masters() -> torch.Tensor:
    """Every low half under upper halves of both signs, the edge exponents (zero and subnormals, the smallest and
    largest normals, infinity and NaN) and some between, with mantissas at both ends and in the middle."""
    uppers = [
        (sign << 15) | (exponent << 7) | mantissa
        for sign in (0, 1)
        for exponent in (0, 1, 2, 64, 126, 127, 128, 200, 253, 254, 255)
        for mantissa in (0, 1, 0x40, 0x7E, 0x7F)
    ]
    upper = torch.tensor(uppers, dtype=torch.int64)[:, None] << 16
    low = torch.arange(1 << 16, dtype=torch.int64)[None, :]
    bits = (upper | low).reshape(-1)
    return (bits - ((bits >= 1 << 31).long() << 32)).to(torch.int32).view(torch.float32)


def test_split_then_join_gives_every_master_back_bit_for_bit():
    masters = _masters()
    weight, remainder = split_master(masters)
    joined = join_master(weight, remainder)
    nan = torch.isnan(masters)
    assert torch.equal(joined[~nan].view(torch.int32), masters[~nan].view(torch.int32))
    assert torch.isnan(joined[nan]).all()  # a NaN stays a NaN (its payload is not kept)
    assert torch.equal(weight[nan].view(torch.int16), torch.full((int(nan.sum()),), 0x7FC0, dtype=torch.int16))


def test_the_bf16_half_is_the_master_rounded_to_nearest_ties_away_from_zero():
    masters = _masters()
    finite = torch.isfinite(masters) & (masters.abs() < torch.finfo(BF).max)
    masters = masters[finite]
    weight = split_master(masters)[0]
    torch_cast = masters.to(BF)
    low = masters.view(torch.int32) & 0xFFFF
    tie = low == 0x8000
    assert torch.equal(weight[~tie].view(torch.int16), torch_cast[~tie].view(torch.int16))
    # at a tie: the neighbour of larger magnitude (torch picks the even one), never more than half an ulp away
    assert (weight[tie].double().abs() > masters[tie].double().abs()).all()
    error = (weight.double() - masters.double()).abs()
    exponent = ((masters.view(torch.int32) >> 23) & 0xFF).clamp(min=1)  # subnormals: the smallest normal binade's
    ulp = torch.ldexp(torch.ones_like(error), exponent - 127 - 7)
    assert (error <= ulp / 2).all()


def test_write_master_stores_both_halves_in_place_and_refuses_other_dtypes():
    master = torch.randn(37)
    weight, remainder = torch.empty(37, dtype=BF), torch.empty(37, dtype=torch.int16)
    write_master(weight, remainder, master)
    assert torch.equal(join_master(weight, remainder), master)
    with pytest.raises(ValueError, match="fp32 masters"):
        split_master(master.double())
    with pytest.raises(ValueError, match="bf16 weight and an int16 remainder"):
        join_master(weight.float(), remainder)


MOMENTS = [(F32, F32), (BF, BF), (E4, E5), (BF, E5)]


def _scales(dtypes, n):
    return tuple(torch.ones(-(-n // SCALE_BLOCK)) if is_fp8(d) else None for d in dtypes)


@pytest.mark.parametrize("moments", MOMENTS, ids=lambda m: "/".join(str(d).removeprefix("torch.") for d in m))
@pytest.mark.parametrize("grad_dtype", [F32, BF], ids=["fp32 grad", "bf16 grad"])
def test_a_run_on_the_two_halves_steps_the_fp32_master_bit_for_bit(moments, grad_dtype):
    """Three steps from masters with ties among them: the joined master, both moments and the fp8 scales equal the
    fp32 run's bit for bit at every step, and the bf16 half is the split of the fp32 run's master."""
    gen = torch.Generator().manual_seed(3)
    n = 3 * SCALE_BLOCK + 45
    master = torch.randn(n, generator=gen)
    bits = master.view(torch.int32)
    bits[::7] = (bits[::7] & ~0xFFFF) | 0x8000  # ties, where the bf16 half was rounded away from zero
    weight, remainder = split_master(master)
    state = {
        "fp32": [master.clone(), *(torch.zeros(n, dtype=d) for d in moments), _scales(moments, n)],
        "halves": [weight, *(torch.zeros(n, dtype=d) for d in moments), _scales(moments, n)],
    }
    coef = torch.tensor(0.5)
    for step in range(1, 4):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        scalars = AdamWScalars.of(3e-3, 0.9, 0.95, 1e-8, 0.1, step)
        p, m, v, scales = state["fp32"]
        adamw_run(p, grad, m, v, scalars, coef, backend="torch", scales=scales)
        h, hm, hv, hscales = state["halves"]
        adamw_run(h, grad, hm, hv, scalars, coef, backend="torch", scales=hscales, remainder=remainder)
        assert torch.equal(join_master(h, remainder).view(torch.int32), p.view(torch.int32))
        assert torch.equal(h.view(torch.int16), split_master(p)[0].view(torch.int16))
        assert torch.equal(hm.view(torch.uint8), m.view(torch.uint8))
        assert torch.equal(hv.view(torch.uint8), v.view(torch.uint8))
        assert all(a is None or torch.equal(a, b) for a, b in zip(scales, hscales, strict=True))


def test_a_run_with_a_remainder_refuses_fp32_weights_an_out_tensor_and_a_wrong_remainder():
    n = 8
    grad, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    scalars = AdamWScalars.of(1e-3, 0.9, 0.95, 1e-8, 0.0, 1)
    remainder = torch.zeros(n, dtype=torch.int16)
    with pytest.raises(ValueError, match="bf16 half"):
        adamw_run(torch.zeros(n), grad, m, v, scalars, remainder=remainder)
    with pytest.raises(ValueError, match="bf16 half"):
        adamw_run(torch.zeros(n, dtype=BF), grad, m, v, scalars, out=torch.zeros(n, dtype=BF), remainder=remainder)
    with pytest.raises(ValueError, match="int16 tensor of 8"):
        adamw_run(torch.zeros(n, dtype=BF), grad, m, v, scalars, remainder=torch.zeros(n, dtype=torch.int32))


def test_fused_adamw_refuses_remainders_with_an_overlapped_step():
    """The overlapped step writes a staged copy of the bf16 weights; with remainders the step writes them in place."""
    from hfsdp.core import FusedAdamW

    with pytest.raises(ValueError, match="store_param_remainders=True cannot be combined with overlap_next_forward"):
        FusedAdamW(
            [torch.nn.Parameter(torch.zeros(2))],
            prestage_gathers=True,
            overlap_next_forward=True,
            store_param_remainders=True,
        )
