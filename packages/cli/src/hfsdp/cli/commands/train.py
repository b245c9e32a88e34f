"""`hfsdp train`: validate everything, then launch through PyTorch's elastic launcher.

On a laptop `hfsdp train --nproc 4` starts 4 local processes itself (`launch.py`). Under
an external `torchrun` (multi-node) it sees the launcher's environment and runs as the
rank it was given instead of spawning. Either way the configuration (`train_config`) and
the paths, checkpoint and device (`preflight`) are checked before any rank starts, and
the run ends with one line on an error or a signal, never a traceback for either.

The options are generated from `settings.SETTINGS`, so a new setting is one table entry.
"""

from __future__ import annotations

import inspect
import os
import signal
import time
from typing import Annotated, Any

import typer

from hfsdp.cli.rank import stopping
from hfsdp.cli.settings.config_file import ConfigFileError
from hfsdp.cli.settings.report import problem_text, say
from hfsdp.cli.settings.settings import SETTINGS
from hfsdp.core.rules.config import ConfigError, Problem

EXIT_INVALID, EXIT_UNUSABLE, EXIT_FAILED = 1, 2, 1
#: How long a rank other than 0 waits before failing on a problem rank 0 reports (the agent then stops it).
REPORT_GRACE_S = 10


def train(**flags: Any) -> None:
    """Train a megatron-core GPT or a Hugging Face causal LM with hybrid-sharded data parallelism.

    Everything is checked before any rank starts: the settings (the rules of validate-config),
    then --load, --save, --metrics, --data-path and the device. Exit codes: 0 done (or nothing
    to do), 1 invalid settings or a rank failed, 2 a file or path cannot be used, 130 / 143
    stopped by SIGINT / SIGTERM (at a step boundary; checkpoints stay intact).
    """
    stopping.install()
    torchrun_world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else None
    rank = int(os.environ.get("RANK", "0")) if torchrun_world is not None else 0
    try:
        code = _train(flags, torchrun_world, rank)
    except stopping.Interrupted as stop:
        stopping.ignore()
        if rank == 0:
            say(
                f"interrupted before training started ({signal.Signals(stop.signum).name}); nothing was saved", err=True
            )
        code = stop.exit_code
    raise typer.Exit(code)


def _train(flags: dict[str, Any], torchrun_world: int | None, rank: int) -> int:
    from hfsdp.cli.checks.preflight import PreflightError, preflight
    from hfsdp.cli.settings.continuation import keep_batch

    def report(problems, what: str) -> None:
        if rank != 0:
            # Under torchrun every rank finds the same problems and rank 0 says them once. The others wait before
            # failing: the agent stops every rank as soon as one exits, and rank 0 must have spoken by then.
            time.sleep(REPORT_GRACE_S)
            return
        if len(problems) == 1:
            say(f"error: {problem_text(problems[0].field, problems[0].message)}", err=True)
            return
        say(f"error: {what} ({len(problems)} problems):", err=True)
        for p in problems:
            say(f"  - {problem_text(p.field, p.message)}", err=True)

    try:
        cfg, own = _settings(flags, torchrun_world)
    except ConfigFileError as err:
        report([Problem("--config", str(err))], "")
        return EXIT_UNUSABLE
    except ConfigError as err:
        report(err.problems, "the training configuration is invalid")
        return EXIT_INVALID
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torchrun_world is not None else cfg.nproc
    try:
        plan = preflight(cfg, verify_checkpoint=rank == 0 and not own, local_ranks=local_ranks)
    except PreflightError as err:
        report(err.problems, "the run cannot start")
        return EXIT_UNUSABLE
    if done := plan.nothing_to_do(cfg):
        if rank == 0:
            say(done)
        return 0
    if plan.checkpoint is not None:
        try:
            cfg = keep_batch(cfg, plan.saved_layout, str(plan.checkpoint))
        except ConfigError as err:
            report(err.problems, "the run cannot resume")
            return EXIT_INVALID
    refused = _memory(cfg, rank, local_ranks)
    if refused is not None:
        report([refused], "the run cannot start")
        return EXIT_UNUSABLE
    resumed_from = str(plan.checkpoint) if plan.checkpoint else None
    if torchrun_world is not None:
        from hfsdp.cli.rank.worker import run_rank

        if rank == 0:
            say(f"rank 0 of {torchrun_world} starting ({cfg.layout.layout_name})")
        return run_rank(cfg, resumed_from)
    from hfsdp.cli.launcher.restarts import check_shrinking, launch

    if problems := check_shrinking(cfg):
        report(problems, "the run cannot shrink as asked")
        return EXIT_INVALID
    return launch(cfg, resumed_from)


