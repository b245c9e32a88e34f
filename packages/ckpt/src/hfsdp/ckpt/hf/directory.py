"""A Hugging Face `save_pretrained` directory, read as untrusted input, before a byte of weights is used.

The directory holds `config.json` and either `model.safetensors` or shards
`model-0000k-of-0000n.safetensors` listed by `model.safetensors.index.json`
(`{"metadata": {...}, "weight_map": {tensor name: file name}}`); like
transformers, a `model.safetensors` present wins over the index. All of it is
data from elsewhere, checked the way a checkpoint is:

- the JSON files are bounded in size and parsed by `safe_json` (finite numbers,
  unique keys, bounded nesting), through the one reader of Hugging Face JSON files
  that `train --model-config` uses too (`hfsdp.models.hf_config`);
- every file name the weight map gives is a plain name inside the directory
  (`names.plain_name_problem`): `../x` or `/x` are refused, naming the name;
- every file is a regular file (a symlink to one is accepted: the Hugging Face
  hub cache is made of symlinks into its blob store; a FIFO or device is not);
- every safetensors header passes `headers.read_header` (bounded, spans tiling
  the data), each tensor sits in exactly one file, and the weight map and the
  headers agree on where.

What comes out is the config as a dict and, for every tensor, its file, dtype
code, shape and absolute byte offset, which is all `hf_source.py` needs to read
any flat range of it. Whether the tensors are the model's is `importing.py`'s
check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.headers import read_header_at
from hfsdp.ckpt.format.names import plain_name_problem
from hfsdp.models import hf_config
from hfsdp.models.hf_config import CONFIG_NAME, HFModelError

SINGLE_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
HINT = "Pass the directory a transformers model's save_pretrained wrote, complete."


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the directory: its file, safetensors dtype code, shape and the byte offset of its data."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class HFDir:
    path: Path
    config: dict[str, Any]
    tensors: dict[str, HFTensor]  # in file order, then header order
    files: tuple[str, ...]


def read_hf_dir(path: str | Path) -> HFDir:
    """The config and the tensor table of the `save_pretrained` directory `path`, after every check above."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory. {HINT}")
    config = _read_json(path / CONFIG_NAME, "model config")
    try:  # the same checks, and messages, as `train --model-config`: sizes within bounds, heads that divide
        hf_config.check_hf_config(config, str(path / CONFIG_NAME))
    except HFModelError as err:
        raise CheckpointError(f"{err} Nothing was written.") from None
    weight_map = _weight_map(path)
    files = tuple(dict.fromkeys(weight_map.values())) if weight_map is not None else (SINGLE_FILE,)
    tensors: dict[str, HFTensor] = {}
    for file in files:
        file_path = path / file
        _check_regular(file_path, "weights file", listed_by=None if weight_map is None else path / WEIGHTS_INDEX)
        header, data_start = read_header_at(file_path)
        for name, entry in header.items():
            if name in tensors:
                raise CheckpointError(
                    f"Tensor {name!r} is in both {path / tensors[name].file} and {file_path}; a model directory holds "
                    f"each tensor once. {HINT}"
                )
            if weight_map is not None and weight_map.get(name) != file:
                listed = weight_map.get(name)
                where = "does not list it" if listed is None else f"puts it in {listed}"
                raise CheckpointError(
                    f"{file_path} holds tensor {name!r}, but {path / WEIGHTS_INDEX} {where}: the weight map and the "
                    f"files disagree. {HINT}"
                )
            tensors[name] = HFTensor(file, entry.dtype, entry.shape, data_start + entry.begin)
    if weight_map is not None:
        absent = next((name for name in weight_map if name not in tensors), None)
        if absent is not None:
            raise CheckpointError(
                f"{path / WEIGHTS_INDEX} puts tensor {absent!r} in {path / weight_map[absent]}, which does not hold "
                f"it: the weight map and the files disagree. {HINT}"
            )
    return HFDir(path, config, tensors, files)


def _weight_map(path: Path) -> dict[str, str] | None:
    """The weight map of a sharded directory, or None for a single `model.safetensors` (which wins, as in
    transformers)."""
    if os.path.lexists(path / SINGLE_FILE):
        return None
    index_path = path / WEIGHTS_INDEX
    if not os.path.lexists(index_path):
        raise CheckpointError(
            f"{path} holds no {SINGLE_FILE} and no {WEIGHTS_INDEX}, so it has no safetensors weights. hfsdp imports "
            "safetensors only: convert PyTorch .bin weights first (load the model in transformers and save_pretrained "
            f"it again). {HINT}"
        )
    data = _read_json(index_path, "weight map")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index_path} has no 'weight_map' object naming the file of each tensor, so it is not a safetensors "
            f"weight index. {HINT}"
        )
    for name, file in weight_map.items():
        problem = plain_name_problem(file) if isinstance(file, str) else "is not a string"
        if problem:
            raise CheckpointError(
                f"{index_path} puts tensor {name!r} in the file {file!r}, which {problem}; a model directory only "
                f"names its own files. {HINT}"
            )
    return weight_map


def _read_json(file: Path, what: str) -> Any:
    try:
        return hf_config.read_json_file(file, what)
    except HFModelError as err:
        raise CheckpointError(f"{err} {HINT}") from None


def _check_regular(file: Path, what: str, listed_by: Path | None = None) -> None:
    """`file` exists and is (or links to) a regular file."""
    try:
        hf_config.check_regular(file, what, listed_by)
    except HFModelError as err:
        raise CheckpointError(f"{err} {HINT}") from None
