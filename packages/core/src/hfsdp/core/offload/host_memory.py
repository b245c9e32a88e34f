"""Exact-size page-locked host buffers, for the optimizer state that offload keeps in host memory.

Offloaded units copy their gradients to the host and their updated weights back while the GPU works, which
needs page-locked memory. torch's pinned allocator (`torch.empty(..., pin_memory=True)`) rounds every request
up to the next power of two so that freed blocks can be reused. A unit of a 13B Llama holds 318M elements,
1.27 GB in fp32, which becomes a 2 GiB block: offload then page-locks 1.68x what it stores. On an H200 host with
128 GiB that is what stopped a 13.0B Llama (killed by the OOM killer holding 100 GB page-locked, for buffers of
about 60 GB) and what a 11.75B one spent on nothing (its 125 GB resident matched the rounded sizes to 1%).
Offload's buffers are allocated once and live as long as the model, so reuse buys nothing: `page_locked_empty`
takes exactly the bytes asked for from ordinary memory, page-locks them in place (cudaHostRegister), and
unlocks them when the last tensor that views them is freed.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable

import torch

#: cudaHostRegisterPortable: the memory counts as page-locked in every CUDA context of the process.
_PORTABLE = 1


def page_locked_empty(
    numel: int,
    dtype: torch.dtype = torch.float32,
    *,
    lock: Callable[[int, int], None] | None = None,
    unlock: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """An uninitialised 1-D host tensor of exactly `numel` elements, page-locked until its last view is freed.

    `lock(address, nbytes)` and `unlock(address)` default to CUDA's register and unregister; the tests pass
    their own to check the lifetime on a machine without a GPU."""
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    # ctypes takes the block with calloc: fresh zero pages from the kernel, not touched until they are locked.
    block = (ctypes.c_byte * nbytes)()
    tensor = torch.frombuffer(block, dtype=dtype)  # its storage holds `block` until the last view is gone
    address = ctypes.addressof(block)
    (lock or _cuda_lock)(address, nbytes)
    # Runs when `block` dies, before ctypes frees its memory: after the last storage that views it is released.
    finalizer = weakref.finalize(block, unlock or _cuda_unlock, address)
    finalizer.atexit = False  # at exit the process's memory goes back anyway, and CUDA may be torn down first
    return tensor


def _cuda_lock(address: int, nbytes: int) -> None:
    error = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _PORTABLE))
    if error != 0:
        raise RuntimeError(
            f"could not page-lock {nbytes / 2**30:.2f} GiB of host memory for offloaded optimizer state "
            f"(cudaHostRegister returned error {error}). The host may be short of memory or have a low locked-memory "
            "limit (`ulimit -l`): offload a smaller share (`offload=` a fraction) or raise the limit."
        )


def _cuda_unlock(address: int) -> None:
    # A copy to or from the block may still be queued on a stream: let it finish before the memory is freed.
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(address)
