"""hfsdp checkpoints: plain safetensors files plus one JSON index, resharded between any two layouts.

Online (collective): `save_checkpoint`, `load_checkpoint` (any layout: reshard on
load), `AsyncSaver` (a save whose writing overlaps training). Offline (one process):
`reshard`, `export` (consolidated or Hugging Face), `import_hf` (a Hugging Face
directory as a checkpoint), `verify`, `inspect`, `write_from_tensors`. Every failure
is a `CheckpointError` whose message names the file and the fix. The format is described in docs/checkpoints.md.

The subpackages, each one concern; each imports only those listed before it:
- `format`: the on-disk format, torch-free (index, schema, headers, checksums, store, staging, verify);
- `tensors`: flat ranges in and out of safetensors files (torch);
- `live`: the bridge to a live sharded model (save, load, model/optimizer/RNG state);
- `hf`: Hugging Face directories in (import) and the names an export writes;
- `offline`: reshard, export, and writing from full tensors, in one process.

Importing this package stays light: `verify`, `inspect`, `read_index`,
`resolve` and `save_conflict` need neither torch nor megatron-core, so `hfsdp ckpt verify` starts at
once. What needs torch is imported on first use (module `__getattr__`).
"""

from __future__ import annotations

import importlib

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.index import CheckpointIndex, GroupSpec
from hfsdp.ckpt.format.index_file import read_index
from hfsdp.ckpt.format.store import resolve, save_conflict
from hfsdp.ckpt.format.verify import inspect, verify

#: Names that need torch, and the module each lives in (no module is named like the function it holds, so a
#: submodule import can never shadow the function on the package).
_LAZY = {
    "AsyncSaver": "hfsdp.ckpt.live.async_save",
    "export": "hfsdp.ckpt.offline.export",
    "import_hf": "hfsdp.ckpt.hf.import_hf",
    "load_checkpoint": "hfsdp.ckpt.live.load",
    "reshard": "hfsdp.ckpt.offline.reshard",
    "save_checkpoint": "hfsdp.ckpt.live.save",
    "write_from_tensors": "hfsdp.ckpt.offline.from_tensors",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AsyncSaver",
    "CheckpointError",
    "CheckpointIndex",
    "GroupSpec",
    "export",
    "import_hf",
    "inspect",
    "load_checkpoint",
    "read_index",
    "reshard",
    "resolve",
    "save_checkpoint",
    "save_conflict",
    "verify",
    "write_from_tensors",
]