def _memory(cfg, rank: int, local_ranks: int):
    """Say the model's size and the memory a rank needs (rank 0); the refusal when a rank has less."""
    from hfsdp.cli.checks.memory_check import check, estimate, start_line

    try:
        shape, mem = estimate(cfg)
    except ValueError:
        return None  # an unreadable --model-config was reported by the checks before this one
    if rank == 0:
        say(start_line(cfg, shape, mem))
    return check(cfg, mem, shape, local_ranks)


def _settings(flags: dict[str, Any], torchrun_world: int | None):
    """The run's settings, and whether they resume the run's own checkpoint (a restart under torchrun).

    Under torchrun a restart is a new process with the same command line: when torchrun restarts (its
    --max-restarts) and --save's latest checkpoint was saved by this run (same --rdzv-id), the run resumes it on
    the world torchrun gave, keeping that checkpoint's inner size and global batch. Outside torchrun, hfsdp's
    launcher does the same for its ranks (`restarts.py`), so the command line is taken as it is.
    """
    from hfsdp.cli.settings import autoresume
    from hfsdp.cli.settings.train_config import gather_train, resolve

    given, problems, nproc = gather_train(flags, torchrun_world)
    if torchrun_world is None:
        return resolve(given, problems, nproc=nproc), False
    theirs = autoresume.torchrun_restarts(given)
    if theirs is not None:
        mine = given["max_restarts"]
        if mine.source in ("flag", "file") and mine.value != theirs.value:
            problems.append(
                Problem(
                    "--max-restarts",
                    f"--max-restarts {mine.value} disagrees with torchrun's --max-restarts {theirs.value}: under "
                    "torchrun the restarts are torchrun's; pass --max-restarts to torchrun and drop it here.",
                )
            )
        given = {**given, "max_restarts": theirs}
    if given["min_nproc"].value is not None:
        problems.append(
            Problem(
                "--min-nproc",
                "--min-nproc shrinks a run on one machine; under torchrun give torchrun --nnodes MIN:MAX instead, and "
                "a restart on fewer nodes keeps the inner size and the global batch.",
            )
        )
    own = autoresume.own_checkpoint(given["save"].value, autoresume.run_id()) if theirs is not None else None
    if own is None or problems:
        return resolve(given, problems, nproc=nproc), False
    return autoresume.resume_own(given, torchrun_world, *own), True


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _signature() -> inspect.Signature:
    """`train`'s options, one per flag of `SETTINGS`, plus --config; every default shown as --help states it."""
    params = []
    for s in SETTINGS:
        if not s.flag:
            continue
        names = f"{s.flag}/--no-{s.flag[2:]}" if s.type is bool else s.flag  # a switch, not a value
        option = typer.Option(
            names, help=s.help, show_default=s.shown_default, rich_help_panel=s.panel, hidden=s.hidden
        )
        params.append(
            inspect.Parameter(
                s.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[s.type | None, option]
            )
        )
    config = typer.Option(
        "--config",
        help="A config file (.yaml, .toml, .json; as validate-config reads it); flags override it, and its world "
        "size sets the number of ranks.",
        show_default="none",
        rich_help_panel="Layout",
    )
    params.append(
        inspect.Parameter(
            "config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[str | None, config]
        )
    )
    return inspect.Signature(params)


train.__signature__ = _signature()  # type: ignore[attr-defined]
