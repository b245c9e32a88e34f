"""Random-number-generator states in a checkpoint: what each rank saves, and how it comes back.

A rank saves torch's CPU generator (and the CUDA one when CUDA is initialised)
as uint8 tensors in its own file, and the global generators of Python's
`random` and of NumPy (`np.random`'s legacy MT19937) as lists of integers in
the index. They come back only on the same world size, rank r getting rank r's.
Restoring is split in two so a damaged state never leaves a rank half-restored:
`read` loads and checks every part (the schema already checked the index's
lists), then `restore` sets them all, which can no longer fail.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.schema import RNG_KEYS

TORCH_CPU, TORCH_CUDA = RNG_KEYS


def capture() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's generator states: the tensors for its file, and the index record (without "file", "keys")."""
    tensors = {TORCH_CPU: torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors[TORCH_CUDA] = torch.cuda.get_rng_state()
    version, words, gauss = random.getstate()
    _, keys, position, has_gauss, cached = np.random.get_state()
    meta = {
        "python": [version, list(words), gauss],
        "numpy": [[int(k) for k in keys], int(position), int(has_gauss), float(cached)],
    }
    return tensors, meta


def read_tensors(ckpt_dir: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The RNG tensors of one rank's record, from its file (whose header `files.check_files` has checked)."""
    path = ckpt_dir / meta["file"]
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in meta["keys"]}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(
            f"The RNG state in {path} cannot be read ({err}); the file is damaged. Restore it from a good copy, or "
            "load with restore_rng=False."
        ) from None


@dataclass(frozen=True)
class RngState:
    tensors: dict[str, torch.Tensor]
    python: tuple
    numpy: tuple | None


def read(ckpt_dir: Path, meta: dict[str, Any]) -> RngState:
    """Load and check one rank's RNG record; every part is one this process's generators accept."""
    tensors = read_tensors(ckpt_dir, meta)
    for key, tensor in tensors.items():
        if not _accepted(key, tensor):
            raise CheckpointError(
                f"The RNG state '{key}' in {ckpt_dir / meta['file']} ({tensor.numel()} values of {tensor.dtype}) is "
                "not one this torch's generator accepts; the file is damaged or from another torch. Restore it, or "
                "load with restore_rng=False."
            )
    version, words, gauss = meta["python"]
    numpy = None
    if "numpy" in meta:
        keys, position, has_gauss, cached = meta["numpy"]
        numpy = ("MT19937", np.array(keys, dtype=np.uint32), position, has_gauss, cached)
    return RngState(tensors, (version, tuple(words), gauss), numpy)


def _accepted(key: str, tensor: torch.Tensor) -> bool:
    """Whether the generator of `key` takes `tensor` as its state (tried, then put back as it was)."""
    if key == TORCH_CUDA and not torch.cuda.is_available():
        return True  # restored only where there is CUDA
    get, put = (torch.get_rng_state, torch.set_rng_state) if key == TORCH_CPU else _cuda_rng()
    current = get()
    try:
        put(tensor)
        return True
    except (RuntimeError, TypeError, ValueError):
        return False
    finally:
        put(current)


def _cuda_rng():
    return torch.cuda.get_rng_state, torch.cuda.set_rng_state


def restore(state: RngState) -> None:
    """Set every generator from a state `read` has checked."""
    if TORCH_CPU in state.tensors:
        torch.set_rng_state(state.tensors[TORCH_CPU])
    if TORCH_CUDA in state.tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(state.tensors[TORCH_CUDA])
    random.setstate(state.python)
    if state.numpy is not None:
        np.random.set_state(state.numpy)
