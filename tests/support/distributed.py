"""Run a function on several local gloo processes and collect what each rank returns.

Starting ranks costs seconds per group, so tests run many cases inside one call and
assert on the returned values in the parent process, where pytest reports them.

The ranks are forked from a forkserver that has imported torch, transformers and
megatron-core once: a fresh interpreter per rank spends 2-10 s of CPU importing them,
which on a 2-core machine was most of the suite's time. The forkserver itself runs no
tensor code, so its children start as clean as spawned ones (no threads, no process
group, the default RNG state; `random` reseeds itself after a fork).
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import traceback

import torch.multiprocessing as mp

#: Imported once by the forkserver; a module that is not installed is skipped.
PRELOAD = [
    "torch",
    "torch.distributed",
    "hfsdp.core",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "megatron.core.transformer",
    "megatron.core.models.gpt",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain pickle copies tensor data; torch's queue pickler would share memory that dies with this process.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            gc.collect()  # gloo's finished collectives sit in reference cycles that can abort interpreter exit
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 600.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the results in rank order."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the first group starts the server
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    for _ in range(world_size):
        try:
            rank, status, payload = queue.get(timeout=timeout)
        except Exception as err:
            errors.append(f"no answer from some rank within {timeout} s ({type(err).__name__}: {err})")
            break
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors.append(f"rank {rank}:\n{payload}")
            break
    for p in procs:
        p.join(timeout=5 if errors else timeout)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("distributed worker failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
