"""What `hfsdp train` says and checks about memory before any rank starts, from the planner's memory model.

At the start: one line with the model's parameter count and the per-rank memory the layout
needs, split as `hfsdp plan` splits it. Then the check: a run whose estimate exceeds what a
rank has (the GPU's memory when training on CUDA; on the CPU, the host's available memory
shared by the local ranks) is refused with one paragraph saying what it would need and which
layouts of the same ranks would fit. So is a run whose offloaded optimizer state (16 bytes per
offloaded element with fp32 moments, fewer with the precision-aware optimizer's: `host_bytes_per_element`, on
every local rank) exceeds the host's available memory: found out at
fully_shard instead, it would end with the OOM killer after minutes of setup. The estimate counts
the model (its states, buffers and activations), not the framework's own memory (CUDA context,
imported libraries).
"""

from __future__ import annotations

from hfsdp.cli.checks.plan_inputs import default_mfu, layout_fields, model_shape, step_settings
from hfsdp.cli.settings.train_config import TrainConfig
from hfsdp.core.rules.config import Problem
from hfsdp.core.rules.layout import dense_layout
from hfsdp.planning.activations import activations
from hfsdp.planning.candidates import layout_name, plan_layouts
from hfsdp.planning.cluster import Cluster
from hfsdp.planning.groups import groups_for
from hfsdp.planning.memory import SCALE_BLOCK, Memory, memory, moment_bytes
from hfsdp.planning.model_shape import ModelShape, billions

GIB = 2**30
#: How many layouts that fit a refusal names (hfsdp plan lists them all).
NAMED_LAYOUTS = 4


def estimate(cfg: TrainConfig) -> tuple[ModelShape, Memory]:
    """The run's model and the per-rank memory at its step's peak (raises ValueError on an unreadable model)."""
    shape = model_shape(cfg)
    run = step_settings(cfg, shape)
    acts = activations(shape, run.seq, run.micro_batch, run.compute_bytes, run.recompute)
    return shape, memory(shape, groups_for(shape, cfg.layout, run.fp8_param_gather), acts, run)


def start_line(cfg: TrainConfig, shape: ModelShape, mem: Memory) -> str:
    split = ", ".join(
        f"{label} {value / GIB:.2f}"
        for label, value in (
            ("params", mem.params),
            ("grads", mem.grads),
            ("optimizer", mem.optimizer),
            ("communication", mem.comm_buffers),
            ("activations", mem.activations),
        )
    )
    host = f"; {mem.host / GIB:.2f} GiB in host memory" if mem.host else ""
    return (
        f"model: {billions(shape.params)} parameters ({shape.params:,}); {layout_name(cfg.layout)} needs about "
        f"{mem.total / GIB:.2f} GiB per rank ({split} GiB){host}"
    )


def _gpu_total(cfg: TrainConfig) -> int | None:
    """The memory of the GPU a rank trains on, or None when the run trains on the CPU."""
    import torch

    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.cuda.get_device_properties(0).total_memory
    return None


def capacity(cfg: TrainConfig, local_ranks: int) -> tuple[int, str] | None:
    """Bytes one rank can use and what they are, or None when unknown."""
    total = _gpu_total(cfg)
    if total is not None:
        return total, f"the GPU's {total / GIB:.1f} GiB"
    available = _host_available()
    if available is None:
        return None
    share = available // max(1, local_ranks)
    return share, f"{share / GIB:.1f} GiB, the host's {available / GIB:.1f} GiB available shared by {local_ranks} ranks"


def check_build(cfg: TrainConfig, shape: ModelShape, local_ranks: int) -> Problem | None:
    """Every rank builds the model whole, in fp32, on the host before sharding it (and moves it whole to its GPU):
    the refusal when the local ranks together cannot, else None."""
    whole = 4 * shape.params
    available = _host_available()
    if available is not None and local_ranks * whole > available:
        return Problem(
            "memory",
            f"every rank builds the whole model in fp32 before sharding it: {billions(shape.params)} parameters are "
            f"{whole / GIB:.1f} GiB per rank, {local_ranks * whole / GIB:.1f} GiB for the {local_ranks} ranks on "
            f"this host, which has {available / GIB:.1f} GiB available; use fewer ranks per host, or a smaller model.",
        )
    gpu = _gpu_total(cfg)
    if gpu is not None and whole > gpu:
        return Problem(
            "memory",
            f"every rank builds the whole model in fp32 and moves it to its GPU before sharding it: "
            f"{whole / GIB:.1f} GiB, more than the GPU's {gpu / GIB:.1f} GiB; train a smaller model.",
        )
    return None


