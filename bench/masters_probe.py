"""Where two of `gpu_correctness.py`'s runs part: step by step, how many fp32 master weights differ between hfsdp
and its reference, with and without `store_param_remainders`, and at the first step the gradients and the clip
norm each side used. One process, one GPU (or `--device cpu` with a tiny model).

Written for the one check `gpu_correctness.py` failed on the remainder kernels' first H200 run
(docs/benchmarks.md, "exact masters as bf16 weights plus a 16-bit remainder"): whether the remainders or the
by-design rounding of the in-step clip moved the masters.

    python bench/masters_probe.py [--device cpu] [--options fp8t_,] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _correctness_cases as cases


def _masters(engine) -> dict[str, torch.Tensor]:
    if isinstance(engine, cases.Reference):
        return {n: m.detach().cpu().clone() for n, m in engine.masters.items()}
    from hfsdp.core.buffers.main_params import piece_of

    return {n: piece_of(p).master().detach().cpu().clone() for n, p in engine.model.named_parameters()}


def run(engine_name: str, option: str, shape, batches, device) -> dict:
    """Train `shape.steps` steps; the losses, the masters after each, and step 1's gradients and clip norm."""
    from hfsdp.core.buffers.main_params import piece_of

    engine = cases.ENGINES[engine_name](cases.Case(engine_name, "eager", option), shape, device, False)
    first: dict = {}
    step = engine.opt.step

    def recording_step(*args, **kwargs):
        if not first and engine_name == "hfsdp":
            named = engine.model.named_parameters()
            first["grads"] = {n: piece_of(p).grad_view().detach().float().cpu().clone() for n, p in named}
        out = step(*args, **kwargs)
        if not first.get("norm") and engine_name == "hfsdp":
            first["norm"] = float(engine.opt.grad_norm)
        return out

    engine.opt.step = recording_step
    clip = torch.nn.utils.clip_grad_norm_
    if engine_name == "reference":

        def recording_clip(params, *args, **kwargs):
            params = list(params)
            if not first:
                first["grads"] = {n: p.grad.detach().cpu().clone() for n, p in zip(engine.masters, params, strict=True)}
            norm = clip(params, *args, **kwargs)
            first.setdefault("norm", norm.item())
            return norm

        torch.nn.utils.clip_grad_norm_ = recording_clip
    try:
        steps = [(engine.step(mbs).item(), _masters(engine)) for mbs in batches]
    finally:
        torch.nn.utils.clip_grad_norm_ = clip
    engine.opt = engine.model = None  # free the device memory before the next run
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"steps": steps, **first}


def _differing(a: dict, b: dict) -> int:
    return sum(int((a[n].reshape(-1) != b[n].reshape(-1)).sum()) for n in a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--options", default=",fp8t_", help="fp8 prefixes to probe ('' bf16, 'fp8t_' fp8 tensorwise)")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    device = torch.device(args.device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29613", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.use_deterministic_algorithms(True)
    shape = cases.Shape(steps=args.steps)
    if device.type == "cpu":
        shape = replace(shape, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32, micro_batch=2)
    batches = cases.batches(shape, 1, 0, device)
    for fp8 in args.options.split(","):
        for rem in ("", "_rem"):
            ref = run("reference", f"{fp8}fused{rem}", shape, batches, device)
            ours = run("hfsdp", f"{fp8}fused_clip_prestage{rem}", shape, batches, device)
            rows = [(a[0], b[0], _differing(a[1], b[1])) for a, b in zip(ref["steps"], ours["steps"], strict=True)]
            print(f"{fp8}fused{rem}: hfsdp against its reference, step by step (loss, loss, masters that differ):")
            for i, (la, lb, n) in enumerate(rows, 1):
                print(f"  step {i}: {la!r} {lb!r} {n:,}")
            grads = _differing(ref["grads"], ours["grads"])
            print(f"  step 1: gradients that differ {grads:,}; clip norm {ref['norm']!r} (torch's clip) "
                  f"{ours['norm']!r} (FusedAdamW's)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
