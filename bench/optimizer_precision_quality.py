"""Precision against quality: eval loss of a small Llama, the baseline vs optimizer-state precision (issue 38,
item 5) and vs fp8 compute (issue 39, item 5).

Every run trains the same model (`diloco_data.Llama`: RMSNorm, rotary, SwiGLU, untied embeddings; by default 4
layers, hidden 192, 6 heads, SwiGLU 512, vocabulary 256: 1.9M parameters) on the same bytes (per seed: the same
random windows of the standard library's `.py` files; every 20th file held out for evaluation), sharded with
`hfsdp.core.fully_shard` on a one-rank gloo group with `MixedPrecision(param_dtype=torch.bfloat16)` (bf16 compute,
fp32 masters), and stepped by `FusedAdamW(backend="torch")`: the CPU path that computes the GPU kernel's
operations in the same order (`--device cuda`: the Triton kernel, see below). What changes between settings is only
what issue 38 or issue 39 adds. Issue 38, optimizer-state precision (the default `--settings`):

    setting                  gradients (reduce_dtype)  exp_avg   exp_avg_sq  Megatron's flags
    fp32                     fp32                      fp32      fp32        (the default)
    bf16 moments             fp32                      bf16      bf16        --exp-avg{,-sq}-dtype bf16
    fp8 moments              fp32                      fp8 e4m3  fp8 e5m2    --exp-avg{,-sq}-dtype fp8
    bf16 grads               bf16                      fp32      fp32        --main-grads-dtype bf16
    bf16 grads+moments       bf16                      bf16      bf16        all three bf16 (Megatron's "together")
    bf16 grads+fp8 moments   bf16                      fp8       fp8         the same with fp8 moments

Issue 39, fp8 compute: `hfsdp.core.convert_to_float8(model, Float8Config(format, recipe), units=model.layers,
min_size=--fp8-min-size)` before `fully_shard` turns the transformer layers' Linear layers (qkv, proj, gate_up,
down) into `Float8Linear` (`torch._scaled_mm`); the embedding, norms and output layer stay bf16. `--fp8-min-size`
is 0 here (every layer whose dims are multiples of 16: the quality of fp8 arithmetic itself), where `hfsdp train`'s
default, 2048, converts only layers large enough to gain speed (none at hidden 2048). Optimizer state and
gradients as fp32's:

    setting                  Float8Config                             hfsdp train's flags
    bf16                     none (the same run as fp32: bf16 compute, fp32 state; the fp8 rows' baseline)
    fp8 tensorwise hybrid    format="hybrid", recipe="tensorwise"     --fp8-format hybrid
    fp8 tensorwise e4m3      format="e4m3", recipe="tensorwise"       --fp8-format e4m3
    fp8 rowwise e4m3         format="e4m3", recipe="rowwise"          --fp8-format e4m3 --fp8-recipe rowwise

Each run's JSON line records the conversion's one-line summary. The fp8 gather (`fp8_param_gather`) is not a
setting: the runs are on one rank, where nothing is gathered, and it is bit-identical to tensorwise where it is
(tests/core/fp8/test_fp8_gather.py).

`--device cuda` runs the same on GPU 0 (one rank, an NCCL group): the model built on the GPU, bf16 compute as above,
`FusedAdamW(backend="auto")` (the Triton kernel), the step times measured between `torch.cuda.synchronize()` calls
and the peak memory recorded; the model-size flags (`--layers --hidden --heads --ffn --seq --rows`) give the 0.95B
shape. `--dry-run` builds each setting's model on the meta device, converts it, and prints one JSON line per setting
(device, process group, optimizer backend, parameters, conversion summary) without training or needing a GPU.

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
    python bench/optimizer_precision_quality.py --settings bf16 "fp8 tensorwise hybrid" --seeds 0 --out c.jsonl
    python bench/optimizer_precision_quality.py --report a.jsonl b.jsonl
"""

from __future__ import annotations

import argparse
import gc
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
    fp8_format: str | None = None  # Float8Config(format=...) for the units' Linear layers; None: bf16 compute
    fp8_recipe: str | None = None


