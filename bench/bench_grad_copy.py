"""Ways to copy one unit's bf16 gradients into an fp32 flat buffer on a GPU: kernel time, host time, and
whether the host waits for the GPU (a hidden synchronisation stalls the launch queue in backward).

    python bench/bench_grad_copy.py --hidden 2048 --ffn 5632

The gradients are those of one Llama decoder layer. Methods: one `copy_` per parameter, one
`torch._chunk_cat` for all of them (what FSDP2 builds its reduce-scatter input with), one
`torch._foreach_copy_` into the slots. "Host waits" launches the method behind a 20 ms GPU sleep:
a method that returns in well under 20 ms did not wait.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def layer_grads(hidden: int, ffn: int, device) -> list[torch.Tensor]:
    shapes = [(hidden, hidden)] * 4 + [(ffn, hidden), (ffn, hidden), (hidden, ffn), (hidden,), (hidden,)]
    return [torch.randn(s, dtype=torch.bfloat16, device=device) for s in shapes]


def methods(grads: list[torch.Tensor], flat: torch.Tensor) -> dict:
    numel = sum(g.numel() for g in grads)
    views, offset = [], 0
    for g in grads:
        views.append(flat[offset : offset + g.numel()])
        offset += g.numel()
    flat_grads = [g.reshape(-1) for g in grads]

    def per_param():
        for view, g in zip(views, flat_grads, strict=True):
            view.copy_(g)

    def chunk_cat():
        torch._chunk_cat(flat_grads, dim=0, num_chunks=1, out=flat[:numel].view(1, numel))

    def foreach_copy():
        torch._foreach_copy_(views, flat_grads)

    return {"copy_ per parameter": per_param, "_chunk_cat": chunk_cat, "_foreach_copy_": foreach_copy}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    device = torch.device("cuda")
    grads = layer_grads(args.hidden, args.ffn, device)
    numel = sum(g.numel() for g in grads)
    flat = torch.empty(numel + 128, dtype=torch.float32, device=device)
    expected = torch.cat([g.reshape(-1).float() for g in grads])
    moved = numel * (2 + 4)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    stop.record()
    torch.cuda.synchronize()
    cycles_per_ms = int(10**7 / start.elapsed_time(stop))
    gpu = torch.cuda.get_device_name()
    print(f"one layer: {numel / 1e6:.1f}M elements, {moved / 1e9:.3f} GB moved per copy; {gpu}")
    print("| method | kernel time (ms) | GB/s | host time per call (ms) | host time behind a 20 ms GPU sleep (ms) |")
    print("|---|---:|---:|---:|---:|")
    for name, fn in methods(grads, flat).items():
        flat.zero_()
        fn()
        torch.cuda.synchronize()
        assert torch.equal(flat[:numel], expected), name
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            fn()
        stop.record()
        torch.cuda.synchronize()
        kernel_ms = start.elapsed_time(stop) / args.iters
        hosts = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            hosts.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles_per_ms * 20)
        t0 = time.perf_counter()
        fn()
        behind = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        gbs = moved / (kernel_ms * 1e-3) / 1e9
        print(f"| {name} | {kernel_ms:.3f} | {gbs:.0f} | {statistics.median(hosts):.3f} | {behind:.3f} |")


if __name__ == "__main__":
    main()
