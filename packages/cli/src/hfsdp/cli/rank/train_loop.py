"""The training loop every rank runs: readable in one sitting.

setup (process group, megatron-core groups, model, sharding, optimizer, data, resume: `resume.py`)
-> for each step: the next global batch from the data position (consumed samples), microbatches
forward/backward, clip, step, log, maybe publish a background save, maybe save (`saving.py`),
maybe stop -> summary. Rank 0 reports progress and writes the metrics file (and the TensorBoard logs);
every rank beats its heartbeat (`heartbeat.py`) for hang detection.

Stopping: a SIGINT/SIGTERM only sets a flag (`stopping.deferred`); the flag travels in the
step's loss all-reduce, so every rank sees it after the same step and leaves together with
`Interrupted`, a save in progress (or in flight in the background) finished.
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

from hfsdp.cli.checks.preflight import MODEL_KEY, model_settings
from hfsdp.cli.rank import stopping, timeline
from hfsdp.cli.rank.heartbeat import Heartbeat
from hfsdp.cli.rank.profiling import StepProfiler
from hfsdp.cli.rank.progress import reporter
from hfsdp.cli.rank.run_dir import RUN_DIR_ENV, progress_file, read_json, write_json
from hfsdp.cli.rank.tensorboard_log import TensorBoardLog
from hfsdp.cli.rank.throughput import Throughput
from hfsdp.cli.settings.report import say
from hfsdp.cli.settings.train_config import TrainConfig


def run_training(cfg: TrainConfig) -> dict:
    """Train as one rank of an already-launched job (torch.distributed.run set RANK, WORLD_SIZE, ...)."""
    device = _init_distributed(cfg)
    try:
        result = _train(cfg, device, dist.get_rank())
    except Exception:
        # Leaving on an error (often a peer's death): the elastic agent waits for every rank to exit before it can
        # restart them, and collecting a process's millions of torch and transformers objects took seconds per rank
        # (12 s on a loaded 2-core box). Frozen, they are left to the exit; no collective is freed meanwhile.
        gc.freeze()
        raise
    except BaseException:  # a stop by a signal: every rank leaves together, at the same step
        _close()
        raise
    _close()
    return result


def _close() -> None:
    # torch's gloo keeps finished collectives in reference cycles; freed at interpreter exit they can abort the
    # process, so they are collected while the process group still lives.
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
    from hfsdp.cli.rank.build_model import build_model
    from hfsdp.cli.rank.resume import CONSUMED_KEY, SCHEDULE_KEY, open_metrics, resume
    from hfsdp.cli.rank.saving import Saver
    from hfsdp.cli.settings.autoresume import RUN_ID_KEY, run_id
    from hfsdp.core.engine.clip import clip_grad_norm_, global_grad_norm
    from hfsdp.core.engine.weight_decay import param_groups
    from hfsdp.recipes.data import microbatch

    layout, world = cfg.layout, dist.get_world_size()
    run_dir = os.environ.get(RUN_DIR_ENV)
    beat = Heartbeat(cfg.step_timeout, rank, cfg.save, run_dir)
    built = build_model(cfg, device)
    if rank == 0 and built.fp8_summary is not None:
        say(built.fp8_summary)
    sharded = built.sharded
    throughput = Throughput.of(cfg, device)
    opt = _optimizer(cfg, param_groups(sharded, cfg.weight_decay), device)
    if rank == 0 and cfg.store_param_remainders:
        say(_remainders_line(sharded, by_default=not cfg.explicit("store_param_remainders")))
    clips_in_step = getattr(opt, "max_grad_norm", None) is not None  # FusedAdamW clips as it steps
    apart = _instances_apart(layout)
    data, held_out = _data(cfg, built.vocab_size)
    if rank == 0:
        timeline.note(cfg.timeline, "model built")
    began_load = time.perf_counter()
    beat.beat("load", 0)
    resumed = resume(cfg, sharded, opt, rank)
    if rank == 0:
        timeline.note(cfg.timeline, "loaded", seconds=time.perf_counter() - began_load, step=resumed.start)
    start, consumed, settings = resumed.start, resumed.consumed, resumed.schedule
    schedule = _schedule(settings, opt, start)
    progress = progress_file(run_dir) if run_dir is not None else None
    shown_up_to = int(read_json(progress).get("shown", 0)) if progress is not None else 0
    if progress is not None and rank == 0:
        write_json(progress, {"step": start, "shown": shown_up_to})

    saver = Saver(cfg, sharded, opt, built.record, rank)
    metrics = open_metrics(cfg.metrics, start) if (cfg.metrics and rank == 0) else None
    board = TensorBoardLog(cfg.tensorboard_dir) if (cfg.tensorboard_dir and rank == 0) else None
    profiler = StepProfiler(cfg.profile_dir, cfg.profile_steps, rank, device)
    count, times, loss_value = cfg.num_microbatches, [], float("nan")
    shown = reporter(cfg.steps, start, cfg.log_every, shown_up_to) if rank == 0 else None
    batch = data.samples(consumed, layout.global_batch_size) if start < cfg.steps else None
    with stopping.deferred(), shown or _Silent(), profiler:
        for step in range(start, cfg.steps):
            beat.beat("step", step + 1)
            profiler.before_step(step + 1)
            if cfg.debug_fail_rank == rank and step == start + 1:
                raise RuntimeError(f"injected failure on rank {rank} at step {step} (--debug-fail-rank)")
            began = time.perf_counter()
            total = torch.zeros((), device=device)
            # Every microbatch on the device before any compute: a copy from pageable host memory waits for the
            # work queued before it, which after the first microbatch would be that microbatch's whole backward.
            inputs = [[t.to(device) for t in microbatch(batch, i, count, rank, layout.dp, apart)] for i in range(count)]
            for index, (tokens, labels) in enumerate(inputs):
                sharded.set_microbatch(index, count)
                loss = built.loss(sharded, tokens, labels)
                loss.backward()
                total += loss.detach()
            # The stop flag and "my checkpoint file is written" ride on the loss's all-reduce: every rank learns of
            # a signal, and of a background save every rank has written, after the same step.
            flags = [float(stopping.requested() is not None), float(saver.written())]
            # Filled on the device (no copy from the host, which would wait for the backward before the host could
            # queue the update).
            shared = torch.stack([total, *(torch.full((), f, device=device) for f in flags)])
            dist.all_reduce(shared)
            if not clips_in_step:
                norm = clip_grad_norm_(sharded, cfg.clip_grad) if cfg.clip_grad else global_grad_norm(sharded)
            lr = opt.param_groups[0]["lr"]
            saver.before_update()
            opt.step()
            if clips_in_step:
                norm = opt.grad_norm  # the global norm before clipping, as clip_grad_norm_ returns it
            opt.zero_grad()
            schedule.step()
            consumed += layout.global_batch_size
            # The next batch is made while the device still runs this step's update; the reads below wait for it.
            batch = data.samples(consumed, layout.global_batch_size) if step + 1 < cfg.steps else None
            loss_value = shared[0].item() / (count * layout.dp)
            elapsed = time.perf_counter() - began
            times.append(elapsed)
            profiler.after_step(step + 1)
            record = {
                "step": step + 1,
                "loss": loss_value,
                "grad_norm": norm.item(),
                "lr": lr,
                "tokens_per_s": cfg.tokens_per_step / elapsed,
                "step_time_s": elapsed,
                **throughput.figures(elapsed),
                "peak_memory_mb": _peak_memory_mb(device),
                "consumed_samples": consumed,
            }
            if held_out is not None and ((step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps):
                record["eval_loss"] = _evaluate(cfg, built, held_out, device, rank)
            if shown:
                shown.update(record)
            if rank == 0 and progress is not None:  # after its line, before the metrics and the save: a kill from
                shown_up_to = max(shown_up_to, step + 1)  # here on neither misnames the step nor prints it twice
                write_json(progress, {"step": step + 1, "shown": shown_up_to})
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if board:
                board.write(record)
            if rank == 0 and step == start:
                timeline.note(cfg.timeline, "first step", step=step + 1)
            if saver.in_flight:
                beat.beat("publish", step + 1)
            saver.publish_if(shared[2].item() == world)
            if saver.due(step + 1):
                beat.beat("save", step + 1)
                extra = {"step": step + 1, CONSUMED_KEY: consumed, MODEL_KEY: model_settings(cfg),
                         SCHEDULE_KEY: settings, RUN_ID_KEY: run_id()}  # fmt: skip
                saver.save(step + 1, extra)
            if shared[1].item() > 0 and step + 1 < cfg.steps:
                beat.beat("save", step + 1)
                saver.finish()
                if metrics:
                    metrics.close()
                if board:
                    board.close()
                raise stopping.Interrupted(stopping.requested() or signal.SIGTERM, step + 1)
        beat.beat("save", cfg.steps)
        saver.finish()
    beat.close()
    if metrics:
        metrics.close()
    if board:
        board.close()
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, _peak_memory_mb(device))
    steady = sorted(times[1:] or times)
    median = steady[len(steady) // 2] if steady else float("nan")
    summary = {
        "layout": layout.layout_name,
        "steps": cfg.steps,
        "final_loss": loss_value,
        "tokens_per_s": cfg.tokens_per_step / median,
        "median_step_s": median,
        "peak_memory_mb_per_rank": peaks,
        "checkpoints": [str(p) for p in saver.saved],
    }
    if steady:
        summary.update(throughput.figures(median))
    if rank == 0:
        _print_summary(cfg, summary, device, throughput)
        if profiler.written:
            say(f"profile of steps {cfg.profile_steps}: {', '.join(str(p) for p in profiler.written)} (a trace per "
                "rank; open one in https://ui.perfetto.dev or chrome://tracing)")  # fmt: skip
    return summary


def _optimizer(cfg: TrainConfig, groups, device: torch.device):
    """Megatron's --optimizer: adam is AdamW (decoupled weight decay), sgd torch's SGD. AdamW is hfsdp's FusedAdamW
    (the clip and the next forward's gather input folded into its step: 1.13x the engine's bandwidth floor at
    3.0B on an H200 against torch's 1.46x) or torch's fused AdamW, as --adam-kernel says."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum)
    if _fused_adamw(cfg, device):
        from hfsdp.core import FusedAdamW

        return FusedAdamW(groups, lr=cfg.lr, max_grad_norm=cfg.clip_grad or None, prestage_gathers=True,
                          overlap_next_forward=cfg.overlap_step, exp_avg_dtype=cfg.exp_avg_dtype,
                          exp_avg_sq_dtype=cfg.exp_avg_sq_dtype,
                          store_param_remainders=cfg.store_param_remainders)  # fmt: skip
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=True)


