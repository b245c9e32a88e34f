"""`PieceTensor`: a rank's flat piece of a parameter (or of its optimizer state), as DCP and torch's
state-dict helpers see it.

hfsdp's pieces are ranges of a parameter's flattened elements (`[start, stop)`), cut wherever the
rank's share of a flat buffer ends, so a piece is rarely whole rows. DCP stores a tensor as
rectangular chunks, and a flat range of a tensor is a short list of rectangles, each itself a
contiguous range (a partial row, whole rows, a partial row; recursively for more dimensions):
`chunks_of` cuts it. A `PieceTensor` is a DTensor of the whole parameter's shape on the group's
mesh, whose local tensor is the piece's flat elements, and which tells DCP its true chunks
(`__create_chunk_list__`, `__create_write_items__`, `__get_tensor_shard__`: DCP asks these before it
would compute offsets from the placements, which here would be `torch.chunk`'s, not hfsdp's). DCP
then saves, loads and reshards it like any DTensor: each rank writes its rectangles, replicas are
written once, and a load on another layout reads whichever saved rectangles overlap its own.

Its placements are the optimizer state's (the axes that shard it are `Shard(0)`): only
`device_mesh` and the placements' kinds are used by torch's helpers, and a `distribute_tensor`
over them gives an ordinary DTensor, which `to_piece` reads back. Its whole value
(`full_tensor()`, or `redistribute` to all-`Replicate`, which `get_state_dict(full_state_dict=True)`
calls) is gathered by hfsdp, not by DTensor's chunk arithmetic: every rank places its piece in a
zero tensor and the sharding axes sum the bytes (exact: each byte is nonzero on at most one rank of
the sum). Any other operation on it is refused: it is a view for checkpointing, not a tensor to
compute with. Pickled (`torch.save`), it is its plain piece, as before, so `torch.load(weights_only=
True)` reads it and the same layout loads it back.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

Chunk = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, flat index of its first element


def chunks_of(shape: tuple[int, ...], start: int, stop: int) -> list[Chunk]:
    """The rectangles covering elements [start, stop) of a tensor of `shape` (row-major), in order: each a
    contiguous range of the flattened tensor."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), (stop - start,) * len(shape), start)]
    inner = math.prod(shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)

    def within(row: int, lo: int, hi: int) -> list[Chunk]:
        return [((row, *o), (1, *s), row * inner + f) for o, s, f in chunks_of(shape[1:], lo, hi)]

    if first == last:
        return within(first, head, tail)
    out = []
    if head:
        out += within(first, head, inner)
        first += 1
    if last > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:]), first * inner))
    if tail:
        out += within(last, 0, tail)
    return out


def _spec(mesh, sharded_axes: tuple[int, ...], shape: torch.Size, dtype: torch.dtype) -> DTensorSpec:
    placements = tuple(Shard(0) if k in sharded_axes else Replicate() for k in range(mesh.ndim))
    stride = torch.empty(shape, device="meta").stride()
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, stride, dtype))


