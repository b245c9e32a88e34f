"""hfsdp as bench_step's `hfsdp` engine and its variants `hfsdp+fused[+clip][+prestage][+overlap][+keep][+bf16m|
+fp8m][+bf16g][+rem][+fp8t|+fp8g|+fp8r]`: the engine under test, set up as `hfsdp train` sets it up, each variant
switching on one option.
"""

from __future__ import annotations

import torch
from _engine_base import Engine, adamw, tensor_bytes
from _floor import floor_bytes, step_bytes
from _step_model import build_model, flops_per_token, loss_of, maybe_compile, units_of

#: hfsdp engine variants, `hfsdp+fused[+clip][+prestage][+overlap][+keep]`: FusedAdamW instead of torch's fused
#: AdamW, the clip inside its step, the next forward's gather input written by the step, the step overlapping the
#: next forward, every unit's gathered parameters kept from its forward through its backward
#: (`reshard_after_forward=False`).
#: Megatron's precision-aware optimizer through FusedAdamW: `bf16m` bf16 moments, `fp8m` fp8 moments (e4m3 / e5m2, a
#: scale per 128 elements), `bf16g` gradients reduced and read in bf16, `rem` exact fp32 masters kept as the bf16
#: shard plus a 16-bit remainder (`store_param_remainders`).
#: FP8 compute (issue 39) of the units' Linear layers: `fp8t` hybrid tensorwise, `fp8g` the same with the weights
#: gathered in fp8 (`fp8_param_gather`), `fp8r` e4m3 rowwise.
FP8_PARTS = {"fp8t": ("hybrid", "tensorwise"), "fp8g": ("hybrid", "tensorwise"), "fp8r": ("e4m3", "rowwise")}
VARIANT_PARTS = ("fused", "clip", "prestage", "overlap", "keep", "bf16m", "fp8m", "bf16g", "rem", *FP8_PARTS)


def is_variant(name: str) -> bool:
    head, *parts = name.split("+")
    return (
        head == "hfsdp"
        and bool(parts)
        and parts[0] == "fused"
        and len(set(parts)) == len(parts)
        and all(x in VARIANT_PARTS for x in parts)
        and ("overlap" not in parts or "prestage" in parts)
        and not {"bf16m", "fp8m"} <= set(parts)
        and len(set(parts) & set(FP8_PARTS)) <= 1
    )


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
        parts = set(variant.split("+")[1:]) if variant else set()
        fp8 = next((FP8_PARTS[p] for p in parts if p in FP8_PARTS), None)
        if fp8 is not None:
            from hfsdp.core import Float8Config, convert_to_float8

            if args.model == "gpt":
                raise ValueError("the fp8 variants need a transformers Llama (--model llama): hfsdp refuses the GPT")
            self.fp8_summary = convert_to_float8(
                model, Float8Config(*fp8), units=units_of(model), min_size=args.fp8_min_size
            ).summary()
            print(self.fp8_summary, flush=True)
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
                fp8_param_gather="fp8g" in parts,
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
                store_param_remainders="rem" in self.variant,
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
