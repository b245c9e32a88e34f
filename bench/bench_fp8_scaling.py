"""How FusedAdamW's fp8 moments should be scaled: per tensor, or per block of B elements (CPU, the torch path).

Runs AdamW on one 512x2048 tensor for STEPS steps with synthetic gradients shaped like a transformer's
(row and column magnitudes spread log-normally, heavy-tailed noise around a persistent signal), and an embedding
table's (each row touched with probability 0.05 per step: untouched rows keep decaying moments), with fp32 moments
and with each low-precision option, all from the same gradients. Prints, per option, the relative error of the
total update (||dp - dp_fp32|| / ||dp_fp32||), of the last step's update, and the share of elements whose
exp_avg_sq is stored as 0 where fp32's is not (those elements step by m / eps).

    .venv/bin/python bench/bench_fp8_scaling.py
"""

from __future__ import annotations

import torch

from hfsdp.core.kernels.adamw_kernel import AdamWScalars, ScaleBlocks, adamw_run

STEPS, ROWS, COLS = 100, 512, 2048
E4, E5, BF = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16


def gradients(kind: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.exp(torch.randn(ROWS, 1, generator=gen) * 1.5) * 1e-3
    cols = torch.exp(torch.randn(1, COLS, generator=gen) * 0.5)
    signal = torch.randn(ROWS, COLS, generator=gen) * 0.3
    for _ in range(STEPS):
        noise = torch.distributions.StudentT(4.0).sample((ROWS, COLS))
        g = rows * cols * (signal + noise)
        if kind == "embedding":
            g = g * (torch.rand(ROWS, 1, generator=gen) < 0.05)
        yield g.reshape(-1)


def run(kind: str, dtypes, block: int | None):
    torch.manual_seed(1)
    n = ROWS * COLS
    p = torch.randn(n) * 0.02
    p0 = p.clone()
    m, v = (torch.zeros(n, dtype=d) for d in dtypes)
    blocks = ScaleBlocks([n], "cpu", block=block or n)
    scales = tuple(torch.ones(blocks.count) if d in (E4, E5) else None for d in dtypes)
    last = None
    for step, g in enumerate(gradients(kind), start=1):
        before = p.clone()
        s = AdamWScalars.of(1e-3, 0.9, 0.95, 1e-8, 0.0, step)
        adamw_run(p, g, m, v, s, backend="torch", scales=scales, blocks=blocks)
        last = p - before
    v32 = v.float() if scales[1] is None else v.float() * scales[1][blocks.ids]
    return p - p0, last, v32


def main() -> None:
    torch.set_num_threads(2)
    options = [("bf16 / bf16", (BF, BF), None)]
    for name, pair in (("e4m3 / e5m2", (E4, E5)), ("e4m3 / e4m3", (E4, E4))):
        for block in (None, 4096, 256, 128, 32):
            options.append((f"{name}, {'per tensor' if block is None else f'block {block}'}", pair, block))
    for kind in ("dense", "embedding"):
        ref_total, ref_last, ref_v = run(kind, (torch.float32, torch.float32), None)
        print(f"\n{kind}: {STEPS} steps, {ROWS}x{COLS}")
        print(f"{'exp_avg / exp_avg_sq':<32} {'total update':>12} {'last update':>12} {'v flushed':>10}")
        for name, dtypes, block in options:
            total, last, v = run(kind, dtypes, block)
            err_total = ((total - ref_total).norm() / ref_total.norm()).item()
            err_last = ((last - ref_last).norm() / ref_last.norm()).item()
            flushed = ((v == 0) & (ref_v > 0)).float().mean().item()
            print(f"{name:<32} {err_total:>12.4f} {err_last:>12.4f} {flushed:>10.2%}")


if __name__ == "__main__":
    main()
