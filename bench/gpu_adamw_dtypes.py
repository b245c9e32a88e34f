"""FusedAdamW's moment dtypes on a GPU: the Triton kernels bit for bit against the torch path, their speed, and
FusedAdamW end to end on a small sharded model.

    python bench/gpu_adamw_dtypes.py --out OUT/adamw_dtypes.json           # CUDA, one GPU, about a minute
    python bench/gpu_adamw_dtypes.py --out X.json --device cpu --backends torch,torch --quick --numel 65536

1. Bits. For every moment option (exp_avg/exp_avg_sq: fp32/fp32, bf16/bf16, fp16/fp16, bf16/fp8, fp8/fp8,
   fp8/bf16), gradient dtype (fp32, bf16) and variant (plain; clip coefficient and bf16 `out`; fp16 `out`; clipped,
   the masters as a bf16 half plus an int16 remainder, `store_param_remainders`, compared joined too), a run of
   several pieces (lengths no multiple of 128 or of the kernel's 4096, one piece of a single element, one that never
   gets a gradient, so the fp8 blocks restart at each piece's start as `FusedAdamW` cuts them) is stepped by
   `adamw_run` with the first backend (default "triton") and the second ("torch") from the same inputs, step after
   step. After every step the weights, both stored moments, the fp8 scales and `out` must be the same bits; the
   first step, index and values of a difference are reported, for every case (none stops the others). The first
   backend is also run a second time: the same bits again (determinism). Two gradient profiles: `real` (log-normal
   magnitudes around 1e-4..1e-2, the range training sees) and `wide` (1e-30..1: fp32 and fp8 subnormals, the fp8
   scales' clamps).
2. Speed. The first backend on one flat run of `--numel` elements (default 256 Mi) per option and gradient dtype,
   with the clip coefficient and the bf16 `out` (what the step moves in training), and again with the masters as
   a bf16 half plus a remainder (no `out`: 2 bytes less per element): CUDA events, warm-up, the median
   of `--repeat` steps. Bandwidth from the bytes per element below (derived from the dtypes, as `fused_adamw`'s
   docstring states them), against the H200's 4.8 TB/s datasheet HBM bandwidth, and a device copy for scale.
3. FusedAdamW. One process (NCCL on CUDA, gloo on the CPU), `hfsdp.core.fully_shard` of a small MLP with bf16
   compute weights, clipped by `max_grad_norm`, `prestage_gathers` (the step writes the bf16 gather input): a
   FusedAdamW on each backend from the same model, fp32 and bf16 reduced gradients (bf16 is read from the buffer),
   three steps: the same losses, weights and checkpoint state (moments, fp8 scales) bit for bit; and each option
   once more with bf16 reduction and `store_param_remainders=True` (the fp32 masters joined from the two halves).

Everything lands in the JSON at `--out`; the exit status is 1 if any check failed (every part still runs).
With Triton, the PTX of each compiled kernel is summarised too (flush-to-zero and fused multiply-add instructions,
which would break the bit equality on subnormals or everywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
import zlib

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import hfsdp.core  # noqa: F401
except ImportError:  # a checkout with no install: its sources
    sys.path[:0] = [os.path.join(ROOT, "packages", p, "src") for p in ("core", "ckpt", "cli")]

from hfsdp.core.buffers.param_remainders import join_master, split_master  # noqa: E402
from hfsdp.core.kernels import adamw_kernel  # noqa: E402
from hfsdp.core.kernels.adamw_kernel import (  # noqa: E402
    SCALE_BLOCK,
    AdamWScalars,
    ScaleBlocks,
    adamw_run,
    is_fp8,
    triton_usable,
)

F32, BF16, F16, E4, E5 = torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2
#: (exp_avg, exp_avg_sq) of each option, by Megatron's names (fp8: e4m3 for exp_avg, e5m2 for exp_avg_sq).
OPTIONS = {
    "fp32/fp32": (F32, F32),
    "bf16/bf16": (BF16, BF16),
    "fp16/fp16": (F16, F16),
    "bf16/fp8": (BF16, E5),
    "fp8/fp8": (E4, E5),
    "fp8/bf16": (E4, BF16),
}
GRADS = {"fp32": F32, "bf16": BF16}
#: (clip coefficient, out dtype) of each variant; "remainders": clipped, the masters as a bf16 weight plus an int16
#: remainder (`store_param_remainders`), compared as the joined fp32 master and both halves.
VARIANTS = {"plain": (False, None), "clip+bf16out": (True, BF16), "fp16out": (False, F16), "remainders": (True, None)}
#: Bytes per element `fused_adamw`'s docstring states (fp32 gradient, bf16 gradient), with the bf16 `out`.
DOCSTRING_BYTES = {
    "fp32/fp32": (30, 28),
    "bf16/bf16": (22, 20),
    "fp16/fp16": (22, 20),
    "bf16/fp8": (20.19, 18.19),
    "fp8/fp8": (18.19, 16.19),
}
H200_HBM_BYTES_PER_S = 4.8e12
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
#: Piece lengths of the runs the bit checks step (each a list of pieces stepped as one run).
RUNS = {
    "small": [1000, 77, 4101, 300, 129, 1, 2500, 640],
    "large": [1_000_003, 5000, 131, 8192],
}
QUICK_RUNS = {"small": RUNS["small"]}
SILENT_PIECE = 5  # index in "small" of the piece that never gets a gradient (its fp8 blocks have amax 0)

RESULTS: list[dict] = []


def check(part: str, name: str, ok: bool, **detail) -> bool:
    RESULTS.append({"part": part, "check": name, "ok": bool(ok), **detail})
    text = "; ".join(f"{k}={v}" for k, v in detail.items() if k != "traceback")
    print(f"{'PASS' if ok else 'FAIL'} [{part}] {name}{': ' + text if text and not ok else ''}", flush=True)
    return ok


def crashed(part: str, name: str, err: BaseException) -> None:
    """A case that raised (a kernel that does not compile, say) fails its check; the others still run."""
    check(part, name, False, error=f"{type(err).__name__}: {err}"[:2000], traceback=traceback.format_exc())


# -- bytes per element -------------------------------------------------------------------------------------------


def bytes_per_element(exp_avg: torch.dtype, exp_avg_sq: torch.dtype, grad: torch.dtype, out=BF16) -> float:
    """What one step moves per element: the fp32 weights read and written (8), the gradient read, each moment read
    and written in its dtype, `out` written; an fp8 moment adds its scale (fp32, read and written: 8 bytes per block
    of 128 elements), and any fp8 moment the block table (int32 start and length: 8 bytes per block)."""
    total = 8 + grad.itemsize + 2 * exp_avg.itemsize + 2 * exp_avg_sq.itemsize
    if out is not None:
        total += out.itemsize
    fp8 = sum(is_fp8(d) for d in (exp_avg, exp_avg_sq))
    total += fp8 * 8 / SCALE_BLOCK + (8 / SCALE_BLOCK if fp8 else 0)
    return total


def bytes_table() -> dict:
    table = {}
    for option, (m, v) in OPTIONS.items():
        table[option] = {g: bytes_per_element(m, v, GRADS[g]) for g in GRADS}
        stated = DOCSTRING_BYTES.get(option)
        table[option]["docstring"] = None if stated is None else dict(zip(GRADS, stated, strict=True))
    return table


def print_bytes_table(table: dict) -> None:
    print("\nbytes per element per step (with the bf16 out), derived from the dtypes; the docstring's in brackets")
    print(f"  {'exp_avg/exp_avg_sq':<20}{'fp32 grad':>18}{'bf16 grad':>18}")
    for option, row in table.items():
        cells = []
        for g in GRADS:
            stated = row["docstring"][g] if row["docstring"] else None
            mark = "" if stated is None or abs(stated - row[g]) < 0.006 else " !"
            cells.append(f"{row[g]:.4g} [{'-' if stated is None else stated}]{mark}")
        print(f"  {option:<20}{cells[0]:>18}{cells[1]:>18}")
    print("  (! : the docstring's figure differs from the dtypes' count)\n")


# -- bit checks --------------------------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def first_difference(a: torch.Tensor, b: torch.Tensor) -> dict | None:
    """None if `a` and `b` hold the same bits; else how many elements differ and the first one."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return {"count": -1, "why": f"{a.dtype}{tuple(a.shape)} against {b.dtype}{tuple(b.shape)}"}
    differ = bits(a) != bits(b)
    count = int(differ.sum())
    if not count:
        return None
    index = int(differ.nonzero()[0, 0])
    x, y = a.reshape(-1)[index], b.reshape(-1)[index]
    width = 2 * a.element_size()
    return {
        "count": count,
        "of": a.numel(),
        "index": index,
        "values": [float(x.float()), float(y.float())],
        "bits": [f"{int(bits(x.reshape(1))) & (2 ** (4 * width) - 1):0{width}x}" for x in (x, y)],
    }


