"""Exact fp32 master weights kept as a bf16 weight plus a 16-bit remainder (Megatron's `store_param_remainders`).

An fp32 number is 32 bits; its upper 16 are a bf16 number. Where the weights are kept in bf16 anyway (the
compute-dtype shard of HFSDP's outer axis, ZeRO-1/2, DDP), storing the master beside them in fp32 keeps those
upper 16 bits twice. Keeping only the lower 16 (the *remainder*, an int16) beside the bf16 weight stores the same
fp32 master, exactly, in 2 bytes instead of 4.

The bf16 weight must still be the master rounded to nearest, not truncated (truncation would bias every weight
toward zero by up to one bf16 ulp in the forward). So the split rounds: when the remainder's top bit is set
(the discarded half is at least half an ulp), the upper half is incremented, which rounds to nearest with
ties away from zero; and the remainder, read as a signed int16, is then negative, which is how the join knows
to take that increment back. Torch's cast rounds ties to even instead; the two differ only where the low 16
bits are exactly 0x8000 (one fp32 value in 65,536), by one bf16 ulp. Ties to even cannot be kept this way:
two masters one ulp apart would split into the same pair. Megatron's reference kernel (TransformerEngine's
FusedAdam) splits the same way.

A NaN master splits into torch's canonical bf16 NaN (as its cast gives) and joins back into a NaN, not
necessarily the same payload. Everything else round-trips bit for bit (tested over every 16-bit remainder
and every sign, exponent and upper mantissa).

These are the torch operations (the CPU's path and the reference); `adamw_kernel`'s Triton kernels do the same
integer steps in registers.
"""

from __future__ import annotations

import torch

_LOW = 0xFFFF
_HALF = 0x8000
_BF16_NAN = 0x7FC0


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 weight, int16 remainder) of an fp32 `master` (any shape): the weight rounded to nearest (ties away
    from zero), the remainder its low 16 bits."""
    if master.dtype != torch.float32:
        raise ValueError(f"split_master takes fp32 masters, got {master.dtype}")
    bits = master.contiguous().view(torch.int32)
    low = bits & _LOW
    high = (bits >> 16) + (low >= _HALF).to(torch.int32)
    high = torch.where(torch.isnan(master), _BF16_NAN, high)
    return high.to(torch.int16).view(torch.bfloat16), low.to(torch.int16)


def join_master(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master that `split_master` split into `weight` (bf16) and `remainder` (int16): a new tensor."""
    if weight.dtype != torch.bfloat16 or remainder.dtype != torch.int16 or weight.shape != remainder.shape:
        raise ValueError(
            f"join_master takes a bf16 weight and an int16 remainder of one shape, got {weight.dtype} "
            f"{tuple(weight.shape)} and {remainder.dtype} {tuple(remainder.shape)}"
        )
    low = remainder.to(torch.int32)
    high = weight.contiguous().view(torch.int16).to(torch.int32) - (low < 0).to(torch.int32)
    return ((high << 16) | (low & _LOW)).view(torch.float32)


def write_master(weight: torch.Tensor, remainder: torch.Tensor, master: torch.Tensor) -> None:
    """Store the fp32 `master` into `weight` (bf16) and `remainder` (int16) in place (same number of elements)."""
    high, low = split_master(master.reshape(weight.shape))
    weight.copy_(high)
    remainder.copy_(low)
