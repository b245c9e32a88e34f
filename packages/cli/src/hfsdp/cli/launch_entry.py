"""The function torch.distributed.run starts in every local rank (module-level, so it can be spawned)."""

from __future__ import annotations

import socket

from torch.distributed.elastic.multiprocessing.errors import record


@record
def entrypoint(cfg) -> None:
    """Run one rank; `record` hands an exception's message to the launcher, which stops the other ranks."""
    from hfsdp.cli.train_loop import run_training

    run_training(cfg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
