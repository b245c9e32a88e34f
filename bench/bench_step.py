"""One training step of a megatron-core GPT or a transformers Llama: hfsdp against PyTorch FSDP2 on the same
model, data, mesh and optimizer.

Launch with torchrun, one process per rank:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 bench/bench_step.py --device cpu \\
        --layers 4 --hidden 256 --heads 8 --vocab 1024 --seq-len 128 --micro-batch-size 2 \\
        --steps 10 --warmup 3 --layouts zero3:1x4,hsdp:2x2,hfsdp:2x2 --engines hfsdp,fsdp2
    torchrun --nproc-per-node 2 bench/bench_step.py --device cuda --dtype bf16 ...

Engines (each layout runs them one after the other in the same process group; the
previous model is freed before the next is built):

- `hfsdp`: `shard_megatron_model` (GPT; the mesh built through the megatron-core adapter)
  or `fully_shard(model, units=model.model.layers)` (Llama), `torch.optim.AdamW` over
  its main params (fused by default, --optimizer), `hfsdp.core.clip_grad_norm_`. bf16:
  fp32 main weights cast at each gather (or a bf16 shard where the optimizer shards
  more than the parameters), fp32 gradient reduction.
- `fsdp2`: `fully_shard` on every `model.decoder.layers[i]`, then on the root, with
  `MixedPrecisionPolicy(param_dtype=bf16 or None, reduce_dtype=fp32)`, on a DeviceMesh of
  the same shape from `init_device_mesh`; the same `torch.optim.AdamW` on its
  DTensors, `torch.nn.utils.clip_grad_norm_`. 1-D mesh ("dp_shard",) for R = 1 (FSDP);
  2-D ("dp_outer", "dp_shard") for R > 1, where FSDP2 does HSDP (replicate over
  dp_outer, shard over dp_shard). FSDP2 has no HFSDP: an `hfsdp:RxN` layout is compared
  with FSDP2 HSDP on the same mesh and labelled so. `zero2` maps to FSDP2 with
  reshard_after_forward=False (SHARD_GRAD_OP: parameters stay gathered from forward
  to backward but are sharded between steps, unlike ZeRO-2). FSDP2 has no
  ZeRO-1/DDP; those layouts run hfsdp only.
- `mfsdp`, `mfsdp2`: Megatron-FSDP's `fully_shard` and its experimental v2 (the
  `megatron-fsdp` package, not a dependency of hfsdp: install it beside), on the same
  mesh, data and AdamW; `_megatron_fsdp.py` says how each is set up and what differs.
- `plain`: the unsharded model on rank 0 alone (other ranks wait), fp32 parameters,
  the same torch.optim.AdamW, rank 0's share of the work (M microbatches of
  micro-batch-size). With --dtype bf16 it runs under torch.autocast(bf16) on CUDA; on
  CPU it runs plain fp32 (no autocast). It is the reference for the overhead of
  sharding on one device: compare it with hfsdp/fsdp2 at world size 1.
- `model`: the model alone on rank 0, its weights in the compute dtype, forward and
  backward with the gradients dropped: no optimizer, no clipping, no engine. It is the
  floor under every engine's step; an engine's step minus it is what the engine costs.

`--simulate-world N` runs a single process as one rank of an N-rank world on torch's
fake process group, whose collectives move no data. Every allocation is the real
rank's, so it measures per-rank peak memory of any layout (2x4, 4x2, 1x8) on one
device; step times then leave out communication and losses are meaningless (not
checked).

Gradient accumulation (M = global batch / (micro batch x dp) microbatches, 1 by
default): hfsdp averages over microbatches x dp internally; FSDP2 averages over dp
itself, so each FSDP2/plain microbatch loss is divided by M. FSDP2 reduce-scatters
every microbatch (as hfsdp does); with R > 1 its outer all-reduce runs on the last
microbatch only (`set_requires_all_reduce`), as hfsdp's does.

What is measured, per engine and layout (every rank measures; the table shows the
slowest rank's median and the largest memory):
- step time: wall time of one optimizer step (all microbatches, clipping, optimizer,
  zero_grad), synchronized at both ends on CUDA; median (and minimum, the estimate
  least disturbed by other load on a shared machine) over --steps after --warmup,
  pooled over --rounds;
- tokens/s per rank = micro-batch x M x seq-len / median step time;
- memory: CUDA `max_memory_allocated` over the timed steps; CPU max RSS (monotonic over
  the process, so it says little about engines after the first) and, on both, the
  bytes of persistent model state on the rank: hfsdp `state_bytes()` of model and
  optimizer; FSDP2 local shards of parameters + gradients + optimizer state;
- MFU (CUDA), by the field's definition (PaLM, Megatron-LM, torchtitan): model FLOPs (6 x matmul
  parameters + 12 x layers x hidden x seq, per token; recomputation not counted) over the datasheet's
  dense peak of the GPU in the run's dtype (H200 SXM bf16: 989 TFLOP/s; `--peak-tflops` for others),
  and beside it the same FLOPs over the matmul rate measured in the run ("of achievable");
- with `--floor` (CUDA): the bandwidth floor of each hfsdp engine's cost, the bytes its own kernels
  move per step and the fewest its layout must move (`_floor.py`), over the device-to-device copy
  bandwidth measured in the run, against the engine's cost (its step minus the `model` engine's);
- comm blocked: host time inside collective calls (hfsdp.core.buffers.collectives, the
  torch.distributed functions, Work.wait). On gloo calls are synchronous, so this is
  the exposed communication plus waiting for slower ranks; on NCCL it is launch time
  only, and the exposed communication comes from --profile (collective kernels with no
  compute/copy kernel on any stream);
- CPU s/step/rank: process CPU time (user + system, all threads) of one step up to the
  final synchronize, median per rank, mean over ranks. On CPU it is the work a rank
  does, which time-slicing on a shared or oversubscribed CPU does not inflate the way
  it inflates wall time (gloo waits sleep). On CUDA it is the host time to issue the
  step (plus any synchronizing call inside it, which spins): close to the step time
  means the step is host-bound.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
import traceback
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _ceilings import copy_bandwidth, datasheet_peak, matmul_tflops
from _common import STEP_LABEL, CallTimers, install_comm_timers, markdown_table, summarize_profile, top_ops
from _floor import floor_bytes, step_bytes

#: Layout names -> (outer strategy, inner strategy).
LAYOUTS = {
    "zero3": ("no_shard", "optim_grads_params"),
    "fsdp": ("no_shard", "optim_grads_params"),
    "zero2": ("no_shard", "optim_grads"),
    "zero1": ("no_shard", "optim"),
    "ddp": ("no_shard", "no_shard"),
    "hsdp": ("no_shard", "optim_grads_params"),
    "hfsdp": ("optim", "optim_grads_params"),
}
SEED = 1234
ENGINES = ("hfsdp", "fsdp2", "mfsdp", "mfsdp2", "plain", "model")
#: hfsdp engine variants, `hfsdp+fused[+clip][+prestage][+overlap][+keep]`: FusedAdamW instead of torch's fused
#: AdamW, the clip inside its step, the next forward's gather input written by the step, the step overlapping the
#: next forward, every unit's gathered parameters kept from its forward through its backward
#: (`reshard_after_forward=False`).
#: Megatron's precision-aware optimizer through FusedAdamW: `bf16m` bf16 moments, `fp8m` fp8 moments (e4m3 / e5m2, a
#: scale per 128 elements), `bf16g` gradients reduced and read in bf16.
VARIANT_PARTS = ("fused", "clip", "prestage", "overlap", "keep", "bf16m", "fp8m", "bf16g")
SINGLE_DEVICE_ENGINES = ("plain", "model")  # unsharded, on rank 0 alone


@dataclass(frozen=True)
class Layout:
    name: str
    instances: int
    inner_size: int
    outer: str
    inner: str

    @property
    def tag(self) -> str:
        return f"{self.name}:{self.instances}x{self.inner_size}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--simulate-world",
        type=int,
        default=0,
        help="run one process as rank --simulate-rank of a world of this size, on torch's fake process group "
        "(collectives move no data): per-rank memory of any layout on one device; step times then exclude "
        "communication and losses are meaningless",
    )
    p.add_argument("--simulate-rank", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt", help="megatron-core GPT or transformers Llama")
    p.add_argument("--kv-heads", type=int, default=None, help="llama: key/value heads (default: --heads)")
    p.add_argument("--ffn", type=int, default=None, help="llama: intermediate size (default: 8/3 hidden, to 256)")
    p.add_argument("--compile", action="store_true", help="torch.compile every unit (every engine alike)")
    p.add_argument(
        "--compile-style",
        choices=("module", "forward"),
        default="module",
        help="with --compile: unit.compile() (torchtitan's habit; default) or unit.forward = torch.compile(...) "
        "(what hfsdp train --compile does)",
    )
    p.add_argument("--optimizer", choices=("fused", "foreach"), default="fused", help="torch AdamW implementation")
    p.add_argument(
        "--liger",
        action="store_true",
        help="llama: Liger's Triton kernels (liger-kernel from the package registry) for every engine: RMSNorm, "
        "SwiGLU, RoPE, and the output projection fused with the cross-entropy (no logits tensor)",
    )
    p.add_argument(
        "--liger-without",
        default="",
        help="with --liger: Liger kernels to leave out, comma-separated from " + ", ".join(LIGER_KERNELS),
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="optimizer in host memory: hfsdp offload=True, FSDP2 CPUOffloadPolicy (parameters on the host too)",
    )
    p.add_argument(
        "--offload-fraction",
        default=None,
        help="hfsdp only: offload this fraction of the optimizer state (0..1), or 'auto' (what the GPU cannot hold)",
    )
    p.add_argument("--recompute", action="store_true", help="recompute every unit's activations in backward (both)")
    p.add_argument(
        "--build-on-device",
        action="store_true",
        help="initialise a Llama's weights on the device instead of the CPU (faster for large models; every engine "
        "of the run gets the same weights, but not those of a CPU-built run)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the GPU's datasheet dense peak in the run's dtype, the MFU denominator (default: from the table in "
        "_ceilings.py; H200 SXM bf16 989)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="CUDA: measure the copy bandwidth and report each hfsdp engine's cost against its bandwidth floor",
    )
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=None, help="default: micro-batch-size x dp (M = 1)")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps before the timed ones")
    p.add_argument(
        "--back-to-back",
        action="store_true",
        help="time the timed steps as one run, synchronised only at its two ends (each step's time: the run's over "
        "--steps), as a training loop that does not wait for the device between steps sees them; an optimizer "
        "step that overlaps the next forward (hfsdp+fused+prestage+overlap) shows its gain only so",
    )
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--engines", default="hfsdp,fsdp2", help=f"comma-separated, from {', '.join(ENGINES)}")
    p.add_argument("--layouts", default=None, help="comma-separated name:RxN (default zero3:1xWORLD)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--rounds", type=int, default=1, help="repeat every (layout, engine) run, alternating the order")
    p.add_argument("--loss-steps", type=int, default=3, help="first steps whose losses must agree between engines")
    p.add_argument(
        "--check-against",
        default=None,
        help="a JSON this script wrote for the same model, data and dtype: its reference row checks this run's "
        "losses too (for a run of one engine, e.g. FSDP2 alone at a size where both do not fit one process)",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    p.add_argument("--profile", action="store_true", help="profile --profile-steps extra steps per engine")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument(
        "--memory-trace",
        action="store_true",
        help="CUDA: after the timed steps, one more step recording allocated memory at every unit's forward and "
        "backward boundaries, and where the step's peak falls",
    )
    p.add_argument("--trace-dir", default=None, help="with --profile: write a chrome trace per engine and rank")
    p.add_argument(
        "--timers",
        choices=("auto", "on", "off"),
        default="auto",
        help="host timers around collectives and engine phases (auto: on for cpu, off for cuda, where they "
        "only see launch time; with --profile they are installed to annotate the trace either way)",
    )
    args = p.parse_args(argv)
    args.timing = args.timers == "on" or (args.timers == "auto" and args.device == "cpu")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.liger_without = tuple(k.strip() for k in args.liger_without.split(",") if k.strip())
    if set(args.liger_without) - set(LIGER_KERNELS):
        p.error(f"--liger-without: choose from {', '.join(LIGER_KERNELS)}, got {','.join(args.liger_without)}")
    if args.liger_without and not args.liger:
        p.error("--liger-without leaves kernels out of --liger; add --liger")
    unknown = [e for e in args.engines if e not in ENGINES and not _is_variant(e)]
    if unknown:
        p.error(
            f"--engines: unknown {unknown}; choose from {', '.join(ENGINES)}, or hfsdp variants "
            "hfsdp+fused, hfsdp+fused+clip, hfsdp+fused+clip+prestage[+overlap][+keep] (FusedAdamW; the clip in its "
            "step; the gather input written by it; the step overlapping the next forward; the units' parameters "
            "kept gathered through backward)"
        )
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        p.error(f"--peak-tflops must be a positive number of TFLOP/s, got {args.peak_tflops}")
    if args.offload_fraction is not None:
        try:
            args.offload_fraction = _offload_fraction(args.offload_fraction)
        except ValueError as err:
            p.error(f"--offload-fraction: {err}")
    if args.simulate_world and not 0 <= args.simulate_rank < args.simulate_world:
        p.error(f"--simulate-rank must be in 0..{args.simulate_world - 1}")
    return args


def _is_variant(name: str) -> bool:
    head, *parts = name.split("+")
    return (
        head == "hfsdp"
        and bool(parts)
        and parts[0] == "fused"
        and len(set(parts)) == len(parts)
        and all(x in VARIANT_PARTS for x in parts)
        and ("overlap" not in parts or "prestage" in parts)
        and not {"bf16m", "fp8m"} <= set(parts)
    )


def _offload_fraction(text: str):
    if text == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"must be a number from 0 to 1 or 'auto', got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"must be a number from 0 to 1 or 'auto', got {text!r}")
    return value


def parse_layouts(text: str | None, world: int) -> list[Layout]:
    text = text or f"zero3:1x{world}"
    layouts = []
    for item in text.split(","):
        name, _, shape = item.strip().partition(":")
        if name not in LAYOUTS:
            raise SystemExit(f"--layouts: '{name}' is not a layout name; use one of {', '.join(LAYOUTS)}")
        try:
            r, n = (int(x) for x in shape.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--layouts: '{item}' must look like name:RxN, e.g. hfsdp:2x2") from None
        if r * n != world:
            raise SystemExit(f"--layouts: '{item}' has {r}x{n} = {r * n} ranks but the world size is {world}")
        if name in ("zero3", "fsdp") and r != 1:
            raise SystemExit(f"--layouts: '{item}': {name} shards over every rank, so R must be 1 (use hsdp:RxN)")
        if name in ("hsdp", "hfsdp") and r == 1:
            raise SystemExit(f"--layouts: '{item}': {name} needs R > 1 instances (use zero3:1x{n})")
        layouts.append(Layout(name, r, n, *LAYOUTS[name]))
    return layouts


# -- device --------------------------------------------------------------------------------


def init_distributed(args) -> torch.device:
    if args.simulate_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("fake", store=FakeStore(), rank=args.simulate_rank, world_size=args.simulate_world)
        return device
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def gather_objects(obj, args) -> list:
    """Every rank's `obj`, in rank order; a simulated rank has only its own (the fake group moves no data)."""
    if args.simulate_world:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tensor_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        total += t.numel() * t.element_size()
    return total


