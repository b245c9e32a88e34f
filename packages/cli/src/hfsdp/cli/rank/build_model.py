"""The model a training run shards: the megatron-core GPT, or a Hugging Face causal LM (`--model-config`).

Either way the result is the same few things the loop needs: the sharded model,
its loss on a microbatch, the vocabulary its data must stay within, and the model
record a checkpoint keeps (so an export knows what it holds). Units are the
transformer layers in both; `--recompute` and `--compile` wrap their forwards. With `--fp8-format` (a Hugging Face
model only: the rules refuse the GPT) the units' Linear layers large enough to gain (`--fp8-min-size`) become fp8
ones first, so that compile and recompute wrap the layers that run, and the conversion's one-line summary travels
with the model for rank 0 to print. When no layer is converted, the model trains in bf16, gathers nothing in fp8
(`fully_shard` refuses the fp8 gather without an fp8 layer) and the line says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hfsdp.cli.settings.train_config import TrainConfig


@dataclass(frozen=True)
class BuiltModel:
    sharded: Any  # the model, sharded in place by hfsdp.core.engine.module
    loss: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]
    vocab_size: int
    record: dict[str, Any]
    fp8_summary: str | None = None  # what --fp8-format converted, for the start of the run's output


def build_model(cfg: TrainConfig, device: torch.device) -> BuiltModel:
    """Build, wrap and shard the run's model on `device` (collective: builds the meshes)."""
    mp = mixed_precision(cfg)
    if cfg.model_config is not None:
        return _hugging_face(cfg, device, mp)
    return _megatron_gpt(cfg, device, mp)


def mixed_precision(cfg: TrainConfig):
    """The run's `MixedPrecision`: --dtype's compute dtype, and gradients reduced in fp32, or in bf16 with
    --main-grads-dtype bf16 (Megatron's main_grads_dtype), which FusedAdamW then reads from the buffer as they are."""
    from hfsdp.core.buffers.mixed_precision import MixedPrecision

    reduce = torch.bfloat16 if cfg.main_grads_dtype == "bf16" else torch.float32
    return MixedPrecision(param_dtype=torch.bfloat16 if cfg.dtype == "bf16" else None, reduce_dtype=reduce)


def offload_of(cfg: TrainConfig) -> bool | float | str:
    """What `fully_shard(offload=...)` gets: False, the share given by --offload-fraction (1: all), or "auto"."""
    if cfg.offload != "optim":
        return False
    fraction = cfg.offload_fraction
    if fraction == "auto":
        return "auto"
    fraction = float(fraction)
    return True if fraction == 1.0 else fraction


def optimizer_state_bytes(cfg: TrainConfig) -> float:
    """The optimizer's state per element, for `offload="auto"`: AdamW's moments in the run's dtypes."""
    from hfsdp.planning.memory import state_bytes_per_element

    return state_bytes_per_element(cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype)


def convert_fp8(cfg: TrainConfig, model, units):
    """--fp8-format: swap the nn.Linear layers inside `units` for fp8 ones in place (same parameter names, so
    checkpoints and exports are unchanged); the `Float8Conversion`, or None when fp8 is off."""
    if cfg.fp8 is None:
        return None
    from hfsdp.core.fp8.config import Float8Config
    from hfsdp.core.fp8.convert import convert_to_float8

    config = Float8Config(format=cfg.fp8, recipe=cfg.fp8_recipe)
    return convert_to_float8(model, config, units=units, min_size=cfg.fp8_min_size)


def fp8_shard_options(cfg: TrainConfig, conversion) -> dict[str, Any]:
    """`fully_shard`'s fp8 keyword, given only when fp8 is on (a run without fp8 asks nothing of it); the fp8 gather
    only when `conversion` converted a layer (`fully_shard` refuses it on a model without fp8 layers)."""
    if cfg.fp8 is None:
        return {}
    return {"fp8_param_gather": cfg.fp8_param_gather and bool(conversion.converted)}


def fp8_start_line(cfg: TrainConfig, conversion) -> str:
    """The conversion's summary for the start of the run; when it converted nothing, with why fp8 is off."""
    line = conversion.summary()
    if conversion.converted:
        return line
    if any(reason.startswith("too small") for reason in conversion.skipped.values()):
        spelled = cfg.given["fp8_min_size"].spelled if "fp8_min_size" in cfg.given else "--fp8-min-size"
        force = f"{spelled}: 0" if "." in spelled else f"{spelled} 0"
        return (
            f"{line}. fp8 is off for this model: no layer is large enough to gain from it, so it trains in bf16; "
            f"{force} forces fp8."
        )
    return f"{line}. fp8 is off for this model: none of its layers can multiply in fp8, so it trains in bf16."


def _wrap_units(cfg: TrainConfig, units) -> None:
    from hfsdp.core.engine.unit_forward import compile_units, recompute

    if cfg.compile:
        compile_units(units)
    if cfg.recompute:
        recompute(units)


def _hugging_face(cfg: TrainConfig, device: torch.device, mp) -> BuiltModel:
    from hfsdp.core.engine.mesh import build_meshes
    from hfsdp.core.engine.module import fully_shard
    from hfsdp.models import hf

    config = hf.load_config(cfg.model_config)
    model = hf.build_causal_lm(config, seed=cfg.seed).to(device)
    units = hf.decoder_layers(model)
    fp8 = convert_fp8(cfg, model, units)
    _wrap_units(cfg, units)
    meshes = build_meshes(cfg.layout, device.type)
    # The loss is computed outside the model, on its logits: free the root's parameters while it peaks.
    sharded = fully_shard(
        model,
        cfg.layout,
        meshes,
        units=units,
        mp=mp,
        offload=offload_of(cfg),
        optimizer_state_bytes=optimizer_state_bytes(cfg),
        reshard_root_after_forward=True,
        diloco=cfg.diloco,
        **fp8_shard_options(cfg, fp8),
    )
    record = {"format": "transformers", "config": config.to_dict()}
    summary = fp8_start_line(cfg, fp8) if fp8 is not None else None
    return BuiltModel(sharded, hf.causal_lm_loss, hf.vocab_size(config), record, summary)


def _megatron_gpt(cfg: TrainConfig, device: torch.device, mp) -> BuiltModel:
    from hfsdp.models.megatron.adapter import expert_naming_for, initialize_parallel, shard_megatron_model
    from hfsdp.models.megatron.cpu_shim import seed_megatron
    from hfsdp.models.megatron.gpt import GPTShape, build_gpt, lm_loss, reinit_by_global_name

    layout = cfg.layout
    initialize_parallel(layout)
    seed_megatron(cfg.seed)
    shape = GPTShape(
        num_layers=cfg.layers,
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.heads,
        vocab_size=cfg.vocab,
        seq_length=cfg.seq_len,
        num_moe_experts=layout.num_moe_experts,
        moe_router_topk=cfg.moe_topk,
        normalization=cfg.normalization,
        swiglu=cfg.swiglu,
        num_query_groups=cfg.num_query_groups,
    )
    model = build_gpt(shape)
    reinit_by_global_name(model, expert_naming_for(layout), cfg.seed)
    model.to(device)
    _wrap_units(cfg, list(model.decoder.layers))
    sharded = shard_megatron_model(
        model,
        layout,
        device.type,
        mp,
        offload=offload_of(cfg),
        diloco=cfg.diloco,
        optimizer_state_bytes=optimizer_state_bytes(cfg),
    )
    return BuiltModel(sharded, lm_loss, cfg.vocab, {"format": "megatron-gpt", "config": shape.record()})
