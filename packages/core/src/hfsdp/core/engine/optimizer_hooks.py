"""The engine's work around each optimizer's step, bound to that optimizer.

Any `torch.optim` optimizer over a sharded model's parameters (its main params) works
unwrapped: the first time it steps, a global pre-step hook finds which models' pieces it
holds and binds it, registering its own pre- and post-step hooks
(`Optimizer.register_step_pre_hook` / `register_step_post_hook`). From then on only that
optimizer's hooks run for it:

- before its step, compute waits for the last weight gathers (they may still read the main
  weights), and the pieces it steps get their fp32 (or host) gradient where one is needed;
- after its step, the groups it stepped publish their new weights (cast to the compute
  dtype, gathered where parameters are replicated but the optimizer is sharded), and the
  gradients of the pieces it stepped, and only those, are released.

So two optimizers over one model (AdamW for some parameters, SGD for others) each publish
and release their own parameters. Which groups an optimizer steps is decided by parameter
names, the same on every rank, since every rank has a parameter (perhaps empty) under
every name: publishing is collective and every rank must issue the same gathers.

An optimizer whose parameter groups change (`add_param_group`) is bound again at its next
step. Optimizers that hold no hfsdp parameter are remembered as such and cost one lookup
per step.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hfsdp.core.buffers.main_params import MainParam, check_elementwise, piece_of
from hfsdp.core.engine.optimizer_state import serve_state_dicts

_bindings: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_installed = False


class OptimizerBinding:
    """Which pieces of which sharded models one optimizer steps, and its step hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.signature = _signature(optimizer)
        by_model: dict[int, tuple[object, list[MainParam]]] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                piece = piece_of(param)
                if piece is not None and not piece.group.frozen:  # a frozen piece is never stepped
                    sharding = piece.group.owner()
                    by_model.setdefault(id(sharding), (sharding, []))[1].append(piece)
        self.models = list(by_model.values())
        self._prepared = False
        self._handles = []
        if self.models:
            serve_state_dicts(optimizer)
            self._handles = [
                optimizer.register_step_pre_hook(self._pre_hook),
                optimizer.register_step_post_hook(self._post_hook),
            ]

    def stale(self, optimizer) -> bool:
        return _signature(optimizer) != self.signature

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def prepare(self, optimizer) -> None:
        """The work before this optimizer's step (once per step, whichever hook gets there first)."""
        if self._prepared:
            return
        for sharding, pieces in self.models:
            check_elementwise(optimizer, pieces)
            _check_no_fp8_scales(optimizer, pieces)
            _check_remainders(optimizer, pieces)
            sharding.before_step(pieces)
        self._prepared = True

    def _pre_hook(self, optimizer, args, kwargs) -> None:
        self.prepare(optimizer)

    def _post_hook(self, optimizer, args, kwargs) -> None:
        self._prepared = False
        for sharding, pieces in self.models:
            sharding.after_step(pieces)


#: The state entries FusedAdamW adds beside an fp8 moment (its state-dict format: `kernels/fused_adamw.py`).
MOMENT_SCALE_KEYS = ("exp_avg_scale", "exp_avg_sq_scale")


def _check_no_fp8_scales(optimizer, pieces: list[MainParam]) -> None:
    """Refuse an optimizer other than FusedAdamW holding FusedAdamW's fp8 scale entries: its state dict was loaded
    into it directly, and torch's load cast each fp8 moment to fp32 without its scale, so every moment is off by its
    block's scale (hfsdp's checkpoints dequantize instead)."""
    if getattr(optimizer, "loads_scaled_state", False):  # FusedAdamW, whose state format these keys are
        return
    held = next((key for p in pieces for key in optimizer.state.get(p.param, {}) if key in MOMENT_SCALE_KEYS), None)
    if held is not None:
        raise ValueError(
            f"{type(optimizer).__name__} holds '{held}', the per-element scale of an fp8 moment of hfsdp's FusedAdamW: "
            "its state dict was loaded with load_state_dict, which casts the fp8 moments to fp32 without their "
            "scales, so the moments are wrong. Load it into FusedAdamW(exp_avg_dtype='fp8', exp_avg_sq_dtype='fp8'), "
            "or go through hfsdp's checkpoints (hfsdp.ckpt.load_checkpoint), which dequantize the moments for any "
            "optimizer."
        )


def _check_remainders(optimizer, pieces: list[MainParam]) -> None:
    """Refuse an optimizer that would step masters kept as a bf16 weight plus a remainder without the remainder:
    it would update the bf16 half alone, and the next FusedAdamW step or checkpoint would join it with a stale one."""
    if getattr(optimizer, "steps_param_remainders", False):  # FusedAdamW, which steps both halves
        return
    split = next((p for p in pieces if p.group.remainder is not None), None)
    if split is not None:
        raise TypeError(
            f"{type(optimizer).__name__} steps parameter '{split.name}', whose fp32 master weights are kept as a "
            "bf16 weight plus a 16-bit remainder (FusedAdamW(store_param_remainders=True) made them so): it would "
            "update the bf16 half alone. Step these parameters with hfsdp.core.FusedAdamW, or shard the model "
            "again and build its optimizer without store_param_remainders."
        )


def _signature(optimizer) -> tuple[int, ...]:
    return tuple(len(group["params"]) for group in optimizer.param_groups)


def _discover(optimizer, args, kwargs) -> None:
    """Global pre-step hook: bind an optimizer the first time it steps (or after its groups changed)."""
    binding = _bindings.get(optimizer)
    if binding is not None and not binding.stale(optimizer):
        return
    if binding is not None:
        binding.remove()
    binding = OptimizerBinding(optimizer)
    _bindings[optimizer] = binding
    if binding.models:
        binding.prepare(optimizer)  # its own pre-hook, registered just now, may not run in this step


def bind(optimizer: torch.optim.Optimizer) -> OptimizerBinding:
    """Bind `optimizer` now (instead of at its first step): it is checked at once (an optimizer that is not
    elementwise over partial pieces is refused at its first step either way)."""
    install()
    binding = _bindings.get(optimizer)
    if binding is None or binding.stale(optimizer):
        if binding is not None:
            binding.remove()
        binding = _bindings[optimizer] = OptimizerBinding(optimizer)
    return binding


def install() -> None:
    """Register the discovery hook, once per process."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_discover)
        _installed = True
