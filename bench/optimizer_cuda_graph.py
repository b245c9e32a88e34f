"""Does capturing FusedAdamW's step in a CUDA graph pay? (issue 38: Megatron's --optimizer-cuda-graph)

One process (world size 1: a 1-rank process group, or under torchrun with one process), a transformers Llama
sharded by hfsdp (ZeRO-3 layout on one GPU, bf16 compute, fp32 main weights), FusedAdamW with the clip inside its
step. Variants, each on a freshly built model (the same seed), timed over --steps steps after --warmup:

- `eager prestage` : FusedAdamW(max_grad_norm, prestage_gathers=True), what `hfsdp+fused+clip+prestage` runs;
- `eager`          : FusedAdamW(max_grad_norm), no prestage (capturable=True refuses prestage_gathers);
- `eager capturable` : FusedAdamW(max_grad_norm, capturable=True), eager: the step's scalars computed on the GPU;
- `graph`          : the same optimizer, its step captured once in a torch.cuda.CUDAGraph and replayed each step.

The captured region is FusedAdamW's own step (norm, clip, every group's kernels, the step counters). hfsdp's step
hooks (before: wait for the last gathers; after: publish the new weights, release the gradient buffers) are host
bookkeeping and run eagerly around each replay, as `opt.step()` runs them around the step.

The gradient buffer: hfsdp frees each group's flat gradient buffer after the step and makes a new one in the next
backward, except under `FusedAdamW(capturable=True)`, which keeps each at one address (`GradBuffer.keep_storage`:
2 (bf16) or 4 (fp32) bytes per element held through the forward). A graph replays the addresses it captured; this
script still checks every group's gradient address before every replay and stops the graph variant if one moved.

The correctness check runs with deterministic algorithms (as `gpu_correctness.py`: attention's backward otherwise
sums with atomics, and two eager runs differ); the timed variants without.

Per variant: median over the steps of the whole step (CUDA events: forward+backward, optimizer step incl. hooks,
total; wall time with a synchronize per step), and of the host time spent issuing the optimizer step. Correctness
in the same run: from the same initial weights and data, 3 steps of eager capturable=False, of eager
capturable=True and of graph replays (all three replays: the warm-up step is undone before capture); the weights,
moments and step counts are compared (max abs difference, bit-identical or not).

    python bench/optimizer_cuda_graph.py --out /tmp/ocg                       # the 0.95B on one GPU
    torchrun --nproc-per-node 1 bench/optimizer_cuda_graph.py --out /tmp/ocg  # the same under torchrun
    python bench/optimizer_cuda_graph.py --device cpu --small --out /tmp/ocg  # smoke test: no capture

Writes `optimizer_cuda_graph.json` and `optimizer_cuda_graph.txt` to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

VARIANTS = ("eager prestage", "eager", "eager capturable", "graph")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--small", action="store_true", help="a tiny model and 3 steps (a smoke test)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--moments", choices=("fp32", "bf16", "fp8"), default="fp32")
    p.add_argument("--grads", choices=("fp32", "bf16"), default="fp32", help="the gradient reduce dtype")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--no-check", action="store_true", help="skip the 3-step correctness check")
    p.add_argument("--out", required=True, help="a folder for optimizer_cuda_graph.json and .txt")
    args = p.parse_args(argv)
    if args.small:
        args.layers, args.hidden, args.ffn, args.heads, args.vocab = 2, 64, 128, 4, 256
        args.seq_len, args.micro_batch_size, args.steps, args.warmup = 32, 2, 3, 1
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    return args


# -- setup ---------------------------------------------------------------------------------------------------------


def init(args) -> torch.device:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False (use --device cpu --small to smoke-test)")
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a single process: a 1-rank group of its own
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if args.device == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    if dist.get_world_size() != 1:
        raise SystemExit(f"run with one process (world size 1), not {dist.get_world_size()}")
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shape_of(args):
    from _step_model import llama_config

    ns = argparse.Namespace(
        vocab=args.vocab, hidden=args.hidden, ffn=args.ffn, layers=args.layers, heads=args.heads, kv_heads=None,
        seq_len=args.seq_len,
    )  # fmt: skip
    return llama_config(ns)


def build(args, device, shape, variant: str):
    """A fresh hfsdp Llama (same seed every time) and the variant's FusedAdamW."""
    from _step_model import build_model, units_of

    from hfsdp.core import FusedAdamW, LayoutConfig, MixedPrecision, build_meshes, fully_shard

    mb = args.micro_batch_size
    cfg = LayoutConfig(world_size=1, inner="optim_grads_params", outer="no_shard", instances=1,
                       global_batch_size=mb, micro_batch_size=mb)  # fmt: skip
    model = build_model(cfg, shape, device, on_device=device.type == "cuda")
    compute = torch.bfloat16
    grads = torch.bfloat16 if args.grads == "bf16" else torch.float32
    model = fully_shard(model, cfg, build_meshes(cfg, device.type), units=units_of(model),
                        mp=MixedPrecision(param_dtype=compute, reduce_dtype=grads))  # fmt: skip
    capturable = variant in ("eager capturable", "graph")
    opt = FusedAdamW(
        model.parameters(), lr=args.lr, weight_decay=args.weight_decay, max_grad_norm=args.clip,
        prestage_gathers=variant == "eager prestage", exp_avg_dtype=args.moments, exp_avg_sq_dtype=args.moments,
        capturable=capturable,
    )  # fmt: skip
    return model, opt


