"""The `hfsdp` commands, one module each (registered in `hfsdp.cli.main`)."""