# -- the model -----------------------------------------------------------------------------


def gpt_shape(args):
    from hfsdp.models.megatron.gpt import GPTShape

    return GPTShape(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        vocab_size=args.vocab,
        seq_length=args.seq_len,
    )


def llama_config(args):
    from transformers import LlamaConfig

    ffn = args.ffn or (8 * args.hidden // 3 + 255) // 256 * 256
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def build_model(cfg, shape, device: torch.device, init_groups: bool = True, on_device: bool = False):
    """The same model for every engine, seeded. GPT: megatron-core groups for `cfg` (collective; the plain
    engine, rank 0 alone, reuses the ones already built), re-initialised by name. A Llama is initialised on the
    CPU, or with `on_device` on the device itself (the weights then differ from a CPU-built model's, but are the
    same for every engine)."""
    if not hasattr(shape, "num_layers"):  # a transformers config
        from hfsdp.models import hf

        if on_device:
            return hf.build_causal_lm(shape, seed=SEED, device=device)
        return hf.build_causal_lm(shape, seed=SEED).to(device)
    from hfsdp.models.megatron.adapter import expert_naming_for, initialize_parallel
    from hfsdp.models.megatron.cpu_shim import seed_megatron
    from hfsdp.models.megatron.gpt import build_gpt, reinit_by_global_name

    if init_groups:
        initialize_parallel(cfg)
    seed_megatron(SEED)
    model = build_gpt(shape)
    reinit_by_global_name(model, expert_naming_for(cfg), SEED)
    return model.to(device)


def cast_parameters(model, dtype: torch.dtype | None) -> None:
    """The parameters alone into the compute dtype, as a mixed-precision engine computes with them: `model.to` would
    cast the buffers too, and a Llama's rotary inverse frequencies in bf16 move a 3B model's first loss by 2e-3."""
    if dtype is not None:
        for param in model.parameters():
            param.data = param.data.to(dtype)


def units_of(model) -> list:
    return list(model.model.layers) if hasattr(model, "model") else list(model.decoder.layers)


#: Set by --liger: the output projection and the loss are one Liger kernel, which never builds the logits.
FUSED_LINEAR_CROSS_ENTROPY = False


def loss_of(model, tokens, labels):
    if hasattr(getattr(model, "module", model), "model"):  # a transformers causal LM, sharded or not
        from hfsdp.models.hf import causal_lm_loss

        if FUSED_LINEAR_CROSS_ENTROPY:  # Liger's forward: `shift_labels` are the next tokens, as `labels` here
            return model(input_ids=tokens, shift_labels=labels, use_cache=False, skip_logits=True).loss
        return causal_lm_loss(model, tokens, labels)
    from hfsdp.models.megatron.gpt import lm_loss

    return lm_loss(model, tokens, labels)


#: Liger's kernels --liger applies (and --liger-without may leave out); flce: the output projection fused with the loss.
LIGER_KERNELS = ("rope", "rms_norm", "swiglu", "flce")


def apply_liger(without: tuple[str, ...] = ()) -> None:
    """Patch transformers' Llama with Liger's kernels, before any model is built (the classes change)."""
    global FUSED_LINEAR_CROSS_ENTROPY
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    kept = {k: k not in without for k in LIGER_KERNELS}
    apply_liger_kernel_to_llama(rope=kept["rope"], rms_norm=kept["rms_norm"], swiglu=kept["swiglu"],
                                cross_entropy=False, fused_linear_cross_entropy=kept["flce"])  # fmt: skip
    FUSED_LINEAR_CROSS_ENTROPY = kept["flce"]


def maybe_compile(args, model) -> None:
    """torch.compile and/or activation recomputation of every unit, as the flags ask (both engines alike)."""
    from hfsdp.core.engine.unit_forward import compile_units, recompute

    if args.compile and args.compile_style == "forward":
        compile_units(units_of(model))
    elif args.compile:
        for unit in units_of(model):
            unit.compile()
    if args.recompute:
        recompute(units_of(model))


def adamw(args, params):
    kind = {"fused": True} if args.optimizer == "fused" else {"foreach": True}
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, **kind)