class PieceTensor(DTensor):
    """Elements [start, stop) of a tensor of `shape` on this rank (`_local_tensor`, flat), the rest elsewhere."""

    _piece_start: int
    _piece_stop: int

    @staticmethod
    def of(local: torch.Tensor, mesh, sharded_axes: tuple[int, ...], shape, start: int, stop: int) -> PieceTensor:
        """Wrap `local` (any shape, `stop - start` elements, contiguous: a view is kept, not a copy)."""
        flat = local.detach().view(-1)
        if flat.numel() != stop - start:
            raise ValueError(f"a piece of {stop - start} elements cannot be a view of {flat.numel()}")
        made = PieceTensor(flat, _spec(mesh, sharded_axes, torch.Size(shape), flat.dtype), requires_grad=False)
        made._piece_start, made._piece_stop = start, stop
        return made

    def _rewrap(self, local: torch.Tensor) -> PieceTensor:
        sharded = tuple(k for k, p in enumerate(self.placements) if p.is_shard())
        return PieceTensor.of(local, self.device_mesh, sharded, self.shape, self._piece_start, self._piece_stop)

    @property
    def piece_range(self) -> tuple[int, int]:
        return self._piece_start, self._piece_stop

    # -- what DCP asks -------------------------------------------------------------------------

    def _chunks(self) -> list[Chunk]:
        return chunks_of(tuple(self.shape), self._piece_start, self._piece_stop)

    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in self._chunks()]

    def __create_write_items__(self, fqn: str, obj):
        properties = TensorProperties.create_from_tensor(self._local_tensor)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(o)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(o), torch.Size(s)), properties=properties, size=self.shape
                ),
            )
            for o, s, _ in self._chunks()
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, sizes, first in self._chunks():
            if torch.Size(offsets) == index.offset:
                lo = first - self._piece_start
                return self._local_tensor[lo : lo + math.prod(sizes)].view(sizes)
        raise ValueError(f"'{index.fqn}' has no chunk at offset {tuple(index.offset or ())} on this rank")

    # -- the whole value -----------------------------------------------------------------------

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        """The whole tensor on every rank of the mesh (collective over the axes that shard it)."""
        local = self._local_tensor
        size = local.element_size()
        whole = torch.zeros(self.shape.numel() * size, dtype=torch.uint8, device=local.device)
        whole[self._piece_start * size : self._piece_stop * size] = local.contiguous().view(torch.uint8)
        for k, placement in enumerate(self.placements):
            if placement.is_shard():
                dist.all_reduce(whole, group=self.device_mesh.get_group(k))
        return whole.view(local.dtype).view(self.shape)

    def redistribute(self, device_mesh=None, placements=None, *, async_op: bool = False, **kwargs) -> DTensor:
        mesh = device_mesh or self.device_mesh
        if mesh != self.device_mesh or placements is None or not all(p.is_replicate() for p in placements):
            raise NotImplementedError(
                "an hfsdp state-dict tensor redistributes only to Replicate() on its own mesh (its whole value: "
                "full_tensor()); it is a view of this rank's piece for checkpointing, not a DTensor to compute with."
            )
        return DTensor.from_local(self.full_tensor(), mesh, tuple(placements), run_check=False)

    # -- copies keep the piece; nothing else is computed on it ----------------------------------

    def to(self, *args, **kwargs) -> PieceTensor:
        """The piece moved or cast, kept a `PieceTensor` here, before any dispatch: DCP's staging for `async_save`
        calls `.to("cpu")` and `.new_empty(..., device="cpu")`, and torch 2.11's DTensor fast path turns a GPU
        subclass into a plain DTensor there (measured on an H200), whose chunks DCP would then take from the
        placements."""
        return self._rewrap(self._local_tensor.to(*args, **kwargs))

    def cpu(self, *args, **kwargs) -> PieceTensor:
        return self._rewrap(self._local_tensor.cpu(*args, **kwargs))

    def new_empty(self, *size, **kwargs) -> PieceTensor:
        """An empty piece like this one (DCP's staging asks with the whole shape, or none, then fills it in)."""
        return self._rewrap(self._local_tensor.new_empty(self._local_tensor.shape, **kwargs))

    def data_ptr(self) -> int:
        """0, as for any DTensor: the wrapper has no storage of its own (torch would report the local view's offset,
        and DCP's async staging would then copy a storage that is not there)."""
        return 0

    def __deepcopy__(self, memo):
        return self._rewrap(self._local_tensor.clone())

    def __reduce_ex__(self, protocol):
        return self._local_tensor.__reduce_ex__(protocol)

    _COPIES: ClassVar[set] = {
        torch.ops.aten.detach.default,
        torch.ops.aten.alias.default,
        torch.ops.aten.clone.default,
        torch.ops.aten._to_copy.default,
        torch.ops.aten.empty_like.default,
        torch.ops.aten.zeros_like.default,
    }

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func in cls._COPIES and isinstance(first, PieceTensor):
            return first._rewrap(func(first._local_tensor, *args[1:], **kwargs))
        if func is torch.ops.aten.new_empty.default and isinstance(first, PieceTensor):  # DCP's async staging
            return first._rewrap(func(first._local_tensor, list(first._local_tensor.shape), **kwargs))
        if func is torch.ops.aten.copy_.default and isinstance(first, PieceTensor):
            source = args[1]
            if isinstance(source, PieceTensor) and source.piece_range == first.piece_range:
                first._local_tensor.copy_(source._local_tensor, **kwargs)
                return first
        raise NotImplementedError(
            f"{func} on an hfsdp state-dict tensor: it is this rank's piece of a sharded tensor, for checkpointing "
            "(torch.distributed.checkpoint, full_tensor(), to_local()); call full_tensor() for the whole value."
        )


def to_piece(value: torch.Tensor, shape: torch.Size, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of the flattened tensor `value` stands for: a `PieceTensor`'s own local elements
    (its range must be this one), a DTensor's whole value (collective over its mesh), or a plain tensor of the
    whole shape."""
    if isinstance(value, PieceTensor):
        if value.piece_range != (start, stop) or value.shape != shape:
            raise ValueError(
                f"a state-dict tensor holding elements {value.piece_range} of {tuple(value.shape)} was given where "
                f"this rank holds elements ({start}, {stop}) of {tuple(shape)}: load a state dict taken from this "
                "model (get_state_dict, or model/optimizer state_dict()), which torch.distributed.checkpoint fills."
            )
        return value._local_tensor
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"a tensor of shape {tuple(value.shape)} was given for one of shape {tuple(shape)}")
    return value.detach().reshape(-1)[start:stop]
