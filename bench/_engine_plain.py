"""The unsharded references of bench_step.py, on rank 0 alone: `plain` (the model and torch's AdamW, no engine) and
`model` (the model alone, no optimizer: the floor under every engine's step), and `model+float8t|r`, the model alone
with its units' Linear layers in torchao's float8 (`_float8.py`): the floor under an fp8 engine's step.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from _engine_base import TorchOptimizerEngine, adamw, tensor_bytes
from _float8 import convert, float8_suffix
from _step_model import build_model, cast_parameters, flops_per_token, loss_of, maybe_compile, units_of


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

    def __init__(self, args, timers, compute_dtype, cfg, shape, device, float8: str | None = None):
        """`float8`: None, or a torchao recipe ("tensorwise", "rowwise") for the units' Linear layers."""
        super().__init__(args, timers, compute_dtype)
        self.model = build_model(cfg, shape, device, init_groups=False, on_device=args.build_on_device)
        self.params, self.flops_per_token = flops_per_token(self.model, shape)
        cast_parameters(self.model, compute_dtype)
        converted = ""
        if float8:  # no FSDP here, so nothing is gathered in fp8
            self.kind = f"model+{float8_suffix(float8)}"
            converted = "; " + convert(
                self.model, units_of(self.model), float8, fsdp_all_gather=False, min_size=args.fp8_min_size
            )
        maybe_compile(args, self.model)
        self.opt = None
        dtype = str(compute_dtype or torch.float32).removeprefix("torch.")
        self.label = f"model alone, {dtype} weights: forward + backward, no optimizer (the floor){converted}"
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
