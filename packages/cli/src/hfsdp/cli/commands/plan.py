"""`hfsdp plan`: which layout for this model on this cluster, with memory, traffic and time per layout.

The model and the training settings are `hfsdp train`'s own flags, generated from the same
settings table and checked by the same rules (`train_config.resolve`), so a flag means the
same in both commands; the world is `--nodes` x `--gpus-per-node`. Then every candidate
layout is evaluated by `hfsdp.planning` in closed form: no torch, no transformers, no model
built, so the answer takes about a second for 1,024 nodes as for one. Exit codes: 0 a plan
(even when nothing fits: it says so), 1 invalid settings, 2 a file cannot be used.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Annotated, Any

import typer

from hfsdp.cli.settings.plan_settings import CLUSTER_FLAGS, PLAN_SETTINGS
from hfsdp.cli.settings.report import say
from hfsdp.cli.settings.settings import BY_NAME

EXIT_INVALID, EXIT_UNUSABLE = 1, 2


def plan(**flags: Any) -> None:
    """Plan a training run: for every layout of --nodes x --gpus-per-node GPUs, the memory one rank needs (split into
    parameters, gradients, optimizer state, communication buffers and activations), the bytes each mesh axis carries
    per step, the step time with the engine's overlap, and the fastest layout that fits.

    The defaults describe 8 x H200 nodes with NVLink (450 GB/s per GPU each way) and 400 Gb/s per GPU between nodes;
    communication times are unvalidated (docs/planning.md). With --fp8-format and --fp8-param-gather the converted
    weights (those train converts: dims multiples of 16, in*out/(in+out) >= --fp8-min-size) are gathered at one byte
    per element (their amaxes max-reduced once per step); fp8's faster matmuls are not modelled: compute runs at
    --mfu of --peak-tflops. Exit codes: 0 a plan, 1 invalid settings, 2 a file cannot be used (or --plot without
    matplotlib).
    """
    code = _plan(flags)
    raise typer.Exit(code)


def _plan(flags: dict[str, Any]) -> int:
    from hfsdp.cli.commands.plan_report import report_json, report_text
    from hfsdp.cli.commands.plan_setup import PlanInputError, plan_inputs
    from hfsdp.models.hf_config import HFModelError
    from hfsdp.planning.candidates import plan_layouts, recommend
    from hfsdp.planning.model_shape import ModelShapeError

    if flags.get("plot") and importlib.util.find_spec("matplotlib") is None:
        say(
            f"error: --plot {flags['plot']} needs matplotlib, which is not installed; install it "
            "(pip install matplotlib, or pip install 'hfsdp-cli[plot]') or drop --plot.",
            err=True,
        )
        return EXIT_UNUSABLE
    try:
        inputs = plan_inputs(flags)
    except PlanInputError as err:
        _problems(err.problems)
        return EXIT_INVALID
    except HFModelError as err:
        say(f"error: --model-config: {err}", err=True)
        return EXIT_UNUSABLE
    except ModelShapeError as err:
        say(f"error: --model-config: {err}", err=True)
        return EXIT_INVALID
    rows = plan_layouts(inputs.shape, inputs.cluster, inputs.run, inputs.mfu, **inputs.fields)
    best, why = recommend(rows, inputs.cluster)
    if flags.get("format") == "json":
        say(report_json(inputs, rows, best, why))
    else:
        say(report_text(inputs, rows, best, why, show_all=bool(flags.get("all"))))
    if flags.get("plot"):
        from hfsdp.cli.commands.plan_plot import plot

        plot(flags["plot"], inputs, rows, best)
        if flags.get("format") != "json":
            say(f"plot written to {flags['plot']}")
    return 0


def _problems(problems) -> None:
    if len(problems) == 1:
        say(f"error: {problems[0].field}: {problems[0].message}", err=True)
        return
    say(f"error: the plan's settings are invalid ({len(problems)} problems):", err=True)
    for p in problems:
        say(f"  - {p.field}: {p.message}", err=True)


def _signature() -> inspect.Signature:
    """`plan`'s options: train's for the settings a plan depends on (same flag, help and default), the cluster's,
    and the output's."""
    params = []
    for name in PLAN_SETTINGS:
        s = BY_NAME[name]
        names = f"{s.flag}/--no-{s.flag[2:]}" if s.type is bool else s.flag
        option = typer.Option(names, help=s.help, show_default=s.shown_default, rich_help_panel=s.panel)
        params.append(
            inspect.Parameter(
                s.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[s.type | None, option]
            )
        )
    for flag, attr, default, type_, help_text in CLUSTER_FLAGS:
        shown = "see help" if default is None else (f"{default:.1f}" if type_ is float else str(default))
        option = typer.Option(flag, help=help_text, show_default=shown, rich_help_panel="Cluster")
        params.append(
            inspect.Parameter(
                attr, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[type_ | None, option]
            )
        )
    output = (
        ("format", str, "text", typer.Option("--format", help="text for people, json for scripts (one object).")),
        ("plot", str | None, None, typer.Option("--plot", help="Also draw step time against memory to this PNG.")),
        ("all", bool, False, typer.Option("--all", help="List every layout, not the standard ones and the fastest.")),
    )
    for name, type_, default, option in output:
        option.rich_help_panel = "Output"
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[type_, option]
            )
        )
    return inspect.Signature(params)


plan.__signature__ = _signature()  # type: ignore[attr-defined]
