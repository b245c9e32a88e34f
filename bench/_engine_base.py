"""What every engine of bench_step.py shares: the `Engine` step (microbatches, clip, optimizer, zero_grad, each in
its own timed phase), `TorchOptimizerEngine` for the engines whose optimizer is torch.optim's, the layout and the
DeviceMesh the non-hfsdp engines run on, and the device helpers the step loop and the engines both call.

Kept apart from the engines so that each engine's module reads alone, and free of the engines' own imports (hfsdp,
FSDP2, Megatron-FSDP, torchao), which stay inside their constructors.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from _common import CallTimers

SINGLE_DEVICE_ENGINES = ("plain", "model")  # unsharded, on rank 0 alone (with their variants, e.g. model+float8t)


def engine_family(name: str) -> str:
    """The engine an engine name is a variant of: `hfsdp+fused+clip` -> `hfsdp`, `fsdp2+float8t` -> `fsdp2`. The step
    loop and the loss checks decide by family, so that a variant runs and is checked as its engine is."""
    return name.partition("+")[0]


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def tensor_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        total += t.numel() * t.element_size()
    return total


def adamw(args, params):
    kind = {"fused": True} if args.optimizer == "fused" else {"foreach": True}
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, **kind)


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
