"""One attempt of a local run: `--nproc` ranks through torch's elastic launcher, and how they ended.

`attempt` hands the ranks to `torch.distributed.launcher.elastic_launch` (one rendezvous
per attempt, no restarts of its own: `restarts.py` decides about those, so that it can
report each failure, resume from the run's own checkpoint and change the number of ranks)
and returns an `Outcome`: done, stopped by a signal, or failed (`failures.py` picks the rank
that caused it). With `--step-timeout` the hang watchdog (`watchdog.py`) watches the
attempt from a thread of this process. torch's own logging of the same events is silenced:
it repeats tracebacks, or points at ones that do not exist. Ranks report their progress and
their user-facing errors through the run directory (`run_dir.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from hfsdp.cli.launcher.failures import Failure, read_failure
from hfsdp.cli.launcher.watchdog import HangWatch
from hfsdp.cli.rank import stopping
from hfsdp.cli.rank.heartbeat import stacks_dir
from hfsdp.cli.rank.run_dir import ATTEMPT_ENV, RUN_DIR_ENV, progress_file, read_json
from hfsdp.cli.rank.worker import entrypoint
from hfsdp.cli.settings.train_config import TrainConfig

#: How long ranks get to leave after a signal before the launcher kills what is left.
GRACE_S = 30


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended: done (signum and failure None), stopped by `signum`, or `failure`."""

    signum: int | None = None
    failure: Failure | None = None
    step: int | None = None  # the last completed step rank 0 recorded


def attempt(cfg: TrainConfig, run_dir: Path, number: int, env: dict[str, str]) -> Outcome:
    """Run one attempt of cfg.nproc local ranks (`env` added to their environment)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _silence_torch_logging()
    os.environ.update({RUN_DIR_ENV: str(run_dir), ATTEMPT_ENV: str(number), **env})
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.nproc,
        run_id=f"hfsdp-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        start_method="spawn",
        **_grace(),
    )
    watch = None
    if cfg.step_timeout:
        watch = HangWatch(run_dir, cfg.nproc, cfg.step_timeout, stacks_dir(cfg.save, str(run_dir), number))
    signum = failure = None
    try:
        with watch or contextlib.nullcontext():
            try:
                elastic_launch(launch_config, entrypoint)(cfg)
            except ChildFailedError as err:
                failure = err
    except SignalException as err:  # the elastic agent's handler: it has stopped the ranks
        signum = int(err.sigval)
    except stopping.Interrupted as err:  # ours, before the agent installed its own
        signum = err.signum
    except KeyboardInterrupt:
        signum = signal.SIGINT
    finally:
        _reap_ranks()
    done = read_json(progress_file(run_dir)).get("step")
    if failure is not None and signum is None:
        in_progress = done + 1 if isinstance(done, int) else None
        return Outcome(failure=read_failure(failure, run_dir, in_progress, watch.hang if watch else None), step=done)
    return Outcome(signum=signum, step=done)


def _reap_ranks() -> None:
    """Wait for this launcher's rank processes to be gone; kill any left after the grace period.

    The elastic agent normally stops them itself; this covers a second Ctrl-C that cut its shutdown short.
    """
    deadline = time.monotonic() + GRACE_S
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in rank_processes():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def rank_processes(launcher: int | None = None) -> list[int]:
    """PIDs of the spawned ranks among the children of `launcher` (this process by default; Linux /proc, elsewhere
    nothing is known). Tests and benchmarks use it to find the ranks of an `hfsdp train` they started."""
    pids = []
    for children in Path(f"/proc/{launcher or os.getpid()}/task").glob("*/children"):
        try:
            pids += [int(p) for p in children.read_text().split()]
        except OSError:
            continue
    ranks = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            ranks.append(pid)
    return ranks


def _silence_torch_logging() -> None:
    """The elastic agent logs every failure and signal with tracebacks; the launcher reports them itself."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _grace() -> dict:
    """How long the agent lets stopping ranks finish before it kills them; only torch builds whose LaunchConfig
    takes a shutdown timeout (2.12 and later) can be told (the GPU image's 2.11 cannot: it keeps its default)."""
    from dataclasses import fields

    from torch.distributed.launcher.api import LaunchConfig

    return {"shutdown_timeout": GRACE_S} if "shutdown_timeout" in {f.name for f in fields(LaunchConfig)} else {}