def offloaded_share(cfg: TrainConfig, shape: ModelShape, gpu: int | None = None) -> float:
    """The share of the optimizer state `--offload optim` puts in host memory: --offload-fraction, or for auto the
    engine's own rule (`offload_plan.fraction_for`: the smallest share with which the rest fits in the GPU less
    its reserve, by the per-element bytes of the layout; whole units are then chosen at fully_shard, so the run's
    share can be a unit larger). On the CPU, auto offloads nothing, as the engine does. `gpu`: the GPU's memory,
    if the caller has it (`_gpu_total`)."""
    from hfsdp.core.offload.offload_plan import RESERVE_FRACTION, fraction_for, per_element_bytes

    if cfg.offload_fraction != "auto":
        return float(cfg.offload_fraction)
    gpu = _gpu_total(cfg) if gpu is None else gpu
    if gpu is None:
        return 0.0
    from hfsdp.planning.memory import state_bytes_per_element

    settings = step_settings(cfg, shape)
    reduce = 2 if cfg.main_grads_dtype == "bf16" else 4
    state = state_bytes_per_element(cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype)
    kept, offloaded = per_element_bytes(dense_layout(cfg.layout), settings.compute_bytes, reduce, state)
    return fraction_for(shape.params, kept, offloaded, gpu * (1 - RESERVE_FRACTION))


def host_bytes_per_element(cfg: TrainConfig) -> float:
    """Host bytes per offloaded element: the fp32 main weight, AdamW's two moments in their dtypes (fp8 with its
    block scale), and the gradient staged in fp32 for the CPU step: 16 with fp32 moments, 12 with bf16, 10.0625
    with fp8."""
    moments = sum(moment_bytes(d, SCALE_BLOCK) / SCALE_BLOCK for d in (cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype))
    return 4 + moments + 4


def check_host(cfg: TrainConfig, mem: Memory, shape: ModelShape, local_ranks: int) -> Problem | None:
    """With --offload optim: the refusal when the local ranks' offloaded state exceeds the host's available memory
    (on the CPU the rest of a rank's state lives there too), else None."""
    if cfg.offload != "optim" or not mem.host:
        return None
    available, gpu = _host_available(), _gpu_total(cfg)
    share = offloaded_share(cfg, shape, gpu)
    on_host = share * mem.host
    per_rank = on_host + (0 if gpu is not None else mem.total)
    if available is None or local_ranks * per_rank <= available:
        return None
    asked = "what --offload-fraction auto would offload" if cfg.offload_fraction == "auto" else "--offload-fraction"
    return Problem(
        "memory",
        f"--offload optim keeps {share:.0%} of the optimizer state in host memory ({asked}): {on_host / GIB:.1f} GiB "
        f"per rank ({host_bytes_per_element(cfg):g} bytes per offloaded element: the fp32 main weights, AdamW's two "
        f"moments and the gradient staged for the CPU step){'' if gpu is not None else ' beside the rest of its state'}"
        ", "
        f"{local_ranks * per_rank / GIB:.1f} GiB for the {local_ranks} ranks on this host, which has "
        f"{available / GIB:.1f} GiB available; offload a smaller share (--offload-fraction), run fewer ranks per "
        "host, or shard the optimizer over more ranks.",
    )


def check(cfg: TrainConfig, mem: Memory, shape: ModelShape, local_ranks: int) -> Problem | None:
    """The refusal when the model cannot be built, the estimate exceeds what a rank has, or the offloaded state
    what the host has; else None."""
    built = check_build(cfg, shape, local_ranks)
    if built is not None:
        return built
    have = capacity(cfg, local_ranks)
    if have is None or mem.total <= have[0]:
        return check_host(cfg, mem, shape, local_ranks)
    limit, what = have
    cluster = Cluster(nodes=1, gpus_per_node=cfg.layout.world_size, gpu_memory_gib=limit / GIB)
    rows = plan_layouts(shape, cluster, step_settings(cfg, shape), default_mfu(shape), **layout_fields(cfg))
    fitting = sorted((r for r in rows if r.fits), key=lambda r: r.memory.total)[:NAMED_LAYOUTS]
    if fitting:
        names = ", ".join(f"{r.name} ({r.memory.total / GIB:.1f} GiB)" for r in fitting)
        advice = f"layouts of the same {cfg.layout.world_size} ranks that fit: {names}; `hfsdp plan` compares them all"
    else:
        advice = f"no layout of {cfg.layout.world_size} ranks fits"
    return Problem(
        "memory",
        f"this run would need about {mem.total / GIB:.1f} GiB per rank ({mem.params / GIB:.1f} parameters, "
        f"{mem.grads / GIB:.1f} gradients, {mem.optimizer / GIB:.1f} optimizer state, {mem.comm_buffers / GIB:.1f} "
        f"communication buffers, {mem.activations / GIB:.1f} activations, at its {mem.phase}), but a rank has {what}; "
        f"{advice}. --recompute, --offload optim or a smaller --micro-batch-size also need less.",
    )


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
