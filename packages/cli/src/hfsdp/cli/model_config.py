"""A Hugging Face config.json read as plain data, without transformers: what the planner needs of `--model-config`.

TODO(issue 20): switch to the shared reader of Hugging Face config files
(`hfsdp.models.hf_config`, with its documented bounds) once it lands; until then this
small reader refuses what would hang or exhaust memory (a FIFO, a device, a huge file)
and anything that is not one JSON object.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

CONFIG_NAME = "config.json"
MAX_BYTES = 16 * 2**20  # a config.json is a few KB


class ModelConfigError(ValueError):
    """`--model-config` cannot be read as a config.json; the message names the file and what to do."""


def read_model_config(path: str) -> dict[str, Any]:
    """The fields of `path` (a config.json, or a directory holding one)."""
    file = Path(path)
    if file.is_dir():
        file = file / CONFIG_NAME
    try:
        info = file.stat()
    except OSError as err:
        raise ModelConfigError(
            f"--model-config {path}: {err.strerror or err}; give a Hugging Face config.json."
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise ModelConfigError(f"--model-config {path}: {file} is not a regular file; give a config.json.")
    if info.st_size > MAX_BYTES:
        raise ModelConfigError(
            f"--model-config {path}: {file} is {info.st_size:,} bytes, more than a config.json's "
            f"{MAX_BYTES // 2**20} MiB limit; give the model's config.json."
        )
    try:
        with open(file, "rb") as handle:
            data = json.loads(handle.read(MAX_BYTES + 1), parse_constant=_refuse_constant)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ModelConfigError(
            f"--model-config {path}: {file} is not valid JSON ({str(err)[:200]}); give a Hugging Face config.json."
        ) from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"--model-config {path}: {file} holds a JSON {type(data).__name__}, not an object.")
    return data


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")
