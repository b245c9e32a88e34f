"""The command's self-description: --version, -h everywhere, every default and the strategy names in --help."""

from __future__ import annotations

import re
from importlib.metadata import version

import pytest
from typer.testing import CliRunner

from hfsdp.cli.main import app
from hfsdp.cli.settings.settings import SETTINGS
from hfsdp.core.rules.strategy import Strategy

runner = CliRunner()
WIDE = {"COLUMNS": "250", "TERM": "dumb"}  # one line per option, so each default sits beside its flag


def test_version_comes_from_the_package_metadata():
    """`hfsdp --version` prints the installed hfsdp-cli version and exits 0."""
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"hfsdp {version('hfsdp-cli')}"


@pytest.mark.parametrize("command", [[], ["train"], ["validate-config"], ["ckpt"], ["ckpt", "reshard"]])
def test_dash_h_is_help_everywhere(command):
    """-h gives the same text as --help, for the group and every command."""
    short = runner.invoke(app, [*command, "-h"], env=WIDE)
    long = runner.invoke(app, [*command, "--help"], env=WIDE)
    assert short.exit_code == long.exit_code == 0
    assert short.stdout == long.stdout and "Usage:" in short.stdout


def test_train_help_shows_every_default_and_the_strategies():
    """Every visible option of `hfsdp train` shows its default; the strategy names are listed."""
    out = runner.invoke(app, ["train", "--help"], env=WIDE).stdout
    lines = out.splitlines()
    for s in SETTINGS:
        if s.flag is None or s.hidden:
            continue
        line = next(line for line in lines if re.match(rf"^\W*{s.flag}\s", line))
        assert "[default: " in line, line
    assert "--debug-fail-rank" not in out
    assert all(name in out for name in Strategy.names())
    assert "Total optimizer steps of the run" in out  # --steps is the total, also on resume


def test_validate_config_help_lists_the_strategies():
    """`hfsdp validate-config --help` names the four strategies and shows its defaults."""
    out = runner.invoke(app, ["validate-config", "--help"], env=WIDE).stdout
    assert all(name in out for name in Strategy.names())
    assert "[default: text]" in out


def test_ckpt_reshard_help_lists_the_strategies_and_the_source_defaults():
    """`hfsdp ckpt reshard --help` names the four strategies and says that an option left out keeps the source's."""
    out = runner.invoke(app, ["ckpt", "reshard", "--help"], env=WIDE).stdout
    assert all(name in out for name in Strategy.names())
    for flag in ("--instances", "--outer", "--inner", "--ep", "--expert-strategy"):
        line = next(line for line in out.splitlines() if re.match(rf"^\W*{flag}\s", line))
        assert "the source's" in line, line


@pytest.mark.parametrize("command", [["train"], ["ckpt", "reshard"], ["ckpt", "import"], ["ckpt", "export"]])
def test_help_writes_switches_defaults_and_arguments_as_click_does(command):
    """No `<bool>` after a switch (--help, --swiglu), defaults as written (`[default: 1]`, not `[default: (1)]`),
    arguments in capitals in the usage line (`SRC DST`, not `{src} {dst}`)."""
    out = runner.invoke(app, [*command, "--help"], env=WIDE).stdout
    assert "<bool>" not in out and "[default: (" not in out, out
    if command[0] == "ckpt":
        target = "OUT" if command[1] == "export" else "DST"
        assert re.search(rf"Usage: hfsdp ckpt {command[1]} \[OPTIONS\] SRC {target}\s", out), out
        assert "{src}" not in out


def test_ckpt_import_help_shows_its_defaults_and_the_strategies():
    """`hfsdp ckpt import --help` says what --instances, --outer and --inner default to and lists the strategies,
    as reshard does."""
    lines = runner.invoke(app, ["ckpt", "import", "--help"], env=WIDE).stdout.splitlines()
    for flag, default in (("--instances", "1"), ("--outer", "no_shard"), ("--inner", "optim_grads_params")):
        line = next(line for line in lines if re.match(rf"^\W*{flag}\s", line))
        assert f"[default: {default}]" in line, line
        if flag != "--instances":
            assert all(name in line for name in Strategy.names()) and "zero3" in line, line