def flops_per_token(model, shape) -> tuple[int, float]:
    """(parameter count, training FLOPs per token): 6 x matmul weights + 12 x layers x hidden x seq (attention)."""
    total = sum(p.numel() for p in model.parameters())
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n)
    layers = getattr(shape, "num_layers", None) or shape.num_hidden_layers
    seq = getattr(shape, "seq_length", None) or shape.max_position_embeddings
    return total, 6.0 * matmul + 12.0 * layers * shape.hidden_size * seq


# -- engines -------------------------------------------------------------------------------


class Engine:
    """One engine's model and optimizer; `train_step` runs one optimizer step."""

    kind = ""

    def __init__(self, args, timers: CallTimers, compute_dtype: torch.dtype | None):
        self.args, self.timers, self.compute_dtype = args, timers, compute_dtype
        self.state_bytes_measured: int | None = None

    def microbatch(self, index: int, count: int, tokens, labels) -> torch.Tensor:
        raise NotImplementedError

    def clip(self) -> None:
        raise NotImplementedError

    def optimizer_step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def state_bytes(self) -> int:
        raise NotImplementedError

    def train_step(self, microbatches, measure_state: bool = False) -> torch.Tensor:
        count = len(microbatches)
        total = None
        with self.timers.section("phase:forward+backward", family="step"):
            for index, (tokens, labels) in enumerate(microbatches):
                loss = self.microbatch(index, count, tokens, labels)
                total = loss if total is None else total + loss
        if self.args.clip_grad:
            with self.timers.section("phase:clip", family="step"):
                self.clip()
        with self.timers.section("phase:optimizer", family="step"):
            self.optimizer_step()
        if measure_state:
            self.state_bytes_measured = self.state_bytes()
        with self.timers.section("phase:zero_grad", family="step"):
            self.zero_grad()
        return total / count


def _offloaded_fraction(sharding) -> float:
    total = sum(g.main.numel() for g in sharding.groups)
    return sum(g.main.numel() for g in sharding.groups if g.offload) / max(total, 1)