def _remainders_line(sharded, by_default: bool) -> str:
    """What --store-param-remainders did on rank 0 (its caller), measured on the groups the optimizer converted: how
    many keep their fp32 main weights as the bf16 shard plus a 16-bit remainder, and the remainders' bytes; and,
    where nobody asked for it, that it is the precision-aware optimizer's default and how to turn it off."""
    from hfsdp.core import sharding_of

    groups = [g for g in sharding_of(sharded).groups if not g.frozen]
    kept = [g.remainder for g in groups if g.remainder is not None]
    held = sum(r.numel() * r.element_size() for r in kept)
    return (
        f"store_param_remainders: {len(kept)} of {len(groups)} parameter groups keep their fp32 main weights as the "
        f"bf16 shard plus a 16-bit remainder ({held:,} bytes of remainders on rank 0)"
        + (", the precision-aware optimizer's default (--no-store-param-remainders turns it off)" if by_default else "")
    )


def _fused_adamw(cfg: TrainConfig, device: torch.device) -> bool:
    """--adam-kernel auto: FusedAdamW where it is the faster, on a GPU with the state on it and one inner step per
    optimizer step. Offloaded state steps on the CPU, where torch's fused AdamW is faster than FusedAdamW's torch
    path; DiLoCo's instances clip over their own ranks, which FusedAdamW's global-norm clip does not know.
    --use-precision-aware-optimizer is FusedAdamW wherever it runs (its torch path on the CPU and for offloaded
    state): the rules refuse it with --adam-kernel torch, --optimizer sgd and DiLoCo."""
    if cfg.adam_kernel != "auto":
        return cfg.adam_kernel == "fused"
    if cfg.use_precision_aware_optimizer:
        return True
    return device.type == "cuda" and cfg.offload == "none" and cfg.diloco is None