class State:
    """One backend's copy of a run's state: weights, moments (their dtypes), fp8 scales, the `out` weights."""

    def __init__(self, p, m_dtype, v_dtype, blocks, out_dtype, remainders=False):
        n = p.numel()
        self.p = p.clone()
        self.remainder = None
        if remainders:  # the master as its bf16 half (stepped in place) and its low 16 bits
            self.p, self.remainder = split_master(self.p)
        self.m = torch.zeros(n, dtype=m_dtype, device=p.device)
        self.v = torch.zeros(n, dtype=v_dtype, device=p.device)
        self.scales = tuple(
            torch.ones(blocks.count, device=p.device) if is_fp8(d) else None for d in (m_dtype, v_dtype)
        )
        self.out = None if out_dtype is None else torch.full((n,), float("nan"), dtype=out_dtype, device=p.device)
        self.blocks = blocks if any(is_fp8(d) for d in (m_dtype, v_dtype)) else None

    def step(self, grad, coef, scalars, backend) -> str:
        return adamw_run(
            self.p,
            grad,
            self.m,
            self.v,
            scalars,
            coef,
            self.out,
            backend,
            scales=self.scales,
            blocks=self.blocks,
            remainder=self.remainder,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"param": self.p, "exp_avg": self.m, "exp_avg_sq": self.v}
        if self.remainder is not None:
            named.update(master=join_master(self.p, self.remainder), remainder=self.remainder)
        for key, scale in zip(("exp_avg_scale", "exp_avg_sq_scale"), self.scales, strict=True):
            if scale is not None:
                named[key] = scale
        if self.out is not None:
            named["out"] = self.out
        return named