class HfsdpEngine(Engine):
    kind = "hfsdp"

    def __init__(self, args, timers, compute_dtype, cfg, shape, device, variant: str | None = None):
        super().__init__(args, timers, compute_dtype)
        from hfsdp.core import MixedPrecision, build_meshes, fully_shard, sharding_of
        from hfsdp.models.megatron.adapter import shard_megatron_model

        model = build_model(cfg, shape, device, on_device=args.build_on_device)
        self.params, self.flops_per_token = flops_per_token(model, shape)
        maybe_compile(args, model)
        grads = torch.bfloat16 if "bf16g" in (variant or "") else torch.float32
        mp = MixedPrecision(param_dtype=compute_dtype, reduce_dtype=grads)
        offload = args.offload or (args.offload_fraction if args.offload_fraction is not None else False)
        # Like FSDP2 below, given reshard_after_forward=True for the root too (as torchtitan does).
        keep = variant is not None and "+keep" in variant  # every unit's gather held through its backward
        reshard_root = cfg.inner == "optim_grads_params" and not keep
        if args.model == "gpt":
            self.model = shard_megatron_model(
                model, cfg, device.type, mp, offload=offload, reshard_after_forward=not keep,
                reshard_root_after_forward=reshard_root,
            )  # fmt: skip
        else:
            meshes = build_meshes(cfg, device.type)
            self.model = fully_shard(
                model,
                cfg,
                meshes,
                units=units_of(model),
                mp=mp,
                offload=offload,
                reshard_after_forward=not keep,
                reshard_root_after_forward=reshard_root,
            )
        self.sharding = sharding_of(self.model)
        self.variant = set(variant.split("+")[1:]) if variant else set()
        self.kind = variant or "hfsdp"
        if "fused" in self.variant:
            from hfsdp.core import FusedAdamW

            moments = "fp8" if "fp8m" in self.variant else "bf16" if "bf16m" in self.variant else "fp32"

            self.opt = FusedAdamW(
                self.model.parameters(),
                lr=args.lr,
                weight_decay=args.weight_decay,
                max_grad_norm=args.clip_grad if "clip" in self.variant and args.clip_grad else None,
                prestage_gathers="prestage" in self.variant,
                overlap_next_forward="overlap" in self.variant,
                exp_avg_dtype=moments,
                exp_avg_sq_dtype=moments,
            )
        else:
            self.opt = adamw(args, self.model.parameters())
        self.label = cfg.layout_name + (f" + {'+'.join(sorted(self.variant))}" if self.variant else "")
        self.offloaded_fraction = _offloaded_fraction(self.sharding)
        if self.offloaded_fraction:
            self.label += f", {100 * self.offloaded_fraction:.0f}% of the optimizer state offloaded"
        self.mesh = tuple(self.sharding.meshes.dense.mesh_dim_names)
        count = cfg.num_microbatches
        clip = bool(args.clip_grad)
        self.bytes_moved = dict(step_bytes(self.sharding, self.variant, count, clip, cfg.dp))
        self.bytes_floor = dict(floor_bytes(self.sharding, count, clip))

    def microbatch(self, index, count, tokens, labels):
        self.model.set_microbatch(index, count)
        loss = loss_of(self.model, tokens, labels)
        loss.backward()
        return loss.detach()

    def clip(self):
        from hfsdp.core import clip_grad_norm_

        if "clip" not in self.variant:  # else FusedAdamW clips inside its step
            clip_grad_norm_(self.model, self.args.clip_grad)

    def optimizer_step(self):
        self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad()

    def state_bytes(self):
        state = [t for s in self.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return self.sharding.state_bytes() + tensor_bytes(state)


class TorchOptimizerEngine(Engine):
    """An engine whose model is a plain module and whose optimizer is torch.optim's (FSDP2 and plain)."""

    def clip(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip_grad, foreach=True)

    def optimizer_step(self):
        self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def state_bytes(self):
        params = list(self.model.parameters())
        state = [t for s in self.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return tensor_bytes(params) + tensor_bytes(p.grad for p in params) + tensor_bytes(state)


def device_mesh_of(layout: Layout, device: torch.device, tensor_parallel_axis: bool = False):
    """("dp_outer", "dp_shard") for R > 1, ("dp_shard",) for R = 1: the mesh FSDP2 and Megatron-FSDP run on. With
    `tensor_parallel_axis` a trailing ("tp",) of size 1, which Megatron-FSDP v1 requires even without TP."""
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = (layout.inner_size,), ("dp_shard",)
    if layout.instances > 1:
        shape, names = (layout.instances, *shape), ("dp_outer", *names)
    if tensor_parallel_axis:
        shape, names = (*shape, 1), (*names, "tp")
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


class Fsdp2Engine(TorchOptimizerEngine):
    kind = "fsdp2"

    def __init__(self, args, timers, compute_dtype, cfg, shape, device, layout: Layout):
        super().__init__(args, timers, compute_dtype)
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        model = build_model(cfg, shape, device, on_device=args.build_on_device)
        self.params, self.flops_per_token = flops_per_token(model, shape)
        mesh = device_mesh_of(layout, device)
        self.hybrid = layout.instances > 1
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        reshard = layout.inner == "optim_grads_params"
        maybe_compile(args, model)
        options = {"offload_policy": CPUOffloadPolicy()} if args.offload else {}
        for block in units_of(model):
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, **options)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, **options)
        self.model = model
        self.opt = adamw(args, model.parameters())
        kind = "FULL_SHARD" if reshard else "SHARD_GRAD_OP"
        size = f"{layout.instances}x{layout.inner_size}"
        self.label = f"FSDP2 HSDP {size} ({kind} in rows)" if self.hybrid else f"FSDP2 {kind} {size}"
        if layout.outer == "optim":
            self.label += "; FSDP2 has no HFSDP"
        self.mesh = tuple(mesh.mesh_dim_names)

    def microbatch(self, index, count, tokens, labels):
        if self.hybrid and count > 1:
            self.model.set_requires_all_reduce(index == count - 1)
        loss = loss_of(self.model, tokens, labels)
        (loss / count).backward()
        return loss.detach()


class MegatronFsdpEngine(TorchOptimizerEngine):
    """Megatron-FSDP v1 (`mfsdp`) or its experimental v2 (`mfsdp2`): `_megatron_fsdp.py` says how each is set up."""

    def __init__(self, args, timers, compute_dtype, cfg, shape, device, layout: Layout, kind: str):
        super().__init__(args, timers, compute_dtype)
        import _megatron_fsdp as mf

        if args.offload:
            raise ValueError("--offload: Megatron-FSDP has no optimizer offload; leave mfsdp out of --engines")
        self.kind = kind
        model = build_model(cfg, shape, device, on_device=args.build_on_device)
        self.params, self.flops_per_token = flops_per_token(model, shape)
        cast_parameters(model, compute_dtype)  # Megatron-FSDP computes in the model's dtype, fp32 main weights beside
        maybe_compile(args, model)
        mesh = device_mesh_of(layout, device, tensor_parallel_axis=kind == "mfsdp")
        units = units_of(model)
        if kind == "mfsdp":
            self.model, self.opt = mf.shard_v1(model, type(units[0]), layout, mesh, device, args.lr, args.weight_decay)
            self.accumulate = mf.accumulation_context_v1
            name = "Megatron-FSDP"
        else:
            self.model, self.opt = mf.shard_v2(model, units, layout, mesh, device, args.lr, args.weight_decay)
            self.accumulate = mf.accumulation_context_v2
            name = "Megatron-FSDP v2 (experimental)"
        self.grads_synced = False
        strategies = layout.inner if layout.instances == 1 else f"{layout.outer} over {layout.inner}"
        self.label = f"{name} {layout.instances}x{layout.inner_size} ({strategies})"
        self.mesh = tuple(n for n in mesh.mesh_dim_names if n != "tp")

    def microbatch(self, index, count, tokens, labels):
        with self.accumulate(self.model, index, count):
            loss = loss_of(self.model, tokens, labels)
            (loss / count).backward()
        return loss.detach()

    def clip(self):
        if self.kind == "mfsdp":  # v1 attaches the reduced gradients to its parameters only here
            self.model.finish_grad_sync()
            self.grads_synced = True
        super().clip()

    def optimizer_step(self):
        if self.kind == "mfsdp":
            self.opt.step(sync_grad_before_optimizer_step=not self.grads_synced)
            self.grads_synced = False
        else:
            self.opt.step()


class PlainEngine(TorchOptimizerEngine):
    kind = "plain"

    def __init__(self, args, timers, compute_dtype, cfg, shape, device):
        super().__init__(args, timers, compute_dtype)
        self.model = build_model(cfg, shape, device, init_groups=False, on_device=args.build_on_device)
        self.params, self.flops_per_token = flops_per_token(self.model, shape)
        maybe_compile(args, self.model)
        self.opt = adamw(args, self.model.parameters())
        self.autocast = device.type == "cuda" and compute_dtype == torch.bfloat16
        self.device_type = device.type
        what = "fp32 params, autocast bf16" if self.autocast else "fp32"
        self.label = f"plain 1 rank, unsharded ({what})"
        self.mesh = ()

    def microbatch(self, index, count, tokens, labels):
        ctx = torch.autocast(self.device_type, dtype=torch.bfloat16) if self.autocast else nullcontext()
        with ctx:
            loss = loss_of(self.model, tokens, labels)
        (loss / count).backward()
        return loss.detach()


class ModelOnlyEngine(TorchOptimizerEngine):
    """The model alone in the compute dtype: forward and backward, gradients dropped, no optimizer.

    No engine's step can be faster than this: it is the model's own compute. The
    difference between an engine's step and it is everything the engine adds
    (casts, gradient copies, collectives, clipping, the optimizer step).
    """

    kind = "model"

    def __init__(self, args, timers, compute_dtype, cfg, shape, device):
        super().__init__(args, timers, compute_dtype)
        self.model = build_model(cfg, shape, device, init_groups=False, on_device=args.build_on_device)
        self.params, self.flops_per_token = flops_per_token(self.model, shape)
        cast_parameters(self.model, compute_dtype)
        maybe_compile(args, self.model)
        self.opt = None
        dtype = str(compute_dtype or torch.float32).removeprefix("torch.")
        self.label = f"model alone, {dtype} weights: forward + backward, no optimizer (the floor)"
        self.mesh = ()

    def microbatch(self, index, count, tokens, labels):
        loss = loss_of(self.model, tokens, labels)
        (loss / count).backward()
        return loss.detach().float()

    def clip(self):
        pass

    def optimizer_step(self):
        pass

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)

    def state_bytes(self):
        params = list(self.model.parameters())
        return tensor_bytes(params) + tensor_bytes(p.grad for p in params)


