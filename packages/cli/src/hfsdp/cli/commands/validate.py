"""`hfsdp validate-config FILE`: check a config before a job spends GPU hours on it.

Exit 0 and a summary of what the layout will do (meshes, placements, memory per
parameter); exit 1 and every problem at once; exit 2 when the file cannot be read.
`--format json` prints one object in all three cases, for scripts and CI. The rules are
`hfsdp train`'s own (`train_config.build_file_config`): a file valid here trains with
`hfsdp train --config FILE`, and one refused here is refused there.

Nothing here imports torch or megatron-core: the summary reads the placement
table's names (`hfsdp.core.rules.placement_names`), so a CI job gets its answer in a
fraction of a second.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from hfsdp.cli.settings.config_file import ConfigFileError
from hfsdp.cli.settings.report import printable, problem_text
from hfsdp.cli.settings.settings import SETTINGS, STRATEGIES
from hfsdp.cli.settings.train_config import DEFAULT, TrainConfig, build_file_config
from hfsdp.core.rules.config import MEGATRON_NAMES, ConfigError, LayoutConfig, Problem

EXIT_VALID, EXIT_INVALID, EXIT_UNREADABLE = 0, 1, 2
STATES = (("param", "params"), ("grad", "grads"), ("optim", "optimizer"))
BYTES_NOTE = "bf16 params and grads, fp32 main weights and Adam state"
#: Bytes per element of an Adam moment kept in each of the precision-aware optimizer's dtypes (fp8: one fp32 scale
#: per 128 elements beside it).
MOMENT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0 + 4 / 128}


def _optimizer_bytes(run: TrainConfig | None) -> tuple[float, str]:
    """Bytes per element of the fp32 main weights and the two Adam moments, and what the summary assumes."""
    values = run.values if run is not None else {}
    if not values.get("use_precision_aware_optimizer"):
        return 12.0, BYTES_NOTE
    m, v = values["exp_avg_dtype"], values["exp_avg_sq_dtype"]
    main = "fp32 main weights"
    if values.get("store_param_remainders"):
        main += " kept as the bf16 params plus 2-byte remainders"
    return 4 + MOMENT_BYTES[m] + MOMENT_BYTES[v], f"bf16 params and grads, {main}, Adam state {m}/{v}"


def _remainders(run: TrainConfig | None) -> bool:
    return bool(run is not None and run.values.get("store_param_remainders"))


class OutputFormat(StrEnum):
    text = "text"
    json = "json"


def validate_config(
    file: Annotated[
        Path,
        typer.Argument(
            help=f"Config file (.yaml, .yml, .toml or .json). Sharding strategies: {STRATEGIES}.", show_default=False
        ),
    ],
    output_format: Annotated[
        OutputFormat, typer.Option("--format", help="text for people, json for scripts (one object).")
    ] = OutputFormat.text,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size", help="Use this world size instead of the file's.", show_default="the file's world_size"
        ),
    ] = None,
) -> None:
    """Check a config file with `hfsdp train`'s rules and summarise it; exit 0 valid, 1 invalid, 2 unreadable."""
    as_json = output_format is OutputFormat.json
    try:
        cfg = build_file_config(str(file), world_size=world_size)
    except ConfigFileError as err:
        _report_unreadable(err, as_json)
        raise typer.Exit(EXIT_UNREADABLE) from None
    except ConfigError as err:
        _report_invalid(file, err.problems, as_json)
        raise typer.Exit(EXIT_INVALID) from None
    summary = summarize(cfg.layout, cfg)
    if as_json:
        _print_json(True, [], summary)
    else:
        _print_summary(file, summary)


def summarize(cfg: LayoutConfig, run: TrainConfig | None = None) -> dict[str, Any]:
    """What the layout does, as plain data: the JSON `summary` and the source of the text one.

    With `run`, `settings` lists the trainer's file-settable settings, each with its value and
    whether the file set it or it is the default.
    """
    from hfsdp.core.rules.layout import dense_layout, expert_layout

    optim_bytes, assumes = _optimizer_bytes(run)
    remainders = _remainders(run)
    expert: dict[str, Any] | None = None
    if cfg.num_moe_experts is not None:
        expert = {
            "ep": cfg.ep,
            "num_moe_experts": cfg.num_moe_experts,
            "experts_per_rank": cfg.num_moe_experts // cfg.ep,
            **_mesh_summary(expert_layout(cfg), optim_bytes, remainders),
        }
    return {
        "layout": cfg.layout_name,
        "world_size": cfg.world_size,
        "dp": cfg.dp,
        "global_batch_size": cfg.global_batch_size,
        "micro_batch_size": cfg.micro_batch_size,
        "num_microbatches": cfg.num_microbatches,
        "dense": _mesh_summary(dense_layout(cfg), optim_bytes, remainders),
        "expert": expert,
        "bytes_per_param_assumes": assumes,
        "config": {MEGATRON_NAMES[k]: v for k, v in cfg.to_dict().items()},
        "settings": _settings(run) if run is not None else None,
        "diloco": _diloco_summary(cfg, run),
    }


