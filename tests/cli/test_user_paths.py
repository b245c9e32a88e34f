"""Paths the operating system refuses (a name over 255 bytes, a NUL byte) are one paragraph naming the flag or
config key, never a traceback, in every command that takes a path (issue 37, item 6). In-process, through typer's
CliRunner: the refusal comes before any command imports torch."""

from __future__ import annotations

import errno
import os

import pytest
from typer.testing import CliRunner

from hfsdp.cli.main import app
from hfsdp.cli.settings import user_paths

LONG = "a" * 300
BAD = {"long": lambda tmp: f"{tmp}/{LONG}/x", "nul": lambda tmp: f"{tmp}/a\0b"}

#: (command before the flag, the flag, command after it): each takes a path the user names.
FLAGS = [
    (["train"], "--data-path", []),
    (["train"], "--save", []),
    (["train"], "--load", []),
    (["train"], "--metrics", []),
    (["train"], "--tensorboard-dir", []),
    (["train"], "--profile-dir", []),
    (["train"], "--model-config", []),
    (["plan"], "--model-config", []),
    (["data", "prepare", "corpus.jsonl"], "--tokenizer", ["--output", "out"]),
    (["data", "prepare", "corpus.jsonl", "--tokenizer", "tok"], "--output", []),
]


def _one_paragraph(result, code: int, name: str) -> str:
    """The command ended with `code` and said one paragraph that names `name`; no exception escaped it."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if name in line]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize(("before", "flag", "after"), FLAGS, ids=[" ".join([*b, f]) for b, f, _ in FLAGS])
def test_a_flag_naming_a_path_the_os_refuses_is_one_paragraph_and_exit_2(tmp_path, before, flag, after, kind):
    bad = BAD[kind](tmp_path)
    result = CliRunner().invoke(app, [*before, flag, bad, *after])
    line = _one_paragraph(result, 2, flag)
    assert line.startswith(f"error: {flag} ") and "the operating system refuses this path" in line


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_data_prepare_input_the_os_refuses_is_one_paragraph(tmp_path, kind):
    result = CliRunner().invoke(app, ["data", "prepare", BAD[kind](tmp_path), "--tokenizer", "t", "--output", "o"])
    _one_paragraph(result, 2, "INPUT")


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("command", [["validate-config"], ["train", "--config"]])
def test_a_config_files_path_the_os_refuses_is_an_invalid_value(tmp_path, command, kind):
    """In a config file such a path is a value no machine could use: validate-config's exit 1, naming the key, and
    train --config agrees with it."""
    config = tmp_path / "run.json"
    value = BAD[kind](tmp_path).replace("\0", "\\u0000")
    config.write_text(f'{{"parallel": {{"world_size": 1}}, "model": {{"hf_config": "{value}"}}}}')
    result = CliRunner().invoke(app, [*command, str(config)])
    line = _one_paragraph(result, 1, "model.hf_config")
    assert "must be a path the operating system can open" in line


def test_the_config_file_itself_the_os_refuses_is_unreadable(tmp_path):
    result = CliRunner().invoke(app, ["validate-config", f"{tmp_path}/{LONG}.yaml"])
    _one_paragraph(result, 2, "FILE")


def test_an_os_error_escaping_a_command_about_the_users_path_is_one_paragraph(tmp_path, monkeypatch):
    """The boundary behind the check: an OSError a command lets through, about a path the user gave (here under
    --model-config), is that flag's paragraph and exit 2; one about anything else stays the bug it is."""
    from hfsdp.cli.commands import plan

    given = tmp_path / "model"

    def denied(flags):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(given / "config.json"))

    monkeypatch.setattr(plan, "_plan", denied)
    result = CliRunner().invoke(app, ["plan", "--model-config", str(given)])
    line = _one_paragraph(result, 2, "--model-config")
    assert "Permission denied" in line and "config.json" in line

    def elsewhere(flags):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/somewhere/else")

    monkeypatch.setattr(plan, "_plan", elsewhere)
    result = CliRunner().invoke(app, ["plan", "--model-config", str(given)])
    assert isinstance(result.exception, PermissionError)


def test_the_refusals_are_the_kernels(tmp_path):
    """The check from the text alone says what this machine's file system says: 255 bytes of name open, 256 do not
    (bytes, not characters: 'é' is two), and a NUL byte never does."""
    for name, refused in (("a" * 255, False), ("a" * 256, True), ("é" * 127 + "a", False), ("é" * 128, True)):
        path = str(tmp_path / name)
        assert (user_paths.refusal(path) is not None) is refused, len(os.fsencode(name))
        try:
            open(path, "w").close()
        except OSError as err:
            assert refused and err.errno == errno.ENAMETOOLONG
        else:
            assert not refused
    assert user_paths.refusal("a\0b") is not None
    assert user_paths.refusal("/x/" + "a\ud800") is not None  # a lone surrogate: no file name encodes it
    assert user_paths.refusal("/" + "a/" * 2100) is not None  # over PATH_MAX in all
    assert user_paths.refusal("gpt2") is None  # a hub name, as --tokenizer takes