def install_phase_timers(timers: CallTimers) -> None:
    """Inclusive host time of each engine's phases (labels 'hfsdp:...' and 'fsdp2:...')."""
    from hfsdp.core.buffers.flat_group import FlatParamGroup
    from hfsdp.core.buffers.grad_buffer import GradBuffer
    from hfsdp.core.engine.unit import ShardedUnit

    try:  # FSDP2's private module; its path and method names may move between torch versions
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        FSDPParamGroup = None

    timers.wrap(FlatParamGroup, "start_unshard", "hfsdp::start_unshard (all-gather)")
    timers.wrap(GradBuffer, "accumulate", "hfsdp::accumulate grads (copy-in, reductions)")
    timers.wrap(FlatParamGroup, "publish_main_weights", "hfsdp::publish_main_weights (cast, gather)")
    timers.wrap(ShardedUnit, "pre_forward", "hfsdp::pre_forward hook", family="hfsdp-hook")
    timers.wrap(ShardedUnit, "post_forward", "hfsdp::post_forward hook", family="hfsdp-hook")
    if FSDPParamGroup is None:
        return
    timers.wrap(FSDPParamGroup, "unshard", "FSDP::unshard (copy-in, all-gather)")
    timers.wrap(FSDPParamGroup, "wait_for_unshard", "FSDP::wait_for_unshard (copy-out)")
    timers.wrap(FSDPParamGroup, "post_backward", "FSDP::post_backward (copy-in, reduce-scatter)")
    timers.wrap(FSDPParamGroup, "finalize_backward", "FSDP::finalize_backward")
    timers.wrap(FSDPParamGroup, "pre_forward", "FSDP::pre_forward hook", family="fsdp-hook")
    timers.wrap(FSDPParamGroup, "post_forward", "FSDP::post_forward hook", family="fsdp-hook")


# -- running one engine --------------------------------------------------------------------


def make_batches(shape, count_steps, gbs, microbatches, rank, dp, device):
    """Every step's microbatches for this rank, on the device (built before timing)."""
    from hfsdp.recipes.data import SyntheticTokens, microbatch

    seq = getattr(shape, "seq_length", None) or shape.max_position_embeddings
    data = SyntheticTokens(shape.vocab_size, seq, seed=SEED)
    out = []
    for step in range(count_steps):
        batch = data.global_batch(step, gbs)
        out.append(
            [tuple(t.to(device) for t in microbatch(batch, i, microbatches, rank, dp)) for i in range(microbatches)]
        )
    return out


def run_engine(
    engine_factory, batches, args, device, timers: CallTimers, dp: int, group_size: int, profile: bool
) -> dict:
    """Build, warm up, time, optionally profile one engine; return this rank's measurements."""
    free_memory(device)
    rss_before = max_rss_mib()
    began_setup = time.perf_counter()
    engine = engine_factory()
    sync(device)
    setup_s = time.perf_counter() - began_setup
    allocated_after_setup = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times, comm_times, cpu_times = [], [], [], []
    timers.reset()
    total_steps = args.warmup + args.steps
    run_began = None
    for step in range(total_steps):
        timers.enabled = step >= args.warmup and args.timing
        between = args.back_to_back and step > args.warmup  # no synchronisation between two timed steps
        if not between:
            sync(device)
        comm_before = timers.total("comm::")
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        if step == args.warmup:
            run_began = t0
        loss = engine.train_step(batches[step], measure_state=(step == 0))
        cpu = time.process_time() - cpu0  # before the sync: CUDA's synchronize spins, which is no work
        if not args.back_to_back or step < args.warmup or step == total_steps - 1:
            sync(device)
        elapsed = time.perf_counter() - t0
        losses.append(loss)
        if step >= args.warmup:
            times.append(elapsed)
            comm_times.append(timers.total("comm::") - comm_before)
            cpu_times.append(cpu)
    if args.back_to_back and times:
        times = [(time.perf_counter() - run_began) / len(times)] * len(times)
    timers.enabled = False
    timer_totals = timers.snapshot()
    peak_allocated = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None

    summary = profile_engine(engine, batches[total_steps:], args, device) if profile else None
    memory_trace = None
    if args.memory_trace and device.type == "cuda":
        try:
            memory_trace = trace_memory(engine, batches[-1], device)
        except Exception as err:  # a diagnostic must not lose the timings
            memory_trace = [(f"failed: {type(err).__name__}: {err}", 0.0, 0.0)]

    stacked = torch.stack(losses).float()
    if group_size > 1:
        dist.all_reduce(stacked, group=None)
    stacked = (stacked / dp).tolist()
    microbatch_tokens = sum(t.numel() for t, _ in batches[0])
    median = statistics.median(times)
    steps = max(len(times), 1)
    result = {
        "engine": engine.kind,
        "label": engine.label,
        "mesh": list(engine.mesh),
        "setup_s": setup_s,
        "step_times_s": times,
        "median_step_s": median,
        "tokens_per_step_per_rank": microbatch_tokens,
        "tokens_per_s_per_rank": microbatch_tokens / median,
        "losses": stacked,
        "params": engine.params,
        "flops_per_token": engine.flops_per_token,
        "bytes_moved": getattr(engine, "bytes_moved", None),
        "bytes_floor": getattr(engine, "bytes_floor", None),
        "offloaded_fraction": getattr(engine, "offloaded_fraction", None),
        "model_state_bytes": engine.state_bytes_measured,
        "max_rss_mib": max_rss_mib(),
        "max_rss_mib_before": rss_before,
        "cuda_allocated_after_setup_bytes": allocated_after_setup,
        "cuda_peak_allocated_bytes": peak_allocated,
        "comm_blocked_s_per_step": statistics.median(comm_times),
        "comm_blocked_s": comm_times,
        "cpu_s_per_step": statistics.median(cpu_times),
        "cpu_s": cpu_times,
        "timers_s_per_step": {k: v["seconds"] / steps for k, v in timer_totals.items()},
        "timers_cpu_s_per_step": {k: v["cpu_seconds"] / steps for k, v in timer_totals.items()},
        "timer_calls_per_step": {k: v["calls"] / steps for k, v in timer_totals.items()},
        "profile": summary,
        "memory_trace": memory_trace,
    }
    del engine
    free_memory(device)
    return result


def trace_memory(engine, microbatches, device) -> list[tuple[str, float, float]]:
    """One step with a mark at every unit's forward and backward boundaries: (mark, allocated MiB, peak MiB since
    the previous mark). Shows which phase holds a step's peak and how much each engine holds there."""
    model = engine.model.module if engine.kind == "hfsdp" else engine.model
    marks: list[tuple[str, float, float]] = []

    def mark(label):
        marks.append(
            (label, torch.cuda.memory_allocated(device) / 2**20, torch.cuda.max_memory_allocated(device) / 2**20)
        )
        torch.cuda.reset_peak_memory_stats(device)

    handles = []
    for i, unit in enumerate(units_of(model)):
        handles.append(unit.register_forward_pre_hook(lambda *_, i=i: mark(f"fwd {i} start")))
        handles.append(unit.register_full_backward_pre_hook(lambda *_, i=i: mark(f"bwd {i} start")))
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        engine.train_step(microbatches)
        torch.cuda.synchronize(device)
        mark("step end")
    finally:
        for handle in handles:
            handle.remove()
    return marks


