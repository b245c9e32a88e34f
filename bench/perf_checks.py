"""Correctness first, on the device the timings run on: the FusedAdamW kernel against its torch twin and float64,
the engine with FusedAdamW and with a share offloaded against hfsdp with torch's AdamW, offload's exact-size
page-locked buffers (CUDA only); then the kernel's speed.

    python bench/perf_checks.py --out OUT/checks.json          # CUDA; on a CPU: TRITON_INTERPRET=1 for the kernel

Every check prints one PASS or FAIL line and lands in the JSON; the exit status is 1 if any failed (the
timings are still taken and written, so one failure costs no other result).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hfsdp.core.kernels.adamw_kernel import AdamWScalars, adamw_run, triton_usable

RESULTS: list[dict] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append({"check": name, "ok": bool(ok), "detail": detail})
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def _inputs(n: int, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    p, g, m = (torch.randn(n, generator=gen, device=device) for _ in range(3))
    v = torch.rand(n, generator=gen, device=device) * 1e-2
    return p, g * 0.1, m * 1e-2, v


def _float64(p, g, m, v, coef, s: AdamWScalars):
    p, g, m, v = (t.double() for t in (p, g, m, v))
    g = g * coef
    p = p * s.decay
    m = s.beta1 * m + s.one_minus_beta1 * g
    v = s.beta2 * v + s.one_minus_beta2 * g * g
    return p - s.step_size * m / (v.sqrt() * s.inv_bc2_sqrt + s.eps), m, v


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def kernel_checks(device) -> None:
    """Same bits as the torch path, within 1e-6 of float64, every output element written (NaN-poisoned first)."""
    if not triton_usable(torch.empty(0, device=device)):
        check("triton kernel available", False, f"Triton cannot run on {device} here")
        return
    sizes = [1, 4095, 4096, 4097, 1_000_003] + ([67_108_864 + 5] if device.type == "cuda" else [])
    for step, n in enumerate(sizes, start=1):
        s = AdamWScalars.of(3e-4, 0.9, 0.95, 1e-8, 0.1, step)
        base = _inputs(n, device, seed=step)
        coef = torch.rand(1, device=device) * 0.9 + 0.05
        outs = {}
        for backend in ("triton", "torch"):
            p, g, m, v = (t.clone() for t in base)
            out = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=device)
            used = adamw_run(p, g, m, v, s, coef, out, backend=backend)
            outs[backend] = (used, p, m, v, out)
        (tu, *t), (cu, *c) = outs["triton"], outs["torch"]
        same = all(torch.equal(a, b) for a, b in zip(t, c, strict=True))
        check(f"kernel n={n}: Triton and torch paths give the same bits", same and (tu, cu) == ("triton", "torch"))
        ref = _float64(*base, coef.item(), s)
        errors = [_rel(x, r) for x, r in zip(t[:3], ref, strict=True)]
        check(f"kernel n={n}: p, m, v within 1e-6 of float64", max(errors) < 1e-6, f"{[f'{e:.1e}' for e in errors]}")
        written = not torch.isnan(t[3].float()).any().item()
        cast = written and torch.equal(t[3], t[0].bfloat16())
        check(f"kernel n={n}: every bf16 output written and equal to the cast", cast)


def _time(fn, device, repeat: int = 10) -> float:
    fn()
    if device.type != "cuda":
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3)
    return statistics.median(times)


def kernel_timing(device, numel: int) -> dict:
    """One flat run of `numel` elements: the Triton pass (30 bytes/element with the bf16 write) against
    torch.optim.AdamW(fused=True) on the same tensor (28 bytes/element), and a device copy (the ceiling)."""
    p, g, m, v = _inputs(numel, device, seed=7)
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    coef = torch.tensor([0.5], device=device)
    s = AdamWScalars.of(3e-4, 0.9, 0.95, 1e-8, 0.1, 3)
    fused = _time(lambda: adamw_run(p, g, m, v, s, coef, out), device)
    fused_no_out = _time(lambda: adamw_run(p, g, m, v, s, None, None), device)
    param = torch.nn.Parameter(p)
    param.grad = g
    opt = torch.optim.AdamW([param], lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda")
    torch_fused = _time(opt.step, device)
    dst = torch.empty_like(p)
    copy = _time(lambda: dst.copy_(g), device)
    res = {
        "numel": numel,
        "fusedadamw_with_bf16_s": fused,
        "fusedadamw_s": fused_no_out,
        "torch_fused_adamw_s": torch_fused,
        "copy_s": copy,
        "fusedadamw_with_bf16_TBps": 30 * numel / fused / 1e12,
        "fusedadamw_TBps": 28 * numel / fused_no_out / 1e12,
        "torch_fused_adamw_TBps": 28 * numel / torch_fused / 1e12,
        "copy_TBps": 8 * numel / copy / 1e12,
    }
    print(
        f"kernel timing, {numel / 1e6:.0f}M elements: FusedAdamW+bf16 {fused * 1e3:.2f} ms "
        f"({res['fusedadamw_with_bf16_TBps']:.2f} TB/s at 30 B), FusedAdamW {fused_no_out * 1e3:.2f} ms "
        f"({res['fusedadamw_TBps']:.2f} TB/s), torch fused AdamW {torch_fused * 1e3:.2f} ms "
        f"({res['torch_fused_adamw_TBps']:.2f} TB/s at 28 B), copy {copy * 1e3:.2f} ms ({res['copy_TBps']:.2f} TB/s)",
        flush=True,
    )
    return res


# -- the engine ------------------------------------------------------------------------------------


def _llama(device, seed=0):
    from transformers import LlamaConfig

    from hfsdp.models import hf

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return hf.build_causal_lm(config, seed=seed).to(device)


def _run(device, dtype, optimizer: str, offload=False, steps: int = 4, clip: float = 0.5):
    """Train the small Llama `steps` steps on one rank; return losses, fp32 main weights, compute-weight checks."""
    from hfsdp.core import (
        FusedAdamW,
        LayoutConfig,
        MixedPrecision,
        build_meshes,
        clip_grad_norm_,
        fully_shard,
        sharding_of,
    )
    from hfsdp.core.buffers.flat_layout import FlatLayout
    from hfsdp.models import hf

    cfg = LayoutConfig(world_size=1)
    model = _llama(device)
    mp = MixedPrecision(param_dtype=dtype)
    sharded = fully_shard(
        model, cfg, build_meshes(cfg, device.type), units=hf.decoder_layers(model), mp=mp, offload=offload
    )
    params = sharded.parameters()
    if optimizer == "torch":
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=device.type == "cuda")
    else:
        prestage = optimizer == "prestage"
        opt = FusedAdamW(params, lr=1e-3, weight_decay=0.1, max_grad_norm=clip, prestage_gathers=prestage)
    gen = torch.Generator().manual_seed(5)
    losses, consistent = [], []
    for _ in range(steps):
        tokens = torch.randint(0, 512, (2, 128), generator=gen).to(device)
        loss = hf.causal_lm_loss(sharded, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        if optimizer == "torch":
            clip_grad_norm_(sharded, clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if dtype != torch.float32:
            for group in sharding_of(sharded).groups:
                if group.param_shard is not None:
                    seen = group.param_shard[FlatLayout.within(group.param_range, group.optim_range)]
                elif group._gather_input_ready:
                    seen = group.unsharded[slice(*group.param_range)]
                else:
                    continue
                consistent.append(torch.equal(seen, group.main.to(device=seen.device, dtype=seen.dtype)))
    mains = torch.cat([g.main.detach().to("cpu").reshape(-1) for g in sharding_of(sharded).groups])
    return {"losses": losses, "main": mains, "consistent": consistent, "fraction": sharding_of(sharded).offload_plan}


def engine_checks(device) -> None:
    bf16 = torch.bfloat16
    base = _run(device, torch.float32, "torch")
    fused = _run(device, torch.float32, "fused")
    err = _rel(fused["main"], base["main"])
    name = "fp32: FusedAdamW(max_grad_norm) trains like torch AdamW + clip_grad_norm_"
    check(name, err < 1e-4, f"main rel {err:.1e}")  # 1e-4: CUDA's embedding backward sums with atomics
    ref = _run(device, bf16, "torch")
    for kind in ("fused", "prestage"):
        got = _run(device, bf16, kind)
        diff = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True))
        check(f"bf16 {kind}: losses within 1e-3 of hfsdp with torch AdamW", diff < 1e-3, f"max rel {diff:.1e}")
        if kind == "prestage":  # one GPU keeps no bf16 shard: only a prestaged gather input is written by the step
            written = got["consistent"] and all(got["consistent"])
            check("bf16 prestage: the gather inputs the step wrote are the cast of the main weights", bool(written))
    for offload in (0.5, True):
        got = _run(device, torch.float32, "torch", offload=offload)
        err = _rel(got["main"], base["main"])
        plan = got["fraction"]
        detail = f"units {plan.units}, fraction {plan.fraction:.2f}, main rel {err:.1e}"
        check(f"fp32 offload={offload}: trains like no offload (host and device AdamW)", err < 1e-4, detail)
    got = _run(device, bf16, "torch", offload=0.5)
    diff = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    check("bf16 offload=0.5: losses within 1e-3 of no offload", diff < 1e-3, f"max rel {diff:.1e}")
    auto = _run(device, bf16, "torch", offload="auto", steps=1)
    check("offload='auto' keeps a model that fits on the device", auto["fraction"].fraction == 0.0)


def _resident_bytes() -> int:
    """This process's resident anonymous + shared memory (page-locked memory is one or the other)."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))


