"""The `hfsdp` command: one typer app that only registers commands defined in their own modules.

Importing this module must stay cheap (no torch, no megatron): `hfsdp --help` and
`hfsdp validate-config` on a bad file should answer at once. Commands import heavy
modules inside their bodies.
"""

from __future__ import annotations

import typer

from hfsdp.cli.ckpt import app as ckpt_app
from hfsdp.cli.train import train
from hfsdp.cli.validate import validate_config

app = typer.Typer(
    name="hfsdp",
    help="Hybrid-sharded data parallelism for PyTorch and megatron-core.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _main() -> None:
    """Hybrid-sharded data parallelism for PyTorch and megatron-core."""
    # A callback keeps `hfsdp` a group even while it has a single command.


app.command("train")(train)
app.command("validate-config")(validate_config)
app.add_typer(ckpt_app, name="ckpt", help="Inspect, verify, reshard and export checkpoints.")