def _diloco_summary(cfg: LayoutConfig, run: TrainConfig | None) -> dict[str, Any] | None:
    """DiLoCo's settings with what they cost: outer-state bytes per parameter on a rank, and the bytes per parameter
    one rank sends on the outer axis per optimizer step (docs/formulas.md: 2·α(R)·b / (N·H), b per comm dtype)."""
    diloco = run.diloco if run is not None else None
    if diloco is None:
        return None
    from hfsdp.core.outer.outer_config import COMM_BYTES
    from hfsdp.core.rules.layout import dense_layout

    mesh, r, n = dense_layout(cfg), cfg.instances, cfg.inner_size
    return {
        **diloco.to_dict(),
        "outer_state_bytes_per_param": mesh.outer_bytes_per_param(diloco.anchored, momentum=diloco.momentum > 0),
        "outer_bytes_per_param_per_step": 2 * (r - 1) / r * COMM_BYTES[diloco.comm_dtype] / (n * diloco.sync_every),
    }


def _settings(run: TrainConfig) -> dict[str, Any]:
    """{file key: {"value", "default"}} of every non-layout setting a config file can set."""
    return {
        s.key: {"value": run.values[s.name], "default": run.given[s.name].source == DEFAULT}
        for s in SETTINGS
        if s.key and not s.layout and s.name in run.values
    }


def _mesh_summary(mesh, optim_bytes: float = 12.0, remainders: bool = False) -> dict[str, Any]:
    from hfsdp.core.rules.placement_names import describe_names

    return {
        "mesh": {"names": list(mesh.names), "shape": list(mesh.shape)},
        "strategies": [a.strategy.value for a in mesh.axes],
        "placements": {state: describe_names(mesh.placement_names(state)) for state, _ in STATES},
        "bytes_per_param": mesh.bytes_per_param(optim_bytes=optim_bytes, remainders=remainders),
    }


def _console(stderr: bool = False) -> Console:
    # soft_wrap: never break a message in the middle; people grep these lines.
    return Console(stderr=stderr, soft_wrap=True, highlight=False, emoji=False)


def _print_json(valid: bool, problems: list[Problem] | tuple[Problem, ...], summary: dict[str, Any] | None) -> None:
    errors = [{"field": p.field, "message": p.message} for p in problems]
    typer.echo(json.dumps({"valid": valid, "errors": errors, "summary": summary}, indent=2))


def _report_unreadable(err: ConfigFileError, as_json: bool) -> None:
    if as_json:
        _print_json(False, [Problem("file", str(err))], None)
    else:
        _console(stderr=True).print(printable(f"hfsdp validate-config: {err}"), markup=False)


def _report_invalid(file: Path, problems: tuple[Problem, ...], as_json: bool) -> None:
    if as_json:
        _print_json(False, problems, None)
        return
    console = _console()
    count = f"{len(problems)} problem" + ("s" if len(problems) != 1 else "")
    console.print(printable(f"{file} is not a valid hfsdp config ({count}):"), markup=False)
    for p in problems:
        console.print(printable(f"  - {problem_text(p.field, p.message)}"), markup=False)


def _print_summary(file: Path, s: dict[str, Any]) -> None:
    console = _console()
    console.print(printable(f"{file} is a valid hfsdp config."), markup=False)
    console.print(f"Layout: {s['layout']}", markup=False)
    batch = ""
    if s["num_microbatches"] is not None:
        batch = (
            f"; {s['num_microbatches']} microbatch(es) of {s['micro_batch_size']} per rank per optimizer step"
            f" (global batch {s['global_batch_size']})"
        )
    console.print(f"World size {s['world_size']}, data-parallel size {s['dp']}{batch}.", markup=False)

    meshes = {"dense parameters": s["dense"]}
    if s["expert"] is not None:
        e = s["expert"]
        meshes[f"expert parameters (ep={e['ep']})"] = e
    rows = [("", *meshes), ("mesh", *(_mesh_text(m["mesh"]) for m in meshes.values()))]
    rows.append(("strategy", *(" over ".join(m["strategies"]) for m in meshes.values())))
    rows += [(label, *(m["placements"][state] for m in meshes.values())) for state, label in STATES]
    rows.append(("bytes/param", *(f"{m['bytes_per_param']:g}" for m in meshes.values())))
    # Aligned by hand, not a rich Table: a table wraps or crops cells on a narrow terminal, garbling placements.
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    console.print()
    for row in rows:
        console.print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(), markup=False)
    console.print()
    note = f"bytes/param: model-state bytes per parameter on one rank, with {s['bytes_per_param_assumes']}."
    if s["expert"] is not None:
        e = s["expert"]
        note += (
            f" Expert figures are per parameter of the {e['experts_per_rank']} of {e['num_moe_experts']}"
            " experts one expert-parallel rank holds."
        )
    console.print(note, markup=False)
    if s["diloco"]:
        d = s["diloco"]
        console.print(
            f"DiLoCo: the instances train apart and meet every {d['sync_every']} steps ({d['fragments']} "
            f"fragment(s), {d['comm_dtype']} exchange); outer state {d['outer_state_bytes_per_param']:g} B/param a "
            f"rank; outer axis {d['outer_bytes_per_param_per_step']:.4g} B/param a rank per step.",
            markup=False,
        )
    if s["settings"]:
        listed = ", ".join(f"{k} {v['value']}{'*' if v['default'] else ''}" for k, v in s["settings"].items())
        console.print(printable(f"Trainer settings (* the default): {listed}."), markup=False)


def _mesh_text(mesh: dict[str, list]) -> str:
    """`dp_outer=2 x dp_shard=4`: axis names with their sizes, outer first."""
    return " x ".join(f"{name}={size}" for name, size in zip(mesh["names"], mesh["shape"], strict=True))
