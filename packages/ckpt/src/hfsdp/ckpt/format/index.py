"""The JSON index: what a checkpoint holds and where each byte of it lives.

The index is the only file that knows about layouts; the safetensors files are
plain bags of 1-D pieces. Every tensor is recorded per state kind ("model",
"main", "exp_avg", ...) under its global name, with its global shape and dtype
and the pieces (file, key, flat_start, flat_stop) of its flattened elements.
The group structure (which parameters share a flat buffer, in which order) is
recorded too, because an offline reshard must rebuild the target layout's
buffers without the model's code.

This module is the data model only. Reading and writing `index.json` (its
checksum, its size limit) is `index_file.py`; checking every field of what was
read is `schema.py` (types, bounds) and `structure.py` (fields against each
other), so the rest of the package can trust an index it is handed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

FORMAT = "hfsdp-checkpoint"
#: Version 4 adds DiLoCo's state: the `outer` record, the outer kinds and a leading instance dimension on every
#: other kind (each instance's own weights and inner optimizer state). It is written only by a save that holds
#: that state, so every other checkpoint stays version 3 and readable by the releases that read 3. Version 3
#: adds the index's own checksum (`index.json.checksum`) and NumPy's RNG state. Version 2 recorded
#: "<algorithm>:<hex>" file checksums and the unsharded module tensors; version 1 (hfsdp 0.1) bare sha256
#: digests and no unsharded tensors. Versions 1 and 2 are read, without an index checksum.
VERSION = 3
OUTER_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
INDEX_NAME = "index.json"
#: State kinds every checkpoint has; optimizer states come on top.
MODEL, MAIN = "model", "main"
#: The module's tensors the engine does not shard (persistent buffers, frozen parameters), stored whole.
UNSHARDED = "unsharded"
#: DiLoCo's outer state, one copy over all instances: the global weights, the outer momentum, and the anchor of a
#: lossy exchange (the weights every instance started its cycle from).
OUTER_MAIN, OUTER_MOMENTUM, OUTER_ANCHOR = "outer_main", "outer_momentum", "outer_anchor"
OUTER_KINDS = (OUTER_MAIN, OUTER_MOMENTUM, OUTER_ANCHOR)
#: The model records an index may carry: a transformers config (`config.to_dict()`), or a megatron-core GPT's
#: `GPTShape.record()`.
TRANSFORMERS, MEGATRON_GPT = "transformers", "megatron-gpt"
MODEL_FORMATS = (TRANSFORMERS, MEGATRON_GPT)


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
    #: What model the weights belong to, {"format": "transformers" | "megatron-gpt", "config": {...}}, or None
    #: (older checkpoints, models of neither kind); `model_record.py` says what export makes of it.
    model: dict[str, Any] | None = None
    #: DiLoCo's record (settings and the position in the cycle, `inner_steps`), or None: then no kind has an
    #: instance dimension and there is no outer kind. See `per_instance`.
    outer: dict[str, Any] | None = None
    version: int = VERSION  # the format version it was read with; written: OUTER_VERSION with `outer`, else VERSION

    def entries(self, kind: str) -> dict[str, TensorEntry]:
        """The tensors of one state kind, or the unsharded module tensors for UNSHARDED."""
        return self.unsharded if kind == UNSHARDED else self.tensors[kind]

    @property
    def kinds(self) -> list[str]:
        return list(self.tensors)

    @property
    def instances(self) -> int:
        """How many copies a per-instance kind holds: the layout's instances with DiLoCo state, else 1."""
        return self.layout.get("instances", 1) if self.outer is not None else 1

    def per_instance(self, kind: str) -> bool:
        """Whether `kind` holds one copy per instance (shape [instances, *shape], instance o's elements at
        o * numel): every kind but the outer ones, in a checkpoint with DiLoCo state."""
        return self.outer is not None and kind not in OUTER_KINDS

    @property
    def weights_kind(self) -> str:
        """The kind that holds the model's weights for export: the global weights with DiLoCo state, else main."""
        return OUTER_MAIN if self.outer is not None else MAIN

    def config(self):
        """The LayoutConfig the checkpoint was saved from (the schema check made sure it is a valid one)."""
        from hfsdp.core.rules.config import LayoutConfig

        return LayoutConfig(**self.layout)

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": FORMAT,
            "version": OUTER_VERSION if self.outer is not None else VERSION,
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
        if self.model is not None:  # optional: an index without it is what earlier releases wrote and read
            out["model"] = self.model
        if self.outer is not None:
            out["outer"] = self.outer
        return out


def _entries_json(entries: dict[str, TensorEntry]) -> dict[str, Any]:
    return {
        name: {"shape": list(t.shape), "dtype": t.dtype, "pieces": [[p.file, p.key, p.start, p.stop] for p in t.pieces]}
        for name, t in entries.items()
    }


def meshes_of(cfg) -> dict[str, Any]:
    """Names and shapes of the dense and expert meshes of `cfg`, for the index."""
    from hfsdp.core.rules.layout import dense_layout, expert_layout

    dense, expert = dense_layout(cfg), expert_layout(cfg)
    out: dict[str, Any] = {"dense": {"names": list(dense.names), "shape": list(dense.shape)}, "expert": None}
    if cfg.num_moe_experts:
        out["expert"] = {"names": list(expert.names), "shape": list(expert.shape), "ep": cfg.ep}
    return out
