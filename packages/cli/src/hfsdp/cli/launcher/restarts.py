"""`hfsdp train` on this machine: attempts of the run, restarted after a failure up to `--max-restarts` times.

torchrun's meaning: when any rank dies (SIGKILL, out of memory, an exception) or hangs
(`--step-timeout`), every rank is stopped and all of them start again, up to N times. A restart
is a resume: it loads the newest checkpoint this run published in `--save` (found by the run's
id, `autoresume.py`; before the first one, where the run started), so the steps after that
checkpoint are trained again, exactly (same layout: bit for bit). rank 0 keeps the metrics file
and the progress lines to one record per step (`resume.open_metrics`, the run directory's
"shown"), and the run's last line names every restart. With `--min-nproc M` a restart leaves
out the instance of the rank that failed, as a lost node would be left out under
`torchrun --nnodes MIN:MAX`, while at least M ranks remain: the inner size and the global
batch stay, the instances and the microbatches per rank change (`continuation.on_world`).
Every world the run may shrink to is checked before the first rank starts (`check_shrinking`).

torch's elastic agent can restart ranks too (`max_restarts` of its LaunchConfig), but without
telling its caller which rank failed or letting it change the number of ranks; so each attempt
is one launch without restarts (`launch.attempt`), and this loop decides.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from hfsdp.cli.launcher.failures import Failure
from hfsdp.cli.launcher.launch import attempt
from hfsdp.cli.rank import stopping, timeline
from hfsdp.cli.rank.heartbeat import stacks_dir
from hfsdp.cli.rank.run_dir import (
    ATTEMPT_ENV,
    RUN_DIR_ENV,
    error_file,
    heartbeat_file,
    progress_file,
    read_json,
    write_json,
)
from hfsdp.cli.settings.autoresume import RUN_ID_ENV, own_checkpoint, resume_own
from hfsdp.cli.settings.continuation import on_world
from hfsdp.cli.settings.report import say
from hfsdp.cli.settings.train_config import TrainConfig
from hfsdp.core.rules.config import ConfigError, Problem


def check_shrinking(cfg: TrainConfig) -> list[Problem]:
    """--min-nproc: every world a restart may shrink the run to must hold its layout and its global batch."""
    low = cfg.min_nproc
    if low is None:
        return []
    if low > cfg.nproc:
        return [Problem("--min-nproc", f"--min-nproc {low} is more than the {cfg.nproc} ranks the run starts on; "
                                       f"give at most {cfg.nproc}.")]  # fmt: skip
    inner, batch = cfg.layout.inner_size, cfg.layout.global_batch_size
    for world in range(cfg.nproc - inner, low - 1, -inner):
        try:
            on_world(cfg.given, world, inner, batch)
        except ConfigError as err:
            why = err.problems[0].message
            return [Problem("--min-nproc", f"--min-nproc {low} lets a restart go down to {world} ranks, but {why} "
                                           f"Raise --min-nproc above {world}.")]  # fmt: skip
    return []


def launch(cfg: TrainConfig, resumed_from: str | None = None) -> int:
    """Run the job on this machine, restarting it after failures; return the command's exit code."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    run_dir = Path(tempfile.mkdtemp(prefix="hfsdp-run-"))
    run_id = uuid.uuid4().hex
    devices = _devices(cfg)
    failures: list[Failure] = []
    current, step, origin = cfg, None, resumed_from
    say(f"starting {cfg.nproc} rank{'s' if cfg.nproc != 1 else ''} ({cfg.layout.layout_name})")
    try:
        for number in range(cfg.max_restarts + 1):
            stopping.install()  # the elastic agent of the last attempt may have left its own handlers
            _clear(run_dir)
            env = {RUN_ID_ENV: run_id, **({"CUDA_VISIBLE_DEVICES": ",".join(devices)} if devices else {})}
            timeline.note(cfg.timeline, "attempt started", attempt=number, ranks=current.nproc)
            outcome = attempt(current, run_dir, number, env)
            stopping.install()
            _tidy_stacks(cfg, run_dir, number)
            step = outcome.step
            if outcome.signum is not None:
                return _stopped(cfg, outcome.signum, step, origin)
            if outcome.failure is None:
                timeline.note(cfg.timeline, "attempt done", attempt=number)
                _summary(failures)
                return 0
            failure = outcome.failure
            timeline.note(cfg.timeline, "attempt failed", attempt=number, rank=failure.rank, kind=failure.kind)
            if not failure.restartable or number == cfg.max_restarts:
                return _failed(failures, failure)
            failures.append(failure)
            try:
                current, devices, origin, done = _next(cfg, current, failure, run_id, devices)
            except ConfigError as err:
                return _failed(failures, failure, err.problems)
            if done:
                _summary(failures)
                return 0
            for line in failure.lines[:-1] if failure.kind == "failed" else ():
                say(line, err=True)  # a bug's traceback, once
            where = f"resuming from {origin}" if origin else "starting over from step 0 (no checkpoint yet)"
            pid = f" (pid {failure.pid})" if failure.pid else ""
            say(f"restart {len(failures)} of {cfg.max_restarts}: {failure.short}{pid}; {where} on {current.nproc} "
                f"ranks ({current.layout.layout_name})", err=True)  # fmt: skip
        raise AssertionError("unreachable: the last attempt returns")
    except stopping.Interrupted as stop:
        return _stopped(cfg, stop.signum, step, origin)
    finally:
        stopping.ignore()
        for name in (RUN_ID_ENV, RUN_DIR_ENV, ATTEMPT_ENV):
            os.environ.pop(name, None)
        if not (run_dir / "hangs").exists():
            shutil.rmtree(run_dir, ignore_errors=True)


