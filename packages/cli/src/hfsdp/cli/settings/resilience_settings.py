"""The settings of a run that survives failures (docs/resilience.md), and the hidden ones that inject them.

Part of `settings.SETTINGS` (in this order, after the checkpoint settings); apart only to keep each table short.
"""

from __future__ import annotations

from hfsdp.cli.settings.setting import Setting, boolean, non_negative_int, path, positive_int, positive_number

RESILIENCE_SETTINGS: tuple[Setting, ...] = (
    Setting(
        "max_restarts",
        "--max-restarts",
        0,
        int,
        "Restart all ranks up to N times when one dies, hangs or fails, from this run's last checkpoint in --save.",
        non_negative_int,
        panel="Resilience",
    ),
    Setting(
        "min_nproc",
        "--min-nproc",
        None,
        int,
        "A restart drops the failed rank's instance while this many ranks remain (torchrun: --nnodes MIN:MAX).",
        positive_int,
        panel="Resilience",
        default_text="--nproc",
    ),
    Setting(
        "step_timeout",
        "--step-timeout",
        None,
        float,
        "A step, save or load making no progress this long is a hang: stacks dumped, ranks stopped (and restarted).",
        positive_number,
        panel="Resilience",
        default_text="off",
    ),
    Setting(
        "async_save",
        "--async-save",
        False,
        bool,
        "Write checkpoints in the background while training goes on (host memory: one rank file per rank).",
        boolean,
        panel="Checkpoints",
    ),
    Setting(
        "debug_fail_rank",
        "--debug-fail-rank",
        None,
        int,
        "Fault injection: this rank raises at its second step.",
        hidden=True,
    ),
    Setting(
        "debug_slow_save",
        "--debug-slow-save",
        None,
        int,
        "Fault injection: in the first attempt, the background write of this step's save stalls after writing.",
        positive_int,
        hidden=True,
    ),
    Setting(
        "timeline",
        "--timeline",
        None,
        str,
        "Append timestamped events (launch, failure, restart, load, first step) to this file as JSON lines.",
        path,
        hidden=True,
    ),
)
