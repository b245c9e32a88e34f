"""Megatron-FSDP as bench_step's `mfsdp` and `mfsdp2` engines: the engine class; `_megatron_fsdp.py` holds how each
version is set up and what differs from the other engines.
"""

from __future__ import annotations

from _engine_base import Layout, TorchOptimizerEngine, device_mesh_of
from _step_model import build_model, cast_parameters, flops_per_token, loss_of, maybe_compile, units_of


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
