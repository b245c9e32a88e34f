"""From a validated run (`TrainConfig`) to what the planner computes with: the model's shape and the step's settings.

`hfsdp plan` and `hfsdp train` (its start line and its memory check) both come through
here, so the memory `plan` predicts for a layout is the memory `train` checks before it
launches that layout. Nothing here imports torch.
"""

from __future__ import annotations

from hfsdp.cli.settings.train_config import TrainConfig
from hfsdp.models.hf_config import read_hf_config
from hfsdp.planning.gpt_shape import gpt_shape
from hfsdp.planning.hf_shape import hf_shape
from hfsdp.planning.memory import Settings
from hfsdp.planning.model_shape import MEGATRON_GPT, ModelShape

#: The measured efficiency of one GPU's forward and backward (model FLOPs / (time x 989 TFLOP/s)), by family: the
#: "model alone" step of docs/benchmarks.md (2026-12-01, one H200, bf16, seq 2048, micro-batch 4): the 0.94B GPT in
#: 0.1821 s (6.03 GFLOP per token) and the 0.95B Llama in 0.1263 s (6.13 GFLOP per token), 8192 tokens each.
MEASURED_MFU = {MEGATRON_GPT: 0.27, "hf": 0.40}


def model_shape(cfg: TrainConfig) -> ModelShape:
    """The run's model: `--model-config`'s fields (read by the one reader of Hugging Face configs, with its bounds),
    or the GPT of the model flags. Raises HFModelError or ModelShapeError (both ValueError) with a message naming
    the flag or the file. Its fp8 weights are those `convert_to_float8` would convert with the run's min size."""
    if cfg.model_config is not None:
        return hf_shape(read_hf_config(cfg.model_config), f"--model-config {cfg.model_config}", cfg.fp8_min_size)
    return gpt_shape(
        layers=cfg.layers,
        hidden=cfg.hidden,
        heads=cfg.heads,
        vocab=cfg.vocab,
        normalization=cfg.normalization,
        swiglu=cfg.swiglu,
        num_query_groups=cfg.num_query_groups,
        num_moe_experts=cfg.layout.num_moe_experts,
        moe_topk=cfg.moe_topk,
    )


def step_settings(cfg: TrainConfig, shape: ModelShape) -> Settings:
    """The step `hfsdp train` runs: its microbatches, dtype, recompute and offload, and the precision-aware optimizer's
    gradient and moment dtypes and whether it keeps the fp32 main weights as bf16 shards plus remainders, and whether
    the fp8 weights are gathered in fp8 (not when no layer is large enough to be converted: `build_model` then asks
    no fp8 gather); the root of a Hugging Face model frees its parameters after
    forward (`build_model`), the GPT's keeps them."""
    return Settings(
        seq=cfg.seq_len,
        micro_batch=cfg.layout.micro_batch_size,
        microbatches=cfg.num_microbatches,
        compute_bytes=2 if cfg.dtype == "bf16" else 4,
        recompute=cfg.recompute,
        offload=cfg.offload == "optim",
        root_resharded=shape.family != MEGATRON_GPT,
        reduce_bytes=2 if cfg.main_grads_dtype == "bf16" else 4,
        moment_dtypes=(cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype),
        fp8_param_gather=cfg.fp8 is not None and cfg.fp8_param_gather and any(u.fp8 for u in shape.units),
        store_param_remainders=cfg.store_param_remainders,
    )


def default_mfu(shape: ModelShape) -> float:
    return MEASURED_MFU[MEGATRON_GPT if shape.family == MEGATRON_GPT else "hf"]


def layout_fields(cfg: TrainConfig) -> dict:
    """The LayoutConfig fields every candidate layout shares with the run (experts, batch sizes)."""
    layout = cfg.layout
    return {
        "ep": layout.ep,
        "num_moe_experts": layout.num_moe_experts,
        "expert_strategy": layout.expert_strategy,
        "global_batch_size": layout.global_batch_size,
        "micro_batch_size": layout.micro_batch_size,
    }
