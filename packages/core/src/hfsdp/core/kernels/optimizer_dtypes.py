"""The dtypes an optimizer's moments may be kept in, by Megatron's names (`--exp-avg-dtype`, `--exp-avg-sq-dtype`).

Megatron's precision-aware optimizer names them "fp32", "bf16", "fp16" and "fp8". fp8 means a different format per
moment: `exp_avg` (the first moment, the gradient's running mean, signed, about the gradient's range) is
`torch.float8_e4m3fn` (3 mantissa bits, 18 binades with subnormals), `exp_avg_sq` (the running mean of the squared
gradient, positive, twice the first moment's range in binades) is `torch.float8_e5m2` (2 mantissa bits, 32
binades): see `fused_adamw` for why. One place maps the names, so the CLI and config checks reuse it.
"""

from __future__ import annotations

import torch

#: Megatron's names of the moments' dtypes, and the dtype each stands for, per moment.
STATE_DTYPE_NAMES = ("fp32", "bf16", "fp16", "fp8")
_FP8 = {"exp_avg": torch.float8_e4m3fn, "exp_avg_sq": torch.float8_e5m2}
_BY_NAME = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FIELDS = tuple(_FP8)


def allowed_dtypes(field: str) -> tuple[torch.dtype, ...]:
    """The torch dtypes `field` ("exp_avg" or "exp_avg_sq") may be kept in."""
    return (*_BY_NAME.values(), _FP8[field])


def parse_state_dtype(name: str, field: str) -> torch.dtype:
    """The torch dtype of Megatron's `name` ("fp32", "bf16", "fp16", "fp8") for the moment `field` ("exp_avg" or
    "exp_avg_sq"); a ValueError naming the argument and the allowed values otherwise."""
    if field not in _FP8:
        raise ValueError(f"field must be one of {', '.join(FIELDS)}, got {field!r}")
    if isinstance(name, str) and name in _BY_NAME:
        return _BY_NAME[name]
    if name == "fp8":
        return _FP8[field]
    raise ValueError(f"{field}_dtype must be one of {', '.join(STATE_DTYPE_NAMES)}, got {name!r}")


def state_dtype(value, field: str) -> torch.dtype:
    """`value` (a torch dtype or one of Megatron's names) as the torch dtype of the moment `field`, or a ValueError
    naming `<field>_dtype` and what it may be."""
    if isinstance(value, torch.dtype):
        allowed = allowed_dtypes(field)
        if value in allowed:
            return value
        raise ValueError(
            f"{field}_dtype must be one of {', '.join(STATE_DTYPE_NAMES)} or "
            f"{', '.join(str(d) for d in allowed)}, got {value}"
        )
    if isinstance(value, str):
        try:
            return parse_state_dtype(value, field)
        except ValueError:
            pass
    allowed = ", ".join(str(d) for d in allowed_dtypes(field))
    raise ValueError(f"{field}_dtype must be one of {', '.join(STATE_DTYPE_NAMES)} or {allowed}, got {value!r}")


def megatron_name(dtype: torch.dtype) -> str:
    """Megatron's name of a moment dtype ("fp8" for either fp8 format)."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    return {v: k for k, v in _BY_NAME.items()}[dtype]
