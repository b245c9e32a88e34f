"""One rank of a run: quiet warnings, signal handling, and errors reported once.

`entrypoint` is what the launcher's elastic agent starts in each local rank (module-level,
so it can be spawned); under an external torchrun, `hfsdp train` calls `run_rank` itself.
Either way a rank never prints a traceback for a user's mistake or for a signal:

- stopped by SIGINT/SIGTERM: exit 128 + signal, quietly (the launcher, or rank 0 under
  torchrun, prints the one line);
- a checkpoint or file-system error: one paragraph (to the launcher, through the run
  directory; under torchrun printed by rank 0 for checkpoint errors, which every rank
  raises together, or by the rank that hit an OSError);
- a collective that failed because another rank is gone: quiet, that rank reports;
- anything else is a bug: its traceback, once, from the rank that raised it.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings

import torch.distributed as dist

from hfsdp.ckpt import CheckpointError
from hfsdp.cli.rank import stopping, timeline
from hfsdp.cli.rank.run_dir import PEER_GONE, RUN_DIR_ENV, error_file
from hfsdp.cli.rank.train_loop import run_training
from hfsdp.cli.settings.report import say
from hfsdp.cli.settings.train_config import TrainConfig


def entrypoint(cfg: TrainConfig) -> None:
    """Run one rank under the launcher's elastic agent; exits with the rank's code.

    A rank that failed leaves at once, without the interpreter's teardown: the agent restarts (or ends) the run only
    once every rank is gone, and tearing down torch and transformers took seconds per rank on a loaded machine.
    """
    code = run_rank(cfg)
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_rank(cfg: TrainConfig, resumed_from: str | None = None) -> int:
    """Train as this rank; return the exit code (raise only for a bug, when the launcher reports it)."""
    quiet_warnings()
    stopping.install()
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        timeline.note(cfg.timeline, "rank started")
    run_dir = os.environ.get(RUN_DIR_ENV)
    try:
        run_training(cfg)
        return 0
    except stopping.Interrupted as stop:
        stopping.hold()
        if run_dir is None and rank == 0:
            say(stopping.stopped_line(stop.signum, stop.step, cfg.save, resumed_from), err=True)
        return stop.exit_code
    except Exception as err:
        stopping.hold()  # the agent's SIGTERM to the other ranks must not cut this report short
        if stopping.requested() is not None:
            return 128 + stopping.requested()  # a peer left because of the signal: nothing to add
        if _peer_gone(err) and run_dir is None:
            return 1  # under torchrun the rank that failed first reports; the launcher picks it out itself
        message = _user_error(err)
        if message is None and run_dir is not None:
            raise  # a bug: the elastic agent records the traceback and the launcher prints it
        if message is None:
            traceback.print_exc()
            say(f"error: rank {rank} failed ({type(err).__name__}: {err}); its traceback is above.", err=True)
        elif run_dir is not None:
            error_file(run_dir, rank).write_text(message)
        elif rank == 0 or not _agreed(err):
            say(f"error: {message}", err=True)
        return 1
    finally:
        stopping.ignore()  # leaving now: a late signal must not interrupt the interpreter's own shutdown


def quiet_warnings() -> None:
    """Silence what users cannot act on (megatron-core's notes on Transformer Engine, Apex, deprecations),
    in every rank, before megatron-core is imported."""
    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|apex|cuda_graph_scope|deprecated).*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def _user_error(err: BaseException) -> str | None:
    """The one-paragraph message of an error the user can fix (a checkpoint, a file), or None for a bug."""
    if isinstance(err, CheckpointError):
        return str(err)
    if isinstance(err, OSError):
        where = f" ({err.filename})" if err.filename else ""
        return f"{err.strerror or err}{where}; check the path, its permissions and free space, then run again."
    return None


def _agreed(err: BaseException) -> bool:
    """Checkpoint errors are raised by every rank together (hfsdp.ckpt agrees on them): one rank reports."""
    return isinstance(err, CheckpointError)


def _peer_gone(err: BaseException) -> bool:
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    return any(text in str(err) for text in PEER_GONE)
