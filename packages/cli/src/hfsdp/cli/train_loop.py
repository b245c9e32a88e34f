"""The training loop every rank runs: readable in one sitting.

setup (process group, megatron-core groups, model, sharding, optimizer, data)
-> for each step: microbatches forward/backward, clip, step, log, maybe save
-> summary. Rank 0 draws the progress bar and writes the metrics file.
"""

from __future__ import annotations

import json
import os
import resource
import time
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist

from hfsdp.cli.train_config import TrainConfig


def run_training(cfg: TrainConfig) -> dict:
    """Train as one rank of an already-launched job (torch.distributed.run set RANK, WORLD_SIZE, ...)."""
    # megatron-core warns at import that Transformer Engine and apex are absent; hfsdp never uses them.
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    device = _init_distributed(cfg)
    rank = dist.get_rank()
    try:
        return _train(cfg, device, rank)
    finally:
        dist.destroy_process_group()


def _init_distributed(cfg: TrainConfig) -> torch.device:
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def _train(cfg: TrainConfig, device: torch.device, rank: int) -> dict:
    from hfsdp.core.clip import clip_grad_norm_, global_grad_norm
    from hfsdp.core.data import IndexedTokens, SyntheticTokens, microbatch
    from hfsdp.core.flat_group import MixedPrecision
    from hfsdp.core.megatron.adapter import expert_naming_for, initialize_parallel, shard_megatron_model
    from hfsdp.core.megatron.cpu_shim import seed_megatron
    from hfsdp.core.megatron.gpt import GPTShape, build_gpt, lm_loss, reinit_by_global_name
    from hfsdp.core.optimizer import ShardedAdamW

    layout = cfg.layout
    initialize_parallel(layout)
    seed_megatron(cfg.seed)
    shape = GPTShape(
        num_layers=cfg.layers,
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.heads,
        vocab_size=cfg.vocab,
        seq_length=cfg.seq_len,
        num_moe_experts=layout.num_moe_experts,
        moe_router_topk=cfg.moe_topk,
    )
    model = build_gpt(shape)
    reinit_by_global_name(model, expert_naming_for(layout), cfg.seed)
    model.to(device)
    mp = MixedPrecision(param_dtype=torch.bfloat16 if cfg.dtype == "bf16" else None, reduce_dtype=torch.float32)
    sharded = shard_megatron_model(model, layout, device.type, mp)
    opt = ShardedAdamW(sharded.groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = IndexedTokens(cfg.data_path, cfg.seq_len) if cfg.data_path else SyntheticTokens(cfg.vocab, cfg.seq_len)
    start = _maybe_load(cfg, sharded, opt)

    bar = _ProgressBar(cfg, start) if rank == 0 else nullcontext()
    metrics = open(cfg.metrics, "a" if start else "w") if (cfg.metrics and rank == 0) else None  # noqa: SIM115
    count, times, loss_value = cfg.num_microbatches, [], float("nan")
    with bar:
        for step in range(start, cfg.steps):
            if cfg.debug_fail_rank == rank and step == start + 1:
                raise RuntimeError(f"injected failure on rank {rank} at step {step} (--debug-fail-rank)")
            began = time.perf_counter()
            batch = data.global_batch(step, layout.global_batch_size)
            total = torch.zeros((), device=device)
            for index in range(count):
                sharded.set_microbatch(index, count)
                tokens, labels = (t.to(device) for t in microbatch(batch, index, count, rank, layout.dp))
                loss = lm_loss(sharded, tokens, labels)
                loss.backward()
                total += loss.detach()
            dist.all_reduce(total)
            norm = clip_grad_norm_(sharded.groups, cfg.clip_grad) if cfg.clip_grad else global_grad_norm(sharded.groups)
            opt.step()
            opt.zero_grad()
            loss_value = total.item() / (count * layout.dp)
            elapsed = time.perf_counter() - began
            times.append(elapsed)
            record = {
                "step": step + 1,
                "loss": loss_value,
                "grad_norm": norm.item(),
                "lr": opt.lr,
                "tokens_per_s": cfg.tokens_per_step / elapsed,
                "step_time_s": elapsed,
                "peak_memory_mb": _peak_memory_mb(device),
            }
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if rank == 0:
                bar.update(record)
            if cfg.save and cfg.save_every and (step + 1) % cfg.save_every == 0:
                _save(cfg, sharded, opt, step + 1)
    if cfg.save and (not cfg.save_every or cfg.steps % cfg.save_every):
        _save(cfg, sharded, opt, cfg.steps)
    if metrics:
        metrics.close()
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, _peak_memory_mb(device))
    steady = sorted(times[1:] or times)
    median = steady[len(steady) // 2] if steady else float("nan")
    summary = {
        "layout": layout.layout_name,
        "steps": cfg.steps,
        "final_loss": loss_value,
        "tokens_per_s": cfg.tokens_per_step / median if steady else float("nan"),
        "peak_memory_mb_per_rank": peaks,
    }
    if rank == 0:
        _print_summary(summary, device)
    return summary


def _maybe_load(cfg: TrainConfig, sharded, opt) -> int:
    if not cfg.load:
        return 0
    from hfsdp.ckpt import load_checkpoint

    extra = load_checkpoint(cfg.load, sharded, opt)
    return int(extra["step"])


def _save(cfg: TrainConfig, sharded, opt, step: int) -> None:
    from hfsdp.ckpt import save_checkpoint

    save_checkpoint(
        cfg.save, sharded, opt, step=step, extra={"step": step, "consumed_samples": step * cfg.layout.global_batch_size}
    )


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _ProgressBar:
    """Rank 0's rich progress bar: step, loss, tokens/s, memory."""

    def __init__(self, cfg: TrainConfig, start: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
        )
        self.task = self.progress.add_task("train", total=cfg.steps, completed=start, info="")

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def update(self, r: dict) -> None:
        info = f"loss {r['loss']:.4f}  {r['tokens_per_s']:,.0f} tok/s  {r['peak_memory_mb']:,.0f} MiB"
        self.progress.update(self.task, completed=r["step"], info=info)


def _print_summary(summary: dict, device: torch.device) -> None:
    from rich.console import Console

    kind = "allocated" if device.type == "cuda" else "RSS"
    peaks = ", ".join(f"{p:,.0f}" for p in summary["peak_memory_mb_per_rank"])
    Console().print(
        f"[bold]done[/bold]: {summary['layout']}, {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
        f"{summary['tokens_per_s']:,.0f} tokens/s (median step), peak {kind} MiB per rank: [{peaks}]"
    )
