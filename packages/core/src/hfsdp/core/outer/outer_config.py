"""DiLoCo's settings: how often the instances meet, the outer optimizer, and what the outer exchange sends.

A layout whose outer strategy is `diloco` trains each instance apart and meets every
`sync_every` optimizer steps (H): the pseudo-gradient of each instance, the global weights
minus its own, is averaged over the instances and stepped by an outer SGD (Nesterov by
default, lr 0.7 and momentum 0.9 as in DiLoCo, arXiv 2311.08105). `fragments` (F) splits the
units into F groups synced at staggered steps (Streaming DiLoCo, arXiv 2501.18512), so one
outer exchange carries about 1/F of the model. `comm_dtype` is what the exchange sends:
fp32 (exact), bf16, or int8 with one fp32 scale per block of `INT8_BLOCK` elements.

Like `LayoutConfig` this is a frozen value validated at construction (every problem at
once, as full sentences naming the field), and it imports no torch: `hfsdp validate-config`
checks it too. `CONFIG_KEYS` are its names in a config file's `diloco` section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hfsdp.core.rules.config import ConfigError, Problem

COMM_DTYPES = ("fp32", "bf16", "int8")
#: Elements per int8 scale: 128 int8 values and one fp32 scale send 1.03 bytes per element.
INT8_BLOCK = 128
#: Bytes per element each comm dtype sends (int8: the values and their share of the block scales, at most).
COMM_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / INT8_BLOCK}

#: Field -> its key in a config file (section `diloco`) and the `hfsdp train` flag.
CONFIG_KEYS = {
    "sync_every": ("diloco.sync_every", "--sync-every"),
    "lr": ("diloco.outer_lr", "--outer-lr"),
    "momentum": ("diloco.outer_momentum", "--outer-momentum"),
    "nesterov": ("diloco.outer_nesterov", "--outer-nesterov"),
    "comm_dtype": ("diloco.outer_comm_dtype", "--outer-comm-dtype"),
    "fragments": ("diloco.sync_fragments", "--sync-fragments"),
}


@dataclass(frozen=True)
class DiLoCoConfig:
    """The outer step of a `diloco` layout: every `sync_every` inner optimizer steps, per fragment."""

    sync_every: int
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    comm_dtype: str = "fp32"
    fragments: int = 1

    def __post_init__(self) -> None:
        problems = validate(self)
        if problems:
            raise ConfigError(problems)

    @property
    def anchored(self) -> bool:
        """Whether the exchange is lossy, so each rank keeps the weights of the last outer step (its anchor)."""
        return self.comm_dtype != "fp32"

    @property
    def uses_nesterov(self) -> bool:
        """Nesterov looks ahead along the momentum; with momentum 0 there is none, and the step is plain SGD."""
        return self.nesterov and self.momentum > 0

    def offset(self, fragment: int) -> int:
        """The step (mod H) after which `fragment` syncs: fragment f at ((f + 1) H / F) mod H, so with F = 1 every
        H steps and otherwise evenly staggered, the last fragment with the whole model's rhythm."""
        return ((fragment + 1) * self.sync_every // self.fragments) % self.sync_every

    def due(self, steps_done: int) -> list[int]:
        """The fragments whose outer step comes after inner step number `steps_done` (1-based)."""
        return [f for f in range(self.fragments) if steps_done % self.sync_every == self.offset(f)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "sync_every": self.sync_every,
            "lr": self.lr,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "comm_dtype": self.comm_dtype,
            "fragments": self.fragments,
        }


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def validate(cfg: DiLoCoConfig) -> list[Problem]:
    """Every problem of `cfg`, each under its field name."""
    problems: list[Problem] = []

    def bad(name: str, message: str) -> None:
        problems.append(Problem(name, message))

    if not _whole(cfg.sync_every) or cfg.sync_every < 1:
        bad("sync_every", f"sync_every must be a whole number of steps >= 1 (H, such as 50), got {cfg.sync_every!r}.")
    if not _number(cfg.lr) or cfg.lr <= 0:
        bad("lr", f"lr (the outer learning rate) must be a positive number such as 0.7, got {cfg.lr!r}.")
    if not _number(cfg.momentum) or not 0 <= cfg.momentum < 1:
        bad("momentum", f"momentum (the outer momentum) must be a number in [0, 1) such as 0.9, got {cfg.momentum!r}.")
    if not isinstance(cfg.nesterov, bool):
        bad("nesterov", f"nesterov must be true or false, got {cfg.nesterov!r}.")
    if cfg.comm_dtype not in COMM_DTYPES:
        bad("comm_dtype", f"comm_dtype must be one of {', '.join(COMM_DTYPES)}, got {cfg.comm_dtype!r}.")
    if not _whole(cfg.fragments) or cfg.fragments < 1:
        bad("fragments", f"fragments must be a whole number >= 1 (1: the whole model at once), got {cfg.fragments!r}.")
    elif _whole(cfg.sync_every) and cfg.sync_every >= 1 and cfg.fragments > cfg.sync_every:
        bad(
            "fragments",
            f"fragments {cfg.fragments} is more than sync_every {cfg.sync_every}: the fragments sync at staggered "
            f"steps of one cycle of H steps, so at most H of them fit; use at most {cfg.sync_every} fragments.",
        )
    return problems
