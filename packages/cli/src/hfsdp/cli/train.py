"""`hfsdp train`: validate, then launch through PyTorch's elastic launcher (torch.distributed.run).

On a laptop `hfsdp train --nproc 4` starts 4 local processes itself. Under an
external `torchrun` (multi-node) it sees the launcher's environment and runs as
the rank it was given instead of spawning. Either way the whole configuration is
validated before any process starts, and a failure on any rank stops every rank
with that rank's error.
"""

from __future__ import annotations

import os
import sys
from enum import StrEnum
from typing import Annotated

import typer

from hfsdp.cli.config_file import ConfigFileError
from hfsdp.core.config import ConfigError


class Dtype(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


def _opt(help_text: str, **kw):
    return typer.Option(help=help_text, **kw)


def train(
    inner: Annotated[str | None, _opt("Strategy inside an instance (data_parallel_sharding_strategy).")] = None,
    outer: Annotated[str | None, _opt("Strategy across instances (outer_dp_sharding_strategy).")] = None,
    instances: Annotated[int | None, _opt("Number of instances (num_distributed_optimizer_instances).")] = None,
    nproc: Annotated[int, _opt("Processes on this node (ignored under an external torchrun).")] = 4,
    steps: Annotated[int | None, _opt("Optimizer steps.")] = None,
    global_batch_size: Annotated[int | None, _opt("Sequences per optimizer step.")] = None,
    micro_batch_size: Annotated[int | None, _opt("Sequences per rank per microbatch.")] = None,
    seq_len: Annotated[int | None, _opt("Sequence length.")] = None,
    layers: Annotated[int | None, _opt("Transformer layers.")] = None,
    hidden: Annotated[int | None, _opt("Hidden size.")] = None,
    heads: Annotated[int | None, _opt("Attention heads.")] = None,
    vocab: Annotated[int | None, _opt("Vocabulary size.")] = None,
    dtype: Annotated[Dtype | None, _opt("Compute dtype (main weights and optimizer state stay fp32).")] = None,
    lr: Annotated[float | None, _opt("AdamW learning rate.")] = None,
    weight_decay: Annotated[float | None, _opt("AdamW weight decay.")] = None,
    clip_grad: Annotated[float | None, _opt("Clip gradients to this global norm (0: off).")] = None,
    seed: Annotated[int | None, _opt("Seed of the model and the synthetic data.")] = None,
    device: Annotated[Device | None, _opt("Where to train.")] = None,
    metrics: Annotated[str | None, _opt("Write one JSON object per step to this file.")] = None,
    config: Annotated[str | None, _opt("A config file (as validate-config reads); flags override it.")] = None,
    data_path: Annotated[str | None, _opt("Prefix of a Megatron indexed dataset (.bin/.idx).")] = None,
    moe_experts: Annotated[int | None, _opt("Number of MoE experts (0/unset: dense).")] = None,
    moe_topk: Annotated[int | None, _opt("Experts per token.")] = None,
    ep: Annotated[int | None, _opt("Expert-parallel size.")] = None,
    expert_strategy: Annotated[str | None, _opt("Strategy of expert parameters (default: --inner).")] = None,
    expert_instances: Annotated[int | None, _opt("Opt-in outer axis for experts: its size.")] = None,
    expert_outer: Annotated[str | None, _opt("Opt-in outer axis for experts: its strategy.")] = None,
    save: Annotated[str | None, _opt("Checkpoint directory to save into.")] = None,
    save_every: Annotated[int | None, _opt("Save every K steps (and at the end).")] = None,
    load: Annotated[str | None, _opt("Checkpoint (directory or step) to resume from.")] = None,
    debug_fail_rank: Annotated[int | None, typer.Option(hidden=True, help="Fault injection: rank that raises.")] = None,
) -> None:
    """Train a megatron-core GPT with hybrid-sharded data parallelism."""
    flags = dict(locals())
    flags["num_moe_experts"] = flags.pop("moe_experts")
    for key in ("dtype", "device"):
        flags[key] = flags[key].value if flags[key] is not None else None
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else nproc
    try:
        import torch

        from hfsdp.cli.train_config import build_train_config

        cfg = build_train_config(flags, world_size=world, nproc=nproc, cuda_available=torch.cuda.is_available())
    except ConfigFileError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    except ConfigError as err:
        typer.echo(f"error: the training configuration is invalid ({len(err.problems)} problem(s)):", err=True)
        for problem in err.problems:
            typer.echo(f"  - {problem.field}: {problem.message}", err=True)
        raise typer.Exit(1) from None
    if under_torchrun:
        from hfsdp.cli.train_loop import run_training

        run_training(cfg)
        return
    raise typer.Exit(_launch(cfg))


def _launch(cfg) -> int:
    """Start cfg.nproc local ranks with torch.distributed.run's machinery; return the exit code."""
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from hfsdp.cli.launch_entry import entrypoint, free_port

    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.nproc,
        run_id=f"hfsdp-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        start_method="spawn",
    )
    try:
        elastic_launch(launch, entrypoint)(cfg)
    except ChildFailedError as err:
        rank, failure = min(err.failures.items())
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
        reason = message.strip().splitlines()[-1] if message.strip() else f"exit code {failure.exitcode}"
        typer.echo(
            f"error: rank {rank} failed ({reason}); every other rank was stopped. "
            "The rank's full traceback is printed above.",
            err=True,
        )
        return 1
    sys.stdout.flush()
    return 0
