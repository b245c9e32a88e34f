"""The two ceilings a step is measured against: the GPU's datasheet dense matmul peak (the MFU denominator the
field uses) and, measured in the same run, its matmul rate and its memory bandwidth.

MFU follows PaLM (Chowdhery et al. 2022, appendix B), Megatron-LM and torchtitan: model FLOPs per second
(6 per matmul parameter per token plus attention, no recomputation counted) over the datasheet's dense
peak for the dtype. The matmul rate measured here (a large bf16 product on random data) is reported
beside it as "of achievable": on an H200 it has been 718-814 TFLOP/s against the datasheet's 989.
"""

from __future__ import annotations

import statistics
import time

import torch

#: Dense (no sparsity) tensor-core peaks from NVIDIA's datasheets, TFLOP/s, by (device name, dtype). The H200
#: and H100 SXM parts share the processor (989.4 TFLOP/s bf16 dense); PCIe/NVL parts run at lower clocks.
DATASHEET_PEAK_TFLOPS = {
    ("NVIDIA H200", "bf16"): 989.0,
    ("NVIDIA H100 80GB HBM3", "bf16"): 989.0,
    ("NVIDIA H100 PCIe", "bf16"): 756.0,
    ("NVIDIA H200 NVL", "bf16"): 835.0,
    ("NVIDIA A100-SXM4-80GB", "bf16"): 312.0,
    ("NVIDIA A100-SXM4-40GB", "bf16"): 312.0,
}


def datasheet_peak(gpu_name: str, dtype: str) -> float | None:
    """The datasheet dense peak (TFLOP/s) for this GPU and dtype, or None when the table does not know it."""
    return DATASHEET_PEAK_TFLOPS.get((gpu_name, dtype))


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192, iters: int = 50) -> float:
    """Dense matmul rate of this GPU in `dtype` on random data (TFLOP/s): the achievable ceiling."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(5):
        torch.mm(a, b, out=c)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        torch.mm(a, b, out=c)
    stop.record()
    torch.cuda.synchronize(device)
    rate = 2 * n**3 * iters / (start.elapsed_time(stop) * 1e-3) / 1e12
    del a, b, c
    torch.cuda.empty_cache()
    return rate


def copy_bandwidth(device: torch.device, gib: float = 2.0, repeats: int = 20) -> dict:
    """Device-to-device copy bandwidth (bytes read + bytes written per second), median of `repeats` timed copies
    of a `gib` GiB random buffer into one of three targets in turn (so no copy finds its data in the L2)."""
    numel = int(gib * 2**30) // 4
    src = torch.rand(numel, device=device)
    targets = [torch.empty_like(src) for _ in range(3)]
    for target in targets:
        target.copy_(src)
    times = []
    for index in range(repeats):
        if device.type != "cuda":  # a host copy (for trying the bench on a CPU)
            began = time.perf_counter()
            targets[index % 3].copy_(src)
            times.append(time.perf_counter() - began)
            continue
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        targets[index % 3].copy_(src)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3)
    ok = torch.equal(targets[0], src)
    moved = 2 * numel * 4
    out = {
        "bytes_per_copy": moved,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "bytes_per_s": moved / statistics.median(times),
        "best_bytes_per_s": moved / min(times),
        "copy_correct": ok,
    }
    del src, targets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out
