"""Failing together: a collective operation must raise on every rank or on none.

If one rank finds a damaged file and raises while the others go on to the next
collective, the job hangs instead of failing. `agree` runs a step on every rank,
exchanges the outcome, and raises the first rank's error everywhere. Any
exception takes part in the exchange, not only the expected ones: a rank that
left alone on an unforeseen error would hang the others just the same.
"""

from __future__ import annotations

import torch.distributed as dist

from hfsdp.ckpt.format.errors import CheckpointError


def agree(fn):
    """Run `fn` on every rank; if any rank fails, every rank raises the first failure (rank order)."""
    try:
        value, error = fn(), None
    except Exception as err:
        value, error = None, as_checkpoint_error(err)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return value


def as_checkpoint_error(err: Exception) -> CheckpointError:
    """`err` as a CheckpointError naming this rank (a CheckpointError stays as it is)."""
    if isinstance(err, CheckpointError):
        return err
    rank = dist.get_rank()
    if isinstance(err, OSError):
        return CheckpointError(f"Rank {rank}: {err}; check the path, the disk and rights.")
    return CheckpointError(
        f"Rank {rank} failed unexpectedly ({type(err).__name__}: {err}); every rank stopped. If the checkpoint or "
        "model is not the cause, report this as an hfsdp bug."
    )
