"""`verify`: is this checkpoint exactly what its index says? `inspect`: what does it hold (with DiLoCo state,
its settings and place in the cycle, `outer`)?

Both read the index through `index_file.read_index`, the gate every reader
passes: the index's own checksum, then its schema and its structure (every
kind lists the group's tensors with the group's shapes, pieces cover each
tensor exactly once, files named by pieces and RNG records are listed, names
stay inside the directory). verify then checks every file against the index
(`files.check_files`): a regular file of the recorded size, a valid
safetensors header holding each piece and RNG state with its dtype and
length, and the recorded checksum. inspect reads the index only.

Neither needs torch or megatron-core: the CLI answers in a fraction of a second.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hfsdp.ckpt.format.dtypes import itemsize
from hfsdp.ckpt.format.files import check_files
from hfsdp.ckpt.format.index import MAIN
from hfsdp.ckpt.format.index_file import read_index
from hfsdp.ckpt.format.store import resolve


def verify(path: str | Path, io_threads: int = 4) -> dict[str, Any]:
    """Raise CheckpointError on the first problem found; return a short summary when there is none."""
    ckpt_dir = resolve(path)
    index = read_index(ckpt_dir)
    checked = check_files(ckpt_dir, index, threads=io_threads)
    return {
        "path": str(ckpt_dir),
        "version": index.version,
        "index_checksum": index.version >= 3,
        "files": len(index.files),
        "bytes": checked,
        "tensors": len(index.tensors[MAIN]),
        "kinds": index.kinds,
    }


def inspect(path: str | Path) -> dict[str, Any]:
    """What a checkpoint holds: layout, step, optimizer, tensors (shapes, dtypes, bytes) and files."""
    ckpt_dir = resolve(path)
    index = read_index(ckpt_dir)
    tensors = []
    lead = 1 if index.per_instance(MAIN) else 0  # DiLoCo state: one copy per instance of the per-instance kinds
    for name, main in index.tensors[MAIN].items():
        dtypes = {kind: entries[name].dtype for kind, entries in index.tensors.items()}
        tensors.append(
            {
                "name": name,
                "shape": list(main.shape)[lead:],
                "numel": math.prod(main.shape[lead:]),
                "dtypes": dtypes,
                "bytes": sum(e[name].numel * itemsize(e[name].dtype) for e in index.tensors.values()),  # all kinds
                "pieces": len(main.pieces),
            }
        )
    return {
        "path": str(ckpt_dir),
        "version": index.version,
        "index_checksum": index.version >= 3,
        "step": index.step,
        "layout": {**index.layout, "name": index.config().layout_name},
        "meshes": index.meshes,
        "optimizer": index.optimizer,
        "outer": index.outer,
        "extra": index.extra,
        "model": index.model,
        "kinds": index.kinds,
        "groups": len(index.groups),
        "tensors": tensors,
        "parameters": sum(t["numel"] for t in tensors),
        "unsharded": [
            {"name": name, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.numel * itemsize(t.dtype)}
            for name, t in index.unsharded.items()
        ],
        "files": [{"name": n, "bytes": f.bytes, "checksum": f.checksum} for n, f in index.files.items()],
        "total_bytes": sum(f.bytes for f in index.files.values()),
    }
