"""Resilience on one GPU: the training stall of a checkpoint save, synchronous against asynchronous, and the time
to recover after a rank is killed, split into its parts.

One command, meant to finish well under 10 minutes on one H200; logs and `results.json` go under OUT, and a short
table is printed last:

    python3 bench/bench_resilience.py OUT                # Llama 0.9B and 3.0B, bf16, one GPU
    python3 bench/bench_resilience.py OUT --smoke        # CPU, a tiny Llama: checks the script itself in a minute

**Stall** (this process, one rank, `hfsdp.core.fully_shard` + torch's fused AdamW, bf16 compute, fp32 main weights):
the median step time without saving is the baseline. A synchronous save is `save_checkpoint` at a step boundary:
its stall is the time of the call. An asynchronous save is `hfsdp.ckpt.AsyncSaver.save` at the boundary (plan,
staging, the copy to page-locked host memory, issued on a side stream) and training continues; the loop publishes
once the background write is done, as `hfsdp train --async-save` does. Its stall is the time of the `save` call,
plus what the following steps took beyond the baseline while the copy and the write were in flight, plus the
publish. The first asynchronous save also allocates the page-locked buffers; the second reuses them (the steady
state). Each checkpoint is deleted after it is measured (14 bytes per parameter: about 42 GB for the 3B), and a
model whose checkpoint would not fit the free disk is skipped and says so. Goal (issue 21): the steady
asynchronous stall at most 10% of the synchronous save.

**Recovery** (`hfsdp train --max-restarts 1 --timeline` in a subprocess, the 0.9B Llama): after step 9 of a run
that saved step 6, the rank is SIGKILLed. From the timeline: detect (the kill until the launcher has the group
stopped and knows which rank failed), restart (until the new rank has built its model: process start, imports,
process group, model), load (reading and resharding step 6), first step (until the first replayed step is done);
and whether the replayed steps' losses equal the first attempt's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

MODELS = {  # Llama shapes: hidden, layers, heads, kv heads, ffn, vocab
    "llama-0.9b": (2048, 16, 16, 16, 5632, 32000),
    "llama-3b": (3072, 28, 24, 8, 8192, 32000),
    "tiny": (64, 2, 4, 2, 128, 256),
}
#: Bytes a checkpoint holds per parameter: the bf16 weights, fp32 main weights, AdamW's two fp32 moments.
CHECKPOINT_BYTES_PER_PARAM = 2 + 4 + 4 + 4


def llama_config(name: str, seq_len: int):
    from transformers import LlamaConfig

    hidden, layers, heads, kv, ffn, vocab = MODELS[name]
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq_len,
                       tie_word_embeddings=False, attn_implementation="sdpa")  # fmt: skip


# -- stall -------------------------------------------------------------------------------------


def _init_process_group(device: torch.device) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, **kwargs)


def _build(name: str, args, device: torch.device):
    from hfsdp.core import LayoutConfig, MixedPrecision, build_meshes, fully_shard, param_groups
    from hfsdp.models import hf

    cfg = LayoutConfig(world_size=1, global_batch_size=args.micro_batch, micro_batch_size=args.micro_batch)
    model = hf.build_causal_lm(llama_config(name, args.seq_len), seed=0, device=device)
    params = sum(p.numel() for p in model.parameters())
    mp = MixedPrecision(param_dtype=torch.bfloat16 if device.type == "cuda" else None, reduce_dtype=torch.float32)
    model = fully_shard(model, cfg, build_meshes(cfg, device.type), units=hf.decoder_layers(model), mp=mp,
                        reshard_root_after_forward=True)  # fmt: skip
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-4, fused=True)
    return model, opt, params


def _stepper(model, opt, args, device: torch.device, vocab: int):
    from hfsdp.core import clip_grad_norm_
    from hfsdp.models import hf

    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=gen).to(device)

    def step(before_update=None) -> float:
        began = time.perf_counter()
        model.set_microbatch(0, 1)
        hf.causal_lm_loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
        clip_grad_norm_(model, 1.0)
        if before_update is not None:
            before_update()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - began

    return step


def measure_stall(name: str, args, device: torch.device, root: Path, log) -> dict:
    """Baseline step, synchronous save, then `args.async_saves` asynchronous ones, on one model."""
    from hfsdp.ckpt import AsyncSaver, save_checkpoint

    began = time.perf_counter()
    model, opt, params = _build(name, args, device)
    need = params * CHECKPOINT_BYTES_PER_PARAM
    free = shutil.disk_usage(root).free
    out = {"model": name, "params": params, "checkpoint_gb": need / 1e9, "build_s": time.perf_counter() - began}
    if free < 1.15 * need:
        out["skipped"] = f"not measured: a checkpoint needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free in {root}"
        log(out["skipped"])
        return out
    step = _stepper(model, opt, args, device, MODELS[name][5])
    for _ in range(args.warmup):
        step()
    baseline = statistics.median(step() for _ in range(args.steps))
    out["step_s"] = baseline
    log(f"{name}: {params / 1e9:.2f}B parameters, step {baseline:.4f} s")

    target = root / f"{name}-sync"
    t = time.perf_counter()
    save_checkpoint(target, model, opt, step=1)
    out["sync_save_s"] = time.perf_counter() - t
    after = [step() for _ in range(3)]
    out["sync_after_excess_s"] = sum(max(0.0, s - baseline) for s in after)
    shutil.rmtree(target, ignore_errors=True)
    log(f"{name}: synchronous save {out['sync_save_s']:.3f} s")

    saver, out["async"] = AsyncSaver(), []
    for k in range(args.async_saves):
        target = root / f"{name}-async-{k}"
        t = time.perf_counter()
        saver.save(target, model, opt, step=2 + k)
        snapshot = time.perf_counter() - t
        excess, steps, published = 0.0, 0, None
        while published is None and steps < args.max_steps_in_flight:
            excess += max(0.0, step(saver.before_update) - baseline)
            steps += 1
            if saver.written():
                written_after = time.perf_counter() - t
                p = time.perf_counter()
                saver.publish()
                published = time.perf_counter() - p
        if published is None:  # the write outlasted the steps allowed: wait for it (counted as stall)
            written_after = time.perf_counter() - t
            p = time.perf_counter()
            saver.publish()
            published = time.perf_counter() - p
        record = {"snapshot_s": snapshot, "steps_in_flight": steps, "excess_s": excess, "publish_s": published,
                  "write_s": written_after, "stall_s": snapshot + excess + published,
                  "host_gb": saver.host_bytes / 1e9}  # fmt: skip
        out["async"].append(record)
        log(f"{name}: async save {k}: stall {record['stall_s']:.3f} s (snapshot {snapshot:.3f}, excess {excess:.3f} "
            f"over {steps} steps, publish {published:.3f}); background write {written_after:.2f} s")  # fmt: skip
        shutil.rmtree(target, ignore_errors=True)
    saver.close()
    del model, opt, saver
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# -- recovery ----------------------------------------------------------------------------------


def _ranks(launcher: int) -> list[int]:
    from hfsdp.cli.launcher.launch import rank_processes

    return rank_processes(launcher)


def _records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def measure_recovery(name: str, args, device: torch.device, work: Path, log) -> dict:
    """hfsdp train saving at step 6, the rank SIGKILLed after step 9, restarted once: the parts of the recovery."""
    work.mkdir(parents=True, exist_ok=True)
    config = llama_config(name, args.seq_len)
    config.to_json_file(str(work / "config.json"))
    metrics, line = work / "metrics.jsonl", work / "timeline.jsonl"
    dtype = "bf16" if device.type == "cuda" else "fp32"
    cmd = [sys.executable, "-m", "hfsdp.cli", "train", "--model-config", str(work / "config.json"), "--nproc", "1",
           "--device", device.type, "--dtype", dtype, "--seq-len", str(args.seq_len), "--global-batch-size",
           str(args.micro_batch), "--micro-batch-size", str(args.micro_batch), "--steps", "12", "--save",
           str(work / "ck"), "--save-every", "6", "--save-keep", "1", "--max-restarts", "1", "--metrics",
           str(metrics), "--timeline", str(line), "--log-every", "1"]  # fmt: skip
    with open(work / "train.log", "w") as logfile:
        proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + args.recover_timeout
        while proc.poll() is None and time.monotonic() < deadline and [r["step"] for r in _records(metrics)][-1:] < [9]:
            time.sleep(0.05)
        if proc.poll() is not None or time.monotonic() >= deadline:
            proc.kill()
            return {"model": name, "error": f"the run did not reach step 9 (see {work / 'train.log'})"}
        before = {r["step"]: r["loss"] for r in _records(metrics)}
        killed_at = time.time()
        os.kill(_ranks(proc.pid)[0], signal.SIGKILL)
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = "killed: --recover-timeout"
    events = [e for e in _records(line) if e["time"] >= killed_at]

    def first(event: str) -> dict | None:
        return next((e for e in events if e["event"] == event), None)

    failed, built, loaded, stepped = first("attempt failed"), first("model built"), first("loaded"), first("first step")
    out = {"model": name, "exit": code, "killed_after_step": max(before)}
    if None in (failed, built, loaded, stepped):
        out["error"] = f"incomplete timeline (see {line})"
        return out
    out |= {
        "detect_s": failed["time"] - killed_at,
        "restart_s": built["time"] - failed["time"],
        "load_s": loaded["seconds"],
        "first_step_s": stepped["time"] - loaded["time"],
        "total_s": stepped["time"] - killed_at,
        "replayed_steps": max(before) - loaded["step"],
    }
    after = {r["step"]: r["loss"] for r in _records(metrics)}
    diffs = [abs(after[s] - before[s]) for s in before if s > loaded["step"] and s in after]
    out["replayed_loss_max_abs_diff"] = max(diffs) if diffs else None
    log(f"{name}: recovery {out['total_s']:.2f} s (detect {out['detect_s']:.2f}, restart {out['restart_s']:.2f}, "
        f"load {out['load_s']:.2f}, first step {out['first_step_s']:.2f}); exit {code}")  # fmt: skip
    return out


# -- the command -------------------------------------------------------------------------------


def table(results: dict) -> str:
    lines = ["| model | params | step s | sync save s | async stall s (first) | async stall s (steady) | steady/sync "
             "| background write s |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results["stall"]:
        if "skipped" in r or "sync_save_s" not in r:
            lines.append(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r.get('skipped', 'failed')} |||||")
            continue
        a = r["async"]
        steady = a[-1]["stall_s"]
        lines.append(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['step_s']:.3f} | {r['sync_save_s']:.2f} | "
                     f"{a[0]['stall_s']:.3f} | {steady:.3f} | {steady / r['sync_save_s']:.1%} | "
                     f"{a[-1]['write_s']:.2f} |")  # fmt: skip
    lines += ["", "| recovery | detect s | restart s | load s | first step s | total s | replayed loss diff |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results["recovery"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['error']} ||||||")
            continue
        lines.append(f"| {r['model']} | {r['detect_s']:.2f} | {r['restart_s']:.2f} | {r['load_s']:.2f} | "
                     f"{r['first_step_s']:.2f} | {r['total_s']:.2f} | {r['replayed_loss_max_abs_diff']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="directory for the logs, results.json and the checkpoints' work space")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny Llama, few steps: checks the script itself")
    p.add_argument("--save-dir", type=Path, default=None, help="where checkpoints are written (default: OUT/ck)")
    p.add_argument("--models", default=None, help="comma-separated, of " + ", ".join(MODELS))
    p.add_argument("--recover-model", default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps of the baseline")
    p.add_argument("--async-saves", type=int, default=2)
    p.add_argument("--max-steps-in-flight", type=int, default=400)
    p.add_argument("--recover-timeout", type=float, default=240)
    args = p.parse_args(argv)
    smoke = args.smoke
    device = torch.device("cpu") if smoke or not torch.cuda.is_available() else torch.device("cuda", 0)
    args.models = (args.models or ("tiny" if smoke else "llama-0.9b,llama-3b")).split(",")
    args.recover_model = args.recover_model or ("tiny" if smoke else "llama-0.9b")
    args.seq_len = args.seq_len or (32 if smoke else 2048)
    args.micro_batch = args.micro_batch or 2
    args.out.mkdir(parents=True, exist_ok=True)
    root = args.save_dir or args.out / "ck"
    root.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    logfile = open(args.out / "bench.log", "a")  # noqa: SIM115

    def log(text: str) -> None:
        line = f"[{time.perf_counter() - began:7.1f} s] {text}"
        print(line, flush=True)
        logfile.write(line + "\n")
        logfile.flush()

    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
           "save_dir": str(root), "smoke": smoke}  # fmt: skip
    results = {"environment": env, "stall": [], "recovery": []}

    def saved() -> None:  # after every phase: a run cut short by a time limit keeps what it measured
        results["seconds"] = time.perf_counter() - began
        (args.out / "results.json").write_text(json.dumps(results, indent=2))

    if device.type == "cuda":
        torch.cuda.set_device(device)
    _init_process_group(device)
    try:
        # The first model's stall, then the recovery (which needs no second model), then the larger models.
        for position, name in enumerate(args.models):
            try:
                results["stall"].append(measure_stall(name, args, device, root, log))
            except Exception as err:  # one model failing must not lose the others' numbers
                log(f"{name}: stall failed: {type(err).__name__}: {err}")
                results["stall"].append({"model": name, "params": 0, "skipped": f"failed: {type(err).__name__}"})
            saved()
            if position == 0:
                results["recovery"].append(
                    measure_recovery(args.recover_model, args, device, args.out / "recover", log)
                )
                shutil.rmtree(args.out / "recover" / "ck", ignore_errors=True)
                saved()
    finally:
        dist.destroy_process_group()
    log(f"done in {time.perf_counter() - began:.0f} s; results in {args.out / 'results.json'}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