OPTIMIZER_SETTINGS = [
    Setting("fp32", "fp32", "fp32", "fp32"),
    Setting("bf16 moments", "fp32", "bf16", "bf16"),
    Setting("fp8 moments", "fp32", "fp8", "fp8"),
    Setting("bf16 grads", "bf16", "fp32", "fp32"),
    Setting("bf16 grads+moments", "bf16", "bf16", "bf16"),
    Setting("bf16 grads+fp8 moments", "bf16", "fp8", "fp8"),
]
FP8_SETTINGS = [
    Setting("bf16", "fp32", "fp32", "fp32"),
    Setting("fp8 tensorwise hybrid", "fp32", "fp32", "fp32", "hybrid", "tensorwise"),
    Setting("fp8 tensorwise e4m3", "fp32", "fp32", "fp32", "e4m3", "tensorwise"),
    Setting("fp8 rowwise e4m3", "fp32", "fp32", "fp32", "e4m3", "rowwise"),
]
SETTINGS = OPTIMIZER_SETTINGS + FP8_SETTINGS
BY_NAME = {s.name: s for s in SETTINGS}
BASELINES = ("fp32", "bf16")  # the same run under two names: bf16 compute, fp32 gradients and optimizer state
TRAIN_EVERY = 50  # the train loss of every this many steps is recorded


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", nargs="+", metavar="JSONL", help="print the table of these result files and exit")
    p.add_argument("--decay-probe", action="store_true", help="print how each moment dtype tracks a drop of E[g^2]")
    p.add_argument("--settings", nargs="+", default=[s.name for s in OPTIMIZER_SETTINGS], choices=list(BY_NAME))
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
    p.add_argument("--eval-batch", type=int, default=32, help="held-out rows per evaluation forward")
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one rank on GPU 0")
    p.add_argument(
        "--fp8-min-size", type=float, default=0.0, help="convert_to_float8(min_size=): 0 converts every layer it can"
    )
    p.add_argument("--dry-run", action="store_true", help="print each setting's plan (no training, no GPU needed)")
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


def plan(args) -> dict:
    """Where and how the runs compute: the same for every setting, and what --dry-run prints."""
    cuda = args.device == "cuda"
    return {
        "device": "cuda:0" if cuda else "cpu",
        "process_group": "nccl" if cuda else "gloo",
        # the GPU's fused kernel ("auto": Triton there); on the CPU the torch path of the same arithmetic
        "optimizer_backend": "auto" if cuda else "torch",
        "compute": "bf16",
    }


def convert(model, setting: Setting, min_size: float):
    """The fp8 conversion of the model's transformer layers (in place), or None for bf16 compute."""
    if setting.fp8_format is None:
        return None
    from hfsdp.core import Float8Config, convert_to_float8

    config = Float8Config(format=setting.fp8_format, recipe=setting.fp8_recipe)
    return convert_to_float8(model, config, units=list(model.layers), min_size=min_size)


def build(args, setting: Setting, seed: int):
    """The sharded model, its FusedAdamW and the fp8 summary (or None) for one run (world size 1: the process group
    must exist)."""
    from hfsdp.core import FusedAdamW, LayoutConfig, MixedPrecision, build_meshes, fully_shard

    where = plan(args)
    torch.manual_seed(seed)
    with torch.device(where["device"]):
        model = Llama(args.shape)
    conversion = convert(model, setting, args.fp8_min_size)  # before fully_shard, as hfsdp train does
    cfg = LayoutConfig(world_size=1)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=_dtype(setting.grads))
    sharded = fully_shard(model, cfg, build_meshes(cfg, args.device), units=list(model.layers), mp=mp)
    opt = FusedAdamW(
        sharded.parameters(),
        lr=args.lr,
        betas=(0.9, args.beta2),
        weight_decay=args.weight_decay,
        max_grad_norm=args.clip,
        backend=where["optimizer_backend"],
        exp_avg_dtype=_dtype(setting.exp_avg),
        exp_avg_sq_dtype=_dtype(setting.exp_avg_sq),
    )
    return sharded, opt, None if conversion is None else conversion.summary()