def profile_engine(engine, batches, args, device) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    engine.timers.annotating = True
    try:
        with profile(activities=activities, profile_memory=True) as prof:
            for microbatches in batches:
                sync(device)
                with record_function(STEP_LABEL):
                    engine.train_step(microbatches)
                    sync(device)
    finally:
        engine.timers.annotating = False
    try:
        summary = summarize_profile(prof, device.type)
        summary["top_self_cpu_ops_s"] = top_ops(prof)
    except Exception as err:  # a profiler API that differs between torch versions must not lose the timings
        summary = {"error": f"{type(err).__name__}: {err}"}
        print(f"rank {dist.get_rank()}: could not summarize the profile of {engine.kind}: {summary['error']}")
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        tag = "".join(c if c.isalnum() else "_" for c in engine.label)[:48]
        prof.export_chrome_trace(os.path.join(args.trace_dir, f"{engine.kind}-{tag}-rank{dist.get_rank()}.json"))
    return summary


# -- reporting -----------------------------------------------------------------------------


def merge_ranks(per_rank: list[dict]) -> dict:
    """One row from every rank's result: slowest median step, largest memory, rank 0's losses."""
    first = dict(per_rank[0])

    def biggest(key):
        values = [r[key] for r in per_rank if r.get(key) is not None]
        return max(values) if values else None

    first["median_step_s"] = biggest("median_step_s")
    first["min_step_s"] = max(min(r["step_times_s"]) for r in per_rank)
    first["tokens_per_s_per_rank"] = first["tokens_per_step_per_rank"] / first["median_step_s"]
    for key in ("model_state_bytes", "max_rss_mib", "cuda_peak_allocated_bytes", "comm_blocked_s_per_step"):
        first[key] = biggest(key)
    first["cpu_s_per_step"] = statistics.mean(r["cpu_s_per_step"] for r in per_rank)
    first["per_rank"] = [
        {k: r[k] for k in ("median_step_s", "step_times_s", "model_state_bytes", "max_rss_mib")}
        | {"cuda_peak_allocated_bytes": r["cuda_peak_allocated_bytes"]}
        | {k: r[k] for k in ("comm_blocked_s_per_step", "comm_blocked_s", "cpu_s_per_step", "cpu_s")}
        | {k: r[k] for k in ("timers_s_per_step", "timers_cpu_s_per_step")}
        for r in per_rank
    ]
    return first


def combine_rounds(rows: list[dict]) -> dict:
    """One row from the rounds of one (layout, engine): every rank's step times pooled, its median, the
    slowest rank's median; the largest memory; host timers averaged; losses and profile of round 0."""
    first = dict(rows[0])
    ranks = len(first["per_rank"])
    pooled = [[t for row in rows for t in row["per_rank"][r]["step_times_s"]] for r in range(ranks)]
    first["median_step_s"] = max(statistics.median(times) for times in pooled)
    first["min_step_s"] = max(min(times) for times in pooled)
    first["round_median_step_s"] = [row["median_step_s"] for row in rows]
    first["tokens_per_s_per_rank"] = first["tokens_per_step_per_rank"] / first["median_step_s"]
    for key in ("model_state_bytes", "max_rss_mib", "cuda_peak_allocated_bytes"):
        values = [row[key] for row in rows if row.get(key) is not None]
        first[key] = max(values) if values else None
    comm = [[t for row in rows for t in row["per_rank"][r]["comm_blocked_s"]] for r in range(ranks)]
    first["comm_blocked_s_per_step"] = max(statistics.median(times) for times in comm)
    cpu = [[t for row in rows for t in row["per_rank"][r]["cpu_s"]] for r in range(ranks)]
    first["cpu_s_per_step"] = statistics.mean(statistics.median(times) for times in cpu)
    for r in range(ranks):
        keys = {k for row in rows for k in row["per_rank"][r]["timers_s_per_step"]}
        first["per_rank"][r] = dict(first["per_rank"][r]) | {
            "step_times_s": pooled[r],
            "comm_blocked_s": comm[r],
            "cpu_s": cpu[r],
            "timers_s_per_step": {
                k: statistics.mean(row["per_rank"][r]["timers_s_per_step"].get(k, 0.0) for row in rows) for k in keys
            },
            "timers_cpu_s_per_step": {
                k: statistics.mean(row["per_rank"][r]["timers_cpu_s_per_step"].get(k, 0.0) for row in rows)
                for k in keys
            },
        }
    first["rounds"] = len(rows)
    first["loss_drift_between_rounds"] = max(
        (abs(a - b) for row in rows[1:] for a, b in zip(row["losses"], first["losses"], strict=True)), default=0.0
    )
    return first


#: Relative loss agreement over the first --loss-steps steps, by dtype. In bf16 the engines differ by the order of
#: a few sums (the clip's norm, FSDP2's microbatch scaling, autocast in `plain`) and flash attention's backward
#: sums with atomics: measured 0.9e-4 to 1.5e-4 on one and two H200s (docs/results/h200-2026-11-30-*). The defect
#: the GPU correctness script found (a compiled unit's hooks traced into its graph) moved step 2 by 6e-4 to 1.2e-3.
LOSS_RTOL = {"fp32": 1e-5, "bf16": 5e-4}


def loss_reference(results: list[dict]) -> dict | None:
    """The row others are checked against: the unsharded `plain` engine where it ran, else FSDP2's first row, else
    hfsdp's first (every layout trains the same model on the same global batch)."""
    for kind in ("plain", "fsdp2", "hfsdp"):
        found = next((r for r in results if r["engine"] == kind), None)
        if found is not None:
            return found
    return next((r for r in results if r["engine"] != "model"), None)


def loss_checks(results: list[dict], args, world: int) -> list[dict]:
    """Every row against a reference row on the first --loss-steps losses: a row whose losses are wrong is a
    failure, however fast. At world size 1 every row has the same data; above it the unsharded engines (`plain`,
    `model`) train rank 0's share, so they are checked against each other and the sharded rows among themselves.
    The `model` engine (no optimizer) is checked on its first step, where it computes with the same bf16 weights."""
    single = [r for r in results if r["engine"] in SINGLE_DEVICE_ENGINES]
    families = [results] if world == 1 else [[r for r in results if r not in single], single]
    earlier = _earlier_reference(args)
    checks = []
    for rows in families:
        ref = earlier if earlier is not None and rows is not single else loss_reference(rows)
        checks += [_loss_check(ref, other, args) for other in rows if ref is not None and other is not ref]
    return checks


def _earlier_reference(args) -> dict | None:
    """The reference row of `--check-against`'s run (its layout tag marked as coming from that file)."""
    if not args.check_against:
        return None
    with open(args.check_against) as f:
        earlier = json.load(f)
    ref = loss_reference([r for r in earlier["results"] if r["engine"] not in SINGLE_DEVICE_ENGINES])
    if ref is None:
        raise SystemExit(f"--check-against {args.check_against}: that run has no sharded row to check against")
    return dict(ref, layout=f"{ref['layout']} of {os.path.basename(args.check_against)}")


def _loss_check(ref: dict, other: dict, args) -> dict:
    rtol = LOSS_RTOL[args.dtype]
    steps = 1 if other["engine"] == "model" else args.loss_steps
    a, b = ref["losses"][:steps], other["losses"][:steps]
    rel = max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=False)), default=math.inf)
    pairs = list(zip(ref["losses"], other["losses"], strict=False))[: max(steps, len(other["losses"]))]
    rel_all = max(abs(x - y) / max(abs(x), 1e-12) for x, y in pairs) if steps > 1 else rel
    return {
        "layout": other["layout"],
        "engine": other["engine"],
        "pair": f"{other['engine']} vs {ref['engine']} {ref['layout']}",
        "hfsdp": b,  # the checked row's losses (the key is kept for the reports that read it)
        "reference": a,
        "steps_checked": steps,
        "max_rel_diff_first_steps": rel,
        "max_rel_diff_all_steps": rel_all,
        "rtol": rtol,
        "ok": rel <= rtol and math.isfinite(rel),
    }


