"""What bench_step's engine setup decides without a GPU: Megatron-FSDP v2 runs each layout with hfsdp's own
per-axis placements, and the model-alone row keeps its buffers in fp32."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import _megatron_fsdp  # noqa: E402
import _step_model  # noqa: E402
import bench_step  # noqa: E402


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("no_shard", ("Replicate", "Partial", "Replicate")),
        ("optim", ("Replicate", "Partial", "Flat")),
        ("optim_grads", ("Replicate", "Flat", "Flat")),
        ("optim_grads_params", ("Flat", "Flat", "Flat")),
    ],
)
def test_megatron_fsdp_v2_placements_are_the_strategy_table(strategy, expected):
    assert _megatron_fsdp.v2_placements(strategy) == expected


def test_megatron_fsdp_v2_placements_refuse_an_unknown_strategy():
    with pytest.raises(ValueError):
        _megatron_fsdp.v2_placements("zero4")


def test_cast_parameters_leaves_buffers_in_their_dtype():
    """A Llama's rotary inverse frequencies are a buffer: in bf16 they moved a 3.0B model's first loss by 2e-3."""
    module = torch.nn.Linear(4, 4)
    module.register_buffer("inv_freq", torch.rand(4, dtype=torch.float32))
    _step_model.cast_parameters(module, torch.bfloat16)
    assert module.weight.dtype == module.bias.dtype == torch.bfloat16
    assert module.inv_freq.dtype == torch.float32
    assert isinstance(module.weight, torch.nn.Parameter)


def test_the_megatron_fsdp_engines_are_known_to_the_bench():
    args = bench_step.parse_args(["--engines", "hfsdp,fsdp2,mfsdp,mfsdp2,model"])
    assert args.engines == ["hfsdp", "fsdp2", "mfsdp", "mfsdp2", "model"]
