"""Float8Linear's matmuls on a GPU against fp32 products: rowwise and tensorwise (the check of rowwise_check.txt;
the code that ran, reformatted for ruff only)."""

import torch

from hfsdp.core import Float8Config
from hfsdp.core.fp8 import scaling
from hfsdp.core.fp8.linear import float8_linear


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


torch.manual_seed(0)
dev = "cuda"
for rec, fmt in (("rowwise", "e4m3"), ("tensorwise", "hybrid")):
    rows = torch.logspace(-2, 1, 256, device=dev)[:, None]
    x = (torch.randn(256, 512, device=dev) * rows).bfloat16().requires_grad_()
    w = (torch.randn(384, 512, device=dev) * 0.05).bfloat16().requires_grad_()
    g = torch.randn(256, 384, device=dev).bfloat16()
    y = float8_linear(x, w, None, Float8Config(fmt, rec))
    y.backward(g)
    xr, wr = x.detach().float(), w.detach().float()
    dx, dw = rel(x.grad, g.float() @ wr), rel(w.grad, g.float().t() @ xr)
    print(rec, "y vs fp32", rel(y, xr @ wr.t()), "dx", dx, "dw", dw)
    if rec == "rowwise":
        xq, sx = scaling.rowwise(x.detach(), scaling.E4M3)
        wq, sw = scaling.rowwise(w.detach(), scaling.E4M3)
        print(" y vs dequant", rel(y, (xq.float() / sx) @ (wq.float() / sw).t()))
        wc, swc = scaling.rowwise(w.detach(), scaling.E4M3, dim=0)
        gq, sg = scaling.rowwise(g, scaling.E4M3)
        print(" dx vs dequant", rel(x.grad, (gq.float() / sg) @ (wc.float() / swc)))