def _next(cfg: TrainConfig, current: TrainConfig, failure: Failure, run_id: str, devices: list[str] | None):
    """The next attempt after `failure`: (its settings, its GPUs, the checkpoint it resumes, nothing left to do)."""
    from hfsdp.cli.checks.preflight import PreflightError, preflight

    inner, world = cfg.layout.inner_size, current.nproc
    if cfg.min_nproc is not None and failure.rank is not None and world - inner >= cfg.min_nproc:
        lost = failure.rank // inner  # the instance the failed rank belonged to, as a lost node takes its ranks
        world -= inner
        if devices:
            devices = devices[: lost * inner] + devices[(lost + 1) * inner :]
    own = own_checkpoint(cfg.save, run_id)
    if own is not None:
        following = resume_own(cfg.given, world, *own)
    else:
        following = on_world(cfg.given, world, inner, cfg.layout.global_batch_size)
    try:
        plan = preflight(following, verify_checkpoint=False)
    except PreflightError as err:
        raise ConfigError(list(err.problems)) from None
    origin = str(plan.checkpoint) if plan.checkpoint is not None else None
    return following, devices, origin, plan.nothing_to_do(following) is not None


def _devices(cfg: TrainConfig) -> list[str] | None:
    """The GPUs of this run's ranks (CUDA_VISIBLE_DEVICES, else 0..nproc-1), so that a shrunk run can leave out
    the failed instance's; None on CPU."""
    if cfg.device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    listed = [d for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(cfg.nproc)]
    return listed[: cfg.nproc]


def _clear(run_dir: Path) -> None:
    """Before an attempt: no error or heartbeat file of the last one, and no completed step yet (the last
    step printed stays, so that a replayed step's line is not printed twice)."""
    for stale in [*run_dir.glob(error_file("", "*").name), *run_dir.glob(heartbeat_file("", "*").name)]:
        stale.unlink(missing_ok=True)
    shown = read_json(progress_file(run_dir)).get("shown", 0)
    write_json(progress_file(run_dir), {"shown": shown})


def _tidy_stacks(cfg: TrainConfig, run_dir: Path, number: int) -> None:
    """After an attempt: remove the stack files nothing was dumped into (ranks open them at start)."""
    directory = stacks_dir(cfg.save, str(run_dir), number) if cfg.step_timeout else None
    if directory is None or not directory.is_dir():
        return
    for path in directory.glob("rank-*.txt"):
        if path.stat().st_size == 0:
            path.unlink(missing_ok=True)
    for empty in (directory, directory.parent):
        with contextlib.suppress(OSError):
            empty.rmdir()


def _summary(failures: list[Failure]) -> None:
    if failures:
        count = len(failures)
        say(f"{count} restart{'s' if count != 1 else ''}: " + ", ".join(f.short for f in failures))


def _failed(failures: list[Failure], failure: Failure, problems: list[Problem] = ()) -> int:
    if failures:
        count = len(failures)
        say(f"after {count} restart{'s' if count != 1 else ''} ({', '.join(f.short for f in failures)}):", err=True)
    for line in failure.lines:
        say(line, err=True)
    for p in problems:
        say(f"error: the run cannot restart: {p.field}: {p.message}", err=True)
    return 1


def _stopped(cfg: TrainConfig, signum: int, step: int | None, origin: str | None) -> int:
    stopping.ignore()
    say(stopping.stopped_line(signum, step, cfg.save, origin), err=True)
    return 128 + signum
