"""PyTorch FSDP2 as bench_step's `fsdp2` engine: `fully_shard` on every unit, then on the root, on a DeviceMesh of
the layout's shape, with torch's AdamW on its DTensors. `fsdp2+float8t` and `fsdp2+float8r` are the same engine with
the units' Linear layers in torchao's float8 (`_float8.py` says how), converted before compile and `fully_shard`.
"""

from __future__ import annotations

import torch
from _engine_base import Layout, TorchOptimizerEngine, adamw, device_mesh_of
from _float8 import convert, float8_suffix, precompute_scales, require_torchao
from _step_model import build_model, flops_per_token, loss_of, maybe_compile, units_of


class Fsdp2Engine(TorchOptimizerEngine):
    kind = "fsdp2"

    def __init__(self, args, timers, compute_dtype, cfg, shape, device, layout: Layout, float8: str | None = None):
        """`float8`: None (the units in the compute dtype) or a torchao recipe, "tensorwise" or "rowwise"."""
        super().__init__(args, timers, compute_dtype)
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        model = build_model(cfg, shape, device, on_device=args.build_on_device)
        self.params, self.flops_per_token = flops_per_token(model, shape)
        mesh = device_mesh_of(layout, device)
        self.hybrid = layout.instances > 1
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        reshard = layout.inner == "optim_grads_params"
        self.precompute, converted = None, ""
        if float8:
            self.kind = f"fsdp2+{float8_suffix(float8)}"
            converted = "; " + convert(model, units_of(model), float8, fsdp_all_gather=True, min_size=args.fp8_min_size)
            self.precompute = precompute_scales(require_torchao(), float8, fsdp_all_gather=True)
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
        self.label += converted
        self.mesh = tuple(mesh.mesh_dim_names)

    def microbatch(self, index, count, tokens, labels):
        if self.hybrid and count > 1:
            self.model.set_requires_all_reduce(index == count - 1)
        loss = loss_of(self.model, tokens, labels)
        (loss / count).backward()
        return loss.detach()

    def optimizer_step(self):
        self.opt.step()
        if self.precompute is not None:  # the next forward's fp8 weight scales, for all weights in one pass
            self.precompute(self.model)