def _gradients(lengths: list[int], steps: int, profile: str, seed: int) -> list[torch.Tensor]:
    """fp32 gradients on the CPU (the same on every device): `real`, log-normal magnitudes (per piece around 1e-4
    to 1e-2, per element sigma 1) times normal noise; `wide`, each element's magnitude 10**U(-30, 0). The piece
    `SILENT_PIECE` of a run of more pieces never gets a gradient, and the last piece none at the second step."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        pieces = []
        for index, length in enumerate(lengths):
            noise = torch.randn(length, generator=gen)
            if profile == "wide":
                g = noise * torch.pow(10.0, -30 * torch.rand(length, generator=gen))
            else:
                level = 10 ** (-4 + 2 * torch.rand((), generator=gen).item())
                g = noise * level * torch.exp(torch.randn(length, generator=gen))
            silent = (len(lengths) > SILENT_PIECE and index == SILENT_PIECE) or (
                step == 1 and index == len(lengths) - 1
            )
            pieces.append(torch.zeros(length) if silent else g)
        out.append(torch.cat(pieces))
    return out


def bit_case(device, backends, option, grad_name, variant, run_name, lengths, profile, steps) -> dict:
    m_dtype, v_dtype = OPTIONS[option]
    clip, out_dtype = VARIANTS[variant]
    n = sum(lengths)
    seed = zlib.crc32(f"{option} {grad_name} {variant} {run_name} {profile}".encode())
    gen = torch.Generator().manual_seed(seed)
    p0 = (torch.randn(n, generator=gen) * 0.02).to(device)
    grads = [g.to(GRADS[grad_name]).to(device) for g in _gradients(lengths, steps, profile, seed)]
    coefs = [torch.tensor([0.25 + 0.7 * torch.rand((), generator=gen).item()], device=device) for _ in range(steps)]
    blocks = ScaleBlocks(lengths, device)
    first, second = backends
    split = variant == "remainders"
    states = {key: State(p0, m_dtype, v_dtype, blocks, out_dtype, split) for key in ("a", "b", "again")}
    runs = {"a": first, "b": second, "again": first}
    record = {"mismatch": {}, "nondeterministic": {}, "used": set()}
    for step in range(steps):
        scalars = AdamWScalars.of(LR, *BETAS, EPS, WD, step + 1)
        coef = coefs[step] if clip else None
        for key, state in states.items():
            record["used"].add(state.step(grads[step], coef, scalars, runs[key]))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        a, b, again = (states[k].tensors() for k in ("a", "b", "again"))
        for name in a:
            diff = first_difference(a[name], b[name])
            if diff is not None and name not in record["mismatch"]:
                record["mismatch"][name] = {"step": step + 1, **diff}
            diff = first_difference(a[name], again[name])
            if diff is not None and name not in record["nondeterministic"]:
                record["nondeterministic"][name] = {"step": step + 1, **diff}
    final = states["a"].tensors()
    record["finite"] = all(bool(torch.isfinite(t.float()).all()) for t in final.values())
    stored = {k: final[k] for k in ("exp_avg", "exp_avg_sq")}
    record["nonzero_moment_share"] = {k: float((t.float() != 0).float().mean()) for k, t in stored.items()}
    record["used"] = sorted(record["used"])
    return record


def bit_checks(device, backends, steps: int, quick: bool, options) -> list[dict]:
    cases = []
    runs = QUICK_RUNS if quick else RUNS
    matrix = [
        (option, grad, variant, run, "real")
        for option in options
        for grad in GRADS
        for variant in VARIANTS
        for run in runs
    ]
    matrix += [(option, "fp32", "clip+bf16out", "small", "wide") for option in options]
    for option, grad, variant, run, profile in matrix:
        shape = f"({sum(runs[run])} elements, {len(runs[run])} pieces)"
        name = f"{option} grad={grad} {variant} run={run} {shape} {profile}"
        try:
            record = bit_case(device, backends, option, grad, variant, run, runs[run], profile, steps)
        except Exception as err:  # a kernel that does not compile fails its cases, not the script
            crashed("bits", name, err)
            cases.append({"case": name, "error": traceback.format_exc()})
            continue
        record["case"] = name
        cases.append(record)
        check("bits", f"{name}: {backends[0]} == {backends[1]}", not record["mismatch"], **record["mismatch"])
        check(
            "bits", f"{name}: {backends[0]} deterministic", not record["nondeterministic"], **record["nondeterministic"]
        )
        check("bits", f"{name}: finite", record["finite"])
    return cases


# -- timing ------------------------------------------------------------------------------------------------------


def _time(fn, device, warmup: int, repeat: int) -> dict:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e-3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return {"median_s": statistics.median(times), "min_s": min(times), "repeat": repeat}


def timing(device, backend: str, numel: int, warmup: int, repeat: int, options) -> list[dict]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(7)
    p = torch.randn(numel, generator=gen, device=device).mul_(0.02)
    g32 = torch.randn(numel, generator=gen, device=device).mul_(1e-3)
    out = torch.empty(numel, dtype=BF16, device=device)
    coef = torch.tensor([0.5], device=device)
    s = AdamWScalars.of(LR, *BETAS, EPS, WD, 10)
    copy = _time(lambda: out.copy_(g32), device, warmup, repeat)  # read 4, write 2: bytes 6
    copy_row = {"what": "copy fp32 -> bf16", "bytes_per_element": 6.0, **copy}
    copy_row["TBps"] = 6.0 * numel / copy["median_s"] / 1e12
    rows.append(copy_row)
    blocks = ScaleBlocks([numel], device)
    high, low = split_master(p)  # the same masters as a bf16 half and a remainder
    for grad_name, grad_dtype in GRADS.items():
        g = g32 if grad_dtype == F32 else g32.to(grad_dtype)
        for option in options:
            m_dtype, v_dtype = OPTIONS[option]
            name = f"{option} grad={grad_name}"
            try:
                m = torch.zeros(numel, dtype=m_dtype, device=device)
                v = torch.zeros(numel, dtype=v_dtype, device=device)
                scales = tuple(
                    torch.ones(blocks.count, device=device) if is_fp8(d) else None for d in (m_dtype, v_dtype)
                )
                run_blocks = blocks if any(is_fp8(d) for d in (m_dtype, v_dtype)) else None

                def step(m=m, v=v, scales=scales, run_blocks=run_blocks, g=g):
                    adamw_run(p, g, m, v, s, coef, out, backend, scales=scales, blocks=run_blocks)

                def split_step(m=m, v=v, scales=scales, run_blocks=run_blocks, g=g):
                    adamw_run(high, g, m, v, s, coef, None, backend, scales=scales, blocks=run_blocks, remainder=low)

                measured = {False: _time(step, device, warmup, repeat), True: _time(split_step, device, warmup, repeat)}
            except Exception as err:
                crashed("timing", name, err)
                rows.append({"what": name, "error": traceback.format_exc()})
                continue
            for remainders, timed in measured.items():
                # with remainders: the master's two 16-bit halves read and written (fp32's 8 bytes), no bf16 `out`
                per = bytes_per_element(m_dtype, v_dtype, grad_dtype) - (2 if remainders else 0)
                what = name + (" remainders" if remainders else "")
                row = {"what": what, "option": option, "grad": grad_name, "remainders": remainders}
                row.update(bytes_per_element=per, **timed)
                row["TBps"] = per * numel / timed["median_s"] / 1e12
                row["fraction_of_4.8TBps"] = row["TBps"] * 1e12 / H200_HBM_BYTES_PER_S
                rows.append(row)
            del m, v, scales
    for row in rows:
        if "error" in row:
            continue
        extra = f", {row['fraction_of_4.8TBps']:.0%} of 4.8 TB/s" if "fraction_of_4.8TBps" in row else ""
        print(
            f"  {row['what']:<26} {row['median_s'] * 1e3:8.3f} ms (min {row['min_s'] * 1e3:.3f})  "
            f"{row['bytes_per_element']:7.4g} B/elem  {row['TBps']:.3f} TB/s{extra}",
            flush=True,
        )
    return rows


# -- FusedAdamW end to end ---------------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class _Net(torch.nn.Module):
    """Odd sizes (no piece a multiple of 128): 24 -> 200, two blocks 200 -> 333 -> 200, a scalar head, MSE."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(24, 200)
        self.layers = torch.nn.ModuleList(_Block(200, 333) for _ in range(2))
        self.head = torch.nn.Linear(200, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return ((self.head(h).squeeze(-1).float() - y) ** 2).mean()


def _fused_run(device, backend: str, option: str, reduce_dtype, steps: int, remainders: bool = False):
    from hfsdp.core import LayoutConfig, MixedPrecision, build_meshes, fully_shard, sharding_of
    from hfsdp.core.kernels.fused_adamw import FusedAdamW

    torch.manual_seed(0)
    net = _Net().to(device)
    cfg = LayoutConfig(world_size=1)
    mp = MixedPrecision(param_dtype=BF16, reduce_dtype=reduce_dtype)
    model = fully_shard(net, cfg, build_meshes(cfg, device.type), units=list(net.layers), mp=mp)
    m_dtype, v_dtype = OPTIONS[option]
    opt = FusedAdamW(
        model.parameters(),
        lr=3e-3,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        max_grad_norm=0.05,
        prestage_gathers=True,
        backend=backend,
        exp_avg_dtype=m_dtype,
        exp_avg_sq_dtype=v_dtype,
        store_param_remainders=remainders,
    )
    gen = torch.Generator().manual_seed(11)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(64, 24, generator=gen).to(device), torch.randn(64, generator=gen).to(device)
        model.set_microbatch(0, 1)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float().item())
    model.wait_for_weights()
    named = {}
    for piece in sharding_of(model).main_params:
        named[f"{piece.name}"] = piece.master().detach().clone()  # the fp32 master (joined with remainders)
        for key, value in opt.checkpoint_state(piece.param).items():
            if isinstance(value, torch.Tensor) and value.dim():
                named[f"{piece.name}.{key}"] = value.detach().clone()
    return losses, named, sorted(opt.backends_used)


