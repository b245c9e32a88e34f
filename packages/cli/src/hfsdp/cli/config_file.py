"""Reading an hfsdp config file: Megatron's vocabulary in, one validated `LayoutConfig` out.

A config file has four sections (`parallel`, `ddp`, `model`, `train`) whose keys are
Megatron's argument names, so a config moves between the two unchanged. Layout keys
are found through `MEGATRON_NAMES` (the one table of them, in core); the few other keys
the trainer reads are passed through in `FileConfig.model` and `FileConfig.train`.

Two kinds of failure, kept apart because the CLI gives them different exit codes:
`ConfigFileError` when the file cannot be read as a mapping at all, and core's
`ConfigError` when it can but what it says is wrong. The latter carries every problem
at once (unknown keys and broken layout rules together) with each `Problem.field`
spelled as the dotted name the user wrote, e.g. "ddp.outer_dp_sharding_strategy".
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import tomllib
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hfsdp.core.config import MEGATRON_NAMES, ConfigError, LayoutConfig, Problem

SUFFIXES = (".yaml", ".yml", ".toml", ".json")
DTYPES = ("bf16", "fp16", "fp32")

#: "section.key" -> LayoutConfig field, the inverse of core's table.
LAYOUT_KEYS: dict[str, str] = {dotted: name for name, dotted in MEGATRON_NAMES.items()}


class ConfigFileError(Exception):
    """The file is missing, unreadable, unparseable or not a mapping: nothing in it can be checked."""

    def __init__(self, path: str | Path, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"Cannot read the config file '{self.path}': {reason}")


@dataclass(frozen=True)
class FileConfig:
    """A validated config file: the layout, plus the model and train keys the trainer reads."""

    layout: LayoutConfig
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)


# The non-layout keys, each with a check that returns (value, None) or (None, what is wrong).
Check = Callable[[object], tuple[Any, str | None]]


def _positive_int(value: object) -> tuple[Any, str | None]:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value, None
    return None, "must be a positive integer; write a whole number such as 1, 2 or 8"


def _non_negative_int(value: object) -> tuple[Any, str | None]:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value, None
    return None, "must be a non-negative integer such as 0 or 1234"


def _non_negative_float(value: object) -> tuple[Any, str | None]:
    # PyYAML follows YAML 1.1, which reads `1e-4` (no dot) as text: accept such text as the number it spells.
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value), None
    return None, "must be a non-negative number such as 1.0 or 3.0e-4"


def _dtype(value: object) -> tuple[Any, str | None]:
    if isinstance(value, str) and value in DTYPES:
        return value, None
    return None, f"must be one of {', '.join(DTYPES)}"


EXTRA_KEYS: dict[str, Check] = {
    "model.num_layers": _positive_int,
    "model.hidden_size": _positive_int,
    "model.num_attention_heads": _positive_int,
    "model.vocab_size": _positive_int,
    "model.seq_length": _positive_int,
    "model.moe_router_topk": _positive_int,
    "train.train_iters": _positive_int,
    "train.lr": _non_negative_float,
    "train.clip_grad": _non_negative_float,
    "train.seed": _non_negative_int,
    "train.dtype": _dtype,
}

_MISSING_WORLD_SIZE = Problem(
    MEGATRON_NAMES["world_size"],
    "parallel.world_size is missing; set it in the file's 'parallel' section or pass --world-size N.",
)

SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(k.split(".")[0] for k in (*LAYOUT_KEYS, *EXTRA_KEYS)))


def file_problems(problems: Iterable[Problem], names: Mapping[str, str] | None = None) -> list[Problem]:
    """Rename problems' fields from core's short names to the file's: `outer` -> `ddp.outer_dp_sharding_strategy`.

    `names` overrides `MEGATRON_NAMES` per field (the trainer maps a field to the flag that set it);
    fields found in neither are kept as they are.
    """
    table = {**MEGATRON_NAMES, **(names or {})}
    return [Problem(table.get(p.field, p.field), p.message) for p in problems]


def file_config_error(error: ConfigError, names: Mapping[str, str] | None = None) -> ConfigError:
    """`error` with its problems' fields renamed as `file_problems` does."""
    return ConfigError(file_problems(error.problems, names))


