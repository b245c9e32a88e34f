"""`hfsdp ckpt`: reshard, import, export, inspect and verify checkpoints from the shell.

Exit codes: 0 done; 1 the target layout is invalid (every problem printed);
2 the checkpoint or destination is at fault (one paragraph naming the file and
the fix, never a traceback). With `--format json`, inspect and verify print one
JSON object on stdout whatever happens: the result with "ok": true, or
{"ok": false, "error": "..."} with exit code 2.

Names and paths read from a checkpoint are data: every text line printed goes
through `printable`, so an escape sequence in a tensor name shows as `\x1b`
instead of reaching the terminal. torch is imported only by the commands that
need it (reshard, import, export); `hfsdp --help`, inspect and verify stay fast.
"""

from __future__ import annotations

import contextlib
import json
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from hfsdp.ckpt.format.text import printable
from hfsdp.cli.settings.report import problem_text
from hfsdp.core.rules.strategy import Strategy  # torch-free

EXIT_OK, EXIT_INVALID_LAYOUT, EXIT_CHECKPOINT = 0, 1, 2
STRATEGIES = ", ".join(Strategy.names()) + " (or ddp, zero1, zero2, zero3)"
SOURCES = "the source's"
MIB = 1 << 20

app = typer.Typer(
    name="ckpt",
    help="Reshard, import, export, inspect and verify hfsdp checkpoints.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


class ExportDtype(StrEnum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class ExportFormat(StrEnum):
    auto = "auto"
    hf = "hf"
    megatron = "megatron"


class ComputeDtype(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


COMPUTE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class OutputFormat(StrEnum):
    text = "text"
    json = "json"


def _console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, soft_wrap=True, highlight=False, emoji=False)


def _say(console: Console, text: str) -> None:
    """Print one line, its non-printable characters escaped (names in it may come from a file), and so are the
    characters the output's encoding cannot hold (an ASCII terminal)."""
    encoding = console.encoding or "utf-8"
    console.print(printable(text).encode(encoding, "backslashreplace").decode(encoding), markup=False)


def _fail(command: str, message: str, as_json: bool) -> typer.Exit:
    if as_json:
        typer.echo(json.dumps({"ok": False, "error": printable(message)}))
    else:
        _say(_console(stderr=True), f"hfsdp ckpt {command}: {message}")
    return typer.Exit(EXIT_CHECKPOINT)


def _guarded(command: str, fn, as_json: bool = False):
    """Run `fn`, turning every failure into one paragraph (or JSON object) and exit code 2, never a traceback."""
    from hfsdp.ckpt import CheckpointError

    try:
        return fn()
    except CheckpointError as err:
        raise _fail(command, str(err), as_json) from None
    except OSError as err:
        where = err.filename or "a file"
        raise _fail(command, f"{where}: {err.strerror or err}; check the path and rights.", as_json) from None
    except Exception as err:  # a bug: still one paragraph, with what a report needs
        message = (
            f"internal error ({type(err).__name__}: {err}); this is a bug in hfsdp, not (only) a damaged "
            "checkpoint. Please report it with the command line and the checkpoint's index.json."
        )
        raise _fail(command, message, as_json) from None


def _destination_free(command: str, src: Path, dst: Path) -> None:
    """Refuse a destination that is taken, or is (around) the source, before torch is imported (seconds), with the
    messages and in the order the writer has them."""
    from hfsdp.ckpt.format.staging import check_apart, ensure_absent  # torch-free

    def check() -> None:
        check_apart([src], dst, command)
        ensure_absent(dst, command)

    _guarded(command, check)


def _progress(label: str):
    """A rich progress bar on a terminal and the (done, total) callback that drives it. When stderr is a file or a
    pipe, nothing: a bar there is noise, and rich ends it with an empty line."""
    console = _console(stderr=True)
    if not console.is_terminal:
        return contextlib.nullcontext(), lambda done, total: None
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    bar = Progress(
        f"[bold]{label}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    task = bar.add_task(label, total=None)

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    return bar, update


@app.command()
def reshard(
    src: Annotated[Path, typer.Argument(help="Checkpoint directory, or a root whose 'latest' names one.")],
    dst: Annotated[Path, typer.Argument(help="New directory to write (must not exist, or be empty).")],
    world_size: Annotated[int, typer.Option("--world-size", help="World size of the target layout.")],
    instances: Annotated[
        int | None, typer.Option(help="Optimizer instances (outer axis size).", show_default=SOURCES)
    ] = None,
    outer: Annotated[
        str | None, typer.Option(help=f"Outer sharding strategy: {STRATEGIES}.", show_default=SOURCES)
    ] = None,
    inner: Annotated[
        str | None, typer.Option(help=f"Inner sharding strategy: {STRATEGIES}.", show_default=SOURCES)
    ] = None,
    ep: Annotated[int | None, typer.Option(help="Expert-parallel size.", show_default=SOURCES)] = None,
    expert_strategy: Annotated[
        str | None,
        typer.Option("--expert-strategy", help=f"Expert sharding strategy: {STRATEGIES}.", show_default=SOURCES),
    ] = None,
    global_batch_size: Annotated[
        int | None,
        typer.Option(
            "--global-batch-size",
            help="The run's global batch from now on (a resume keeps the checkpoint's); it must split over the "
            "target's ranks.",
            show_default=SOURCES,
        ),
    ] = None,
    micro_batch_size: Annotated[
        int | None, typer.Option("--micro-batch-size", help="Sequences per rank per microbatch.", show_default=SOURCES)
    ] = None,
    io_threads: Annotated[int, typer.Option("--io-threads", help="Files written in parallel.")] = 4,
    memory_budget: Annotated[int, typer.Option("--memory-budget", help="Bytes in flight, in MiB.")] = 256,
) -> None:
    """Rewrite a checkpoint for another layout; options not given keep the source's values.

    The run's global batch is kept (a resume of the result trains on it); where it does not split over the target's
    ranks the reshard is refused with the sizes that work, unless --global-batch-size or --micro-batch-size says.
    """
    from hfsdp.ckpt import read_index, resolve
    from hfsdp.core.rules.config import ConfigError, LayoutConfig

    _destination_free("reshard", src, dst)
    index = _guarded("reshard", lambda: read_index(resolve(src)))
    given = {"instances": instances, "outer": outer, "inner": inner, "ep": ep, "expert_strategy": expert_strategy}
    given |= {"global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size}
    fields = {**index.layout, "world_size": world_size, **{k: v for k, v in given.items() if v is not None}}
    if fields.get("expert_outer") == "diloco" and instances is not None:
        fields["expert_instances"] = instances  # DiLoCo's experts train apart over the dense instances
    try:
        target = LayoutConfig(**fields)
    except ConfigError as err:
        batch = [p for p in err.problems if p.field == "global_batch_size"]
        if batch and len(batch) == len(err.problems) and fields.get("micro_batch_size"):
            _refuse_batch(fields, world_size, global_batch_size is not None)
        _report_invalid(err)
        raise typer.Exit(EXIT_INVALID_LAYOUT) from None
    from hfsdp.ckpt import reshard as do_reshard

    bar, update = _progress("reshard")
    with bar:
        result = _guarded(
            "reshard",
            lambda: do_reshard(
                src, dst, target, io_threads=io_threads, memory_budget_bytes=memory_budget * MIB, progress=update
            ),
        )
    _say(
        _console(),
        f"Resharded {result.source} ({index.config().layout_name}, world {index.layout['world_size']}) to {dst} "
        f"({target.layout_name}, world {target.world_size}): {result.files} files, {result.bytes_written / 1e9:.3f} GB "
        f"in {result.seconds:.2f} s ({result.gb_per_s:.2f} GB/s).",
    )


def _refuse_batch(fields: dict[str, Any], world_size: int, told: bool) -> None:
    """The run's global batch does not split over the target's ranks: say so, with the sizes that work (exit 1)."""
    from hfsdp.cli.settings.continuation import split_advice

    batch, micro = fields["global_batch_size"], fields["micro_batch_size"]
    whose = "--global-batch-size" if told else "the checkpoint's global batch"
    _say(
        _console(stderr=True),
        f"hfsdp ckpt reshard: {whose} {batch} {split_advice(batch, micro, world_size, '--micro-batch-size')} A resume "
        "of the result keeps this batch; reshard to one of those world sizes, or pass --micro-batch-size, or "
        "--global-batch-size to change the run's batch from here on.",
    )
    raise typer.Exit(EXIT_INVALID_LAYOUT)


def _report_invalid(err, command: str = "reshard") -> None:
    console = _console(stderr=True)
    _say(console, f"hfsdp ckpt {command}: the target layout is invalid ({len(err.problems)} problem(s)):")
    for p in err.problems:
        _say(console, f"  - {problem_text(p.field, p.message)}")


@app.command("import")
def import_(
    src: Annotated[
        Path, typer.Argument(help="A Hugging Face model directory (save_pretrained: config.json, safetensors).")
    ],
    dst: Annotated[Path, typer.Argument(help="New checkpoint directory to write (must not exist, or be empty).")],
    world_size: Annotated[int, typer.Option("--world-size", help="World size of the target layout.")],
    instances: Annotated[
        int | None, typer.Option(help="Optimizer instances (outer axis size).", show_default="1")
    ] = None,
    outer: Annotated[
        str | None, typer.Option(help=f"Outer sharding strategy: {STRATEGIES}.", show_default="no_shard")
    ] = None,
    inner: Annotated[
        str | None, typer.Option(help=f"Inner sharding strategy: {STRATEGIES}.", show_default="optim_grads_params")
    ] = None,
    compute_dtype: Annotated[
        ComputeDtype, typer.Option("--compute-dtype", help="dtype of the training run's compute weights.")
    ] = ComputeDtype.fp32,
    io_threads: Annotated[int, typer.Option("--io-threads", help="Files written in parallel.")] = 4,
    memory_budget: Annotated[int, typer.Option("--memory-budget", help="Bytes in flight, in MiB.")] = 256,
) -> None:
    """Turn a Hugging Face causal LM directory into an hfsdp checkpoint of any layout (step 0, no optimizer)."""
    from hfsdp.core.rules.config import ConfigError, LayoutConfig

    _destination_free("import", src, dst)

    given = {"instances": instances, "outer": outer, "inner": inner}
    try:
        target = LayoutConfig(world_size=world_size, **{k: v for k, v in given.items() if v is not None})
    except ConfigError as err:
        _report_invalid(err, "import")
        raise typer.Exit(EXIT_INVALID_LAYOUT) from None
    from hfsdp.ckpt import import_hf

    bar, update = _progress("import")
    with bar:
        result = _guarded(
            "import",
            lambda: import_hf(
                src,
                dst,
                target,
                compute_dtype=COMPUTE_DTYPES[compute_dtype.value],
                io_threads=io_threads,
                memory_budget_bytes=memory_budget * MIB,
                progress=update,
            ),
        )
    _say(
        _console(),
        f"Imported {result.tensors} tensors from {src} to {dst} ({target.layout_name}, world {target.world_size}, "
        f"step 0, no optimizer state): {result.files} files, {result.bytes_written / 1e9:.3f} GB in "
        f"{result.seconds:.2f} s.",
    )


@app.command()
def export(
    src: Annotated[Path, typer.Argument(help="Checkpoint directory, or a root whose 'latest' names one.")],
    out: Annotated[Path, typer.Argument(help="New directory for the safetensors files (must not exist, or be empty).")],
    dtype: Annotated[
        ExportDtype | None,
        typer.Option(
            help="dtype of the exported weights: by default the model's own (its Hugging Face config's dtype, else "
            "the training --dtype), as save_pretrained keeps it.",
            show_default="the model's own",
        ),
    ] = None,
    output_format: Annotated[
        ExportFormat,
        typer.Option(
            "--format",
            help="hf: a directory transformers' from_pretrained loads (config.json, transformers names; needs the "
            "checkpoint's model record). megatron: the consolidated state dict under the model's own names. auto: "
            "hf when the checkpoint records its model, else megatron.",
        ),
    ] = ExportFormat.auto,
    max_shard_size: Annotated[int, typer.Option("--max-shard-size", help="Largest file, in MiB.")] = 5000,
    io_threads: Annotated[int, typer.Option("--io-threads", help="Files written in parallel.")] = 4,
) -> None:
    """Write the consolidated model weights as standard, size-split safetensors files plus their index."""
    _destination_free("export", src, out)
    from hfsdp.ckpt import export as do_export

    bar, update = _progress("export")
    with bar:
        result = _guarded(
            "export",
            lambda: do_export(
                src,
                out,
                dtype.value if dtype is not None else None,
                format=output_format.value,
                max_shard_bytes=max_shard_size * MIB,
                io_threads=io_threads,
                progress=update,
            ),
        )
    what = "a Hugging Face model directory" if result.format == "hf" else "the consolidated state dict"
    _say(
        _console(),
        f"Exported {result.tensors} tensors ({result.dtype}) as {what} (--format {result.format}) to {out}: "
        f"{result.files} file(s), {result.bytes_written / 1e9:.3f} GB in {result.seconds:.2f} s."
        + (
            f" (Not --format hf: the {result.note}, which no transformers architecture matches.)" if result.note else ""
        ),
    )


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="Checkpoint directory, or a root whose 'latest' names one.")],
    output_format: Annotated[OutputFormat, typer.Option("--format", help="text for people, json for scripts.")] = (
        OutputFormat.text
    ),
) -> None:
    """Show a checkpoint's layout, step, optimizer, tensors and files."""
    from hfsdp.ckpt import inspect as do_inspect

    as_json = output_format is OutputFormat.json
    info = _guarded("inspect", lambda: do_inspect(path), as_json)
    if as_json:
        typer.echo(json.dumps({"ok": True, **info}, indent=2))
    else:
        _print_inspect(info)


def _print_inspect(info: dict[str, Any]) -> None:
    from hfsdp.ckpt.format.checksum import short
    from hfsdp.ckpt.format.model_record import describe

    console = _console()
    layout = info["layout"]
    say = lambda text: _say(console, text)  # noqa: E731
    unsealed = "" if info["index_checksum"] else f" (format version {info['version']}: the index has no checksum)"
    say(f"{info['path']}: step {info['step']}{unsealed}")
    say(f"Layout: {layout['name']}, world size {layout['world_size']}")
    say(f"Model: {describe(info['model'])}")
    if layout.get("num_moe_experts"):
        say(f"Experts: {layout['num_moe_experts']}, ep {layout['ep']}")
    if info.get("outer"):
        say(_describe_outer(info["outer"], layout.get("instances", 1)))
    opt = info["optimizer"]
    if opt:
        steps = sorted({v for v in opt["scalars"].get("step", {}).get("values", {}).values()})
        at = f" at step {steps[0]:g}" if len(steps) == 1 else ""
        say(f"Optimizer: {opt['type']}{at}, states {', '.join(opt['states']) or 'none yet'}")
        for index, group in enumerate(opt["param_groups"]):
            numbers = {k: v for k, v in group["hyper"].items() if not isinstance(v, bool | str) and v is not None}
            hyper = ", ".join(f"{k}={v}" for k, v in numbers.items())
            say(f"  group {index} ({len(group['params'])} tensors): {hyper}")
    say(f"State kinds: {', '.join(info['kinds'])}")
    if info["extra"]:
        say(f"Extra: {json.dumps(info['extra'])}")
    say(f"{len(info['tensors'])} tensors, {info['parameters']:,} parameters:")
    width = max((len(t["name"]) for t in info["tensors"]), default=0)
    for t in info["tensors"]:
        dtypes = ", ".join(f"{k}={v}" for k, v in t["dtypes"].items())
        say(f"  {t['name'].ljust(width)}  {t['shape']!s:<14} {t['bytes']:>12,} B  {dtypes}")
    if info["unsharded"]:
        say(f"{len(info['unsharded'])} unsharded module tensors (buffers, frozen parameters):")
        width = max(len(t["name"]) for t in info["unsharded"])
        for t in info["unsharded"]:
            say(f"  {t['name'].ljust(width)}  {t['shape']!s:<14} {t['bytes']:>12,} B  {t['dtype']}")
    say(f"{len(info['files'])} files, {info['total_bytes']:,} bytes:")
    for f in info["files"]:
        say(f"  {f['name']}  {f['bytes']:>12,}  {short(f['checksum'])}")


def _describe_outer(outer: dict[str, Any], instances: int) -> str:
    """DiLoCo's record in one line: the strategy and H, the outer optimizer, the exchange, the cycle position."""
    h, fragments, done = outer["sync_every"], outer["fragments"], outer["inner_steps"]
    nesterov = "Nesterov " if outer["nesterov"] and outer["momentum"] > 0 else ""
    where = f"{done % h} of {h} steps into the cycle" if fragments == 1 else f"{done} steps done, {fragments} fragments"
    return (
        f"Outer: {outer['strategy']} over {instances} instances, sync every {h} steps (H={h}), {nesterov}SGD lr "
        f"{outer['lr']:g} momentum {outer['momentum']:g}, exchange {outer['comm_dtype']}; {where}"
    )


@app.command()
def verify(
    path: Annotated[Path, typer.Argument(help="Checkpoint directory, or a root whose 'latest' names one.")],
    output_format: Annotated[OutputFormat, typer.Option("--format", help="text for people, json for scripts.")] = (
        OutputFormat.text
    ),
) -> None:
    """Check the index, every file's header and checksum, and that they agree; exit 2 on the first problem."""
    from hfsdp.ckpt import verify as do_verify

    as_json = output_format is OutputFormat.json
    started = time.perf_counter()
    summary = _guarded("verify", lambda: do_verify(path), as_json)
    seconds = time.perf_counter() - started
    if as_json:
        typer.echo(json.dumps({"ok": True, **summary, "seconds": round(seconds, 3)}, indent=2))
        return
    unsealed = "" if summary["index_checksum"] else f" (format version {summary['version']}: index not checksummed)"
    _say(
        _console(),
        f"{summary['path']} is intact{unsealed}: {summary['files']} files, {summary['bytes']:,} bytes, "
        f"{summary['tensors']} tensors x {len(summary['kinds'])} kinds ({', '.join(summary['kinds'])}) checked in "
        f"{seconds:.2f} s.",
    )
