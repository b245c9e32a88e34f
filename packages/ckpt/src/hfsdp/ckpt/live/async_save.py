"""Saving while training continues: snapshot at a step boundary, write on a background thread, publish later.

A save has three phases (`save.py`); only the middle one takes long, and only it runs here
on a background thread:

1. `save()` (collective, at a step boundary): waits for the save in flight and publishes
   it, then `prepare_save` agrees on the plan and makes the staging directory, and the
   snapshot copies this rank's tensors into host memory. On a GPU the copies go into
   page-locked buffers on a side stream and overlap the next forward and backward; the
   compute stream waits for them only before the next optimizer step
   (`before_update`), the first thing that changes what was saved.
2. The background thread writes the file, checksums it as it goes and fsyncs it. It
   calls no collective and no engine method: nothing it does can interleave with the
   training's collectives on the same process group (gloo and NCCL both require one
   order of collectives per group, and a second thread issuing them would break it).
3. `publish()` (collective): every rank calls it at the same step boundary, which the
   caller agrees on (the training loop adds "my write is done" to the loss all-reduce it
   makes anyway, so all ranks learn together that the checkpoint can be published). It
   exchanges the results, and rank 0 writes the index and moves `latest`, exactly as a
   synchronous save.

At most one save is in flight: the next `save()` waits for it. A process killed during the
write leaves only the hidden staging directory, so the previous checkpoint stays the
latest. Host memory: one snapshot per rank, as large as the rank's file (its pieces of the
weights, the fp32 main weights and the optimizer's state), one block allocated by the first
save (page-locked with cudaHostRegister on a GPU) and reused by the next ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hfsdp.ckpt.live.save import PreparedSave, Snapshot, prepare_save, rank_write_failed


class AsyncSaver:
    """Checkpoint saves whose writing overlaps training; see the module docstring for the protocol.

    `on_written`, if given, runs on the background thread after this rank's file is written (and before the
    write counts as done): an upload, or a fault injected by a test.
    """

    def __init__(self, on_written: Callable[[int], None] | None = None):
        self._buffers: list[torch.Tensor] = []
        self._on_written = on_written
        self._pending: _Pending | None = None
        self._stream = None
        self._sources: list[torch.Tensor] = []
        self._registered: torch.Tensor | None = None

    @property
    def host_bytes(self) -> int:
        """Host memory this saver holds for snapshots (one rank file's worth)."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def written(self) -> bool:
        """Whether this rank's file of the save in flight is written (True when none is in flight); local."""
        return self._pending is None or self._pending.done.is_set()

    def save(self, root: str | Path, model, optimizer=None, *, step: int, **options: Any) -> float:
        """Collective: publish the save in flight (waiting for it), then snapshot this one and start writing it.

        `options` are `save_checkpoint`'s (`extra`, `save_rng`, `model_record`). Returns the seconds spent waiting
        for the previous save. Raises what a synchronous save raises, on every rank together.
        """
        began = time.perf_counter()
        self.publish()
        waited = time.perf_counter() - began
        prepared = prepare_save(root, model, optimizer, step=step, **options)
        self._sources = []
        snapshot = prepared.snapshot(copy=self._copy)
        sources, self._sources = self._sources, []
        self._pending = _Pending(prepared, snapshot, self._stream, sources, self._on_written, step)
        return waited

    def before_update(self) -> None:
        """Call before the optimizer step: the step must not change tensors the snapshot is still copying."""
        if self._pending is not None:
            self._pending.wait_copied_on_device()

    def publish(self) -> Path | None:
        """Collective: wait for this rank's write, then publish the checkpoint; every rank at the same point.

        Returns its directory (None when nothing was in flight); raises its CheckpointError on every rank.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        return pending.prepared.publish(pending.result())

    def _copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of `tensors` in this saver's host buffers (made on first use, reused while the shapes match)."""
        on_gpu = any(t.is_cuda for t in tensors)
        if on_gpu and self._stream is None:
            self._stream = torch.cuda.Stream()
        if [(t.dtype, t.numel()) for t in tensors] != [(b.dtype, b.numel()) for b in self._buffers]:
            self._allocate(tensors, on_gpu)
        if on_gpu:
            self._sources = tensors  # a fresh cast must live until the side stream has copied it
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for buffer, tensor in zip(self._buffers, tensors, strict=True):
                    buffer.copy_(tensor.reshape(-1), non_blocking=True)
        else:
            for buffer, tensor in zip(self._buffers, tensors, strict=True):
                buffer.copy_(tensor.reshape(-1))
        return list(self._buffers)

    def _allocate(self, tensors: list[torch.Tensor], on_gpu: bool) -> None:
        """One host block for every tensor (views at 64-byte aligned offsets), page-locked when the tensors are on
        a GPU. Registered with cudaHostRegister rather than taken from torch's pinned-memory allocator, which
        rounds every block up to a power of two (a 45 GB snapshot would hold 64 GB)."""
        self.close()
        offsets, total = [], 0
        for t in tensors:
            total = -(-total // 64) * 64
            offsets.append(total)
            total += t.numel() * t.element_size()
        block = torch.empty(total, dtype=torch.uint8)
        if on_gpu and total:
            torch.cuda.cudart().cudaHostRegister(block.data_ptr(), total, 0)
            self._registered = block
        self._buffers = [
            block[o : o + t.numel() * t.element_size()].view(t.dtype) for o, t in zip(offsets, tensors, strict=True)
        ]

    def close(self) -> None:
        """Give the host memory back (after the last publish); the next save allocates it again."""
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered.data_ptr())
            self._registered = None
        self._buffers = []


class _Pending:
    """One save in flight: its copies on their way to host memory, then its file being written by a thread."""

    def __init__(self, prepared: PreparedSave, snapshot: Snapshot, stream, sources, on_written, step: int):
        self.prepared, self.step = prepared, step
        self._sources = sources
        self.done = threading.Event()
        self._result: Any = None
        self._copied = None
        self._waited_on_device = False
        if stream is not None:
            self._copied = torch.cuda.Event()
            self._copied.record(stream)
        # A daemon thread: a process leaving on an error must not wait for (or hang in) the write.
        thread = threading.Thread(target=self._write, args=(snapshot, on_written), name="hfsdp-save", daemon=True)
        thread.start()

    def _write(self, snapshot: Snapshot, on_written) -> None:
        try:
            if self._copied is not None:
                self._copied.synchronize()
            self._sources = []
            self._result = snapshot.write()
            if on_written is not None and not isinstance(self._result, Exception):
                on_written(self.step)
        except BaseException as err:  # reported through publish, on every rank
            self._result = snapshot.error or rank_write_failed(snapshot.rank, snapshot.tmp, err)
        finally:
            self.done.set()

    def wait_copied_on_device(self) -> None:
        if self._copied is not None and not self._waited_on_device:
            torch.cuda.current_stream().wait_event(self._copied)
            self._waited_on_device = True

    def result(self):
        self.done.wait()
        return self._result
