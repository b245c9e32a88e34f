"""The training loop every rank runs: readable in one sitting.

setup (process group, megatron-core groups, model, sharding, optimizer, data, resume)
-> for each step: microbatches forward/backward, clip, step, log, maybe save, maybe stop
-> summary. Rank 0 reports progress and writes the metrics file.

Stopping: a SIGINT/SIGTERM only sets a flag (`stopping.deferred`); the flag travels in the
step's loss all-reduce, so every rank sees it after the same step and leaves together with
`Interrupted`, a save in progress finished.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hfsdp.cli import stopping
from hfsdp.cli.preflight import MODEL_KEY, model_settings
from hfsdp.cli.progress import reporter
from hfsdp.cli.report import say
from hfsdp.cli.train_config import TrainConfig
from hfsdp.cli.worker import RUN_DIR_ENV

#: Optimizer hyper-parameters a setting sets; a value the user gave wins over a resumed checkpoint's.
HYPER_PARAMETERS = ("lr", "weight_decay")


def run_training(cfg: TrainConfig) -> dict:
    """Train as one rank of an already-launched job (torch.distributed.run set RANK, WORLD_SIZE, ...)."""
    device = _init_distributed(cfg)
    try:
        return _train(cfg, device, dist.get_rank())
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
    from hfsdp.core.main_params import param_groups
    from hfsdp.core.megatron.adapter import expert_naming_for, initialize_parallel, shard_megatron_model
    from hfsdp.core.megatron.cpu_shim import seed_megatron
    from hfsdp.core.megatron.gpt import GPTShape, build_gpt, lm_loss, reinit_by_global_name

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
    opt = torch.optim.AdamW(param_groups(sharded, cfg.weight_decay), lr=cfg.lr, fused=True)
    data = IndexedTokens(cfg.data_path, cfg.seq_len) if cfg.data_path else SyntheticTokens(cfg.vocab, cfg.seq_len)
    start = _maybe_load(cfg, sharded, opt, rank)
    progress = Path(os.environ[RUN_DIR_ENV]) / "progress.json" if RUN_DIR_ENV in os.environ else None

    metrics = open(cfg.metrics, "a" if start else "w") if (cfg.metrics and rank == 0) else None  # noqa: SIM115
    count, times, loss_value, saved = cfg.num_microbatches, [], float("nan"), []
    shown = reporter(cfg.steps, start, cfg.log_every) if rank == 0 else None
    with stopping.deferred(), shown or _Silent():
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
            # The stop flag rides on the loss's all-reduce: every rank learns of a signal after the same step.
            shared = torch.stack([total, torch.tensor(float(stopping.requested() is not None), device=device)])
            dist.all_reduce(shared)
            norm = clip_grad_norm_(sharded.groups, cfg.clip_grad) if cfg.clip_grad else global_grad_norm(sharded.groups)
            opt.step()
            opt.zero_grad()
            loss_value = shared[0].item() / (count * layout.dp)
            elapsed = time.perf_counter() - began
            times.append(elapsed)
            record = {
                "step": step + 1,
                "loss": loss_value,
                "grad_norm": norm.item(),
                "lr": opt.param_groups[0]["lr"],
                "tokens_per_s": cfg.tokens_per_step / elapsed,
                "step_time_s": elapsed,
                "peak_memory_mb": _peak_memory_mb(device),
            }
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if shown:
                shown.update(record)
            if cfg.save and cfg.save_every and (step + 1) % cfg.save_every == 0:
                saved.append(_save(cfg, sharded, opt, step + 1, rank))
            if rank == 0 and progress:
                _write_progress(progress, step + 1)
            if shared[1].item() > 0 and step + 1 < cfg.steps:
                if metrics:
                    metrics.close()
                raise stopping.Interrupted(stopping.requested() or signal.SIGTERM, step + 1)
        if cfg.save and cfg.steps > start and (not cfg.save_every or cfg.steps % cfg.save_every):
            saved.append(_save(cfg, sharded, opt, cfg.steps, rank))
    if metrics:
        metrics.close()
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, _peak_memory_mb(device))
    steady = sorted(times[1:] or times)
    summary = {
        "layout": layout.layout_name,
        "steps": cfg.steps,
        "final_loss": loss_value,
        "tokens_per_s": cfg.tokens_per_step / steady[len(steady) // 2] if steady else float("nan"),
        "peak_memory_mb_per_rank": peaks,
        "checkpoints": [str(p) for p in saved],
    }
    if rank == 0:
        _print_summary(cfg, summary, device)
    return summary


class _Silent:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def _maybe_load(cfg: TrainConfig, sharded, opt, rank: int) -> int:
    """Resume from --load; a learning rate or weight decay the user set wins over the checkpoint's."""
    if not cfg.load:
        return 0
    from hfsdp.ckpt import load_checkpoint, read_index, resolve

    extra = load_checkpoint(cfg.load, sharded, opt)
    notes = []
    for name in HYPER_PARAMETERS:
        groups = [g for g in opt.param_groups if name != "weight_decay" or g.get("name") == "decay"]
        restored = groups[0][name]
        if cfg.explicit(name) and restored != cfg.values[name]:
            for group in groups:
                group[name] = cfg.values[name]
            notes.append(
                f"{name} {cfg.values[name]:g} from {cfg.given[name].spelled}, not the checkpoint's {restored:g}"
            )
    if rank == 0:
        ckpt_dir = resolve(cfg.load)
        before = read_index(ckpt_dir).config().layout_name
        say(f"resumed from {ckpt_dir} ({before} -> {cfg.layout.layout_name})" + "".join(f"; {n}" for n in notes))
    return int(extra["step"])


def _save(cfg: TrainConfig, sharded, opt, step: int, rank: int) -> Path:
    """Save step `step` (collective); rank 0 then applies --save-keep, once the new checkpoint is published."""
    from hfsdp.ckpt import save_checkpoint

    extra = {
        "step": step,
        "consumed_samples": step * cfg.layout.global_batch_size,
        MODEL_KEY: model_settings(cfg),
    }
    path = save_checkpoint(cfg.save, sharded, opt, step=step, extra=extra)
    if rank == 0 and cfg.save_keep:
        from hfsdp.cli.retention import prune

        prune(cfg.save, cfg.save_keep)
    return path


def _write_progress(path: Path, step: int) -> None:
    """Record the last completed step for the launcher's report (replace, so it is never read half-written)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, path)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _print_summary(cfg: TrainConfig, summary: dict, device: torch.device) -> None:
    kind = "allocated" if device.type == "cuda" else "RSS"
    peaks = ", ".join(f"{p:,.0f}" for p in summary["peak_memory_mb_per_rank"])
    say(
        f"done: {summary['layout']}, {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
        f"{summary['tokens_per_s']:,.0f} tokens/s (median step), peak {kind} MiB per rank: [{peaks}]"
    )
    if cfg.save:
        from hfsdp.cli.retention import checkpoints

        kept = checkpoints(Path(cfg.save))
        latest = Path(cfg.save) / "latest"
        names = ", ".join(p.name for p in kept)
        newest = latest.read_text().strip() if latest.is_file() else "none"
        say(f"checkpoints: {cfg.save} (latest: {newest}; kept: {names or 'none'})")
