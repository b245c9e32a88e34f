"""Model TFLOP/s and MFU as `hfsdp train` reports them: the model's FLOPs counted off the real model, the datasheet
peak by GPU name, recomputation never counted."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

from hfsdp.cli.checks.plan_inputs import model_shape, step_settings
from hfsdp.cli.rank.throughput import Throughput, datasheet_peak_tflops
from hfsdp.cli.settings.train_config import build_train_config
from hfsdp.planning.timing import model_flops, step_flops

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
         "vocab_size": 128, "max_position_embeddings": 256}  # fmt: skip
CASES = {
    "llama": {"model_type": "llama", "num_key_value_heads": 4},
    "llama-gqa-tied-head-dim": {"model_type": "llama", "num_key_value_heads": 2, "tie_word_embeddings": True,
                                "head_dim": 8},
    "qwen2": {"model_type": "qwen2", "num_key_value_heads": 2},
}  # fmt: skip


def _config(tmp_path, case: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL, **CASES[case]}))
    return str(path)


def _counted_off_the_model(config_path: str, tokens: int, seq: int) -> float:
    """6 FLOPs per token per weight of every nn.Linear (the output head too, tied or not) for forward and backward,
    and attention's scores and weighted sum: 2 matmuls of seq x query width, 2 FLOPs each, x3 for backward."""
    from hfsdp.models import hf

    config = hf.load_config(config_path)
    model = hf.build_causal_lm(config, device="meta")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    layers = hf.decoder_layers(model)
    query_width = layers[0].self_attn.q_proj.out_features
    return tokens * (6.0 * linear + 12.0 * len(layers) * seq * query_width)


@pytest.mark.parametrize("case", list(CASES))
def test_model_flops_are_the_real_models(tmp_path, case):
    """A step's model FLOPs for one rank: every microbatch of micro-batch x seq tokens, counted off the model."""
    flags = {"model_config": _config(tmp_path, case), "seq_len": 256, "micro_batch_size": 3, "global_batch_size": 12,
             "nproc": 2}  # fmt: skip
    cfg = build_train_config(flags)
    assert cfg.num_microbatches == 2
    expected = 2 * _counted_off_the_model(cfg.model_config, 3 * 256, 256)
    assert Throughput.of(cfg, torch.device("cpu")).flops_per_step == pytest.approx(expected, rel=1e-12)


def test_recomputation_is_work_but_not_model_flops(tmp_path):
    cfg = build_train_config({"model_config": _config(tmp_path, "llama"), "recompute": True, "nproc": 1})
    shape = model_shape(cfg)
    run = step_settings(cfg, shape)
    assert run.recompute
    assert model_flops(shape, run) == step_flops(shape, replace(run, recompute=False)) < step_flops(shape, run)


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [("NVIDIA H200", "bf16", 989.0), ("NVIDIA H100 80GB HBM3", "bf16", 989.0), ("NVIDIA H100 PCIe", "bf16", 756.0),
     ("NVIDIA A100-SXM4-80GB", "bf16", 312.0), ("NVIDIA H200", "fp32", 67.0),
     ("NVIDIA GeForce RTX 4090", "bf16", None)],
)  # fmt: skip
def test_the_datasheet_peak_by_gpu_name(name, dtype, peak):
    assert datasheet_peak_tflops(name, dtype) == peak


def test_mfu_is_the_rate_over_the_datasheet_peak():
    known = Throughput(flops_per_step=4.945e14, peak_tflops=989.0, device_name="NVIDIA H200", dtype="bf16")
    figures = known.figures(1.0)
    assert figures["model_tflops_per_gpu"] == pytest.approx(494.5)
    assert figures["mfu"] == pytest.approx(0.5)
    assert known.describe(1.0) == "494.5 model TFLOP/s per GPU, 50.0% MFU (of the NVIDIA H200's 989 TFLOP/s bf16 peak)"
    unknown = Throughput(flops_per_step=2e12, peak_tflops=None, device_name="cpu", dtype="fp32")
    assert unknown.figures(2.0) == {"model_tflops_per_gpu": 1.0}
    assert unknown.describe(2.0) == "1.0 model TFLOP/s per GPU"
