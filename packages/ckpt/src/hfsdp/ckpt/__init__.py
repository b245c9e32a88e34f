"""hfsdp checkpoints: plain safetensors files plus one JSON index, resharded between any two layouts.

Online (collective): `save_checkpoint`, `load_checkpoint` (any layout: reshard on
load). Offline (one process): `reshard`, `export`, `verify`, `inspect`,
`write_from_tensors`. Every failure is a `CheckpointError` whose message names
the file and the fix. The format is described in docs/checkpoints.md.
"""

from hfsdp.ckpt.errors import CheckpointError
from hfsdp.ckpt.export import export
from hfsdp.ckpt.from_tensors import write_from_tensors
from hfsdp.ckpt.index import CheckpointIndex, GroupSpec, read_index
from hfsdp.ckpt.load import load_checkpoint
from hfsdp.ckpt.reshard import reshard
from hfsdp.ckpt.save import save_checkpoint
from hfsdp.ckpt.store import resolve
from hfsdp.ckpt.verify import inspect, verify

__all__ = [
    "CheckpointError",
    "CheckpointIndex",
    "GroupSpec",
    "export",
    "inspect",
    "load_checkpoint",
    "read_index",
    "reshard",
    "resolve",
    "save_checkpoint",
    "verify",
    "write_from_tensors",
]
