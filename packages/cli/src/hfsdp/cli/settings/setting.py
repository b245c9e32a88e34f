"""One setting of a run, and the per-value checks settings use: the vocabulary `settings.py`'s table is written in.

A check returns None when a value is fine, else what it must be, finishing a sentence that
starts with the setting's name ("must be a positive whole number such as 1, 2 or 8").
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hfsdp.cli.settings.user_paths import refusal

#: A per-value rule: None when `value` is fine, else what it must be ("must be a positive whole number ...").
Check = Callable[[Any], str | None]

#: One megatron-core seed offset is added to the seed; keep the sum a valid 32-bit seed.
MAX_SEED = 2**31 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def positive_int(value: object) -> str | None:
    return None if _is_int(value) and value >= 1 else "must be a positive whole number such as 1, 2 or 8"


def seed(value: object) -> str | None:
    return None if _is_int(value) and 0 <= value <= MAX_SEED else f"must be a whole number from 0 to {MAX_SEED}"


def non_negative_int(value: object) -> str | None:
    return None if _is_int(value) and value >= 0 else "must be a whole number >= 0 such as 0 or 100"


def boolean(value: object) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def positive_number(value: object) -> str | None:
    return None if _is_number(value) and value > 0 else "must be a positive number such as 3e-4"


def non_negative_number(value: object) -> str | None:
    return None if _is_number(value) and value >= 0 else "must be a number >= 0 such as 0, 0.01 or 1.0"


def unit_interval(value: object) -> str | None:
    return None if _is_number(value) and 0 <= value < 1 else "must be a number in [0, 1) such as 0.9"


def parse_step_range(value: str) -> tuple[int, int] | None:
    """'K' or 'FIRST-LAST' (whole numbers from 1, FIRST <= LAST) as (first, last); None when it is neither."""
    first, dash, last = value.strip().partition("-")
    last = last if dash else first
    if not (first.isdigit() and last.isdigit()) or not 1 <= int(first) <= int(last):
        return None
    return int(first), int(last)


def step_range(value: object) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str) and parse_step_range(value) is not None:
        return None
    return "must be a step K or a range FIRST-LAST of steps counted from 1, such as 5 or 3-4"


def one_of(*choices: str) -> Check:
    def check(value: object) -> str | None:
        if value in choices:
            return None
        guess = difflib.get_close_matches(value, choices, n=1, cutoff=0.8) if isinstance(value, str) else []
        return f"must be one of {', '.join(choices)}" + (f" (did you mean {guess[0]}?)" if guess else "")

    return check


def fraction_or_auto(value: object) -> str | None:
    """A share from 0 to 1 (a number, or its text from a flag), or "auto"."""
    if value == "auto":
        return None
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if _is_number(number) and 0 <= number <= 1:
        return None
    return "must be a number from 0 to 1 (the share of the optimizer state in host memory) or auto"


def path(value: object) -> str | None:
    """A path as text, and one the operating system could open: a config file's NUL byte or 300-byte component is
    an invalid value here (validate-config's exit 1), not a traceback where a command first touches it."""
    if not (isinstance(value, str) and value.strip()):
        return "must be a path"
    reason = refusal(value)
    return None if reason is None else f"must be a path the operating system can open ({reason})"


@dataclass(frozen=True)
class Setting:
    """One thing a run can be told. `name` is the attribute of TrainConfig (or the LayoutConfig field)."""

    name: str
    flag: str | None  # the `hfsdp train` option; None when only a config file sets it
    default: Any
    type: type  # of the flag's value
    help: str
    check: Check | None = None  # layout settings: None, LayoutConfig checks them
    key: str | None = None  # the config-file key, Megatron's name; None when only the flag sets it
    layout: bool = False
    arch: bool = False  # part of the model's architecture: a resumed checkpoint must have the same
    panel: str = "Training"  # the group --help lists it under
    default_text: str | None = None  # what --help shows as the default, when not str(default)
    hidden: bool = False

    @property
    def shown_default(self) -> str:
        return self.default_text if self.default_text is not None else str(self.default)
