"""The `hfsdp` command: one typer app that only registers commands defined in their own modules.

Importing this module must stay cheap (no torch, no megatron): `hfsdp --help` and
`hfsdp validate-config` on a bad file should answer at once. Commands import heavy
modules inside their bodies.

Every command is registered with one command class, `_Command`: the paths a user names on the command line go
through `settings.user_paths` before the command runs, and an OSError about one of them that escapes the command is
reported as that flag's one paragraph (exit 2); a signal while it runs is one line and exit 128 + signal (before
it runs, `hfsdp/cli/__init__.py` sees to that).
"""

from __future__ import annotations

import inspect
import signal
from importlib.metadata import PackageNotFoundError, version
from pathlib import PurePath
from typing import Annotated

import typer
from typer.core import TyperCommand

from hfsdp.cli import IS_THE_PROGRAM, help_format
from hfsdp.cli.commands.ckpt import app as ckpt_app
from hfsdp.cli.commands.data import app as data_app
from hfsdp.cli.commands.plan import plan
from hfsdp.cli.commands.train import train
from hfsdp.cli.commands.validate import validate_config
from hfsdp.cli.rank import stopping
from hfsdp.cli.settings import user_paths
from hfsdp.cli.settings.report import say
from hfsdp.cli.settings.setting import path
from hfsdp.cli.settings.settings import SETTINGS

#: The parameters (beside those typed `Path`) that hold a user's path: the table's path settings, and the
#: commands' own (`--config`, data prepare's INPUT, `--tokenizer` and `--output`, plan's `--plot`).
PATH_PARAMS = frozenset(
    {s.name for s in SETTINGS if s.check is path} | {"config", "inputs", "tokenizer", "output", "plot"}
)
EXIT_UNUSABLE = 2

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


class _Command(TyperCommand):
    """Every command, so that none handles these on its own:

    - signals: start-up's quiet exit (`hfsdp/cli/__init__.py`) gives way to `stopping.py`'s handlers, which unwind
      the command; an `Interrupted` no command reports itself is one line and exit 128 + signal;
    - paths: those its flags and arguments name go through `user_paths` before it runs, and an `OSError` about one
      of them that escapes it is that path's one paragraph (exit 2), not a traceback.
    """

    def invoke(self, ctx):
        before = {sig: signal.getsignal(sig) for sig in (*stopping.SIGNALS, signal.SIGALRM)}  # and its recheck
        stopping.install()  # from here a signal unwinds the command (its cleanup runs), no longer start-up's exit
        try:
            return self._checked(ctx)
        except stopping.Interrupted as stop:  # a command without a line of its own for it (train and data have)
            stopping.ignore()
            say(
                f"interrupted ({signal.Signals(stop.signum).name}); hfsdp {ctx.command_path.partition(' ')[2]} "
                "did not finish",
                err=True,
            )
            raise typer.Exit(stop.exit_code) from None
        finally:
            if IS_THE_PROGRAM:
                stopping.ignore()  # the command is done: a signal now could only break Python's exit with a traceback
            else:  # called in-process (a test's CliRunner, a notebook): leave the caller's handlers as they were
                for sig, handler in before.items():
                    signal.signal(sig, handler)

    def _checked(self, ctx):
        given = []
        for param in self.params:
            values = ctx.params.get(param.name)
            for value in values if isinstance(values, list | tuple) else [values]:
                if isinstance(value, str | PurePath) and (param.name in PATH_PARAMS or isinstance(value, PurePath)):
                    given.append((_spelled(param), str(value)))
        found = user_paths.first_refused(given)
        if found is None:
            try:
                return super().invoke(ctx)
            except (OSError, ValueError) as err:
                found = user_paths.blame(err, given)
                if found is None:
                    raise
        say(f"error: {found}", err=True)
        raise typer.Exit(EXIT_UNUSABLE)


def _spelled(param) -> str:
    """A parameter as its command's help writes it: the long option, or an argument's metavar."""
    longest = max(getattr(param, "opts", None) or [""], key=len)
    return longest if longest.startswith("-") else (param.metavar or param.name or "").upper()


for _info in [
    *app.registered_commands,
    *(c for g in app.registered_groups for c in g.typer_instance.registered_commands),
]:
    _info.cls = _Command