def dry_run(args) -> list[dict]:
    """Each setting's plan, its model built on the meta device (no memory) and converted: nothing trains."""
    lines = []
    for name in args.settings:
        setting = BY_NAME[name]
        with torch.device("meta"):
            model = Llama(args.shape)
        conversion = convert(model, setting, args.fp8_min_size)
        line = {
            "setting": name,
            **plan(args),
            "shape": asdict(args.shape),
            "params": sum(p.numel() for p in model.parameters()),
            "tokens_per_step": args.rows * args.shape.seq,
            "steps": args.steps,
            "fp8": None if conversion is None else conversion.summary(),
            "converted": [] if conversion is None else conversion.converted,
        }
        print(json.dumps({k: v for k, v in line.items() if k != "converted"}), flush=True)
        lines.append(line)
    return lines


@torch.no_grad()
def evaluate(model, held: torch.Tensor, args) -> float:
    tokens, labels = eval_windows(held, args.eval_rows, args.shape.seq)
    total = 0.0
    for start in range(0, args.eval_rows, args.eval_batch):
        chunk = slice(start, start + args.eval_batch)
        loss = model(tokens[chunk].to(args.device), labels[chunk].to(args.device))
        total += loss.float().item() * tokens[chunk].shape[0]
    return total / args.eval_rows


def _sync(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def train_run(args, setting: Setting, seed: int, data) -> dict:
    """Train one setting from one seed; its record (losses, evals, the dtypes the optimizer really kept)."""
    train, held = data
    model, opt, fp8_summary = build(args, setting, seed)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(args, s))
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(args)
    began = time.perf_counter()
    curve, evals, nonfinite, eval_seconds, step_seconds = [], {}, 0, 0.0, []
    last = began
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        tokens, labels = batch(train, args.rows, args.shape.seq, gen)
        tokens, labels = tokens.to(args.device), labels.to(args.device)
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
        value = loss.detach().float().item()  # waits for the step: the steps' own times are wall times
        step_seconds.append(time.perf_counter() - last)
        nonfinite += not math.isfinite(value)
        if (step + 1) % TRAIN_EVERY == 0 or step == 0:
            curve.append([step + 1, value])
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            eval_began = time.perf_counter()
            evals[step + 1] = evaluate(model, held, args)  # its .item() waits for the device
            eval_seconds += time.perf_counter() - eval_began
        last = time.perf_counter()
    _sync(args)
    seconds = time.perf_counter() - began
    grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}  # what zero_grad left (usually none)
    return {
        "setting": setting.name,
        **{k: v for k, v in asdict(setting).items() if k != "name"},
        "fp8_summary": fp8_summary,
        "fp8_min_size": args.fp8_min_size if setting.fp8_format else None,
        **plan(args),
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
        "eval_rows": args.eval_rows,
        "eval_every": args.eval_every,
        "optimizer_dtypes": [str(d) for d in opt.dtypes],
        "backends_used": sorted(opt.backends_used),
        "leftover_grad_dtypes": sorted(str(d) for d in grads),
        "train_curve": curve,
        "train_loss_last_10pct": None,  # filled below
        "evals": evals,
        "eval_loss": evals[args.steps],
        "nonfinite_train_losses": nonfinite,
        "seconds": seconds,
        "eval_seconds": eval_seconds,
        "seconds_per_step": (seconds - eval_seconds) / args.steps,
        "median_step_seconds": statistics.median(step_seconds),  # without the first steps' warm-up
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
    }


def _tail(curve: list, steps: int) -> float:
    tail = [loss for step, loss in curve if step > 0.9 * steps] or [curve[-1][1]]
    return sum(tail) / len(tail)


