"""Optimizer-state precision against quality (issue 38, item 5): eval loss of a small Llama, fp32 state vs the rest.

Every run trains the same model (`diloco_data.Llama`: RMSNorm, rotary, SwiGLU, untied embeddings; by default 4
layers, hidden 192, 6 heads, SwiGLU 512, vocabulary 256: 1.9M parameters) on the same bytes (per seed: the same
random windows of the standard library's `.py` files; every 20th file held out for evaluation), sharded with
`hfsdp.core.fully_shard` on a one-rank gloo group with `MixedPrecision(param_dtype=torch.bfloat16)` (bf16 compute,
fp32 masters), and stepped by `FusedAdamW(backend="torch")`: the CPU path that computes the GPU kernel's
operations in the same order. What changes between settings is only what issue 38 adds:

    setting                  gradients (reduce_dtype)  exp_avg   exp_avg_sq  Megatron's flags
    fp32                     fp32                      fp32      fp32        (the default)
    bf16 moments             fp32                      bf16      bf16        --exp-avg{,-sq}-dtype bf16
    fp8 moments              fp32                      fp8 e4m3  fp8 e5m2    --exp-avg{,-sq}-dtype fp8
    bf16 grads               bf16                      fp32      fp32        --main-grads-dtype bf16
    bf16 grads+moments       bf16                      bf16      bf16        all three bf16 (Megatron's "together")
    bf16 grads+fp8 moments   bf16                      fp8       fp8         the same with fp8 moments

The optimizer's other settings are `hfsdp train`'s (FusedAdamW's defaults: betas 0.9/0.999, eps 1e-8, weight
decay 0.01; clip 1.0 inside the step), since the question is what `hfsdp train` may default to; `--beta2` changes
that. Schedules (`--schedule`): `cosine` (5% linear warm-up to `--lr`, cosine to 10% of it) and `lowlr` (the same
warm-up to `--lr`, held to `--low-after` steps, then `--low-lr` to the end: small updates on a model that has
already learned, so the eval loss that phase gains is what the moment precision could lose).

Each run records the train loss of every 50th step, the eval loss (`--eval-rows` fixed held-out windows, the same
for every run) every `--eval-every` steps and at the end, and its wall time: one JSON line per run in `--out`,
flushed as it ends. `--report FILE...` reads such lines and prints the table: mean and spread over seeds per
setting and schedule, and whether each mean is within fp32's seed-to-seed range (min to max).

    python bench/optimizer_precision_quality.py --settings fp32 "bf16 moments" --seeds 0 1 2 --out a.jsonl
    python bench/optimizer_precision_quality.py --report a.jsonl b.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diloco_data import Llama, Shape, batch, eval_windows, stdlib_bytes


@dataclass(frozen=True)
class Setting:
    name: str
    grads: str  # the gradient buffer's dtype (MixedPrecision.reduce_dtype)
    exp_avg: str
    exp_avg_sq: str


SETTINGS = [
    Setting("fp32", "fp32", "fp32", "fp32"),
    Setting("bf16 moments", "fp32", "bf16", "bf16"),
    Setting("fp8 moments", "fp32", "fp8", "fp8"),
    Setting("bf16 grads", "bf16", "fp32", "fp32"),
    Setting("bf16 grads+moments", "bf16", "bf16", "bf16"),
    Setting("bf16 grads+fp8 moments", "bf16", "fp8", "fp8"),
]
BY_NAME = {s.name: s for s in SETTINGS}
REFERENCE = "fp32"
TRAIN_EVERY = 50  # the train loss of every this many steps is recorded


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", nargs="+", metavar="JSONL", help="print the table of these result files and exit")
    p.add_argument("--decay-probe", action="store_true", help="print how each moment dtype tracks a drop of E[g^2]")
    p.add_argument("--settings", nargs="+", default=[s.name for s in SETTINGS], choices=list(BY_NAME))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--schedule", choices=("cosine", "lowlr"), default="cosine")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--low-lr", type=float, default=1e-5)
    p.add_argument("--low-after", type=int, default=200, help="lowlr: the step from which the lr is --low-lr")
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--rows", type=int, default=8, help="sequences per step")
    p.add_argument(
        "--microbatches", type=int, default=1, help="split each step's rows into this many accumulated microbatches"
    )
    p.add_argument("--eval-rows", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="optimizer_precision.jsonl")
    args = p.parse_args(argv)
    args.shape = Shape(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn, vocab=256, seq=args.seq)
    return args


def lr_factor(args, step: int) -> float:
    """The lr at `step` as a fraction of --lr."""
    warm = max(1, args.steps // 20)
    if step < warm:
        return (step + 1) / warm
    if args.schedule == "lowlr":
        return 1.0 if step < args.low_after else args.low_lr / args.lr
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, args.steps - warm)))


def _dtype(name: str) -> torch.dtype | str:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}.get(name, name)


def build(args, setting: Setting, seed: int):
    """The sharded model and its FusedAdamW for one run (world size 1: the process group must exist)."""
    from hfsdp.core import FusedAdamW, LayoutConfig, MixedPrecision, build_meshes, fully_shard

    torch.manual_seed(seed)
    model = Llama(args.shape)
    cfg = LayoutConfig(world_size=1)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=_dtype(setting.grads))
    sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp)
    opt = FusedAdamW(
        sharded.parameters(),
        lr=args.lr,
        betas=(0.9, args.beta2),
        weight_decay=args.weight_decay,
        max_grad_norm=args.clip,
        backend="torch",
        exp_avg_dtype=_dtype(setting.exp_avg),
        exp_avg_sq_dtype=_dtype(setting.exp_avg_sq),
    )
    return sharded, opt


@torch.no_grad()
def evaluate(model, held: torch.Tensor, args) -> float:
    tokens, labels = eval_windows(held, args.eval_rows, args.shape.seq)
    total = 0.0
    for start in range(0, args.eval_rows, 32):
        chunk = slice(start, start + 32)
        total += model(tokens[chunk], labels[chunk]).float().item() * tokens[chunk].shape[0]
    return total / args.eval_rows


def train_run(args, setting: Setting, seed: int, data) -> dict:
    """Train one setting from one seed; its record (losses, evals, the dtypes the optimizer really kept)."""
    train, held = data
    model, opt = build(args, setting, seed)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(args, s))
    began = time.perf_counter()
    curve, evals, nonfinite = [], {}, 0
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        tokens, labels = batch(train, args.rows, args.shape.seq, gen)
        if args.microbatches == 1:
            loss = model(tokens, labels)
            loss.backward()
        else:  # hfsdp train's accumulation: the engine sums the microbatches' gradients and divides by their count
            loss = 0.0
            for index, part in enumerate(torch.arange(args.rows).chunk(args.microbatches)):
                model.set_microbatch(index, args.microbatches)
                part_loss = model(tokens[part], labels[part])
                part_loss.backward()
                loss = loss + part_loss.detach() / args.microbatches
        opt.step()
        opt.zero_grad()
        schedule.step()
        value = loss.detach().float().item()
        nonfinite += not math.isfinite(value)
        if (step + 1) % TRAIN_EVERY == 0 or step == 0:
            curve.append([step + 1, value])
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evals[step + 1] = evaluate(model, held, args)
    seconds = time.perf_counter() - began
    grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}  # what zero_grad left (usually none)
    return {
        "setting": setting.name,
        **{k: v for k, v in asdict(setting).items() if k != "name"},
        "seed": seed,
        "schedule": args.schedule,
        "steps": args.steps,
        "lr": args.lr,
        "low_lr": args.low_lr if args.schedule == "lowlr" else None,
        "low_after": args.low_after if args.schedule == "lowlr" else None,
        "betas": [0.9, args.beta2],
        "weight_decay": args.weight_decay,
        "clip": args.clip,
        "rows": args.rows,
        "microbatches": args.microbatches,
        "shape": asdict(args.shape),
        "params": sum(p.numel() for p in model.parameters()),
        "tokens": args.steps * args.rows * args.shape.seq,
        "optimizer_dtypes": [str(d) for d in opt.dtypes],
        "backends_used": sorted(opt.backends_used),
        "leftover_grad_dtypes": sorted(str(d) for d in grads),
        "train_curve": curve,
        "train_loss_last_10pct": None,  # filled below
        "evals": evals,
        "eval_loss": evals[args.steps],
        "nonfinite_train_losses": nonfinite,
        "seconds": seconds,
    }


def _tail(curve: list, steps: int) -> float:
    tail = [loss for step, loss in curve if step > 0.9 * steps] or [curve[-1][1]]
    return sum(tail) / len(tail)


def run(args) -> list[dict]:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    train, held, info = stdlib_bytes()
    print(
        f"corpus: {info}; model {sum(p.numel() for p in Llama(args.shape).parameters()) / 1e6:.2f}M parameters; "
        f"torch {torch.__version__}; {platform.processor() or platform.machine()}; {args.threads} thread(s)",
        flush=True,
    )
    records = []
    started = time.perf_counter()
    with open(args.out, "a") as out:
        for seed in args.seeds:
            for name in args.settings:
                record = train_run(args, BY_NAME[name], seed, (train, held))
                record["train_loss_last_10pct"] = _tail(record["train_curve"], args.steps)
                record["torch"] = torch.__version__
                out.write(json.dumps(record) + "\n")
                out.flush()
                records.append(record)
                curve = " ".join(f"{s}:{v:.3f}" for s, v in record["train_curve"])
                evals = " ".join(f"{s}:{v:.4f}" for s, v in record["evals"].items())
                print(
                    f"{args.schedule} {name:<24} seed {seed}: eval {record['eval_loss']:.4f} "
                    f"({record['seconds']:.0f} s, total {time.perf_counter() - started:.0f} s)\n"
                    f"  evals {evals}\n  train {curve}",
                    flush=True,
                )
    return records


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the report --------------------------------------------------------------------------------------------------------


def load(paths) -> list[dict]:
    return [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line.strip()]


def summary(records: list[dict]) -> list[dict]:
    """One row per (schedule, setting): eval loss mean, std, min, max over seeds, against fp32 of that schedule."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        schedule = r["schedule"] + (f", {r['microbatches']} microbatches" if r.get("microbatches", 1) > 1 else "")
        schedule += f", beta2 {r['betas'][1]}" if r["betas"][1] != 0.999 else ""
        schedule += f", lr {r['lr']:g}" if r["lr"] != 2e-3 else ""
        groups.setdefault((schedule, r["setting"]), []).append(r)
    order = {s.name: i for i, s in enumerate(SETTINGS)}
    rows = []
    for (schedule, name), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 99))):
        losses = [r["eval_loss"] for r in sorted(runs, key=lambda r: r["seed"])]
        row = {
            "schedule": schedule,
            "setting": name,
            "seeds": [r["seed"] for r in sorted(runs, key=lambda r: r["seed"])],
            "eval_losses": losses,
            "mean": statistics.fmean(losses),
            "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "min": min(losses),
            "max": max(losses),
            "seconds": statistics.fmean(r["seconds"] for r in runs),
            "nonfinite": sum(r["nonfinite_train_losses"] for r in runs),
        }
        low_after = runs[0].get("low_after")
        if schedule.startswith("lowlr") and low_after and all(str(low_after) in r["evals"] for r in runs):
            # what the low-lr phase gained: eval loss at its start minus at the end, per seed
            row["low_phase_gain"] = statistics.fmean(r["evals"][str(low_after)] - r["eval_loss"] for r in runs)
        rows.append(row)
    for row in rows:
        ref = next((r for r in rows if r["schedule"] == row["schedule"] and r["setting"] == REFERENCE), None)
        if ref is None:
            row["vs_fp32"] = row["within_fp32_range"] = None
            continue
        row["vs_fp32"] = row["mean"] - ref["mean"]
        row["within_fp32_range"] = ref["min"] <= row["mean"] <= ref["max"]
        fp32 = dict(zip(ref["seeds"], ref["eval_losses"], strict=True))
        # this setting minus fp32, seed by seed (the same init and data)
        row["paired_diffs"] = [loss - fp32[seed] for seed, loss in zip(row["seeds"], row["eval_losses"], strict=True)]
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| schedule | setting | eval loss per seed | mean ± std | min - max | mean - fp32 | minus fp32, seed by seed "
        "| within fp32's range | low-lr phase gain |",
        "|---|---|---|---|---|---:|---|---|---:|",
    ]
    for r in rows:
        reference = r["setting"] == REFERENCE or r["vs_fp32"] is None
        within = "—" if r["setting"] == REFERENCE else {True: "yes", False: "**no**", None: "?"}[r["within_fp32_range"]]
        vs = "—" if reference else f"{r['vs_fp32']:+.4f}"
        paired = "—" if reference else ", ".join(f"{d:+.4f}" for d in r["paired_diffs"])
        gain = f"{r['low_phase_gain']:.4f}" if "low_phase_gain" in r else ""
        lines.append(
            f"| {r['schedule']} | {r['setting']} | {', '.join(f'{x:.4f}' for x in r['eval_losses'])} "
            f"| {r['mean']:.4f} ± {r['std']:.4f} | {r['min']:.4f} - {r['max']:.4f} | {vs} | {paired} | {within} "
            f"| {gain} |"
        )
    return "\n".join(lines)


