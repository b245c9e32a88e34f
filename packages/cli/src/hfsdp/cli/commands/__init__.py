"""The commands `hfsdp.cli.main` registers, one module each (with their helpers): `train`, `validate`
(validate-config), `ckpt`, `plan` (and `plan_setup`, `plan_report`, `plan_plot`).

May import every other subpackage of hfsdp.cli. Importing a command module stays cheap (no torch): `hfsdp --help`
and `validate-config` import them all; heavy modules are imported inside the command bodies.
"""
