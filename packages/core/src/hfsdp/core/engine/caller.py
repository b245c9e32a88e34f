"""Whether torch.distributed.checkpoint is the caller.

`model.state_dict()` has two answers: the full state dict on rank 0, which a user who saves with
`torch.save` wants, and the sharded one FSDP2 gives, which DCP's helpers (`get_state_dict`,
`get_model_state_dict`) build on. The module tells them apart by who calls it.
"""

from __future__ import annotations

import sys

_DCP = "torch.distributed.checkpoint"


def called_from_dcp(depth: int = 12, function: str | None = None) -> bool:
    """Whether one of the calling frames (up to `depth`) belongs to torch.distributed.checkpoint (and, given
    `function`, is that function of it)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        in_dcp = frame.f_globals.get("__name__", "").startswith(_DCP)
        if in_dcp and (function is None or frame.f_code.co_name == function):
            return True
        frame = frame.f_back
    return False
