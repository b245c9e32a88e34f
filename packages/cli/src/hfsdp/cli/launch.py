"""Starting `--nproc` local ranks through torch's elastic launcher, and reporting how they ended.

The launcher prints "starting N ranks (layout)" at once, hands the ranks to
`torch.distributed.launcher.elastic_launch`, and afterwards says in one line what
happened: nothing (success: rank 0 printed the summary), "interrupted at step N; last
checkpoint DIR/step-K" (exit 128 + signal), or which rank failed and why (exit 1). torch's
own logging of the same events is silenced: it repeats tracebacks, or points at ones that do
not exist. Ranks report their progress and their user-facing errors through a private run
directory (`run_dir.RUN_DIR_ENV`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
import uuid
from pathlib import Path

from hfsdp.cli import stopping
from hfsdp.cli.report import say
from hfsdp.cli.run_dir import RUN_DIR_ENV, error_file, progress_file
from hfsdp.cli.train_config import TrainConfig
from hfsdp.cli.worker import PEER_GONE, entrypoint

#: How long ranks get to leave after a signal before the launcher kills what is left.
GRACE_S = 30


def launch(cfg: TrainConfig, resumed_from: str | None = None) -> int:
    """Run cfg.nproc local ranks; return the command's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _silence_torch_logging()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    run_dir = Path(tempfile.mkdtemp(prefix="hfsdp-run-"))
    os.environ[RUN_DIR_ENV] = str(run_dir)
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
    say(f"starting {cfg.nproc} rank{'s' if cfg.nproc != 1 else ''} ({cfg.layout.layout_name})")
    signum = None
    try:
        elastic_launch(launch_config, entrypoint)(cfg)
    except SignalException as err:  # the elastic agent's handler: it has stopped the ranks
        signum = int(err.sigval)
    except stopping.Interrupted as err:  # ours, before the agent installed its own
        signum = err.signum
    except KeyboardInterrupt:
        signum = signal.SIGINT
    except ChildFailedError as err:
        for line in _failure_report(err, run_dir):
            say(line, err=True)
        return 1
    finally:
        stopping.ignore()
        _reap_ranks()
        os.environ.pop(RUN_DIR_ENV, None)
        step = _last_step(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
    if signum is None:
        return 0
    say(stopping.stopped_line(signum, step, cfg.save, resumed_from), err=True)
    return 128 + signum


def _last_step(run_dir: Path) -> int | None:
    try:
        return int(json.loads(progress_file(run_dir).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _failure_report(err, run_dir: Path) -> list[str]:
    """What to print when ranks failed: the user-facing message, or one rank's traceback and a line naming it."""
    failures = err.failures
    for rank in sorted(failures):
        path = error_file(run_dir, rank)
        if path.is_file():
            return [f"error: {path.read_text().strip()}"]
    # The root cause: not a lost-peer error, a death by signal (SIGKILL, SIGSEGV) first, then the earliest.
    rank, failure = min(
        failures.items(), key=lambda item: (_collateral(item[1]), item[1].exitcode >= 0, item[1].timestamp, item[0])
    )
    if failure.exitcode < 0:
        name = _signal_name(-failure.exitcode)
        return [
            f"error: rank {rank} was killed by signal {-failure.exitcode} ({name}), by the system (out of memory?) "
            "or by someone; every other rank was stopped. It left no traceback."
        ]
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    message = data.get("message", {}) if isinstance(data.get("message"), dict) else {}
    callstack = (message.get("extraInfo") or {}).get("py_callstack", "")
    reason = message.get("message") or f"exit code {failure.exitcode}"
    if callstack:
        last = f"error: rank {rank} failed ({reason}); every other rank was stopped. Its traceback is above."
        return [*callstack.rstrip().splitlines(), last]
    return [f"error: rank {rank} exited with code {failure.exitcode} without a message; every other rank was stopped."]


def _collateral(failure) -> bool:
    """A failure caused by another rank's death (a collective lost its peer): not the one to report."""
    text = json.dumps(failure.error_file_data) if failure.error_file_data else str(failure.message)
    return any(needle in text for needle in PEER_GONE)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def _reap_ranks() -> None:
    """Wait for this launcher's rank processes to be gone; kill any left after the grace period.

    The elastic agent normally stops them itself; this covers a second Ctrl-C that cut its shutdown short.
    """
    deadline = time.monotonic() + GRACE_S
    while _rank_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in _rank_processes():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _rank_processes() -> list[int]:
    """PIDs of this process's children that are spawned ranks (Linux /proc; elsewhere nothing is known)."""
    pids = []
    for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
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