def host_memory_checks(device) -> None:
    """Offload's exact-size page-locked buffers (`hfsdp.core.offload.host_memory`) on a real GPU: locked, asynchronous,
    the size asked for where torch's pinned allocator takes the next power of two, and freed with their last view."""
    import gc

    from hfsdp.core.offload.host_memory import page_locked_empty

    numel = 318_767_105  # one 13B-Llama unit's elements: 1.27 GB in fp32, a 2 GiB block from torch's allocator
    nbytes = numel * 4
    source = torch.randn(numel, device=device)  # first, so that CUDA's own host memory is in `before`
    torch.cuda.synchronize()
    before = _resident_bytes()
    host = page_locked_empty(numel)
    check("page_locked_empty: is_pinned()", host.is_pinned())
    host.copy_(source, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    queued = not done.query()  # a pageable destination would have made the copy synchronous
    torch.cuda.synchronize()
    grown = _resident_bytes() - before
    check("page_locked_empty: a non_blocking copy into it is asynchronous", queued)
    check("page_locked_empty: resident memory grows by the bytes asked for (within 2%)",
          abs(grown - nbytes) < 0.02 * nbytes, f"{grown / 2**30:.3f} GiB for {nbytes / 2**30:.3f} GiB")  # fmt: skip
    check("page_locked_empty: the copy arrives whole", torch.equal(host, source.cpu()))
    del host
    gc.collect()
    freed = grown - (_resident_bytes() - before)
    check("page_locked_empty: freed with its last view", freed > 0.98 * nbytes, f"{freed / 2**30:.3f} GiB back")
    before = _resident_bytes()
    pinned = torch.empty(numel, pin_memory=True)
    pinned.fill_(0)
    torch_grown = _resident_bytes() - before
    print(f"for comparison, torch's pinned allocator took {torch_grown / 2**30:.3f} GiB for it", flush=True)
    del pinned, source


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    p.add_argument("--timing-numel", type=int, default=512 * 2**20, help="elements of the timed run (0: no timing)")
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    timing = None
    try:
        groups = [("kernel", kernel_checks), ("engine", None if args.skip_engine else engine_checks)]
        groups.append(("host memory", host_memory_checks if device.type == "cuda" else None))
        for name, fn in groups:
            if fn is None:
                continue
            try:
                fn(device)
            except Exception as err:  # a crash is a failed check, and the next group still runs
                check(f"{name} checks ran to the end", False, f"{type(err).__name__}: {err}")
        if args.timing_numel and triton_usable(torch.empty(0, device=device)):
            timing = kernel_timing(device, args.timing_numel)
    finally:
        dist.destroy_process_group()
    failed = [r for r in RESULTS if not r["ok"]]
    print(f"{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed" + (": FAILURES ABOVE" if failed else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"checks": RESULTS, "kernel_timing": timing}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
