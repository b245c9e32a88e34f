"""How fast one Linear layer's forward and backward run in fp8 against bf16, shape by shape (issue 39).

For each projection of a Llama layer (q, k/v, o, gate/up, down at the given hidden and ffn sizes), times
forward + backward of `nn.Linear` in bf16 and of `Float8Linear` in each recipe, eager and under
`torch.compile` (which fuses the amax, scale and cast around each `torch._scaled_mm`), and prints TFLOP/s
(6 x tokens x in x out per forward + backward) and the fp8 speedup. It says whether the layers pay before
any engine is involved: the casts of activations and gradients are the cost fp8 adds.

    python bench/fp8_linear_speed.py --hidden 4096 --ffn 14336 --kv 1024 --tokens 8192 --out fp8_linear.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "core" / "src"))

from hfsdp.core import Float8Config, convert_to_float8

VARIANTS = {"bf16": None, "fp8 tensorwise hybrid": ("hybrid", "tensorwise"), "fp8 rowwise e4m3": ("e4m3", "rowwise")}


def _layer(k: int, n: int, variant: str, device) -> nn.Module:
    holder = nn.Sequential(nn.Linear(k, n, bias=False)).to(device, torch.bfloat16)
    if VARIANTS[variant] is not None:
        convert_to_float8(holder, Float8Config(*VARIANTS[variant]), units=[holder], min_size=0)
    return holder[0]


def _time(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / steps


def measure(args) -> list[dict]:
    device = torch.device("cuda")
    shapes = {
        "q/o": (args.hidden, args.hidden),
        "k/v": (args.hidden, args.kv),
        "gate/up": (args.hidden, args.ffn),
        "down": (args.ffn, args.hidden),
    }
    rows = []
    for name, (k, n) in shapes.items():
        x = torch.randn(args.tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(args.tokens, n, device=device, dtype=torch.bfloat16)
        for compiled in (False, True):
            for variant in VARIANTS:
                layer = _layer(k, n, variant, device)
                forward = torch.compile(layer) if compiled else layer

                def step(forward=forward, x=x, grad=grad):
                    forward(x).backward(grad)

                seconds = _time(step, args.steps)
                rows.append(
                    {
                        "layer": name,
                        "in": k,
                        "out": n,
                        "compiled": compiled,
                        "variant": variant,
                        "seconds": seconds,
                        "tflops": 6 * args.tokens * k * n / seconds / 1e12,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def report(rows: list[dict]) -> str:
    lines = ["| layer | in x out | compiled | variant | ms | TFLOP/s | vs bf16 |", "|---|---|---|---|---|---|---|"]
    base = {(r["layer"], r["compiled"]): r["seconds"] for r in rows if r["variant"] == "bf16"}
    for r in rows:
        ratio = base[(r["layer"], r["compiled"])] / r["seconds"]
        lines.append(
            f"| {r['layer']} | {r['in']} x {r['out']} | {'yes' if r['compiled'] else 'no'} | {r['variant']} | "
            f"{r['seconds'] * 1e3:.3f} | {r['tflops']:.0f} | {ratio:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--kv", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch._dynamo.config.cache_size_limit = 64
    rows = measure(args)
    table = report(rows)
    print(table)
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