def batches(args, shape, device, count: int):
    from _step_model import make_batches

    mb = args.micro_batch_size
    return [steps[0] for steps in make_batches(shape, count, mb, 1, 0, 1, device)]


def forward_backward(model, tokens, labels) -> torch.Tensor:
    from _step_model import loss_of

    model.set_microbatch(0, 1)
    loss = loss_of(model, tokens, labels)
    loss.backward()
    return loss.detach()


# -- the captured step ------------------------------------------------------------------------------------------


class GraphStep:
    """FusedAdamW(capturable=True)'s step as a CUDA graph (cuda), or the same raw step run eagerly (cpu smoke test),
    with hfsdp's step hooks run eagerly around it."""

    def __init__(self, model, opt, device):
        from hfsdp.core import sharding_of
        from hfsdp.core.engine.optimizer_hooks import bind

        raw = getattr(type(opt).step, "__wrapped__", None)
        if raw is None:
            raise RuntimeError(
                "FusedAdamW.step has no __wrapped__ (torch's step-hook wrapper changed): cannot call the step "
                "without hfsdp's hooks, which must stay outside the graph"
            )
        self.raw, self.model, self.opt, self.device = raw, model, opt, device
        self.sharding = sharding_of(model)
        self.binding = bind(opt)
        self.graph = None
        self.addresses: list[int] | None = None
        self.moved: str | None = None

    def _grad_addresses(self) -> list[int]:
        out = []
        for group in self.sharding.groups:
            grad = group.grads.main_grad
            out.append(-1 if grad is None else grad.data_ptr())
        return out

    def first(self) -> None:
        """After the first backward: warm the raw step up (on a side stream, as torch's docs ask before a capture: it
        creates the state and the constants and compiles the kernels), undo it, capture, and replay: this step's
        update is the replay's. On the CPU (smoke test) the same, with the raw step run eagerly instead of captured."""
        self.binding.prepare(self.opt)
        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream() if cuda else None
        if cuda:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            self.raw(self.opt)
        if cuda:
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
        self._undo_warmup()
        if not cuda:
            self.raw(self.opt)
        else:
            torch.cuda.synchronize()
            self.addresses = self._grad_addresses()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.raw(self.opt)
            self.graph.replay()
        self.binding._post_hook(self.opt, (), {})

    def _undo_warmup(self) -> None:
        """Back to the state before the warm-up, in place: weights as saved, moments and step counts 0, fp8 scales 1
        (what a fresh optimizer starts from)."""
        for group, saved in zip(self.sharding.groups, self._saved_main, strict=True):
            group.main.copy_(saved)
        for moments in self.opt._moments.values():
            for t in moments.flat:
                t.zero_()
            for t in moments.scales:
                if t is not None:
                    t.fill_(1.0)
        for entry in self.opt.state.values():
            if isinstance(entry.get("step"), torch.Tensor):
                entry["step"].zero_()

    def save_main(self) -> None:
        self._saved_main = [g.main.clone() for g in self.sharding.groups]

    def step(self) -> None:
        self.binding.prepare(self.opt)
        if self.device.type != "cuda":
            self.raw(self.opt)  # the cpu smoke test: the raw step, eagerly, between the hooks
        else:
            now = self._grad_addresses()
            if now != self.addresses:
                moved = [i for i, (a, b) in enumerate(zip(now, self.addresses, strict=True)) if a != b]
                self.moved = (
                    f"the gradient buffers of groups {moved} moved since the capture (hfsdp frees them after each "
                    "step and allocates new ones in the next backward): a replay would read the old addresses"
                )
                raise RuntimeError(self.moved)
            self.graph.replay()
        self.binding._post_hook(self.opt, (), {})


