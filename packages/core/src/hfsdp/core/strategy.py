"""The four sharding strategies: the vocabulary every layout is spelled in.

A strategy says what one mesh axis shards. The names are Megatron's
(`data_parallel_sharding_strategy`), so configs move between the two unchanged.
The strategies are ordered by how much they shard; that order is what the
outer-versus-inner rule in `config.py` compares. The names a DeepSpeed user (and
hfsdp's own layout names) know them by, `ddp`, `zero1`, `zero2` and `zero3`, are
accepted for them.
"""

from __future__ import annotations

import difflib
from enum import StrEnum


class Strategy(StrEnum):
    """What one data-parallel mesh axis shards, in increasing order."""

    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @property
    def level(self) -> int:
        """0 for no_shard up to 3 for optim_grads_params."""
        return _ORDER.index(self)

    @property
    def shards_optim(self) -> bool:
        return self.level >= 1

    @property
    def shards_grads(self) -> bool:
        return self.level >= 2

    @property
    def shards_params(self) -> bool:
        return self.level >= 3

    @property
    def zero_name(self) -> str:
        """The name a DeepSpeed or Megatron user knows this strategy by."""
        return ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")[self.level]

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(s.value for s in cls)

    @classmethod
    def parse(cls, value: object) -> Strategy:
        """Return the strategy named by `value`, or raise ValueError naming the closest match."""
        if isinstance(value, Strategy):
            return value
        if isinstance(value, str):
            text = value.strip().lower()
            for strategy in cls:
                if strategy.value == text:
                    return strategy
            alias = ALIASES.get(text.replace("-", "").replace("_", ""))
            if alias is not None:
                return cls(alias)
            guess = difflib.get_close_matches(text, cls.names(), n=1, cutoff=0.4)
            hint = f" Did you mean '{guess[0]}'?" if guess else ""
            raise ValueError(f"'{value}' is not a sharding strategy.{hint} Use one of {', '.join(cls.names())}.")
        raise ValueError(
            f"{value!r} is a {type(value).__name__}, not a strategy name; use one of {', '.join(cls.names())}."
        )

    def __str__(self) -> str:
        return self.value


_ORDER = tuple(Strategy)
#: The names DeepSpeed and the README use (any case, with or without "-"/"_"): accepted for Megatron's own.
ALIASES = {"ddp": "no_shard", "zero1": "optim", "zero2": "optim_grads", "zero3": "optim_grads_params"}
