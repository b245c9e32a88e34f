"""What `build_train_config` refuses, as the settings tests read it: one message per field."""

from __future__ import annotations

import pytest

from hfsdp.cli.settings.train_config import build_train_config
from hfsdp.core.rules.config import ConfigError


def train_problems(flags: dict) -> dict[str, str]:
    """The problems `flags` (on the CPU) are refused with, by flag or key; a field with two problems fails the test:
    each rule reports one paragraph under its field."""
    with pytest.raises(ConfigError) as err:
        build_train_config({"device": "cpu", **flags})
    found = {}
    for p in err.value.problems:
        assert p.field not in found, f"two problems under {p.field}: {found[p.field]} / {p.message}"
        found[p.field] = p.message
    return found
