"""Model TFLOP/s per GPU and MFU of a training step, as Megatron and torchtitan report them.

The FLOPs are the model's (`hfsdp.planning.timing.model_flops`): 6 per matmul weight per token
for forward and backward, attention's 12 x seq x query width per token and layer, never the
recomputation, so a run that recomputes shows the same model FLOPs in more time. MFU divides
the rate by the GPU's datasheet dense peak in the compute dtype (an H200 in bf16: 989 TFLOP/s,
tensor cores, no sparsity); a measured matmul rate would flatter it. On a GPU hfsdp has no
datasheet figure for, or on the CPU, only the TFLOP/s are reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hfsdp.cli.checks.plan_inputs import model_shape, step_settings
from hfsdp.cli.settings.train_config import TrainConfig
from hfsdp.planning.timing import model_flops

#: Dense peak TFLOP/s by GPU and compute dtype, from NVIDIA's datasheets (bf16 on tensor cores; fp32 without TF32,
#: which torch leaves off for matmuls by default). Matched against the device name, most specific first.
DATASHEET_PEAK_TFLOPS = (
    ("H100 PCIe", {"bf16": 756.0, "fp32": 51.0}),
    ("H100", {"bf16": 989.0, "fp32": 67.0}),  # SXM
    ("H200", {"bf16": 989.0, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "fp32": 19.5}),
)


def datasheet_peak_tflops(device_name: str, dtype: str) -> float | None:
    """The dense peak of the GPU called `device_name` (torch.cuda.get_device_name) in `dtype`, if hfsdp knows it."""
    for model, peaks in DATASHEET_PEAK_TFLOPS:
        if model in device_name:
            return peaks.get(dtype)
    return None


@dataclass(frozen=True)
class Throughput:
    """What one rank's optimizer step is worth in model FLOPs, and the peak its rate is measured against."""

    flops_per_step: float
    peak_tflops: float | None
    device_name: str
    dtype: str

    @classmethod
    def of(cls, cfg: TrainConfig, device: torch.device) -> Throughput:
        shape = model_shape(cfg)  # preflight read the same config: no error left to raise here
        flops = model_flops(shape, step_settings(cfg, shape))
        if device.type != "cuda":
            return cls(flops, None, "cpu", cfg.dtype)
        name = torch.cuda.get_device_name(device)
        return cls(flops, datasheet_peak_tflops(name, cfg.dtype), name, cfg.dtype)

    def figures(self, seconds: float) -> dict[str, float]:
        """`model_tflops_per_gpu`, and `mfu` (a fraction) where the peak is known, for a step of `seconds`."""
        tflops = self.flops_per_step / seconds / 1e12
        if self.peak_tflops is None:
            return {"model_tflops_per_gpu": tflops}
        return {"model_tflops_per_gpu": tflops, "mfu": tflops / self.peak_tflops}

    def describe(self, seconds: float) -> str:
        """The summary's words: '412.0 model TFLOP/s per GPU, 41.7% MFU (of the NVIDIA H200's
        989 TFLOP/s bf16 peak)'."""
        figures = self.figures(seconds)
        text = f"{figures['model_tflops_per_gpu']:,.1f} model TFLOP/s per GPU"
        if "mfu" in figures:
            peak = f"{self.peak_tflops:g} TFLOP/s {self.dtype} peak"
            text += f", {figures['mfu']:.1%} MFU (of the {self.device_name}'s {peak})"
        return text
