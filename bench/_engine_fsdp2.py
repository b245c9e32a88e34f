"""PyTorch FSDP2 as bench_step's `fsdp2` engine: `fully_shard` on every unit, then on the root, on a DeviceMesh of
the layout's shape, with torch's AdamW on its DTensors.
"""

from __future__ import annotations

import torch
from _engine_base import Layout, TorchOptimizerEngine, adamw, device_mesh_of
from _step_model import build_model, flops_per_token, loss_of, maybe_compile, units_of


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