# -- timing -----------------------------------------------------------------------------------------------------


class Marks:
    """CUDA events (cuda) or host clocks (cpu) at named points of one step."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.points: dict[str, object] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points[name] = event
        else:
            self.points[name] = time.perf_counter()

    def ms(self, a: str, b: str) -> float:
        if self.cuda:
            return self.points[a].elapsed_time(self.points[b])
        return (self.points[b] - self.points[a]) * 1e3


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_variant(args, device, shape, variant: str, data) -> dict:
    model, opt = build(args, device, shape, variant)
    graph = GraphStep(model, opt, device) if variant == "graph" else None
    rows, losses = [], []
    try:
        for index, (tokens, labels) in enumerate(data):
            marks = Marks(device)
            sync(device)
            wall = time.perf_counter()
            marks.mark("start")
            losses.append(forward_backward(model, tokens, labels))
            marks.mark("backward")
            host = time.perf_counter()
            if graph is None:
                opt.step()
            elif index == 0:
                graph.save_main()
                graph.first()
            else:
                graph.step()
            host = time.perf_counter() - host
            marks.mark("step")
            opt.zero_grad()
            sync(device)
            wall = time.perf_counter() - wall
            rows.append({
                "forward_backward_ms": marks.ms("start", "backward"),
                "optimizer_step_ms": marks.ms("backward", "step"),
                "step_ms": marks.ms("start", "step"),
                "wall_ms": wall * 1e3,
                "optimizer_host_ms": host * 1e3,
            })  # fmt: skip
        state = snapshot(model, opt)
    finally:
        del graph, opt, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "losses": [float(x) for x in losses], "state": state}


def snapshot(model, opt) -> dict:
    from hfsdp.core import sharding_of

    opt.wait()
    pieces = sharding_of(model).main_params
    weights = torch.cat([p.param.detach().reshape(-1).float().cpu() for p in pieces])
    moments = {}
    for key in ("exp_avg", "exp_avg_sq"):
        parts = [
            opt.state[p.param][key].detach().reshape(-1).float().cpu() for p in pieces if key in opt.state[p.param]
        ]
        moments[key] = torch.cat(parts) if parts else torch.zeros(0)
    steps = sorted({float(opt.state[p.param]["step"]) for p in pieces if "step" in opt.state[p.param]})
    return {"weights": weights, **moments, "steps": steps}


def compare(a: dict, b: dict) -> dict:
    out = {}
    for key in ("weights", "exp_avg", "exp_avg_sq"):
        x, y = a[key], b[key]
        same = x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))
        diff = float((x - y).abs().max()) if x.numel() and x.shape == y.shape else float("nan")
        out[key] = {"max_abs_diff": diff, "bit_identical": bool(same)}
    out["steps"] = {"a": a["steps"], "b": b["steps"], "equal": a["steps"] == b["steps"]}
    return out


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows) if rows else float("nan")


# -- main -------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: deterministic matmuls
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = init(args)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke test: no capture)"
    print(f"torch {torch.__version__}, device {gpu}", flush=True)
    shape = shape_of(args)
    result: dict = {"torch": torch.__version__, "device": gpu, "args": {k: v for k, v in vars(args).items()}}
    result["variants"], result["errors"] = {}, {}
    data = batches(args, shape, device, args.warmup + args.steps)

    if not args.no_check:
        checks, states = {}, {}
        torch.use_deterministic_algorithms(True)  # the same gradients in every variant (see the module docstring)
        torch.backends.cuda.enable_cudnn_sdp(False)
        for variant in ("eager", "eager capturable", "graph"):
            try:
                states[variant] = run_variant(args, device, shape, variant, data[:3])["state"]
            except Exception as err:  # reported; the other variants still run
                result["errors"][f"check: {variant}"] = f"{type(err).__name__}: {err}"
                traceback.print_exc()
        for variant in ("eager capturable", "graph"):
            if "eager" in states and variant in states:
                checks[f"{variant} vs eager (capturable=False)"] = compare(states["eager"], states[variant])
        result["check"] = checks
        torch.use_deterministic_algorithms(False)
        for name, check in checks.items():
            print(f"check, 3 steps, {name}: " + ", ".join(
                f"{k} max|diff| {v['max_abs_diff']:.3g} {'bit-identical' if v['bit_identical'] else 'DIFFERENT'}"
                for k, v in check.items() if k != "steps"
            ) + f", steps {check['steps']['b']}", flush=True)  # fmt: skip

    for variant in args.variants:
        try:
            run = run_variant(args, device, shape, variant, data)
        except Exception as err:  # reported; the other variants still run
            result["errors"][variant] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
            continue
        rows = run["rows"][args.warmup :]
        keys = ("step_ms", "forward_backward_ms", "optimizer_step_ms", "optimizer_host_ms", "wall_ms")
        result["variants"][variant] = {"median": {k: median(rows, k) for k in keys}, "rows": run["rows"],
                                       "losses": run["losses"]}  # fmt: skip
        m = result["variants"][variant]["median"]
        print(f"{variant:>17}: step {m['step_ms']:.2f} ms (fwd+bwd {m['forward_backward_ms']:.2f}, optimizer "
              f"{m['optimizer_step_ms']:.2f}, its host time {m['optimizer_host_ms']:.2f}), wall {m['wall_ms']:.2f} ms",
              flush=True)  # fmt: skip

    result["gradient_buffer"] = (
        "under FusedAdamW(capturable=True) every group keeps its gradient buffer at one address from step to step "
        "(GradBuffer.keep_storage), held through the forward; checked before every replay here."
    )
    (out_dir / "optimizer_cuda_graph.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / "optimizer_cuda_graph.txt").write_text(summary(result))
    print(summary(result), flush=True)
    dist.destroy_process_group()
    return 1 if result["errors"] else 0


def summary(result: dict) -> str:
    a = result["args"]
    lines = [
        f"FusedAdamW step in a CUDA graph: torch {result['torch']}, {result['device']}",
        f"Llama {a['layers']} layers, hidden {a['hidden']}, ffn {a['ffn']}, heads {a['heads']}, vocab {a['vocab']}, "
        f"seq {a['seq_len']}, micro-batch {a['micro_batch_size']}, bf16 compute, {a['grads']} gradients, "
        f"{a['moments']} moments, clip {a['clip']}; medians over {a['steps']} steps after {a['warmup']}",
        "",
        f"{'variant':>17}  {'step ms':>8}  {'fwd+bwd':>8}  {'optim':>8}  {'optim host':>10}  {'wall ms':>8}",
    ]
    for name, v in result["variants"].items():
        m = v["median"]
        lines.append(
            f"{name:>17}  {m['step_ms']:8.2f}  {m['forward_backward_ms']:8.2f}  {m['optimizer_step_ms']:8.2f}  "
            f"{m['optimizer_host_ms']:10.2f}  {m['wall_ms']:8.2f}"
        )
    for name, check in result.get("check", {}).items():
        parts = [
            f"{k} " + ("bit-identical" if c["bit_identical"] else f"max|diff| {c['max_abs_diff']:.3g}")
            for k, c in check.items()
            if k != "steps"
        ]
        lines.append(f"check (3 steps), {name}: " + ", ".join(parts) + f", step counts {check['steps']['b']}")
    for name, err in result["errors"].items():
        lines.append(f"ERROR {name}: {err}")
    lines += ["", "gradient buffer: " + result["gradient_buffer"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
