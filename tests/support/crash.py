"""A save that dies half-way: run as a script by the crash test (`python -m tests.support.crash ...`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support.ckpt_models import ZERO3, engine, local_state, train


def crash_main(mode: str, root: str, side: str, init_file: str) -> None:
    """Save step 1 (its state goes to `side`), train on, then die by SIGKILL inside the save of step 2.

    mode "mid-write": after a few tensors of the rank file are written;
    mode "before-latest": after step-2 is renamed into place, before `latest` moves.
    """
    import os
    import signal

    import hfsdp.ckpt.live.save as save_module
    import hfsdp.ckpt.tensors.writer as writer_module
    from hfsdp.ckpt import save_checkpoint

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    sm, opt = engine(ZERO3)
    train(sm, opt, 1)
    save_checkpoint(root, sm, opt, step=1)
    torch.save(local_state(sm, opt), side)
    train(sm, opt, 1, start=1)

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if mode == "mid-write":
        original, calls = writer_module.TensorFileWriter.write, [0]

        def write(self, chunk):
            original(self, chunk)
            calls[0] += 1
            if calls[0] == 3:
                self._file.flush()
                die()

        writer_module.TensorFileWriter.write = write
    else:
        save_module.atomic_write_text = die
    save_checkpoint(root, sm, opt, step=2)


if __name__ == "__main__":
    import sys

    crash_main(*sys.argv[1:])
