"""`python -m hfsdp.cli` runs the `hfsdp` command (for machines where the console script is not installed)."""

from hfsdp.cli.main import app

app()
