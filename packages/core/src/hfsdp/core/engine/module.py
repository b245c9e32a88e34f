"""`fully_shard`: shard any module in place on the hybrid meshes, keeping the module users know.

As FSDP2's `fully_shard` does, the module keeps its identity: its class becomes a dynamic
subclass of its own class and `HFSDPModule` (`isinstance`, methods such as `generate`,
attributes such as `config` all survive), its parameters keep their names, and outside
forward and backward they are what an optimizer must step, this rank's fp32 main params, so
`torch.optim.AdamW(model.parameters())` trains it. What the subclass adds or changes:

- `set_microbatch(index, count)`: declare gradient accumulation (the last microbatch reduces
  over every axis, the others only where the inner axis shards gradients); hfsdp divides by `count`;
- FSDP2's `set_requires_gradient_sync`, `set_requires_all_reduce`, `set_is_last_backward` and FSDP1's
  `no_sync()`: the same accumulation with FSDP2's meaning, where the user scales the loss (`step.py`);
- `clip_grad_norm_(max_norm)`: the global norm over all ranks (as FSDP1's method; torch's
  `clip_grad_norm_` and `get_total_norm`, however imported, compute the same: `torch_clip.py`);
- `state_dict()` / `load_state_dict()`: full, gathered to rank 0 on the CPU, loadable by the
  unsharded model; loading writes the fp32 main weights (`state_dict.py`);
- `zero_grad()`: frees the gradient buffers;
- `.to(dtype)`, `.double()`, `.cuda()`, ... after sharding are refused with the right way
  (MixedPrecision, build on the device), instead of moving parameters off the flat buffers;
- `wait_for_weights()`: before reading parameters outside forward right after a step;
- `sync_outer()`: with DiLoCo, the outer step of every fragment now (the global weights everywhere).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hfsdp.core.buffers.mixed_precision import MixedPrecision
from hfsdp.core.engine import sharded_state_dict as sharded
from hfsdp.core.engine import torch_clip
from hfsdp.core.engine.caller import called_from_dcp
from hfsdp.core.engine.clip import clip_grad_norm_ as _clip
from hfsdp.core.engine.mesh import HybridMeshes
from hfsdp.core.engine.optimizer_hooks import install as install_optimizer_hooks
from hfsdp.core.engine.sharding import ATTRIBUTE, Sharding, is_expert_param_default, sharding_of
from hfsdp.core.engine.state_dict import full_state_dict, load_full_state_dict
from hfsdp.core.engine.unit import UnitCall
from hfsdp.core.engine.unit_forward import adopt_compile_wrappers
from hfsdp.core.offload.offload_plan import check_offload
from hfsdp.core.outer.outer_config import DiLoCoConfig
from hfsdp.core.rules.config import LayoutConfig
from hfsdp.core.rules.expert_naming import ExpertNaming


class HFSDPModule(UnitCall):
    """What a sharded module's class gains: mixed in before the module's own class, as FSDP2's FSDPModule is. Its call
    is the root unit's (`UnitCall`): the root's parameters are gathered around the module's own call."""

    def set_microbatch(self, index: int, count: int) -> None:
        """Declare the next backward as microbatch `index` of `count` in this optimizer step (gradient
        accumulation: the gradient is then that of the mean loss over all `count` microbatches and all ranks)."""
        sharding_of(self).step.set_microbatch(index, count)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's: whether the next backward reduces the gradients over every axis. With False, gradients
        accumulate (reduced only where the inner axis shards them, which sums the same); set True before the
        last microbatch. As with FSDP2 the loss is yours to scale (`(loss / M).backward()`): the engine divides
        by the data-parallel size alone. `recurse` is accepted for FSDP2's signature: the flag is the model's."""
        sharding_of(self).step.set_sync_flag("set_requires_gradient_sync", requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """FSDP2's, for HSDP/HFSDP: whether the next backward also reduces over the outer axis. With False the
        step's gradients are not ready until a backward with True (and gradient sync on)."""
        sharding_of(self).step.set_sync_flag("set_requires_all_reduce", requires_all_reduce)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2's hint that the next backward is the step's last. hfsdp finishes every backward's reductions
        anyway, so it changes nothing but the declaration (which `set_microbatch` cannot then be mixed with)."""
        sharding_of(self).step.set_sync_flag("set_is_last_backward", is_last_backward)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """FSDP1's and DDP's: backwards inside accumulate without reducing over every axis; the first backward
        after the block reduces the sum. The loss is yours to scale, as with `set_requires_gradient_sync`."""
        step = sharding_of(self).step
        before = step.gradient_sync
        step.set_sync_flag("set_requires_gradient_sync", False)
        try:
            yield
        finally:
            step.gradient_sync = before

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """Scale the gradients so their global norm (over all ranks) is at most `max_norm`; return the norm
        before (collective)."""
        return _clip(self, max_norm, norm_type, error_if_nonfinite)

    def wait_for_weights(self) -> None:
        """Make the current stream wait for the weights the last optimizer step published.

        The gathers of new weights (and, with `FusedAdamW(overlap_next_forward=True)`,
        the step itself) run on side streams and the next forward waits for each
        unit's own; code that reads parameters outside forward right after a step
        (an EMA, logging a norm) calls this first.
        """
        sharding_of(self).wait_for_weights()

    def sync_outer(self) -> None:
        """DiLoCo: run the outer step of every fragment now and republish (collective), so every instance computes
        with the global weights (e.g. before an evaluation or an export at the end of a run). The outer steps the
        schedule brings (every `sync_every` optimizer steps) run by themselves after `optimizer.step()`."""
        sharding_of(self).sync_outer()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Free every gradient buffer; the next backward starts a new step's gradients."""
        sharding_of(self).zero_grad()

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The full state dict: on rank 0 every parameter whole, on the CPU, in the dtype it had when sharded; an
        empty dict on the other ranks (collective: call it on every rank). Called by torch.distributed.checkpoint's
        helpers (`get_state_dict`, `get_model_state_dict`), the sharded one FSDP2 gives them instead: each
        parameter as this rank's piece (`sharded_state_dict.py`), no collective."""
        if args:
            raise TypeError("state_dict() takes its arguments by keyword (destination=, prefix=, keep_vars=)")
        sharding = sharding_of(self)
        values = sharded.sharded_state_dict(sharding) if called_from_dcp() else full_state_dict(sharding)
        out = {} if destination is None else destination
        for key, value in values.items():
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False):
        """Load a full state dict into the fp32 main weights (collective); every rank passes it, or rank 0 alone. A
        sharded one (DTensors: what DCP's helpers and `dcp.load` give) is loaded as each rank's own."""
        if assign:
            raise ValueError(
                "load_state_dict(assign=True) would replace the parameters of a sharded module, which live in "
                "hfsdp's flat buffers; load with assign=False (the values are copied into the main weights)."
            )
        sharding = sharding_of(self)
        if sharded.is_sharded(state_dict):
            return sharded.load(sharding, dict(state_dict), strict)
        return load_full_state_dict(sharding, dict(state_dict), strict)

    def to_empty(self, *, device, recurse: bool = True):
        """torchtitan's meta-device flow: a model built on the meta device and sharded there gets real buffers on
        `device` (each rank only its pieces, zero-filled; buffers uninitialised, as torch's `to_empty` leaves them).
        Load its weights next (`load_state_dict`, or `hfsdp.ckpt.load_checkpoint`): an initialiser run on the
        modules now would see this rank's pieces, not whole parameters."""
        sharding = sharding_of(self)
        if not sharding.on_meta:
            raise RuntimeError(
                f"to_empty() on {type(self).__name__}, which is sharded with real weights on {sharding.device}: it "
                "would discard them. to_empty() is for a model built and sharded on the meta device."
            )
        target = torch.device(device)
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        sharding.materialize(target)
        for sub in self.modules() if recurse else [self]:
            for key, buffer in sub._buffers.items():
                if buffer is not None:
                    sub._buffers[key] = torch.empty_like(buffer, device=target)
        return self

    def _apply(self, fn, recurse: bool = True):
        """Dtype and device moves would take the parameters (the main params, outside forward) off the flat
        buffers: refuse any that changes one; one that changes nothing (`.float()`, `.to(device)` where they are)
        goes through."""
        sharding = sharding_of(self)
        probes = {(g.main.dtype, g.main.device) for g in sharding.groups}
        for dtype, device in probes:
            moved = fn(torch.empty(0, dtype=dtype, device=device))
            if moved.dtype != dtype or moved.device != device:
                raise RuntimeError(
                    f"{type(self).__name__} is sharded by hfsdp: converting it to {moved.dtype} on {moved.device} "
                    "after fully_shard would move its parameters off hfsdp's flat buffers and freeze the model. "
                    "Choose the compute dtype with fully_shard(..., mp=MixedPrecision(param_dtype=...)) (the fp32 "
                    "main weights stay fp32), and move the model to its device before calling fully_shard."
                )
        return super()._apply(fn, recurse)


_SUBCLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"HFSDP{cls.__name__}", (HFSDPModule, cls), {"__module__": cls.__module__})
    return _SUBCLASSES[cls]


def fully_shard(
    module: nn.Module,
    config: LayoutConfig,
    meshes: HybridMeshes,
    *,
    units: Iterable[nn.Module],
    mp: MixedPrecision | None = None,
    is_expert: Callable[[str, nn.Parameter], bool] = is_expert_param_default,
    expert_naming: ExpertNaming | None = None,
    streams=None,
    offload: bool | float | str = False,
    reshard_after_forward: bool = True,
    reshard_root_after_forward: bool = False,
    diloco: DiLoCoConfig | None = None,
    offload_reserve: int | None = None,
    optimizer_state_bytes: float = 8.0,
    fp8_param_gather: bool = False,
) -> nn.Module:
    """Shard `module` in place on `meshes` and return it: each of `units` gets its own buffers, the root the rest.

    - `mp`: the compute and reduction dtypes (default: each parameter's own, fp32 reductions);
    - `is_expert(name, param)`: which parameters live on the expert mesh (default: megatron-core's mark);
    - `expert_naming`: how local expert indices map to global ones (needed to checkpoint with ep > 1);
    - `streams`: the streams to run collectives on (default: CUDA side streams on a GPU, none on a CPU);
    - `offload`: keep the fp32 main weights and the optimizer state in host memory (the optimizer steps there):
      True for all of it, a fraction from 0 to 1 for that share (whole units, the last ones first), or "auto"
      for only what the device cannot hold, leaving `offload_reserve` bytes free (default: 10% of the device)
      for activations (`offload_plan.py`);
    - `optimizer_state_bytes`: what "auto" counts for the optimizer's state per element: 8 for AdamW's two fp32
      moments (the default), 4 for FusedAdamW's bf16 ones, 2 + 2/32 for fp8 with their scales; the optimizer is
      built after `fully_shard`, so it is told here;
    - `reshard_after_forward`: free each unit's gathered parameters after its forward and gather them again for
      its backward (ZeRO-3's memory). False keeps them from forward through backward, as FSDP2's
      `reshard_after_forward=False`: one gather (or, on one rank, one cast) per microbatch instead of two, for
      every unit's full compute-dtype parameters held at the step's activation peak. A forward without backward
      (evaluation) then leaves them gathered until the next backward or optimizer step. The root follows
      `reshard_root_after_forward`;
    - `reshard_root_after_forward`: free the root's parameters after forward. By default the root keeps them
      through backward, as FSDP2's does: when the loss is computed inside the model (a megatron GPT), backward
      needs them at once. When it is computed outside (a transformers model's logits), resharding frees them
      while the loss and its gradient peak, at the price of gathering them again for backward;
    - `fp8_param_gather`: gather the weights of the units' `Float8Linear` layers (`convert_to_float8`, tensorwise
      recipe) in fp8: each rank quantizes its piece, with the scale of the whole weight, and the gather moves fp8
      bytes, half of bf16's; the layers multiply exactly the bits they would quantize themselves (`fp8_gather.py`);
    - `diloco`: the outer step of a layout whose outer strategy is 'diloco' (required there, refused elsewhere):
      every `sync_every` optimizer steps the instances' weights are averaged into the global weights by an outer
      SGD, after `optimizer.step()`, by itself (`outer_sync.py`).
    """
    if isinstance(module, HFSDPModule):
        raise ValueError(f"{type(module).__name__} is already sharded by hfsdp; call fully_shard once per model.")
    units = adopt_compile_wrappers(module, list(units))
    check_offload(offload)
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"reshard_after_forward must be True or False, got {reshard_after_forward!r}: hfsdp frees a unit's "
            "gathered parameters after its forward or keeps them through backward, but does not reshard them onto "
            "a smaller group (FSDP2's int)."
        )
    if offload_reserve is not None and (isinstance(offload_reserve, bool) or not isinstance(offload_reserve, int)):
        raise ValueError(f"offload_reserve must be a whole number of bytes (or None), got {offload_reserve!r}")
    state = optimizer_state_bytes
    if isinstance(state, bool) or not isinstance(state, int | float) or not math.isfinite(state) or state < 0:
        raise ValueError(f"optimizer_state_bytes must be a number of bytes per element >= 0, got {state!r}")
    if not isinstance(fp8_param_gather, bool):
        raise ValueError(f"fp8_param_gather must be True or False, got {fp8_param_gather!r}")
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError("the module has no parameter that requires a gradient: there is nothing to shard.")
    sharding = Sharding(
        module,
        config,
        meshes,
        units,
        mp=mp or MixedPrecision(),
        is_expert=is_expert,
        expert_naming=expert_naming,
        streams=streams,
        offload=offload,
        reshard_after_forward=reshard_after_forward,
        reshard_root_after_forward=reshard_root_after_forward,
        diloco=diloco,
        offload_reserve=offload_reserve,
        optimizer_state_bytes=optimizer_state_bytes,
        fp8_param_gather=fp8_param_gather,
    )
    module.__dict__[ATTRIBUTE] = sharding
    module.__class__ = _sharded_class(type(module))
    install_optimizer_hooks()
    torch_clip.install()
    torch_clip.track(sharding)
    return module
