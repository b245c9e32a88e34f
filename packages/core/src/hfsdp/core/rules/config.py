"""The layout config: one frozen value that cannot exist in an invalid state.

Validation runs in `__post_init__` and reports every problem at once, each as a
full sentence naming the field, the bad value and the fix. Field names are short;
`MEGATRON_NAMES` maps them to the Megatron vocabulary the config files use, so
errors can be reported in the user's own words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hfsdp.core.rules.strategy import Strategy

#: Where each field lives in a config file (Megatron's names, by section).
MEGATRON_NAMES: dict[str, str] = {
    "world_size": "parallel.world_size",
    "tp": "parallel.tensor_model_parallel_size",
    "pp": "parallel.pipeline_model_parallel_size",
    "cp": "parallel.context_parallel_size",
    "ep": "parallel.expert_model_parallel_size",
    "inner": "ddp.data_parallel_sharding_strategy",
    "outer": "ddp.outer_dp_sharding_strategy",
    "instances": "ddp.num_distributed_optimizer_instances",
    "expert_strategy": "ddp.expert_data_parallel_sharding_strategy",
    "expert_instances": "ddp.expert_num_distributed_optimizer_instances",
    "expert_outer": "ddp.expert_outer_dp_sharding_strategy",
    "num_moe_experts": "model.num_moe_experts",
    "global_batch_size": "train.global_batch_size",
    "micro_batch_size": "train.micro_batch_size",
}

_STRATEGY_FIELDS = ("inner", "outer", "expert_strategy", "expert_outer")
_SIZE_FIELDS = ("world_size", "tp", "pp", "cp", "ep", "instances", "expert_instances")
_OPTIONAL_SIZE_FIELDS = ("num_moe_experts", "global_batch_size", "micro_batch_size")


@dataclass(frozen=True)
class Problem:
    """One reason a config is invalid: the field it is about and a full-sentence message."""

    field: str
    message: str


class ConfigError(ValueError):
    """Raised when a config is invalid; carries every problem found, not just the first."""

    def __init__(self, problems: list[Problem]):
        self.problems = tuple(problems)
        lines = "\n".join(f"  - {p.field}: {p.message}" for p in self.problems)
        super().__init__(f"invalid hfsdp config ({len(self.problems)} problem(s)):\n{lines}")


@dataclass(frozen=True)
class LayoutConfig:
    """How the data-parallel domain is split and what each axis shards.

    `inner` is the strategy inside one instance (Megatron's
    `data_parallel_sharding_strategy`), `outer` the one across instances
    (`outer_dp_sharding_strategy`), `instances` the number of instances
    (`num_distributed_optimizer_instances`). Experts have their own strategy and,
    only when asked for, their own outer axis.
    """

    world_size: int
    inner: Strategy | str = Strategy.OPTIM_GRADS_PARAMS
    outer: Strategy | str = Strategy.NO_SHARD
    instances: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    expert_strategy: Strategy | str | None = None
    expert_instances: int = 1
    expert_outer: Strategy | str = Strategy.NO_SHARD
    num_moe_experts: int | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None

    def __post_init__(self) -> None:
        problems = validate(self)
        if problems:
            raise ConfigError(problems)

    # Derived sizes -----------------------------------------------------------------

    @property
    def dp(self) -> int:
        """Data-parallel size: world / (tp * pp * cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def inner_size(self) -> int:
        """Ranks in one instance (the `dp_shard` axis)."""
        return self.dp // self.instances

    @property
    def expert_dp(self) -> int:
        """Ranks that hold a copy (or a shard) of the same experts."""
        return self.dp // self.ep

    @property
    def expert_inner_size(self) -> int:
        return self.expert_dp // self.expert_instances

    @property
    def resolved_expert_strategy(self) -> Strategy:
        return self.expert_strategy if self.expert_strategy is not None else self.inner

    @property
    def num_microbatches(self) -> int | None:
        """Gradient-accumulation steps per optimizer step, when the batch sizes are given."""
        if self.global_batch_size is None or self.micro_batch_size is None:
            return None
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def layout_name(self) -> str:
        """A short human name: 'HFSDP 2x2 (optim over optim_grads_params)'."""
        if self.instances == 1:
            return f"{self.inner.zero_name} 1x{self.inner_size} ({self.inner.value})"
        known = {
            (Strategy.NO_SHARD, Strategy.OPTIM_GRADS_PARAMS): "HSDP",
            (Strategy.OPTIM, Strategy.OPTIM_GRADS_PARAMS): "HFSDP",
        }
        name = "DiLoCo" if self.outer is Strategy.DILOCO else known.get((self.outer, self.inner), "hybrid")
        return f"{name} {self.instances}x{self.inner_size} ({self.outer.value} over {self.inner.value})"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in MEGATRON_NAMES:
            value = getattr(self, name)
            out[name] = value.value if isinstance(value, Strategy) else value
        return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(value: object) -> str:
    """A bad value as a message quotes it: as written (text in quotes, true/false), its kind named only where it is
    not what it looks like to a reader (a number in quotes is text)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "nothing (null)"
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return repr(value)
        return f"the text {value!r}"
    return repr(value)


def validate(cfg: LayoutConfig) -> list[Problem]:
    """Check every rule, normalise strategy names in place, and return all problems found."""
    problems: list[Problem] = []

    def bad(name: str, message: str) -> None:
        problems.append(Problem(name, message))

    # Rule 1 and 5: strategies are names from the four (the expert one may be absent).
    unparsed: set[str] = set()
    for name in _STRATEGY_FIELDS:
        value = getattr(cfg, name)
        if value is None and name == "expert_strategy":
            continue
        try:
            object.__setattr__(cfg, name, Strategy.parse(value))
        except ValueError as err:
            bad(name, f"{name} is {value!r}, which is not allowed: {err}")
            object.__setattr__(cfg, name, None)
            unparsed.add(name)

    # Rule 7: every size is a positive integer.
    sizes_ok = True
    for name in _SIZE_FIELDS + _OPTIONAL_SIZE_FIELDS:
        value = getattr(cfg, name)
        if value is None and name in _OPTIONAL_SIZE_FIELDS:
            continue
        if not _is_int(value) or value < 1:
            bad(
                name,
                f"{name} must be a positive integer, got {_describe(value)}; write a whole number such as 1, 2 or 8.",
            )
            if name in _SIZE_FIELDS:
                sizes_ok = False
    if not sizes_ok:
        return problems
    for name in ("num_moe_experts", "global_batch_size", "micro_batch_size"):
        value = getattr(cfg, name)
        if value is not None and (not _is_int(value) or value < 1):
            object.__setattr__(cfg, name, None)  # already reported; skip the rules that use it

    # Rule 4: the world is tp * pp * cp * dp; only dp > 1 is supported so far.
    for name, what in (("tp", "tensor"), ("pp", "pipeline"), ("cp", "context")):
        if getattr(cfg, name) != 1:
            bad(
                name,
                f"{name} is {getattr(cfg, name)}, but {what} parallelism is not supported yet; "
                f"set {name} to 1 (hfsdp currently shards data parallelism only).",
            )
    model_parallel = cfg.tp * cfg.pp * cfg.cp
    if cfg.world_size % model_parallel:
        bad(
            "world_size",
            f"world_size {cfg.world_size} is not divisible by tp*pp*cp = {model_parallel}; "
            "choose a world size that is a multiple of it.",
        )
        return problems
    dp = cfg.world_size // model_parallel

    # Rules 2 and 3: the outer axis.
    _check_hybrid(bad, cfg.inner, cfg.outer, cfg.instances, dp, "outer", "instances", "data-parallel size")
    _check_diloco(bad, cfg)

    # Rule 5: experts.
    if dp % cfg.ep:
        bad("ep", f"ep {cfg.ep} does not divide the data-parallel size {dp}; choose an ep that divides it.")
    elif cfg.ep > 1 and cfg.num_moe_experts is None:
        bad(
            "num_moe_experts",
            f"ep is {cfg.ep} but num_moe_experts is not set; set the number of experts, a multiple of ep.",
        )
    if cfg.num_moe_experts is not None and cfg.num_moe_experts % cfg.ep:
        bad(
            "num_moe_experts",
            f"num_moe_experts {cfg.num_moe_experts} is not divisible by ep {cfg.ep}; "
            "each expert-parallel rank must hold the same number of experts.",
        )
    # An unparsable expert strategy must not fall back to the inner one: that would judge expert_outer against
    # a strategy the user did not choose.
    if cfg.ep > 1 and dp % cfg.ep == 0 and dp % cfg.instances == 0 and (dp // cfg.ep) % cfg.instances:
        bad(
            "instances",
            f"instances {cfg.instances} does not divide the expert data-parallel size dp / ep = {dp // cfg.ep}; "
            "megatron-core splits that domain into the instances too, so choose instances that divide it "
            "or a smaller ep.",
        )
    expert_inner = None if "expert_strategy" in unparsed else (cfg.expert_strategy or cfg.inner)
    if dp % cfg.ep == 0:
        _check_hybrid(
            bad,
            expert_inner,
            cfg.expert_outer,
            cfg.expert_instances,
            dp // cfg.ep,
            "expert_outer",
            "expert_instances",
            "expert data-parallel size (dp / ep)",
        )

    # Rule 6: the batch splits evenly into microbatches on every rank.
    gbs, mbs = cfg.global_batch_size, cfg.micro_batch_size
    if gbs is not None and mbs is not None and gbs % (mbs * dp):
        bad(
            "global_batch_size",
            f"global_batch_size {gbs} is not divisible by micro_batch_size * dp = {mbs} * {dp} = {mbs * dp}; "
            f"use a multiple of {mbs * dp}.",
        )
    return problems


def _check_hybrid(bad, inner, outer, instances, dp, outer_name, instances_name, domain) -> None:
    """The two rules of a hybrid axis pair, shared by the dense and the expert mesh."""
    if dp % instances:
        bad(
            instances_name, f"{instances_name} {instances} does not divide the {domain} {dp}; choose a divisor of {dp}."
        )
    if outer is None or inner is None or inner.outer_only:
        return
    if instances == 1 and outer is Strategy.DILOCO:
        bad(
            outer_name,
            f"{outer_name} is 'diloco' but {instances_name} is 1: DiLoCo syncs instances that train apart, and one "
            f"instance has nothing to sync with; set {instances_name} > 1, or {outer_name} to 'no_shard'.",
        )
    elif instances == 1 and outer is not Strategy.NO_SHARD:
        bad(
            outer_name,
            f"{outer_name} is '{outer.value}' but {instances_name} is 1, so there is no outer axis to shard over; "
            f"set {instances_name} > 1 or {outer_name} to 'no_shard'.",
        )
    if instances > 1 and outer.level > inner.level:
        bad(
            outer_name,
            f"{outer_name} '{outer.value}' shards more than the inner strategy '{inner.value}': every gather "
            "would then cross instances (the slow links) while the fast links inside an instance sit idle; "
            f"choose an outer strategy no stronger than '{inner.value}' or a stronger inner one.",
        )


def _check_diloco(bad, cfg: LayoutConfig) -> None:
    """DiLoCo is an outer strategy only, and with experts both meshes train apart over the same instances.

    Inside an instance the ranks must agree every step (they hold pieces of one model), so an inner
    strategy cannot train apart: there is no hybrid inside an instance. Experts get the same outer
    axis as the dense weights: an expert axis reduced every step across instances would send
    expert gradients over the slow links every step and mix experts trained against different
    dense weights; so with `outer = diloco` and experts, `expert_outer` is diloco over the same
    number of instances (whose rows are the dense instances' ranks), and not otherwise.
    """
    for name in ("inner", "expert_strategy"):
        value = getattr(cfg, name)
        if value is Strategy.DILOCO:
            bad(
                name,
                f"{name} is 'diloco', which is an outer strategy only: the ranks of one instance hold pieces of one "
                "model and must agree every step. Use diloco as the outer strategy (outer / expert_outer) over "
                "any of no_shard, optim, optim_grads, optim_grads_params inside.",
            )
    if cfg.outer is None or cfg.expert_outer is None:
        return
    dense, expert = cfg.outer is Strategy.DILOCO, cfg.expert_outer is Strategy.DILOCO
    if dense and cfg.num_moe_experts is not None and (not expert or cfg.expert_instances != cfg.instances):
        bad(
            "expert_outer",
            f"outer is 'diloco' over {cfg.instances} instances, so the experts must train apart over the same "
            f"instances (expert_outer 'diloco', expert_instances {cfg.instances}), not be reduced across them every "
            f"step; got expert_outer '{cfg.expert_outer.value}' with expert_instances {cfg.expert_instances}. Set "
            f"expert_outer to 'diloco' and expert_instances to {cfg.instances}.",
        )
    elif expert and not dense:
        bad(
            "expert_outer",
            f"expert_outer is 'diloco' but outer is '{cfg.outer.value}': experts cannot train apart while the dense "
            "weights are reduced every step (each instance's experts would meet dense weights that never "
            "diverge). Set outer to 'diloco' too, or expert_outer to a sharding strategy.",
        )