def decay_probe(numel: int = 4096, steps: int = 2000, drop: int = 200, marks=(200, 400, 1000, 2000)) -> dict:
    """FusedAdamW (torch path) on one tensor of Gaussian gradients, std 1 up to step `drop` and 0.1 after: the
    bias-corrected mean of `exp_avg_sq` (dequantized from the state dict) at `marks`, per beta2 and moment dtype.
    fp32 follows E[g^2] (1, then 0.01) at the pace beta2 sets; a stored moment that cannot hold the step's change
    (round to nearest: (1 - beta2) * v below half a unit in the last place) stops decaying."""
    out = {}
    for beta2 in (0.999, 0.95):
        for dtype in ("fp32", "bf16", "fp8"):
            param = torch.nn.Parameter(torch.zeros(numel))
            opt = torch_fused_adamw(param, beta2, dtype)
            gen = torch.Generator().manual_seed(1)
            seen = {}
            for step in range(1, steps + 1):
                param.grad = torch.randn(numel, generator=gen) * (1.0 if step <= drop else 0.1)
                opt.step()
                if step in marks:
                    state = opt.state_dict()["state"][0]
                    v = state["exp_avg_sq"].float()
                    if "exp_avg_sq_scale" in state:  # fp8: E8M0 scale per element
                        v = v * torch.exp2(state["exp_avg_sq_scale"].float() - 127)
                    seen[step] = v.mean().item() / (1 - beta2**step)
            out[f"beta2 {beta2} {dtype}"] = seen
    return out


def torch_fused_adamw(param, beta2: float, dtype: str):
    from hfsdp.core import FusedAdamW

    return FusedAdamW(
        [param], lr=1e-3, betas=(0.9, beta2), weight_decay=0.0, backend="torch", exp_avg_dtype=dtype,
        exp_avg_sq_dtype=dtype,
    )  # fmt: skip


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.decay_probe:
        torch.set_num_threads(args.threads)
        print("bias-corrected mean exp_avg_sq; E[g^2] is 1 up to step 200, 0.01 after")
        for name, seen in decay_probe().items():
            print(f"{name:<18}", "  ".join(f"step {step}: {v:.4g}" for step, v in seen.items()))
        return
    if args.report:
        rows = summary(load(args.report))
        print(table(rows))
        print(json.dumps(rows, indent=1))
        return
    began = time.perf_counter()
    run(args)
    print(f"wrote {args.out} in {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
