"""The `hfsdp` command: one typer app that only registers commands defined in their own modules.

Importing this module must stay cheap (no torch, no megatron): `hfsdp --help` and
`hfsdp validate-config` on a bad file should answer at once. Commands import heavy
modules inside their bodies.
"""

from __future__ import annotations

import inspect
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer

from hfsdp.cli import help_format
from hfsdp.cli.commands.ckpt import app as ckpt_app
from hfsdp.cli.commands.data import app as data_app
from hfsdp.cli.commands.plan import plan
from hfsdp.cli.commands.train import train
from hfsdp.cli.commands.validate import validate_config

help_format.install()
app = typer.Typer(
    name="hfsdp",
    help="Hybrid-sharded data parallelism for PyTorch and megatron-core.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # Inherited by every subcommand (click passes both down): -h works everywhere, defaults are shown.
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)


def _version(value: bool) -> None:
    if value:
        try:
            typer.echo(f"hfsdp {version('hfsdp-cli')}")
        except PackageNotFoundError:
            typer.echo("hfsdp (version unknown: the hfsdp-cli package is not installed)")
        raise typer.Exit()


@app.callback()
def _main(
    _: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", callback=_version, is_eager=True)
    ] = False,
) -> None:
    """Hybrid-sharded data parallelism for PyTorch and megatron-core."""
    # A callback keeps `hfsdp` a group, and carries --version.


def _help(command) -> str:
    """The command's docstring with each paragraph on one line (typer keeps single line breaks)."""
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(command.__doc__).split("\n\n"))


app.command("train", help=_help(train))(train)
app.command("validate-config", help=_help(validate_config))(validate_config)
app.command("plan", help=_help(plan))(plan)
app.add_typer(ckpt_app, name="ckpt", help="Inspect, verify, reshard, import (Hugging Face) and export checkpoints.")
app.add_typer(data_app, name="data", help="Prepare training data: text to a Megatron indexed dataset.")
