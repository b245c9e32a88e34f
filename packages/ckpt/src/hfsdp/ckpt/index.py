"""The JSON index: what a checkpoint holds and where each byte of it lives.

The index is the only file that knows about layouts; the safetensors files are
plain bags of 1-D pieces. Every tensor is recorded per state kind ("model",
"main", "exp_avg", ...) under its global name, with its global shape and dtype
and the pieces (file, key, flat_start, flat_stop) of its flattened elements.
The group structure (which parameters share a flat buffer, in which order) is
recorded too, because an offline reshard must rebuild the target layout's
buffers without the model's code.

Parsing validates the shape of the JSON, so the rest of the package can trust
the types; whether the pieces agree with the files is `verify.py`'s job.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfsdp.ckpt.checksum import split
from hfsdp.ckpt.errors import CheckpointError

FORMAT = "hfsdp-checkpoint"
#: Version 2 records "<algorithm>:<hex>" checksums and the unsharded module tensors; version 1 (hfsdp 0.1)
#: recorded bare sha256 digests and no unsharded tensors.
VERSION = 2
READABLE_VERSIONS = (1, 2)
INDEX_NAME = "index.json"
#: State kinds every checkpoint has; optimizer states come on top.
MODEL, MAIN = "model", "main"
#: The module's tensors the engine does not shard (persistent buffers, frozen parameters), stored whole.
UNSHARDED = "unsharded"


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of a tensor's flattened data, stored as the 1-D tensor `key` of `file`."""

    file: str
    key: str
    start: int
    stop: int


@dataclass
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str
    pieces: list[Piece] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GroupSpec:
    """One flat buffer: its unit, mesh, compute dtype, expert-parallel rank (experts only) and members in order."""

    unit_index: int
    is_expert: bool
    dtype: str
    ep_rank: int | None
    members: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.members)

    def offsets(self) -> list[tuple[str, int, int]]:
        """(name, offset, numel) of each member in the flat buffer."""
        out, offset = [], 0
        for name, shape in self.members:
            numel = math.prod(shape)
            out.append((name, offset, numel))
            offset += numel
        return out


@dataclass(frozen=True)
class FileEntry:
    checksum: str  # "<algorithm>:<hex digest>", see checksum.py
    bytes: int


@dataclass
class CheckpointIndex:
    step: int
    layout: dict[str, Any]
    meshes: dict[str, Any]
    extra: dict[str, Any]
    optimizer: dict[str, Any] | None
    groups: list[GroupSpec]
    tensors: dict[str, dict[str, TensorEntry]]
    files: dict[str, FileEntry]
    rng: dict[str, dict[str, Any]] = field(default_factory=dict)  # str(rank) -> {"file", "keys", "python"}
    order: list[str] = field(default_factory=list)  # global names in the state-dict order of the ep = 1 model
    unsharded: dict[str, TensorEntry] = field(default_factory=dict)  # global name -> whole tensor, one piece

    def entries(self, kind: str) -> dict[str, TensorEntry]:
        """The tensors of one state kind, or the unsharded module tensors for UNSHARDED."""
        return self.unsharded if kind == UNSHARDED else self.tensors[kind]

    @property
    def kinds(self) -> list[str]:
        return list(self.tensors)

    def config(self):
        """The LayoutConfig the checkpoint was saved from."""
        from hfsdp.core.config import ConfigError, LayoutConfig

        try:
            return LayoutConfig(**self.layout)
        except (ConfigError, TypeError) as err:
            raise CheckpointError(
                f"The checkpoint's index records an invalid layout ({err}); it was damaged or written by another "
                "tool. Restore the checkpoint from a copy."
            ) from None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "layout": self.layout,
            "meshes": self.meshes,
            "extra": self.extra,
            "optimizer": self.optimizer,
            "rng": self.rng,
            "order": self.order,
            "groups": [
                {
                    "unit_index": g.unit_index,
                    "is_expert": g.is_expert,
                    "dtype": g.dtype,
                    "ep_rank": g.ep_rank,
                    "members": [[name, list(shape)] for name, shape in g.members],
                }
                for g in self.groups
            ],
            "tensors": {kind: _entries_json(entries) for kind, entries in self.tensors.items()},
            "unsharded": _entries_json(self.unsharded),
            "files": {name: {"checksum": f.checksum, "bytes": f.bytes} for name, f in self.files.items()},
        }

    @classmethod
    def from_json(cls, data: Any, source: str) -> CheckpointIndex:
        """Parse an index, raising CheckpointError naming `source` and the field when it is malformed."""
        try:
            return _parse(data)
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CheckpointError(
                f"The checkpoint index {source} is malformed ({type(err).__name__}: {err}); it was damaged or "
                "written by another tool. Restore the checkpoint from a copy or re-save it."
            ) from None