def run(args) -> list[dict]:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    where = plan(args)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device here (--dry-run prints the plan without one)")
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        device_id = torch.device(where["device"]) if args.device == "cuda" else None
        dist.init_process_group(where["process_group"], rank=0, world_size=1, device_id=device_id)
    train, held, info = stdlib_bytes()
    with torch.device("meta"):
        params = sum(p.numel() for p in Llama(args.shape).parameters())
    chip = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or platform.machine()
    print(
        f"corpus: {info}; model {params / 1e6:.2f}M parameters; torch {torch.__version__}; {chip}; "
        f"{args.threads} thread(s); {where}",
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
                record["corpus"] = info  # the interpreter's standard library: another Python, other bytes
                out.write(json.dumps(record) + "\n")
                out.flush()
                records.append(record)
                curve = " ".join(f"{s}:{v:.3f}" for s, v in record["train_curve"])
                evals = " ".join(f"{s}:{v:.4f}" for s, v in record["evals"].items())
                memory = f", peak {record['peak_memory_gib']:.1f} GiB" if record["peak_memory_gib"] else ""
                print(
                    f"{args.schedule} {name:<24} seed {seed}: eval {record['eval_loss']:.4f} "
                    f"({record['seconds']:.0f} s, {record['seconds_per_step']:.3f} s/step, median "
                    f"{record['median_step_seconds']:.3f}{memory}, "
                    f"total {time.perf_counter() - started:.0f} s)\n"
                    + (f"  {record['fp8_summary']}\n" if record["fp8_summary"] else "")
                    + f"  evals {evals}\n  train {curve}",
                    flush=True,
                )
                gc.collect()  # the run's model and optimizer, before the next one is built
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    if args.device == "cuda":
        dist.destroy_process_group()  # NCCL's, before the interpreter's exit
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
    """One row per (schedule, setting): eval loss mean, std, min, max over seeds, against the baseline of that
    schedule (fp32, or the same run named bf16: whichever the records hold, fp32 first)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        schedule = r["schedule"] + (f", {r['microbatches']} microbatches" if r.get("microbatches", 1) > 1 else "")
        schedule += f", {r['device']}" if r.get("device", "cpu") != "cpu" else ""
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
        same = [r for r in rows if r["schedule"] == row["schedule"]]
        ref = next((r for name in BASELINES for r in same if r["setting"] == name), None)
        row["baseline"] = None if ref is None else ref["setting"]
        if ref is None:
            row["vs_baseline"] = row["vs_baseline_pct"] = row["within_baseline_range"] = None
            continue
        row["vs_baseline"] = row["mean"] - ref["mean"]
        row["vs_baseline_pct"] = 100 * row["vs_baseline"] / ref["mean"]
        row["within_baseline_range"] = ref["min"] <= row["mean"] <= ref["max"]
        base = dict(zip(ref["seeds"], ref["eval_losses"], strict=True))
        # this setting minus the baseline, seed by seed (the same init and data), where the baseline ran that seed
        pairs = zip(row["seeds"], row["eval_losses"], strict=True)
        row["paired_diffs"] = [loss - base[seed] for seed, loss in pairs if seed in base]
    return rows


def table(rows: list[dict]) -> str:
    """The rows as markdown; "base" is the schedule's baseline (fp32, or the same run named bf16)."""
    lines = [
        "| schedule | setting | eval loss per seed | mean ± std | min - max | mean - base | (%) "
        "| minus base, seed by seed | within base's range | low-lr phase gain |",
        "|---|---|---|---|---|---:|---:|---|---|---:|",
    ]
    for r in rows:
        reference = r["setting"] == r["baseline"] or r["vs_baseline"] is None
        within = "—" if reference else {True: "yes", False: "**no**"}[r["within_baseline_range"]]
        vs = "—" if reference else f"{r['vs_baseline']:+.4f}"
        pct = "—" if reference else f"{r['vs_baseline_pct']:+.2f}%"
        paired = "—" if reference else ", ".join(f"{d:+.4f}" for d in r["paired_diffs"])
        gain = f"{r['low_phase_gain']:.4f}" if "low_phase_gain" in r else ""
        lines.append(
            f"| {r['schedule']} | {r['setting']} | {', '.join(f'{x:.4f}' for x in r['eval_losses'])} "
            f"| {r['mean']:.4f} ± {r['std']:.4f} | {r['min']:.4f} - {r['max']:.4f} | {vs} | {pct} | {paired} "
            f"| {within} | {gain} |"
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
    if args.dry_run:
        dry_run(args)
        return
    began = time.perf_counter()
    run(args)
    print(f"wrote {args.out} in {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