def read_mapping(path: str | Path) -> dict[str, Any]:
    """Parse the file by its extension and return its top-level mapping, or raise ConfigFileError."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigFileError(path, f"the extension '{path.suffix}' is not one hfsdp reads; use {', '.join(SUFFIXES)}.")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigFileError(path, "there is no such file; check the path.") from None
    except IsADirectoryError:
        raise ConfigFileError(path, "it is a directory, not a file; give the path of a config file.") from None
    except OSError as err:
        raise ConfigFileError(path, f"{err.strerror or err}; check that the file exists and is readable.") from None
    try:
        text = raw.decode("utf-8")
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_unique_json_object)
        else:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
    except (UnicodeDecodeError, ValueError, yaml.YAMLError) as err:
        kind = {".toml": "TOML", ".json": "JSON"}.get(suffix, "YAML")
        detail = _yaml_detail(err) if isinstance(err, yaml.MarkedYAMLError) else " ".join(str(err).split())
        raise ConfigFileError(path, f"it is not valid {kind} ({detail}); fix the syntax and run again.") from None
    if not isinstance(data, dict):
        what = "empty" if data is None else f"a {type(data).__name__}"
        raise ConfigFileError(
            path, f"its top level is {what}, not a mapping of sections; start it with 'parallel:' and 'ddp:' sections."
        )
    return data


def load_config_file(path: str | Path, world_size_override: int | None = None) -> FileConfig:
    """Read, check and return the config in `path`; `world_size_override` (--world-size) wins over the file.

    Raises ConfigFileError when the file cannot be read as a mapping, else ConfigError with every problem.
    """
    data = read_mapping(path)
    problems: list[Problem] = []
    layout: dict[str, Any] = {}
    extras: dict[str, dict[str, Any]] = {"model": {}, "train": {}}
    for section, body in data.items():
        if section not in SECTIONS:
            problems.append(
                Problem(str(section), _unknown(f"'{section}' is not a section hfsdp knows", section, SECTIONS))
            )
            continue
        if body is None:
            continue  # an empty section, e.g. "model:" with nothing under it
        if not isinstance(body, dict):
            problems.append(
                Problem(section, f"section '{section}' must be a mapping of key: value, not a {type(body).__name__}.")
            )
            continue
        known = [k.split(".", 1)[1] for k in (*LAYOUT_KEYS, *EXTRA_KEYS) if k.startswith(section + ".")]
        for key, value in body.items():
            dotted = f"{section}.{key}"
            if dotted in LAYOUT_KEYS:
                layout[LAYOUT_KEYS[dotted]] = value
            elif dotted in EXTRA_KEYS:
                checked, wrong = EXTRA_KEYS[dotted](value)
                if wrong:
                    problems.append(Problem(dotted, f"{dotted} is {value!r} ({type(value).__name__}) but {wrong}."))
                else:
                    extras[section][key] = checked
            else:
                problems.append(Problem(dotted, _unknown(f"'{key}' is not a key of section '{section}'", key, known)))

    if world_size_override is not None:
        layout["world_size"] = world_size_override
    names = {"world_size": "--world-size"} if world_size_override is not None else None
    missing = "world_size" not in layout
    if missing:
        layout["world_size"] = None  # still let core check everything it can without it
    try:
        cfg = LayoutConfig(**layout)
    except ConfigError as err:
        found = file_problems(err.problems, names)
        if missing:
            found = [p if p.field != MEGATRON_NAMES["world_size"] else _MISSING_WORLD_SIZE for p in found]
        raise ConfigError(problems + found) from None
    if problems:
        raise ConfigError(problems)
    return FileConfig(layout=cfg, model=extras["model"], train=extras["train"])


def _unknown(what: str, name: object, choices: Iterable[str]) -> str:
    """'X is not known. Did you mean Y? Use one of ...' for an unknown section or key."""
    choices = list(choices)
    guess = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.6)
    hint = f" Did you mean '{guess[0]}'?" if guess else ""
    return f"{what}.{hint} Use one of {', '.join(choices)}, or remove it."


def _yaml_detail(err: yaml.MarkedYAMLError) -> str:
    """PyYAML's message without its multi-line source excerpt: 'expected ..., line 2, column 1'."""
    mark = err.problem_mark or err.context_mark
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{err.problem or err.context}{where}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key written twice is an error instead of a silent overwrite."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeLoader reports unhashable keys itself
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key '{key}' appears a second time", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key '{key}' appears twice; keep one of them")
        out[key] = value
    return out
