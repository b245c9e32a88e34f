"""The strategies: the vocabulary every layout is spelled in.

A strategy says what one mesh axis does to the model's state. The four sharding
strategies are Megatron's (`data_parallel_sharding_strategy`), so configs move
between the two unchanged; they are ordered by how much they shard, and that
order is what the outer-versus-inner rule in `config.py` compares.

`diloco` is an outer strategy only: along its axis every instance trains apart
(its own weights, gradients and inner optimizer state, no per-step collective)
and the instances meet every H steps in an outer step, whose state the axis
shards (DiLoCo, arXiv 2311.08105). It shards none of the inner kinds of state
(level 0), so it goes over any inner strategy.

The names a DeepSpeed user (and hfsdp's own layout names) know the sharding strategies
by, `ddp`, `zero1`, `zero2` and `zero3`, are accepted for them.
"""

from __future__ import annotations

import difflib
from enum import StrEnum


class Strategy(StrEnum):
    """What one data-parallel mesh axis does: the four sharding strategies in increasing order, then DiLoCo."""

    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"
    DILOCO = "diloco"

    @property
    def level(self) -> int:
        """How much of (param, grad, optim) the axis shards: 0 for no_shard up to 3 for optim_grads_params; 0 for
        diloco, whose instances each hold their own whole copy."""
        return 0 if self is Strategy.DILOCO else _ORDER.index(self)

    @property
    def outer_only(self) -> bool:
        """Whether the strategy exists only across instances (diloco): an instance's own ranks cannot train apart."""
        return self is Strategy.DILOCO

    @classmethod
    def sharding(cls) -> tuple[Strategy, ...]:
        """The four sharding strategies, no_shard to optim_grads_params: what an inner axis may take."""
        return _ORDER

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
        if self is Strategy.DILOCO:
            return "DiLoCo"
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
            raise ValueError(f"'{value}' is not a strategy.{hint} Use one of {', '.join(cls.names())}.")
        raise ValueError(
            f"{value!r} is a {type(value).__name__}, not a strategy name; use one of {', '.join(cls.names())}."
        )

    def __str__(self) -> str:
        return self.value


_ORDER = tuple(s for s in Strategy if s is not Strategy.DILOCO)
#: The names DeepSpeed and the README use (any case, with or without "-"/"_"): accepted for Megatron's own.
ALIASES = {"ddp": "no_shard", "zero1": "optim", "zero2": "optim_grads", "zero3": "optim_grads_params"}
