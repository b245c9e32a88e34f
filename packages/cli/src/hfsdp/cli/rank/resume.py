"""Resuming continues the run: its step, its data position, its learning-rate schedule, its metrics file.

A checkpoint records, beside weights and optimizer, the step, the number of samples the run has
consumed, the model's settings and the schedule (`extra`). A resume (`--load`, or a restart
from the run's own `--save`) continues from there on any layout:

- the data position is `consumed_samples`, never step x batch, so a changed global batch or
  world neither replays nor skips a sample (`hfsdp.recipes.data` addresses samples by position);
- the schedule continues the one saved, except settings the user gave (`schedule_settings`);
- the metrics file keeps the records up to the checkpoint's step and drops the later ones, which
  the resumed run trains again, so every step appears once (`open_metrics`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from hfsdp.cli.settings.report import say
from hfsdp.cli.settings.train_config import TrainConfig

#: Where a checkpoint's `extra` records the learning-rate schedule, so that a resume continues it.
SCHEDULE_KEY = "schedule"
#: Where it records the data position: how many samples the run has trained on.
CONSUMED_KEY = "consumed_samples"

#: Schedule setting -> (its key in a checkpoint's "schedule" record, the TrainConfig setting that gives it).
SCHEDULE = {
    "lr": "lr",
    "min_lr": "min_lr",
    "warmup_iters": "lr_warmup_iters",
    "decay_iters": "lr_decay_iters",
    "style": "lr_decay_style",
}


@dataclass(frozen=True)
class Resumed:
    """Where this run starts: the step, the samples consumed before it, the schedule it follows."""

    start: int
    consumed: int
    schedule: dict
    notes: list[str] = field(default_factory=list)


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


def resume(cfg: TrainConfig, model, opt, rank: int) -> Resumed:
    """Load --load into `model` and `opt` (collective) and say so on rank 0; a fresh start without --load.

    The schedule and weight decay continue the checkpoint's unless the user set them. A checkpoint without
    optimizer state (an import of Hugging Face weights) starts the optimizer fresh at step 0 with this run's
    schedule. Every rank must resume the same checkpoint (under torchrun each found it on its own).
    """
    if not cfg.load:
        return Resumed(0, 0, schedule_settings(cfg, None)[0])
    from hfsdp.ckpt import CheckpointError, load_checkpoint, read_index, resolve

    ckpt_dir = resolve(cfg.load)
    chosen = [None] * dist.get_world_size()
    dist.all_gather_object(chosen, str(ckpt_dir))
    if len(set(chosen)) != 1:
        raise CheckpointError(
            f"The ranks would resume different checkpoints ({', '.join(sorted(set(chosen)))}); the checkpoint "
            "directory must be the same shared directory on every node. Check --save/--load on every node."
        )
    index = read_index(ckpt_dir)
    fresh = index.optimizer is None
    extra = load_checkpoint(ckpt_dir, model, None if fresh else opt)
    settings, notes = schedule_settings(cfg, None if fresh else extra.get(SCHEDULE_KEY))
    if fresh:
        notes.insert(0, "weights only: the optimizer starts fresh at step 0")
    elif converted := moment_conversion(index.tensors, opt):
        notes.append(converted)
    decay = [g for g in opt.param_groups if g.get("name") == "decay"]
    if not fresh and cfg.explicit("weight_decay") and decay and decay[0]["weight_decay"] != cfg.weight_decay:
        notes.append(f"weight decay {cfg.weight_decay:g} from {cfg.given['weight_decay'].spelled}, not the "
                     f"checkpoint's {decay[0]['weight_decay']:g}")  # fmt: skip
        for group in decay:
            group["weight_decay"] = cfg.weight_decay
    start = 0 if fresh else int(extra["step"])
    saved_batch = index.layout.get("global_batch_size")
    consumed = 0 if fresh else int(extra.get(CONSUMED_KEY, start * (saved_batch or cfg.layout.global_batch_size)))
    batch, micro, count = cfg.layout.global_batch_size, cfg.layout.micro_batch_size, cfg.num_microbatches
    split = f"{count} microbatch{'es' if count != 1 else ''} of {micro} per rank"
    if saved_batch is not None and saved_batch != batch and not fresh:
        said = (
            f"{cfg.given['global_batch_size'].spelled} {batch} instead of the checkpoint's global batch {saved_batch}"
        )
        notes.insert(0, f"{said} ({split}; the schedule keeps counting steps), from sample {consumed}")
    else:
        notes.insert(int(fresh), f"global batch {batch} ({split}), from sample {consumed}")
    if rank == 0:
        before = index.config().layout_name
        say(f"resumed from {ckpt_dir} ({before} -> {cfg.layout.layout_name})" + "".join(f"; {n}" for n in notes))
    return Resumed(start, consumed, settings, notes)


def moment_conversion(tensors: dict, opt) -> str | None:
    """What the resume line says when the checkpoint's AdamW moments are in other dtypes than `opt` keeps
    (--exp-avg-dtype, --exp-avg-sq-dtype): FusedAdamW's `load_state_dict` (or torch's AdamW, into fp32) converted them
    once, as they were loaded. None when they agree, or when there are no moments (SGD, weights only)."""
    import torch

    from hfsdp.core.kernels.optimizer_dtypes import megatron_name

    held = getattr(opt, "dtypes", None)
    if held is None:
        if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
            return None
        held = (torch.float32, torch.float32)  # torch's AdamW keeps its state in the parameters' fp32
    changes = []
    for key, dtype in zip(("exp_avg", "exp_avg_sq"), held, strict=True):
        entries = tensors.get(key)
        if not entries:
            return None
        saved = getattr(torch, next(iter(entries.values())).dtype)
        if saved != dtype:
            changes.append(f"{key} {megatron_name(saved)} -> {megatron_name(dtype)}")
    if not changes:
        return None
    return f"optimizer state converted once into this run's dtypes ({', '.join(changes)})"


def open_metrics(path: str, start: int):
    """The metrics file, opened to append after step `start`: the records of later steps (trained again by this
    resumed run) and a line a killed run left half-written are dropped first; a fresh run truncates it."""
    target = Path(path)
    if start == 0 or not target.exists():
        return open(target, "w")
    kept = []
    for line in target.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= start:
            kept.append(line + "\n")
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, target)
    return open(target, "a")
