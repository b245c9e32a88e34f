"""The optimizer step alone: torch.optim.AdamW on hfsdp's main params against the flat AdamW hfsdp once had.

hfsdp used to step each flat buffer's fp32 piece with its own AdamW (the arithmetic of
torch's single-tensor AdamW on one big tensor per group: ~10 elementwise passes). Now
any torch optimizer steps the main params (one tensor per parameter piece). This measures,
on one device, the step time of both over the same elements, split into pieces as a
transformer's layers are (per layer: 4 hidden^2 attention, 8 hidden^2 MLP, two norms):

    python bench/bench_optimizer.py --hidden 2048 --layers 16 --device cuda

The flat baseline below exists only to be measured against; the engine does not use it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch


def flat_adamw(param, grad, exp_avg, exp_avg_sq, step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
    """The removed ShardedAdamW's update of one flat piece (torch's single-tensor AdamW arithmetic)."""
    beta1, beta2 = betas
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


def piece_sizes(hidden: int, layers: int) -> list[list[int]]:
    """Per layer (one flat group each), the parameter sizes of a GPT layer."""
    return [[hidden * 3 * hidden, hidden * hidden, hidden * 4 * hidden, 4 * hidden * hidden, hidden, hidden]] * layers


def time_it(fn, device, repeat: int) -> float:
    times = []
    for _ in range(repeat + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times[2:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    device = torch.device(args.device)
    groups = piece_sizes(args.hidden, args.layers)
    numel = sum(map(sum, groups))
    flat = [
        [torch.randn(sum(sizes), device=device) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
        for sizes in groups
    ]
    counter = [0]

    def flat_step():
        counter[0] += 1
        for param, grad, m, v in flat:
            flat_adamw(param, grad, m, v.abs_(), counter[0])

    results = {"flat AdamW (removed)": time_it(flat_step, device, args.repeat)}
    for kind in ("fused", "foreach"):
        params = []
        for sizes in groups:
            for size in sizes:
                p_ = torch.nn.Parameter(torch.randn(size, device=device))
                p_.grad = torch.randn(size, device=device)
                params.append(p_)
        opt = torch.optim.AdamW(params, lr=1e-3, **{kind: True})
        results[f"torch.optim.AdamW({kind}=True) on main params"] = time_it(opt.step, device, args.repeat)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"AdamW step over {numel / 1e6:.0f}M fp32 elements in {sum(map(len, groups))} pieces on {name}:")
    print("| optimizer | step (ms) | GB/s (28 B/element) |")
    print("|---|---|---|")
    for label, seconds in results.items():
        print(f"| {label} | {seconds * 1e3:.2f} | {numel * 28 / seconds / 1e9:.0f} |")


if __name__ == "__main__":
    main()
