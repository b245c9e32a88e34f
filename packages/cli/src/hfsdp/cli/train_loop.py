"""The training loop every rank runs: readable in one sitting.

setup (process group, megatron-core groups, model, sharding, optimizer, data, resume)
-> for each step: microbatches forward/backward, clip, step, log, maybe save, maybe stop
-> summary. Rank 0 reports progress and writes the metrics file (and the TensorBoard logs).

Stopping: a SIGINT/SIGTERM only sets a flag (`stopping.deferred`); the flag travels in the
step's loss all-reduce, so every rank sees it after the same step and leaves together with
`Interrupted`, a save in progress finished.
"""

from __future__ import annotations

import gc
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
from hfsdp.cli.run_dir import RUN_DIR_ENV, progress_file
from hfsdp.cli.tensorboard_log import TensorBoardLog
from hfsdp.cli.train_config import TrainConfig

#: Where a checkpoint's `extra` records the learning-rate schedule, so that a resume continues it.
SCHEDULE_KEY = "schedule"


def run_training(cfg: TrainConfig) -> dict:
    """Train as one rank of an already-launched job (torch.distributed.run set RANK, WORLD_SIZE, ...)."""
    device = _init_distributed(cfg)
    try:
        return _train(cfg, device, dist.get_rank())
    finally:
        # torch's gloo keeps finished collectives in reference cycles; freed at interpreter exit they can abort
        # the process, so they are collected while the process group still lives.
        gc.collect()
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
    from hfsdp.cli.build_model import build_model
    from hfsdp.core.clip import clip_grad_norm_, global_grad_norm
    from hfsdp.core.main_params import param_groups
    from hfsdp.recipes.data import microbatch

    layout = cfg.layout
    built = build_model(cfg, device)
    sharded = built.sharded
    opt = _optimizer(cfg, param_groups(sharded, cfg.weight_decay))
    apart = _instances_apart(layout)
    data, held_out = _data(cfg, built.vocab_size)
    start, settings = _maybe_load(cfg, sharded, opt, rank)
    schedule = _schedule(settings, opt, start)
    progress = progress_file(os.environ[RUN_DIR_ENV]) if RUN_DIR_ENV in os.environ else None

    metrics = open(cfg.metrics, "a" if start else "w") if (cfg.metrics and rank == 0) else None  # noqa: SIM115
    board = TensorBoardLog(cfg.tensorboard_dir) if (cfg.tensorboard_dir and rank == 0) else None
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
                tokens, labels = (t.to(device) for t in microbatch(batch, index, count, rank, layout.dp, apart))
                loss = built.loss(sharded, tokens, labels)
                loss.backward()
                total += loss.detach()
            # The stop flag rides on the loss's all-reduce: every rank learns of a signal after the same step.
            shared = torch.stack([total, torch.tensor(float(stopping.requested() is not None), device=device)])
            dist.all_reduce(shared)
            norm = clip_grad_norm_(sharded, cfg.clip_grad) if cfg.clip_grad else global_grad_norm(sharded)
            lr = opt.param_groups[0]["lr"]
            opt.step()
            opt.zero_grad()
            schedule.step()
            loss_value = shared[0].item() / (count * layout.dp)
            elapsed = time.perf_counter() - began
            times.append(elapsed)
            record = {
                "step": step + 1,
                "loss": loss_value,
                "grad_norm": norm.item(),
                "lr": lr,
                "tokens_per_s": cfg.tokens_per_step / elapsed,
                "step_time_s": elapsed,
                "peak_memory_mb": _peak_memory_mb(device),
            }
            if held_out is not None and ((step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps):
                record["eval_loss"] = _evaluate(cfg, built, held_out, device, rank)
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if board:
                board.write(record)
            if shown:
                shown.update(record)
            if cfg.save and cfg.save_every and (step + 1) % cfg.save_every == 0:
                saved.append(_save(cfg, built, opt, settings, step + 1, rank))
            if rank == 0 and progress:
                _write_progress(progress, step + 1)
            if shared[1].item() > 0 and step + 1 < cfg.steps:
                if metrics:
                    metrics.close()
                if board:
                    board.close()
                raise stopping.Interrupted(stopping.requested() or signal.SIGTERM, step + 1)
        if cfg.save and cfg.steps > start and (not cfg.save_every or cfg.steps % cfg.save_every):
            saved.append(_save(cfg, built, opt, settings, cfg.steps, rank))
    if metrics:
        metrics.close()
    if board:
        board.close()
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


def _optimizer(cfg: TrainConfig, groups):
    """Megatron's --optimizer: adam is torch's fused AdamW (decoupled weight decay), sgd torch's SGD."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum)
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=True)


def _instances_apart(layout) -> int:
    """How many instances train on their own share of each batch: DiLoCo's R (read off the placements), else 1."""
    from hfsdp.core.layout import dense_layout

    dense = dense_layout(layout)
    return dense.size // dense.reduced_size


class _Silent:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def _data(cfg: TrainConfig, vocab_size: int):
    """The training stream and, with --eval-interval, a held-out stream it never shows."""
    from hfsdp.recipes.data import IndexedTokens, SyntheticTokens

    data = IndexedTokens(cfg.data_path, cfg.seq_len) if cfg.data_path else SyntheticTokens(vocab_size, cfg.seq_len)
    if cfg.eval_interval is None:
        return data, None
    return data.split()


#: Schedule setting -> (its key in a checkpoint's "schedule" record, the TrainConfig setting that gives it).
SCHEDULE = {
    "lr": "lr",
    "min_lr": "min_lr",
    "warmup_iters": "lr_warmup_iters",
    "decay_iters": "lr_decay_iters",
    "style": "lr_decay_style",
}


def schedule_settings(cfg: TrainConfig, saved: dict | None) -> tuple[dict, list[str]]:
    """The learning-rate schedule of this run, and notes on where it departs from a resumed checkpoint's.

    A resume continues the schedule it was saved with (as Megatron does): each setting the user did not set
    (flag or config file) comes from the checkpoint's record; one the user set wins, and the note says so.
    Without a record the run's own settings hold; the decay ends at --steps unless --lr-decay-iters says.
    """
    own = {key: cfg.values[name] for key, name in SCHEDULE.items()}
    if own["decay_iters"] is None:
        own["decay_iters"] = cfg.steps
    if not saved:
        return own, []
    settings, notes = {}, []
    for key, name in SCHEDULE.items():
        if cfg.explicit(name) or key not in saved:
            settings[key] = own[key]
            if key in saved and saved[key] != own[key]:
                notes.append(f"{cfg.given[name].spelled} {own[key]} instead of the checkpoint's {saved[key]}")
        else:
            settings[key] = saved[key]
    return settings, notes


def _schedule(settings: dict, opt, start: int):
    """Megatron's warmup + decay as a LambdaLR over every parameter group, positioned after `start` steps."""
    from hfsdp.recipes.lr_schedule import Schedule, scheduler

    schedule = Schedule(
        settings["lr"], settings["min_lr"], settings["warmup_iters"], settings["decay_iters"], settings["style"]
    )
    return scheduler(opt, schedule, start)


@torch.no_grad()
def _evaluate(cfg: TrainConfig, built, held_out, device: torch.device, rank: int) -> float:
    """Mean loss over --eval-iters global batches of held-out data (collective)."""
    from hfsdp.recipes.data import microbatch

    layout, count = cfg.layout, cfg.num_microbatches
    total = torch.zeros((), device=device)
    for k in range(cfg.eval_iters):
        batch = held_out.global_batch(k, layout.global_batch_size)
        for index in range(count):
            tokens, labels = (t.to(device) for t in microbatch(batch, index, count, rank, layout.dp))
            total += built.loss(built.sharded, tokens, labels).detach()
    dist.all_reduce(total)
    return total.item() / (cfg.eval_iters * count * layout.dp)


def _maybe_load(cfg: TrainConfig, sharded, opt, rank: int) -> tuple[int, dict]:
    """Resume from --load: (the step to start from, the learning-rate schedule to follow). The schedule and weight
    decay continue the checkpoint's unless the user set them. A checkpoint without optimizer state (an import of
    Hugging Face weights) starts the optimizer fresh at step 0 with this run's schedule."""
    if not cfg.load:
        return 0, schedule_settings(cfg, None)[0]
    from hfsdp.ckpt import load_checkpoint, read_index, resolve

    ckpt_dir = resolve(cfg.load)
    index = read_index(ckpt_dir)
    fresh = index.optimizer is None
    extra = load_checkpoint(cfg.load, sharded, None if fresh else opt)
    settings, notes = schedule_settings(cfg, None if fresh else extra.get(SCHEDULE_KEY))
    if fresh:
        notes.insert(0, "weights only: the optimizer starts fresh at step 0")
    decay = [g for g in opt.param_groups if g.get("name") == "decay"]
    if not fresh and cfg.explicit("weight_decay") and decay and decay[0]["weight_decay"] != cfg.weight_decay:
        notes.append(f"weight decay {cfg.weight_decay:g} from {cfg.given['weight_decay'].spelled}, not the "
                     f"checkpoint's {decay[0]['weight_decay']:g}")  # fmt: skip
        for group in decay:
            group["weight_decay"] = cfg.weight_decay
    if rank == 0:
        before = index.config().layout_name
        say(f"resumed from {ckpt_dir} ({before} -> {cfg.layout.layout_name})" + "".join(f"; {n}" for n in notes))
    return (0 if fresh else int(extra["step"])), settings


def _save(cfg: TrainConfig, built, opt, settings: dict, step: int, rank: int) -> Path:
    """Save step `step` (collective); rank 0 then applies --save-keep, once the new checkpoint is published."""
    from hfsdp.ckpt import save_checkpoint

    extra = {
        "step": step,
        "consumed_samples": step * cfg.layout.global_batch_size,
        MODEL_KEY: model_settings(cfg),
        SCHEDULE_KEY: settings,
    }
    path = save_checkpoint(cfg.save, built.sharded, opt, step=step, extra=extra, model_record=built.record)
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
        f"done: {summary['layout']}, {summary['steps']} step{'s' if summary['steps'] != 1 else ''}, final loss "
        f"{summary['final_loss']:.4f}, "
        f"{summary['tokens_per_s']:,.0f} tokens/s (median step), peak {kind} MiB per rank: [{peaks}]"
    )
    if cfg.save:
        from hfsdp.cli.retention import checkpoints

        kept = checkpoints(Path(cfg.save))
        latest = Path(cfg.save) / "latest"
        names = ", ".join(p.name for p in kept)
        newest = latest.read_text().strip() if latest.is_file() else "none"
        say(f"checkpoints: {cfg.save} (latest: {newest}; kept: {names or 'none'})")