def fused_checks(device, backends, steps: int, options) -> list[dict]:
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        extra = {"device_id": device} if device.type == "cuda" else {}
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **extra)
    rows = []
    try:
        cases = [(o, r, False) for o in options for r in ("fp32", "bf16")] + [(o, "bf16", True) for o in options]
        for option, reduce_name, remainders in cases:
            reduce_dtype = {"fp32": F32, "bf16": BF16}[reduce_name]
            name = f"FusedAdamW {option} reduce={reduce_name}" + (" store_param_remainders" if remainders else "")
            try:
                la, a, used_a = _fused_run(device, backends[0], option, reduce_dtype, steps, remainders)
                lb, b, used_b = _fused_run(device, backends[1], option, reduce_dtype, steps, remainders)
            except Exception as err:
                crashed("fused", name, err)
                rows.append({"case": name, "error": traceback.format_exc()})
                continue
            diffs = {}
            for key in sorted(set(a) | set(b)):
                if key not in a or key not in b:
                    diffs[key] = {"count": -1, "why": "missing on one backend"}
                elif (diff := first_difference(a[key], b[key])) is not None:
                    diffs[key] = diff
            ok = not diffs and la == lb and used_a == [backends[0]] and used_b == [backends[1]]
            row = {"case": name, "losses": [la, lb], "backends_used": [used_a, used_b], "mismatch": diffs}
            row["tensors"] = len(a)
            rows.append(row)
            check(
                "fused",
                f"{name}: {backends[0]} == {backends[1]}",
                ok,
                **diffs,
                losses=[la, lb],
                used=[used_a, used_b],
            )
    finally:
        if own:
            dist.destroy_process_group()
    return rows


