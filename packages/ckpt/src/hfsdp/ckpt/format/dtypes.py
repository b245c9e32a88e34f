"""The dtypes a checkpoint may hold, by torch's name, with their safetensors code and size, without torch.

The index records dtypes by torch's name ("bfloat16"); safetensors headers by
their own code ("BF16"). verify and inspect read both without importing torch,
so the table lives here; `writer.torch_dtype` maps the names to torch dtypes.
"""

from __future__ import annotations

#: torch dtype name -> (safetensors dtype code, bytes per element).
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
}
#: safetensors dtype code -> bytes per element.
CODE_ITEMSIZE: dict[str, int] = dict(DTYPES.values())


def safetensors_code(name: str) -> str:
    return DTYPES[name][0]


def itemsize(name: str) -> int:
    return DTYPES[name][1]