def floor_report(results: list[dict], meta: dict) -> list[str]:
    """Each engine's cost over the model alone against the bandwidth floor of its layout (`_floor.py`)."""
    bw = meta["copy_bandwidth"]["bytes_per_s"]
    model = next((r for r in results if r["engine"] == "model"), None)
    header = ["engine", "step (s)", "cost over the model alone (ms)", "bytes its kernels move (GB)"]
    header += ["at copy rate (ms)", "floor bytes (GB)", "floor (ms)", "cost / floor", "peak alloc MiB"]
    rows = []
    for r in results:
        if r["engine"] == "model":
            continue
        cost = (r["median_step_s"] - model["median_step_s"]) if model else None
        moved, floor = r.get("bytes_moved"), r.get("bytes_floor")
        moved_b = sum(moved.values()) if moved else None
        floor_b = sum(floor.values()) if floor else None
        r["cost_s"], r["floor_s"] = cost, floor_b / bw if floor_b else None
        row = [r["engine"], r["median_step_s"], f"{cost * 1e3:.1f}" if cost is not None else "n/a"]
        row += [f"{moved_b / 1e9:.1f}" if moved_b else "n/a", f"{moved_b / bw * 1e3:.1f}" if moved_b else "n/a"]
        row += [f"{floor_b / 1e9:.1f}" if floor_b else "n/a", f"{floor_b / bw * 1e3:.1f}" if floor_b else "n/a"]
        row += [f"{cost / (floor_b / bw):.2f}x" if cost is not None and floor_b else "n/a"]
        row += [r["cuda_peak_allocated_bytes"] / 2**20 if r.get("cuda_peak_allocated_bytes") else "n/a"]
        rows.append(row)
    lines = [
        f"## The engine's cost against its bandwidth floor (copy bandwidth measured here: {bw / 1e12:.2f} TB/s)",
        "",
        markdown_table(header, rows),
        "",
    ]
    for r in results:
        if r.get("bytes_moved"):
            kinds = sorted(set(r["bytes_moved"]) | set(r["bytes_floor"]))
            moved, floor = r["bytes_moved"], r["bytes_floor"]
            parts = ", ".join(f"{k} {moved.get(k, 0) / 1e9:.2f}/{floor.get(k, 0) / 1e9:.2f}" for k in kinds)
            lines.append(f"- {r['engine']}: GB moved/floor by kind: {parts}")
    return [*lines, ""]


def report(results: list[dict], checks: list[dict], args, meta: dict) -> str:
    cuda = args.device == "cuda"
    header = ["engine", "layout", "median step (s)", "min step (s)", "tokens/s/rank", "model state MiB/rank"]
    header += ["peak alloc MiB/rank"] if cuda else ["max RSS MiB/rank"]
    header += ["comm blocked s/step (host, median)", "comm blocked % of step", "CPU s/step/rank"]
    if cuda:
        peak = meta.get("peak_tflops")
        header += [f"MFU (of {peak:.0f} TFLOP/s datasheet peak)" if peak else "MFU (no datasheet peak known)"]
        header += ["of achievable (measured matmul rate)"]
    header += ["losses (checked in this run)"]
    verdict = {(c["layout"], c["engine"]): "ok" if c["ok"] else "**WRONG: not a result**" for c in checks}
    rows = []
    for r in results:
        state = r["model_state_bytes"] / 2**20 if r["model_state_bytes"] is not None else "n/a"
        mem = r["cuda_peak_allocated_bytes"] / 2**20 if cuda else r["max_rss_mib"]
        comm = r["comm_blocked_s_per_step"]
        row = [r["engine"], f"{r['layout']} — {r['label']}", r["median_step_s"], r["min_step_s"]]
        row += [r["tokens_per_s_per_rank"], state]
        row += [mem, comm, f"{100 * comm / r['median_step_s']:.1f}%"] if args.timing else [mem, "n/a", "n/a"]
        row += [r["cpu_s_per_step"]]
        if cuda:
            rate = meta.get("matmul_tflops_per_rank", [None])[0]
            achieved = r["flops_per_token"] * r["tokens_per_s_per_rank"]
            r["mfu"] = achieved / (peak * 1e12) if peak else None
            r["mfu_of_achievable"] = achieved / (rate * 1e12) if rate else None
            row += [f"{100 * r['mfu']:.1f}%" if peak else "n/a"]
            row += [f"{100 * r['mfu_of_achievable']:.1f}% of {rate:.0f}" if rate else "n/a"]
        unchecked = "unchecked (simulated)" if args.simulate_world else "reference" if checks else "unchecked (one row)"
        row += [verdict.get((r["layout"], r["engine"]), unchecked)]
        rows.append(row)
    lines = ["", "## Step time", "", markdown_table(header, rows), ""]
    if meta.get("copy_bandwidth"):
        lines += floor_report(results, meta)
    if args.simulate_world:
        lines[3:3] = [
            f"Simulated: rank {args.simulate_rank} of {args.simulate_world} on the fake process group. Memory is "
            "the real rank's; step times leave out all communication; losses are meaningless.",
            "",
        ]

    phase_keys = sorted({k for r in results for k in r["timers_s_per_step"]})
    if phase_keys:
        lines += ["## Host time per step by phase, wall / CPU (ms, inclusive, mean over ranks and steps)", ""]
        cols = [f"{r['engine']} {r['layout']}" for r in results]

        def cell(r, k):
            ranks = r["per_rank"]
            if all(k not in p["timers_s_per_step"] for p in ranks):
                return ""
            wall = statistics.mean(p["timers_s_per_step"].get(k, 0.0) for p in ranks)
            cpu = statistics.mean(p["timers_cpu_s_per_step"].get(k, 0.0) for p in ranks)
            return f"{1e3 * wall:.1f} / {1e3 * cpu:.1f}"

        prow = [[k] + [cell(r, k) for r in results] for k in phase_keys]
        lines += [markdown_table(["phase", *cols], prow), ""]

    profiled = [r for r in results if r.get("profile") and "error" not in r["profile"]]
    if profiled:
        keys = ["step_s", "compute_s", "copy_s", "comm_s", "comm_exposed_s"]
        keys += ["idle_s"] if cuda else ["python_and_hooks_s"]
        keys += ["peak_step_alloc_mib"]
        lines += [f"## Profile, s per step (rank 0; {profiled[0]['profile']['source']})", ""]
        prow = [[r["engine"], r["layout"]] + [r["profile"][k] for k in keys] for r in profiled]
        lines += [markdown_table(["engine", "layout", *keys], prow), ""]
        for r in profiled:
            ranges = ", ".join(f"{k} {v:.4f}" for k, v in list(r["profile"]["annotated_ranges_s"].items())[:8])
            ops = ", ".join(f"{k} {v:.3f}" for k, v in r["profile"]["top_self_cpu_ops_s"][:8])
            lines += [
                f"- {r['engine']} {r['layout']}: annotated ranges s/step: {ranges}",
                f"  top self-CPU ops (s total): {ops}",
            ]
            idle = r["profile"].get("idle_by_host_activity_s", [])[:8]
            if idle:
                lines += ["  GPU idle s/step, by what the host was doing (phase | engine range | op): "]
                lines += [f"    {t:.4f} {k}" for k, t in idle]
        lines += [""]

    if checks:
        lines += ["## Loss agreement (same init, same data)", ""]
        crow = []
        for c in checks:
            flag = "ok" if c["ok"] else "**MISMATCH**"
            crow.append(
                [
                    c["layout"],
                    c["pair"],
                    " ".join(f"{x:.6f}" for x in c["hfsdp"]),
                    " ".join(f"{x:.6f}" for x in c["reference"]),
                    f"{c['max_rel_diff_first_steps']:.2e}",
                    f"{c['max_rel_diff_all_steps']:.2e}",
                    c["rtol"],
                    flag,
                ]
            )
        header = ["layout", "pair", "row's losses", "reference losses", "max rel diff (first)", "(all steps)"]
        header += ["rtol", ""]
        lines += [markdown_table(header, crow), ""]
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    args = parse_args(argv)
    device = init_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        return _main(args, device, rank, world)
    finally:
        dist.destroy_process_group()