# -- PTX -------------------------------------------------------------------------------------------------------------

_PTX_OPS = re.compile(r"\b((?:sqrt|div|fma|mul|add|sub|cvt|abs|max|min|rcp)\.[a-z0-9.]+)")


def _compiled(fn):
    """The compiled kernels of a Triton `JITFunction` (their layout differs across Triton versions)."""
    found = []
    for holder in (getattr(fn, "device_caches", None), getattr(fn, "cache", None)):
        if not isinstance(holder, dict):
            continue
        for entry in holder.values():
            for part in entry if isinstance(entry, tuple | list) else (entry,):
                if isinstance(part, dict):
                    found.extend(k for k in part.values() if hasattr(k, "asm"))
    return found


def ptx_summary() -> dict:
    """Per compiled kernel: its fp instructions and counts; flags for .ftz (subnormals flushed) and fma (contracted)."""
    summary = {}
    for name in ("_adamw_kernel", "_adamw_blocks_kernel"):
        fn = getattr(adamw_kernel, name, None)
        if fn is None:
            continue
        for index, kernel in enumerate(_compiled(fn)):
            ptx = kernel.asm.get("ptx", "") if isinstance(kernel.asm, dict) else ""
            if not ptx:
                continue
            ops: dict[str, int] = {}
            for op in _PTX_OPS.findall(ptx):
                if op.endswith(("f32", "f16", "bf16", "e4m3x2", "e5m2x2", "f16x2", "bf16x2")) or ".f32." in op:
                    ops[op] = ops.get(op, 0) + 1
            summary[f"{name}#{index}"] = {
                "ops": dict(sorted(ops.items())),
                "ftz": sorted(op for op in ops if ".ftz" in op),
                "fma": sorted(op for op in ops if op.startswith("fma")),
            }
    return summary


