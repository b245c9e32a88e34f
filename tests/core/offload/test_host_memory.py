"""Offload's page-locked host buffers: exactly the bytes asked for, locked once, unlocked once after the last view."""

import gc

import pytest
import torch

import hfsdp.core.buffers.flat_group as flat_group
from hfsdp.core.offload.host_memory import page_locked_empty


class Recorder:
    def __init__(self):
        self.locked, self.unlocked = [], []

    def lock(self, address, nbytes):
        self.locked.append((address, nbytes))

    def unlock(self, address):
        self.unlocked.append(address)


@pytest.mark.parametrize("numel,dtype", [(1, torch.float32), (318_767_105 // 1000, torch.float32), (7, torch.bfloat16)])
def test_the_buffer_is_exactly_the_size_asked_for_and_locked_in_place(numel, dtype):
    rec = Recorder()
    buffer = page_locked_empty(numel, dtype, lock=rec.lock, unlock=rec.unlock)
    assert buffer.shape == (numel,) and buffer.dtype == dtype and buffer.device.type == "cpu"
    # Not a power of two: torch's pinned allocator would have asked for the next one up.
    assert rec.locked == [(buffer.data_ptr(), numel * dtype.itemsize)]
    buffer.fill_(3)
    assert buffer.sum().item() == 3 * numel


def test_unlocked_once_after_the_last_view_is_freed_not_before():
    rec = Recorder()
    buffer = page_locked_empty(1000, torch.float32, lock=rec.lock, unlock=rec.unlock)
    address = buffer.data_ptr()
    piece = buffer[100:200].view(10, 10)  # as a parameter's .grad views the group's host gradient
    del buffer
    gc.collect()
    assert rec.unlocked == [], "unlocked while a view of the buffer was alive"
    piece.fill_(1.0)
    assert piece.sum().item() == 100.0
    del piece
    gc.collect()
    assert rec.unlocked == [address]


def test_an_empty_buffer_locks_nothing():
    rec = Recorder()
    assert page_locked_empty(0, torch.float32, lock=rec.lock, unlock=rec.unlock).numel() == 0
    assert rec.locked == [] and rec.unlocked == []


def test_a_failed_lock_says_what_to_do(monkeypatch):
    class Cudart:
        @staticmethod
        def cudaHostRegister(address, nbytes, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart)
    with pytest.raises(RuntimeError, match=r"could not page-lock .* offload a smaller share"):
        page_locked_empty(1 << 20, torch.float32)


def test_groups_on_a_gpu_take_their_host_buffers_from_page_locked_empty(monkeypatch):
    asked = []
    monkeypatch.setattr(flat_group, "page_locked_empty", lambda n, dtype: asked.append((n, dtype)) or torch.empty(n))
    flat_group._host_empty(12, torch.device("cuda"))
    flat_group._host_empty(5, torch.device("cpu"))  # on a CPU run nothing is locked
    assert asked == [(12, torch.float32)]
