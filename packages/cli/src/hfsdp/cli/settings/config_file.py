"""Reading an hfsdp config file: Megatron's vocabulary in, the values it sets (by setting) out.

A config file has four sections (`parallel`, `ddp`, `model`, `train`) whose keys are
Megatron's argument names, so a config moves between the two unchanged. Keys are found
through `settings.KEYS` (the one table of settings); this module only reads and maps the
file. Whether the values are right is `train_config.resolve`'s job, the same for
`hfsdp train` and `hfsdp validate-config`.

Two kinds of failure, kept apart because the CLI gives them different exit codes:
`ConfigFileError` when the file cannot be read as a mapping at all (exit 2), and
`FileValues.problems` (unknown sections and keys) that join the value problems (exit 1).
A misspelt key whose intended key is clear ("Did you mean 'world_size'?") still sets that
key's value, so one mistake is one problem: the rules judge what the user meant instead of
adding a second, misleading complaint about the key that looks missing.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfsdp.cli.settings.file_parse import FORMATS, ParseError, parse, read_bounded
from hfsdp.cli.settings.report import printable
from hfsdp.cli.settings.settings import KEYS
from hfsdp.core.rules.config import Problem

SUFFIXES = tuple(FORMATS)
SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(k.split(".")[0] for k in KEYS))
#: Keys longer than this get no "did you mean" (difflib's cost grows with the product of lengths).
_MAX_GUESS_LENGTH = 200
#: A file with more problems than this is not a config; the rest are counted, not listed.
MAX_PROBLEMS = 50


class ConfigFileError(Exception):
    """The file is missing, unreadable, unparseable or not a mapping: nothing in it can be checked."""

    def __init__(self, path: str | Path, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"Cannot read the config file '{printable(self.path)}': {reason}")


@dataclass(frozen=True)
class FileValues:
    """What a config file sets: setting name -> (value, the key as written), and the keys it got wrong."""

    path: str
    values: dict[str, tuple[Any, str]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)


def read_mapping(path: str | Path) -> dict[Any, Any]:
    """Parse the file by its extension and return its top-level mapping, or raise ConfigFileError."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigFileError(
            path, f"the extension '{printable(path.suffix)}' is not one hfsdp reads; use {', '.join(SUFFIXES)}."
        )
    try:
        data = parse(read_bounded(path), suffix)
    except FileNotFoundError:
        raise ConfigFileError(path, "there is no such file; check the path.") from None
    except IsADirectoryError:
        raise ConfigFileError(path, "it is a directory, not a file; give the path of a config file.") from None
    except OSError as err:
        raise ConfigFileError(path, f"{err.strerror or err}; check that the file exists and is readable.") from None
    except ParseError as err:
        raise ConfigFileError(path, err.reason) from None
    if not isinstance(data, dict):
        what = "empty" if data is None else f"a {type(data).__name__}"
        raise ConfigFileError(
            path, f"its top level is {what}, not a mapping of sections; start it with 'parallel:' and 'ddp:' sections."
        )
    return data


def read_config_file(path: str | Path) -> FileValues:
    """The values `path` sets and its unknown keys; raises ConfigFileError when it cannot be read."""
    data = read_mapping(path)
    out = FileValues(str(path))
    guessed: dict[str, tuple[Any, str]] = {}
    for section, body in data.items():
        if section not in SECTIONS:
            out.problems.append(
                Problem(_text(section), _unknown(f"'{_text(section)}' is not a section", section, SECTIONS))
            )
            continue
        if body is None:
            continue  # an empty section, e.g. "model:" with nothing under it
        if not isinstance(body, dict):
            out.problems.append(
                Problem(section, f"section '{section}' must be a mapping of key: value, not a {type(body).__name__}.")
            )
            continue
        known = [k.split(".", 1)[1] for k in KEYS if k.startswith(section + ".")]
        for key, value in body.items():
            dotted = f"{section}.{_text(key)}"
            if isinstance(key, str) and dotted in KEYS:
                out.values[KEYS[dotted]] = (value, dotted)
                continue
            guess = _guess(key, known)
            message = f"'{_text(key)}' is not a key of section '{section}'"
            out.problems.append(Problem(dotted, _unknown(message, key, known, guess)))
            if guess is not None:
                guessed.setdefault(KEYS[f"{section}.{guess}"], (value, dotted))
    for name, given in guessed.items():
        out.values.setdefault(name, given)  # judge the typo's value as what the user meant
    if len(out.problems) > MAX_PROBLEMS:
        more = len(out.problems) - MAX_PROBLEMS
        del out.problems[MAX_PROBLEMS:]
        out.problems.append(Problem("file", f"... and {more} more unknown sections or keys; is this an hfsdp config?"))
    return out


def _text(name: object) -> str:
    """A key as messages name it: bounded and printable, whatever its type."""
    text = name if isinstance(name, str) else repr(name)
    return printable(text if len(text) <= 80 else text[:77] + "...")


def _guess(name: object, choices: Iterable[str]) -> str | None:
    if not isinstance(name, str) or len(name) > _MAX_GUESS_LENGTH:
        return None
    found = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def _unknown(what: str, name: object, choices: Iterable[str], guess: str | None = None) -> str:
    """'X is not known. Did you mean Y? Use one of ...' for an unknown section or key."""
    choices = list(choices)
    guess = guess if guess is not None else _guess(name, choices)
    hint = f" Did you mean '{guess}'?" if guess else ""
    return f"{what}.{hint} Use one of {', '.join(choices)}, or remove it."