# -- main --------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--backends", default="triton,torch", help="the backend checked and its reference (default triton,torch)"
    )
    p.add_argument("--options", default=",".join(OPTIONS), help=f"moment options, from {', '.join(OPTIONS)}")
    p.add_argument("--steps", type=int, default=4, help="steps per bit case (default 4)")
    p.add_argument("--quick", action="store_true", help="only the small run of pieces")
    p.add_argument("--numel", type=int, default=256 * 2**20, help="elements of the timed run (default 256 Mi; 0: skip)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=30, help="timed steps per option, the median reported (default 30)")
    p.add_argument("--no-fused", dest="fused", action="store_false", help="skip the FusedAdamW part")
    return p.parse_args(argv)


def environment(device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    env["triton"] = getattr(adamw_kernel.triton, "__version__", None) if adamw_kernel.triton is not None else None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
    env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET")
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    backends = tuple(args.backends.split(","))
    options = [o for o in args.options.split(",") if o]
    unknown = [o for o in options if o not in OPTIONS] + [b for b in backends if b not in ("triton", "torch")]
    if len(backends) != 2 or unknown:
        raise SystemExit(f"--backends takes two of triton, torch and --options names from {list(OPTIONS)}: {unknown}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device here: use --device cpu --backends torch,torch")
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "triton" in backends and not triton_usable(torch.empty(0, device=device)):
        why = "Triton missing, or the CPU without TRITON_INTERPRET=1"
        raise SystemExit(f"backend triton cannot run on {device} here ({why})")
    env = environment(device)
    print(f"environment: {json.dumps(env)}", flush=True)
    table = bytes_table()
    print_bytes_table(table)
    report: dict = {"environment": env, "args": vars(args), "bytes_per_element": table}

    print(f"== bits: {backends[0]} against {backends[1]}, {args.steps} steps per case", flush=True)
    report["bit_cases"] = bit_checks(device, backends, args.steps, args.quick, options)
    if "triton" in backends:
        try:
            report["ptx"] = ptx_summary()
        except Exception as err:  # a diagnostic only: Triton's caches differ across versions
            report["ptx"] = {"error": f"{type(err).__name__}: {err}"}
        for kernel, info in report["ptx"].items():
            if isinstance(info, dict):
                print(f"  ptx {kernel}: ftz {info['ftz'] or 'none'}, fma {info['fma'] or 'none'}", flush=True)
    if args.numel:
        size = f"{args.numel} elements ({args.numel / 2**20:g} Mi)"
        print(f"\n== timing: {backends[0]} over {size}, median of {args.repeat}", flush=True)
        try:
            report["timing"] = timing(device, backends[0], args.numel, args.warmup, args.repeat, options)
        except Exception as err:  # out of memory, say: the other parts still count
            crashed("timing", "setup", err)
    if args.fused:
        print(f"\n== FusedAdamW end to end: {backends[0]} against {backends[1]}", flush=True)
        try:
            report["fused"] = fused_checks(device, backends, 3, options)
        except Exception as err:  # the process group or the engine could not start
            crashed("fused", "setup", err)

    failed = [r for r in RESULTS if not r["ok"]]
    report["checks"] = RESULTS
    report["passed"], report["failed"] = len(RESULTS) - len(failed), len(failed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    if failed:
        print("\nfailed:")
        for r in failed:
            print(f"  [{r['part']}] {r['check']}")
    print(f"\n{report['passed']} passed, {report['failed']} failed; JSON: {args.out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
