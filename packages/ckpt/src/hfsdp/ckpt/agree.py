"""Failing together: a collective operation must raise on every rank or on none.

If one rank finds a damaged file and raises while the others go on to the next
collective, the job hangs instead of failing. `agree` runs a step on every rank,
exchanges the outcome, and raises the first rank's error everywhere.
"""

from __future__ import annotations

import torch.distributed as dist

from hfsdp.ckpt.errors import CheckpointError


def agree(fn):
    """Run `fn` on every rank; if any rank fails, every rank raises the first failure (rank order)."""
    try:
        value, error = fn(), None
    except CheckpointError as err:
        value, error = None, err
    except OSError as err:
        value, error = None, CheckpointError(f"Rank {dist.get_rank()}: {err}; check the path, the disk and rights.")
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return value