def _instances_apart(layout) -> int:
    """How many instances train on their own share of each batch: DiLoCo's R (read off the placements), else 1."""
    from hfsdp.core.rules.layout import dense_layout

    dense = dense_layout(layout)
    return dense.size // dense.reduced_size


class _Silent:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def _data(cfg: TrainConfig, vocab_size: int):
    """The training stream and, with --eval-interval, a held-out stream it never shows: the held-out set `hfsdp data
    prepare` wrote beside the dataset, else the dataset's (or the synthetic stream's) own split."""
    from hfsdp.recipes.data import IndexedTokens, SyntheticTokens

    data = IndexedTokens(cfg.data_path, cfg.seq_len) if cfg.data_path else SyntheticTokens(vocab_size, cfg.seq_len)
    if cfg.eval_interval is None:
        return data, None
    from hfsdp.recipes.prepare.sidecar import validation_prefix

    held_out = validation_prefix(cfg.data_path) if cfg.data_path else None  # hfsdp data prepare --validation-fraction
    return (data, IndexedTokens(held_out, cfg.seq_len)) if held_out else data.split()


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


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _print_summary(cfg: TrainConfig, summary: dict, device: torch.device, throughput: Throughput) -> None:
    kind = "allocated" if device.type == "cuda" else "RSS"
    peaks = ", ".join(f"{p:,.0f}" for p in summary["peak_memory_mb_per_rank"])
    rate = f", {throughput.describe(summary['median_step_s'])}" if "model_tflops_per_gpu" in summary else ""
    say(
        f"done: {summary['layout']}, {summary['steps']} step{'s' if summary['steps'] != 1 else ''}, final loss "
        f"{summary['final_loss']:.4f}, "
        f"{summary['tokens_per_s']:,.0f} tokens/s (median step){rate}, peak {kind} MiB per rank: [{peaks}]"
    )
    if cfg.save:
        from hfsdp.cli.rank.retention import checkpoints

        kept = checkpoints(Path(cfg.save))
        latest = Path(cfg.save) / "latest"
        names = ", ".join(p.name for p in kept)
        newest = latest.read_text().strip() if latest.is_file() else "none"
        say(f"checkpoints: {cfg.save} (latest: {newest}; kept: {names or 'none'})")
