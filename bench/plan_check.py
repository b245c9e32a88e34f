"""`hfsdp plan` against measurement on one GPU: per-rank peak memory of 14 layouts of two models, and the step time.

One command (repository root; on the GPU machine after bench/gpu_session.sh's install, or as its `plan` phase):

    python3 bench/plan_check.py OUT_DIR            # H200: the 0.94B megatron GPT and the 0.95B Llama, ~6 minutes
    python3 bench/plan_check.py OUT_DIR --smoke    # CPU, tiny models: the whole pipeline in a minute or two
    python3 bench/plan_check.py OUT_DIR --compare-only   # anywhere: the table from the JSON already in OUT_DIR

For each model it runs bench/bench_step.py with `--simulate-world 2` and `--simulate-world 8` (rank 0 of the
world on torch's fake process group: every allocation is the real rank's, no communication) over 3 + 4
layouts, and one real 1-GPU step (`torchrun --nproc-per-node 1`, ZeRO-3 1x1). It then evaluates the same
layouts with hfsdp.planning (bf16 compute, fp32 reduction, one microbatch, the root resharded after forward
where the inner axis is ZeRO-3, as the bench sets it) and compares: measured `max_memory_allocated` against
the planned peak, and the measured 1-GPU median step against the planned compute + optimizer time. Every
subprocess's output goes to OUT_DIR/*.log, the bench's JSON to OUT_DIR/*.json, the comparison to
OUT_DIR/plan_check.json; the short table is printed last. Communication time is not checked (one GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for src in ("packages/core/src", "packages/ckpt/src", "packages/cli/src"):
    sys.path.insert(0, str(ROOT / src))

from hfsdp.core.rules.config import LayoutConfig  # noqa: E402
from hfsdp.planning.activations import activations  # noqa: E402
from hfsdp.planning.gpt_shape import gpt_shape  # noqa: E402
from hfsdp.planning.groups import groups_for  # noqa: E402
from hfsdp.planning.hf_shape import hf_shape  # noqa: E402
from hfsdp.planning.memory import Settings, memory  # noqa: E402
from hfsdp.planning.timing import step_flops, step_time  # noqa: E402

BENCH_LAYOUTS = {"zero3": ("no_shard", "optim_grads_params"), "zero2": ("no_shard", "optim_grads"),
                 "hsdp": ("no_shard", "optim_grads_params"), "hfsdp": ("optim", "optim_grads_params")}  # fmt: skip
WORLDS = {2: "zero3:1x2,zero2:1x2,hfsdp:2x1", 8: "zero3:1x8,hsdp:2x4,hfsdp:2x4,hfsdp:4x2"}
FULL = {
    "common": dict(seq=2048, mbs=4, vocab=32000, device="cuda"),
    "gpt": dict(layers=16, hidden=2048, heads=16),
    "llama": dict(layers=16, hidden=2048, heads=16, ffn=5632),
}
SMOKE = {
    "common": dict(seq=32, mbs=2, vocab=128, device="cpu"),
    "gpt": dict(layers=2, hidden=64, heads=4),
    "llama": dict(layers=2, hidden=64, heads=4, ffn=192),
}
#: The MFU hfsdp plan assumes by default (hfsdp.cli.checks.plan_inputs.MEASURED_MFU), checked here against a new run.
MFU = {"gpt": 0.27, "llama": 0.40}
H200_BF16_TFLOPS = 989.0


def model_args(sizes: dict, common: dict, model: str) -> list[str]:
    args = ["--model", model, "--layers", str(sizes["layers"]), "--hidden", str(sizes["hidden"])]
    args += ["--heads", str(sizes["heads"]), "--vocab", str(common["vocab"]), "--seq-len", str(common["seq"])]
    args += ["--micro-batch-size", str(common["mbs"]), "--dtype", "bf16", "--device", common["device"]]
    return args + (["--ffn", str(sizes["ffn"])] if "ffn" in sizes else [])


def planned_shape(model: str, sizes: dict, common: dict):
    if model == "gpt":
        return gpt_shape(layers=sizes["layers"], hidden=sizes["hidden"], heads=sizes["heads"], vocab=common["vocab"])
    return hf_shape(
        {
            "model_type": "llama",
            "hidden_size": sizes["hidden"],
            "intermediate_size": sizes["ffn"],
            "num_hidden_layers": sizes["layers"],
            "num_attention_heads": sizes["heads"],
            "vocab_size": common["vocab"],
            "tie_word_embeddings": False,
        }
    )


def plan_for(shape, tag: str, world: int, common: dict) -> tuple[int, object]:
    """(planned peak bytes, settings) of a bench layout `name:RxN` as bench_step.py runs it."""
    name, _, mesh = tag.partition(":")
    r, _ = (int(x) for x in mesh.split("x"))
    outer, inner = BENCH_LAYOUTS[name]
    cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=r)
    run = Settings(common["seq"], common["mbs"], 1, 2, root_resharded=inner == "optim_grads_params")
    acts = activations(shape, run.seq, run.micro_batch, run.compute_bytes, run.recompute)
    return memory(shape, groups_for(shape, cfg), acts, run).total, (cfg, run)


def measure(cmd: list[str], out: Path, stem: str, compare_only: bool) -> int | str:
    """Run one bench command into OUT/stem.{log,json}, or with `compare_only` only say whether its JSON is there."""
    if compare_only:
        return 0 if (out / f"{stem}.json").exists() else "not run"
    code, seconds = run_logged(cmd, out / f"{stem}.log", timeout=240)
    print(f"[{stem}] exit {code} in {seconds:.0f} s", flush=True)
    return code


def run_logged(cmd: list[str], log: Path, timeout: int) -> tuple[int, float]:
    began = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        try:
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, time.perf_counter() - began


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory for the logs and JSON")
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU: check the pipeline, not the numbers")
    p.add_argument("--models", default="gpt,llama")
    p.add_argument(
        "--compare-only",
        action="store_true",
        help="run nothing: compare the bench JSON already in OUT_DIR with the plan (e.g. after a run cut short)",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = SMOKE if args.smoke else FULL
    common = sizes["common"]
    bench = str(ROOT / "bench" / "bench_step.py")
    memory_rows, time_rows, failures = [], [], []
    for model in args.models.split(","):
        shape = planned_shape(model, sizes[model], common)
        margs = model_args(sizes[model], common, model)
        for world, layouts in WORLDS.items():
            stem = f"mem-{model}-{world}"
            cmd = [sys.executable, bench, "--simulate-world", str(world), *margs, "--steps", "1", "--warmup", "1"]
            cmd += ["--layouts", layouts, "--engines", "hfsdp", "--out", str(out / f"{stem}.json")]
            code = measure(cmd, out, stem, args.compare_only)
            if code or not (out / f"{stem}.json").exists():
                failures.append(f"{stem}: exit {code}, see {stem}.log")
                continue
            for result in json.loads((out / f"{stem}.json").read_text())["results"]:
                planned, _ = plan_for(shape, result["layout"], world, common)
                measured = result.get("cuda_peak_allocated_bytes")
                error = (planned - measured) / measured if measured else None
                memory_rows.append({"model": model, "world": world, "layout": result["layout"],
                                    "measured_mib": measured / 2**20 if measured else None,
                                    "planned_mib": planned / 2**20, "error": error})  # fmt: skip
        stem = f"step-{model}-1gpu"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", bench, *margs]
        cmd += ["--steps", "6", "--warmup", "2", "--layouts", "zero3:1x1", "--engines", "hfsdp"]
        cmd += ["--out", str(out / f"{stem}.json")]
        code = measure(cmd, out, stem, args.compare_only)
        if code or not (out / f"{stem}.json").exists():
            failures.append(f"{stem}: exit {code}, see {stem}.log")
            continue
        (result,) = json.loads((out / f"{stem}.json").read_text())["results"]
        from hfsdp.planning.cluster import Cluster

        planned, (cfg, run) = plan_for(shape, "zero3:1x1", 1, common)
        timing = step_time(shape, groups_for(shape, cfg), Cluster(nodes=1, gpus_per_node=1), run, MFU[model])
        measured = result["median_step_s"]
        flops = step_flops(shape, run)
        time_rows.append({"model": model, "measured_step_s": measured, "planned_step_s": timing.step_s,
                          "error": (timing.step_s - measured) / measured,
                          "implied_mfu": flops / (measured * H200_BF16_TFLOPS * 1e12),
                          "measured_peak_mib": (result.get("cuda_peak_allocated_bytes") or 0) / 2**20 or None,
                          "planned_peak_mib": planned / 2**20})  # fmt: skip
    (out / "plan_check.json").write_text(
        json.dumps({"smoke": args.smoke, "memory": memory_rows, "step": time_rows, "failures": failures}, indent=1)
    )
    print("\n## Peak memory per rank: measured (max_memory_allocated, --simulate-world) vs planned")
    print("| model | world | layout | measured MiB | planned MiB | error |\n|---|---|---|---:|---:|---:|")
    for r in memory_rows:
        measured = f"{r['measured_mib']:,.0f}" if r["measured_mib"] else "n/a (cpu)"
        error = f"{100 * r['error']:+.1f}%" if r["error"] is not None else "n/a"
        print(f"| {r['model']} | {r['world']} | {r['layout']} | {measured} | {r['planned_mib']:,.0f} | {error} |")
    print("\n## 1-GPU step: measured median vs planned (compute at the default MFU + optimizer)")
    print("| model | measured s | planned s | error | implied MFU (989 TFLOP/s) |\n|---|---:|---:|---:|---:|")
    for r in time_rows:
        print(f"| {r['model']} | {r['measured_step_s']:.4f} | {r['planned_step_s']:.4f} | {100 * r['error']:+.1f}% "
              f"| {r['implied_mfu']:.3f} |")  # fmt: skip
    worst = max((abs(r["error"]) for r in memory_rows if r["error"] is not None), default=None)
    if worst is not None:
        print(f"\nworst memory error {100 * worst:.1f}% over {len(memory_rows)} layouts (target: within 5%)")
    for f in failures:
        print(f"FAILED {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
