"""Float8Linear's arithmetic, against the same matmuls done in fp32 on the dequantized operands.

`torch._scaled_mm` multiplies fp8 operands and scales the fp32 result back; the reference below
dequantizes the same fp8 tensors to fp32 (exact), multiplies in fp32 and rounds once to bf16, so the
two agree to the rounding of the output. What the test pins down is everything around the call:
which operand gets which scale, the layouts, the roles of e4m3 and e5m2, and the padding of rows.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hfsdp.core import Float8Config, Float8Linear, convert_to_float8
from hfsdp.core.fp8 import scaling
from hfsdp.core.fp8.linear import float8_linear


def _dequant(t, scale):
    return t.float() / scale


def _close(actual, expected, rel=1e-2):
    err = (actual.float() - expected.float()).norm() / expected.float().norm()
    assert err < rel, f"relative error {err:.2e}"


@pytest.mark.parametrize("rows", [32, 21])  # 21: padded to 32 rows inside
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_tensorwise_matmuls_equal_the_dequantized_fp32_reference(rows, fmt):
    torch.manual_seed(0)
    x = torch.randn(rows, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(48, 64) * 0.05).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(rows, 48, dtype=torch.bfloat16)
    y = float8_linear(x, w, None, Float8Config(fmt, "tensorwise"))
    y.backward(grad)
    fwd, bwd = scaling.formats(fmt)
    xq, sx = scaling.tensorwise(x.detach(), fwd)
    wq, sw = scaling.tensorwise(w.detach(), fwd)
    gq, sg = scaling.tensorwise(grad, bwd)
    x8, w8, g8 = _dequant(xq, sx), _dequant(wq, sw), _dequant(gq, sg)
    _close(y, (x8 @ w8.t()).to(torch.bfloat16), 1e-2)
    _close(x.grad, (g8 @ w8).to(torch.bfloat16), 1e-2)
    _close(w.grad, (g8.t() @ x8).to(torch.bfloat16), 1e-2)
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16 and y.shape == (rows, 48)


def test_rowwise_scales_each_row_and_keeps_the_weight_gradient_in_bf16():
    torch.manual_seed(1)
    x = torch.randn(32, 64, dtype=torch.bfloat16) * torch.logspace(-3, 2, 32).to(torch.bfloat16)[:, None]
    x.requires_grad_()
    w = (torch.randn(48, 64) * 0.05).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(32, 48, dtype=torch.bfloat16)
    float8_linear(x, w, None, Float8Config("e4m3", "rowwise")).backward(grad)
    _, sx = scaling.rowwise(x.detach(), scaling.E4M3)
    assert sx.shape == (32, 1) and len(set(sx.flatten().tolist())) > 10  # rows five decades apart: own scales
    w_cols, sw_cols = scaling.rowwise(w.detach(), scaling.E4M3, dim=0)
    gq, sg = scaling.rowwise(grad, scaling.E4M3)
    _close(x.grad, (_dequant(gq, sg) @ _dequant(w_cols, sw_cols)).to(torch.bfloat16), 1e-2)
    torch.testing.assert_close(w.grad, (grad.t() @ x.detach()), rtol=0, atol=0)  # dW in bf16, as nn.Linear's


@pytest.mark.parametrize("recipe", [("hybrid", "tensorwise"), ("e4m3", "rowwise")])
def test_a_frozen_weight_gets_no_gradient_and_the_input_the_same_one(recipe):
    torch.manual_seed(3)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(48, 64) * 0.05).to(torch.bfloat16)
    grad = torch.randn(32, 48, dtype=torch.bfloat16)
    float8_linear(x, w, None, Float8Config(*recipe)).backward(grad)
    frozen_dx = x.grad.clone()
    x.grad = None
    w.requires_grad_()
    float8_linear(x, w, None, Float8Config(*recipe)).backward(grad)
    assert torch.equal(x.grad, frozen_dx) and w.grad is not None


def test_scales_are_powers_of_two_that_fit_the_amax_in_range():
    amax = torch.tensor([1e-3, 0.7, 1.0, 448.0, 449.0, 3e4, 0.0])
    for dtype in (scaling.E4M3, scaling.E5M2):
        scale = scaling.amax_to_scale(amax, dtype)
        mantissa, _ = torch.frexp(scale)
        assert torch.all(mantissa == 0.5), "not a power of two"
        top = torch.finfo(dtype).max
        scaled = amax * scale
        assert torch.all(scaled <= top) and torch.all((scaled > top / 2) | (amax == 0))


def test_quantize_saturates_instead_of_making_nan():
    t = torch.tensor([1e6, -1e6, 1.0])
    q = scaling.quantize(t, torch.tensor(1.0), scaling.E4M3)
    assert q.float().tolist() == [448.0, -448.0, 1.0]


def test_a_gathered_weight_gives_the_bits_of_the_weight_quantized_here():
    torch.manual_seed(2)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    w = (torch.randn(48, 64) * 0.05).to(torch.bfloat16)
    cfg = Float8Config("hybrid", "tensorwise")
    w8, sw = scaling.tensorwise(w, scaling.E4M3)
    assert torch.equal(float8_linear(x, w, None, cfg), float8_linear(x, w, None, cfg, w8, sw))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.units = nn.ModuleList(
            nn.ModuleDict({"q": nn.Linear(32, 32), "odd": nn.Linear(32, 40), "router": nn.Linear(32, 16)})
            for _ in range(2)
        )
        self.out = nn.Linear(32, 16)


def test_convert_swaps_only_the_units_linears_that_fit_and_keeps_names_and_values():
    net = _Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    conversion = convert_to_float8(net, Float8Config(), units=list(net.units), min_size=0)
    assert conversion.converted == ["units.0.q", "units.1.q"]
    assert conversion.skipped == {
        "units.0.odd": "features not multiples of 16, which fp8 matmuls need",
        "units.0.router": "MoE routers",
        "units.1.odd": "features not multiples of 16, which fp8 matmuls need",
        "units.1.router": "MoE routers",
    }
    assert type(net.units[0]["q"]) is Float8Linear and type(net.embed) is nn.Linear and type(net.out) is nn.Linear
    assert net.state_dict().keys() == before.keys()
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items())
    assert conversion.summary().startswith("fp8 (hybrid, tensorwise): 2 of 6 Linear layers in the units")
    again = convert_to_float8(
        net, Float8Config("e4m3"), units=list(net.units), min_size=0, module_filter=lambda n, m: "1" in n
    )
    assert again.converted == ["units.1.q"] and again.skipped["units.0.q"] == "kept by module_filter"


def test_by_default_only_layers_large_enough_to_gain_are_converted():
    """The 8B Llama's projections: q/o (4096 x 4096) and the MLP convert, k/v (4096 -> 1024) stays bf16."""
    shapes = {"q": (4096, 4096), "k": (4096, 1024), "o": (4096, 4096), "up": (4096, 14336), "down": (14336, 4096)}
    with torch.device("meta"):
        unit = nn.ModuleDict({n: nn.Linear(i, o, bias=False) for n, (i, o) in shapes.items()})
    conversion = convert_to_float8(nn.Sequential(unit), Float8Config(), units=[unit])
    assert conversion.converted == ["0.q", "0.o", "0.up", "0.down"]
    assert conversion.skipped == {"0.k": "too small to gain: in*out/(in+out) below 2048"}
    small = nn.ModuleDict({"q": nn.Linear(3072, 3072)})
    assert convert_to_float8(nn.Sequential(small), Float8Config(), units=[small]).converted == []


def test_a_model_without_linear_layers_in_its_units_says_so():
    unit = nn.Sequential(nn.LayerNorm(32))
    summary = convert_to_float8(nn.Sequential(unit), Float8Config(), units=[unit]).summary()
    assert "the units hold no torch.nn.Linear layer" in summary and "TransformerEngine" in summary


def test_config_refusals_name_the_field():
    with pytest.raises(ValueError, match="format='e5m2'"):
        Float8Config("e5m2")
    with pytest.raises(ValueError, match="recipe='blockwise'"):
        Float8Config("e4m3", "blockwise")
    with pytest.raises(ValueError, match=r"rowwise.*hybrid"):
        Float8Config("hybrid", "rowwise")
    with pytest.raises(TypeError, match="Float8Config"):
        convert_to_float8(_Net(), "hybrid", units=[])