def _parse(data: dict[str, Any]) -> CheckpointIndex:
    if data.get("format") != FORMAT:
        raise ValueError(f"format is {data.get('format')!r}, expected {FORMAT!r}")
    version = data.get("version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"The checkpoint index has format version {version!r}, but this hfsdp reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}; convert it with the hfsdp release that wrote it."
        )
    groups = [
        GroupSpec(
            int(g["unit_index"]),
            bool(g["is_expert"]),
            str(g["dtype"]),
            None if g["ep_rank"] is None else int(g["ep_rank"]),
            tuple((str(n), tuple(int(s) for s in shape)) for n, shape in g["members"]),
        )
        for g in data["groups"]
    ]
    tensors = {str(kind): _parse_entries(entries) for kind, entries in data["tensors"].items()}
    files = {str(n): _file_entry(f, version) for n, f in data["files"].items()}
    return CheckpointIndex(
        step=int(data["step"]),
        layout=dict(data["layout"]),
        meshes=dict(data["meshes"]),
        extra=dict(data.get("extra") or {}),
        optimizer=data.get("optimizer"),
        groups=groups,
        tensors=tensors,
        files=files,
        rng=dict(data.get("rng") or {}),
        order=[str(n) for n in data.get("order") or []],
        unsharded=_parse_entries(data.get("unsharded") or {}),
    )


def _entries_json(entries: dict[str, TensorEntry]) -> dict[str, Any]:
    return {
        name: {"shape": list(t.shape), "dtype": t.dtype, "pieces": [[p.file, p.key, p.start, p.stop] for p in t.pieces]}
        for name, t in entries.items()
    }


def _parse_entries(data: dict[str, Any]) -> dict[str, TensorEntry]:
    return {
        str(name): TensorEntry(
            tuple(int(s) for s in t["shape"]),
            str(t["dtype"]),
            [Piece(str(f), str(k), int(a), int(b)) for f, k, a, b in t["pieces"]],
        )
        for name, t in data.items()
    }


def _file_entry(data: dict[str, Any], version: int) -> FileEntry:
    checksum = f"sha256:{data['sha256']}" if version == 1 else str(data["checksum"])
    split(checksum)  # raises ValueError for an unknown algorithm: a malformed index
    return FileEntry(checksum, int(data["bytes"]))


def read_index(ckpt_dir: Path) -> CheckpointIndex:
    """Read `ckpt_dir/index.json`; a directory without one is not a (complete) checkpoint."""
    path = Path(ckpt_dir) / INDEX_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not a checkpoint: it has no {INDEX_NAME} (a save that did not finish leaves no index). "
            "Pass a checkpoint directory, or a root directory whose 'latest' file names one."
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"The checkpoint index {path} cannot be read ({err}); the file is damaged. "
            "Restore the checkpoint from a copy or re-save it."
        ) from None
    return CheckpointIndex.from_json(data, str(path))


def meshes_of(cfg) -> dict[str, Any]:
    """Names and shapes of the dense and expert meshes of `cfg`, for the index."""
    from hfsdp.core.layout import dense_layout, expert_layout

    dense, expert = dense_layout(cfg), expert_layout(cfg)
    out: dict[str, Any] = {"dense": {"names": list(dense.names), "shape": list(dense.shape)}, "expert": None}
    if cfg.num_moe_experts:
        out["expert"] = {"names": list(expert.names), "shape": list(expert.shape), "ep": cfg.ep}
    return out