def _main(args, device, rank, world) -> int:
    from hfsdp.core.rules.config import LayoutConfig

    layouts = parse_layouts(args.layouts, world)
    compute_dtype = torch.bfloat16 if args.dtype == "bf16" else None
    shape = gpt_shape(args) if args.model == "gpt" else llama_config(args)
    if args.liger:
        apply_liger(args.liger_without)
    timers = CallTimers()
    if args.timing or args.profile:
        install_comm_timers(timers)
        install_phase_timers(timers)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv,
        "args": {k: v for k, v in vars(args).items()},
        "world_size": world,
        "device": args.device,
        "torch": torch.__version__,
        "host": platform.node(),
        "cpu_threads_per_rank": torch.get_num_threads(),
        "shape": asdict(shape) if args.model == "gpt" else shape.to_dict(),
    }
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
        rate = matmul_tflops(device, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
        rates = gather_objects(rate, args)
        meta["matmul_tflops_per_rank"] = rates
        meta["matmul_dtype"] = args.dtype
        peak = args.peak_tflops or datasheet_peak(meta["gpu"], args.dtype)
        meta["peak_tflops"] = peak
        meta["peak_source"] = "--peak-tflops" if args.peak_tflops else "datasheet table (bench/_ceilings.py)"
        if args.floor:
            meta["copy_bandwidth"] = copy_bandwidth(device)
        if rank == 0:
            print(f"measured dense {args.dtype} matmul rate (8192^3) per rank, TFLOP/s: {[f'{r:.0f}' for r in rates]}")
            print(f"MFU denominator: {peak} TFLOP/s dense {args.dtype} ({meta['peak_source']}, {meta['gpu']})")
            if args.floor:
                bw = meta["copy_bandwidth"]
                print(
                    f"measured device-to-device copy bandwidth (read + write): {bw['bytes_per_s'] / 1e12:.2f} TB/s "
                    f"median, {bw['best_bytes_per_s'] / 1e12:.2f} best; copy correct: {bw['copy_correct']}"
                )
    elif args.floor:  # on a CPU only to try the report: host bandwidth, no GPU figure
        meta["copy_bandwidth"] = copy_bandwidth(device, gib=0.25, repeats=5)

    runs: dict[tuple[str, str], list[dict]] = {}
    failed: list[str] = []  # engines that raised (one process only; the others still run)
    extra = args.profile_steps if args.profile else 0
    gbs = args.global_batch_size or args.micro_batch_size * world
    batches_by_layout = {}
    for round_index in range(args.rounds):
        for layout in layouts:
            cfg = LayoutConfig(
                world_size=world,
                inner=layout.inner,
                outer=layout.outer,
                instances=layout.instances,
                global_batch_size=gbs,
                micro_batch_size=args.micro_batch_size,
            )
            count = cfg.num_microbatches
            if layout.tag not in batches_by_layout:
                steps = args.warmup + args.steps + extra
                batches_by_layout[layout.tag] = make_batches(shape, steps, gbs, count, rank, cfg.dp, device)
            batches = batches_by_layout[layout.tag]
            kinds = [k for k in args.engines if k not in SINGLE_DEVICE_ENGINES]
            if round_index % 2:
                kinds.reverse()  # alternate the order, so drift in the machine's load favours no engine
            for kind in kinds:
                if kind == "fsdp2" and layout.inner not in ("optim_grads_params", "optim_grads"):
                    if rank == 0 and round_index == 0:
                        print(f"[{layout.tag}] fsdp2: skipped, FSDP2 has no {layout.inner} (ZeRO-1/DDP) equivalent")
                    continue
                if kind == "hfsdp" or _is_variant(kind):

                    def factory(cfg=cfg, kind=kind):
                        variant = kind if kind != "hfsdp" else None
                        return HfsdpEngine(args, timers, compute_dtype, cfg, shape, device, variant)
                elif kind in ("mfsdp", "mfsdp2"):

                    def factory(cfg=cfg, layout=layout, kind=kind):
                        return MegatronFsdpEngine(args, timers, compute_dtype, cfg, shape, device, layout, kind)
                else:

                    def factory(cfg=cfg, layout=layout):
                        return Fsdp2Engine(args, timers, compute_dtype, cfg, shape, device, layout)

                if rank == 0:
                    print(
                        f"[round {round_index}] [{layout.tag}] {kind}: {count} microbatch(es) of "
                        f"{args.micro_batch_size} per step",
                        flush=True,
                    )
                profile = args.profile and round_index == 0
                try:
                    mine = run_engine(factory, batches, args, device, timers, cfg.dp, world, profile)
                except Exception as err:
                    if world > 1:  # the other ranks may be inside a collective: stop them all
                        raise
                    # One process: the engines after this one can still be measured.
                    failed.append(f"[{layout.tag}] {kind}: {type(err).__name__}: {err}")
                    print(f"!!! ENGINE FAILED {failed[-1]}", flush=True)
                    traceback.print_exc()
                    free_memory(device)
                    continue
                mine["layout"] = layout.tag
                row = merge_ranks(gather_objects(mine, args))
                runs.setdefault((layout.tag, kind), []).append(row)
                if rank == 0:
                    print(
                        f"[round {round_index}] [{layout.tag}] {kind}: median step {row['median_step_s']:.4f} s, "
                        f"losses {[round(x, 5) for x in row['losses'][: args.loss_steps]]}",
                        flush=True,
                    )
    results = [combine_rounds(rows) for rows in runs.values()]

    for kind in SINGLE_DEVICE_ENGINES:
        if kind in args.engines and not args.simulate_world:
            results.extend(run_single_device(kind, args, device, rank, world, shape, compute_dtype, timers, extra))

    checks = [] if args.simulate_world else loss_checks(results, args, world)
    if rank == 0:
        text = report(results, checks, args, meta)
        print(text, flush=True)
        bad = [c for c in checks if not c["ok"]]
        for c in bad:
            print(
                f"!!! LOSS MISMATCH [{c['layout']}] {c['pair']}: max relative difference "
                f"{c['max_rel_diff_first_steps']:.3e} over the first {args.loss_steps} steps > rtol {c['rtol']}",
                flush=True,
            )
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            record = {"meta": meta, "results": results, "loss_checks": checks, "table": text, "failed": failed}
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
            print(f"wrote {args.out}")
        for line in failed:
            print(f"!!! ENGINE FAILED {line}", flush=True)
    dist.barrier()
    return 1 if failed or any(not c["ok"] for c in checks) else 0


def run_single_device(kind, args, device, rank, world, shape, compute_dtype, timers, extra) -> list[dict]:
    """The unsharded model (`plain` or `model`) on rank 0 alone; every other rank waits at a barrier."""
    from hfsdp.core.rules.config import LayoutConfig
    from hfsdp.models.megatron.adapter import initialize_parallel

    if args.model == "gpt":  # collective: every rank builds megatron-core's groups (a Llama needs none)
        initialize_parallel(LayoutConfig(world_size=world))
    out = []
    if rank == 0:
        per_rank = (args.global_batch_size or args.micro_batch_size * world) // world  # samples per rank and step
        count = per_rank // args.micro_batch_size
        cfg = LayoutConfig(world_size=1, global_batch_size=per_rank, micro_batch_size=args.micro_batch_size)
        batches = make_batches(shape, args.warmup + args.steps + extra, per_rank, count, 0, 1, device)
        if world > 1:
            print(f"{kind}: runs on rank 0 while the other ranks wait; on a shared CPU it gets more cores")
        print(f"[{kind}] {count} microbatch(es) of {args.micro_batch_size} per step", flush=True)
        engine_class = PlainEngine if kind == "plain" else ModelOnlyEngine

        def factory():
            return engine_class(args, timers, compute_dtype, cfg, shape, device)

        mine = run_engine(factory, batches, args, device, timers, 1, 1, args.profile)
        mine["layout"] = "1x1"
        out.append(merge_ranks([mine]))
    dist.barrier()
    return out


if __name__ == "__main__":
    sys.exit(main())
