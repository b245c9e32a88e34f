"""Every rule of `LayoutConfig`, valid and invalid, and the `Strategy` vocabulary it is spelled in."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from hfsdp.core.rules.config import MEGATRON_NAMES, ConfigError, LayoutConfig, Problem
from hfsdp.core.rules.strategy import Strategy

S = Strategy
ALL = list(Strategy.sharding())  # diloco, the outer-only strategy, has tests of its own (test_diloco.py)
SIZE_FIELDS = ("world_size", "tp", "pp", "cp", "ep", "instances", "expert_instances")
OPTIONAL_SIZE_FIELDS = ("num_moe_experts", "global_batch_size", "micro_batch_size")


def problems(**kwargs) -> dict[str, str]:
    """The problems LayoutConfig(**kwargs) raises, as {field: message}; fails the test if it is valid."""
    kwargs.setdefault("world_size", 8)
    with pytest.raises(ConfigError) as info:
        LayoutConfig(**kwargs)
    found = {p.field: p.message for p in info.value.problems}
    assert len(found) == len(info.value.problems), f"a field was reported twice: {info.value.problems}"
    return found


# Strategy ----------------------------------------------------------------------------------------


def test_strategy_order_is_no_shard_optim_grads_params():
    """The four strategies are ordered by how much they shard, 0 to 3."""
    assert [s.level for s in (S.NO_SHARD, S.OPTIM, S.OPTIM_GRADS, S.OPTIM_GRADS_PARAMS)] == [0, 1, 2, 3]
    assert S.names() == ("no_shard", "optim", "optim_grads", "optim_grads_params", "diloco")
    assert S.sharding() == (S.NO_SHARD, S.OPTIM, S.OPTIM_GRADS, S.OPTIM_GRADS_PARAMS)


@pytest.mark.parametrize(
    ("strategy", "optim", "grads", "params", "zero"),
    [
        (S.NO_SHARD, False, False, False, "DDP"),
        (S.OPTIM, True, False, False, "ZeRO-1"),
        (S.OPTIM_GRADS, True, True, False, "ZeRO-2"),
        (S.OPTIM_GRADS_PARAMS, True, True, True, "ZeRO-3"),
    ],
)
def test_strategy_properties(strategy, optim, grads, params, zero):
    """Each strategy shards exactly the states its name lists and has the matching ZeRO name."""
    assert (strategy.shards_optim, strategy.shards_grads, strategy.shards_params) == (optim, grads, params)
    assert strategy.zero_name == zero
    assert str(strategy) == strategy.value


def test_strategy_parse_accepts_names_case_and_whitespace_insensitively():
    """parse returns the member for its name in any case and with surrounding blanks, and members unchanged."""
    assert S.parse("optim_grads") is S.OPTIM_GRADS
    assert S.parse("  OPTIM_GRADS_PARAMS ") is S.OPTIM_GRADS_PARAMS
    assert S.parse(S.OPTIM) is S.OPTIM


def test_strategy_parse_suggests_the_closest_name():
    """A misspelt name raises ValueError that suggests the intended name and lists all four."""
    with pytest.raises(ValueError, match=r"Did you mean 'optim_grads'\?") as info:
        S.parse("optim_grad")
    assert "no_shard, optim, optim_grads, optim_grads_params" in str(info.value)


@pytest.mark.parametrize("value", [3, None, True, 1.5])
def test_strategy_parse_rejects_non_strings(value):
    """A value that is not a string is rejected with its type named."""
    with pytest.raises(ValueError, match=type(value).__name__):
        S.parse(value)


# Valid configs and derived values ----------------------------------------------------------------


def test_defaults_are_zero3_without_outer_axis():
    """LayoutConfig(world_size) is ZeRO-3 over the whole data-parallel domain with one instance."""
    cfg = LayoutConfig(world_size=8)
    assert (cfg.inner, cfg.outer, cfg.instances) == (S.OPTIM_GRADS_PARAMS, S.NO_SHARD, 1)
    assert (cfg.dp, cfg.inner_size, cfg.expert_dp, cfg.expert_inner_size) == (8, 8, 8, 8)
    assert cfg.resolved_expert_strategy is S.OPTIM_GRADS_PARAMS
    assert cfg.num_microbatches is None
    assert cfg.layout_name == "ZeRO-3 1x8 (optim_grads_params)"


def test_strategy_strings_are_normalised_to_members():
    """Strategy fields given as strings are stored as Strategy members."""
    cfg = LayoutConfig(world_size=4, inner="optim_grads", outer="Optim", instances=2, expert_strategy="optim")
    assert (cfg.inner, cfg.outer, cfg.expert_strategy) == (S.OPTIM_GRADS, S.OPTIM, S.OPTIM)
    assert cfg.resolved_expert_strategy is S.OPTIM


def test_issue_example_is_valid():
    """The HFSDP example from the issue validates, with its derived sizes and microbatch count."""
    cfg = LayoutConfig(
        world_size=8,
        ep=2,
        inner="optim_grads_params",
        outer="optim",
        instances=2,
        expert_strategy="optim_grads",
        num_moe_experts=8,
        global_batch_size=64,
        micro_batch_size=2,
    )
    assert (cfg.dp, cfg.inner_size, cfg.expert_dp, cfg.num_microbatches) == (8, 4, 4, 4)
    assert cfg.layout_name == "HFSDP 2x4 (optim over optim_grads_params)"


@pytest.mark.parametrize(
    ("outer", "inner", "name"),
    [
        ("no_shard", "optim_grads_params", "HSDP 2x4 (no_shard over optim_grads_params)"),
        ("optim", "optim_grads_params", "HFSDP 2x4 (optim over optim_grads_params)"),
        ("no_shard", "optim_grads", "hybrid 2x4 (no_shard over optim_grads)"),
    ],
)
def test_layout_name(outer, inner, name):
    """Hybrid layouts are named HSDP, HFSDP or hybrid, with the mesh shape and both strategies."""
    assert LayoutConfig(world_size=8, inner=inner, outer=outer, instances=2).layout_name == name


def test_to_dict_uses_field_names_and_plain_strategy_strings():
    """to_dict has one entry per MEGATRON_NAMES field, strategies as their names."""
    d = LayoutConfig(world_size=4, outer="optim", instances=2).to_dict()
    assert set(d) == set(MEGATRON_NAMES)
    assert (d["outer"], d["inner"], d["expert_strategy"], d["world_size"]) == ("optim", "optim_grads_params", None, 4)


def test_config_is_frozen():
    """A LayoutConfig cannot be changed after construction (so it cannot become invalid)."""
    cfg = LayoutConfig(world_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.instances = 2


def test_config_error_lists_every_problem():
    """ConfigError is a ValueError whose text names every problem's field."""
    with pytest.raises(ValueError) as info:
        LayoutConfig(world_size=8, inner="bogus", tp=2)
    assert isinstance(info.value, ConfigError)
    assert all(isinstance(p, Problem) for p in info.value.problems)
    assert "2 problem(s)" in str(info.value)
    assert "  - inner: " in str(info.value) and "  - tp: " in str(info.value)


# Rule 1 and 5: strategy names --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["inner", "outer", "expert_strategy", "expert_outer"])
def test_unknown_strategy_names_are_rejected(name):
    """Every strategy field rejects a name outside the four (and their zero/ddp aliases), naming the field and the
    bad value."""
    found = problems(**{name: "zero4"})
    assert set(found) == {name}
    assert "'zero4' is not a strategy" in found[name]


def test_the_zero_and_ddp_names_mean_the_megatron_strategies():
    """zero1, zero2, zero3 and ddp, in any case and with or without - or _, are optim, optim_grads,
    optim_grads_params and no_shard."""
    cfg = LayoutConfig(world_size=4, inner="ZeRO-3", outer="zero_1", instances=2, expert_strategy="zero2")
    assert (cfg.inner, cfg.outer, cfg.expert_strategy) == ("optim_grads_params", "optim", "optim_grads")
    assert LayoutConfig(world_size=4, inner="zero3", outer="DDP", instances=2).outer == "no_shard"


def test_misspelt_strategy_gets_a_suggestion():
    """A misspelt strategy name in a config suggests the closest valid one."""
    found = problems(outer="optm", instances=2)
    assert "Did you mean 'optim'?" in found["outer"]


def test_bad_expert_strategy_does_not_judge_expert_outer_against_the_dense_one():
    """An unparsable expert strategy is the only problem reported, not a comparison against the dense inner one."""
    found = problems(
        inner="no_shard", ep=2, num_moe_experts=2, expert_strategy="bogus", expert_instances=2, expert_outer="optim"
    )
    assert set(found) == {"expert_strategy"}


# Rules 2 and 3: instances and the outer strategy -------------------------------------------------


@pytest.mark.parametrize("outer", ["optim", "optim_grads", "optim_grads_params"])
def test_sharding_outer_strategy_needs_instances(outer):
    """An outer strategy other than no_shard with one instance is rejected: there is no outer axis."""
    found = problems(outer=outer, instances=1)
    assert set(found) == {"outer"}
    assert "instances is 1" in found["outer"] and "no_shard" in found["outer"]


def test_no_shard_outer_with_instances_is_hsdp():
    """no_shard across several instances is valid (HSDP)."""
    cfg = LayoutConfig(world_size=8, outer="no_shard", instances=4)
    assert (cfg.instances, cfg.inner_size) == (4, 2)


@pytest.mark.parametrize(("outer", "inner"), [(o, i) for o, i in itertools.product(ALL, ALL) if o.level > i.level])
def test_outer_sharding_more_than_inner_is_rejected(outer, inner):
    """An outer strategy that shards more than the inner one is rejected because gathers would cross instances."""
    found = problems(world_size=4, inner=inner, outer=outer, instances=2)
    assert set(found) == {"outer"}
    assert "shards more than the inner strategy" in found["outer"]
    assert "cross instances" in found["outer"]


@pytest.mark.parametrize(("outer", "inner"), [(o, i) for o, i in itertools.product(ALL, ALL) if o.level <= i.level])
def test_outer_sharding_no_more_than_inner_is_accepted(outer, inner):
    """Every outer strategy no stronger than the inner one is valid with two instances."""
    cfg = LayoutConfig(world_size=4, inner=inner, outer=outer, instances=2)
    assert (cfg.outer, cfg.inner) == (outer, inner)


@pytest.mark.parametrize(("world_size", "instances"), [(8, 3), (6, 4), (2, 4)])
def test_instances_must_divide_dp(world_size, instances):
    """instances must divide the data-parallel size; the message names the size to divide."""
    found = problems(world_size=world_size, instances=instances)
    assert set(found) == {"instances"}
    assert f"does not divide the data-parallel size {world_size}" in found["instances"]


# Rule 4: model parallelism ------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "what"), [("tp", "tensor"), ("pp", "pipeline"), ("cp", "context")])
def test_model_parallelism_is_not_supported_yet(name, what):
    """tp, pp or cp above 1 is rejected as not supported yet, with the fix 'set it to 1'."""
    found = problems(**{name: 2})
    assert set(found) == {name}
    assert f"{what} parallelism is not supported yet" in found[name]
    assert f"set {name} to 1" in found[name]


def test_world_size_must_be_divisible_by_model_parallel_size():
    """A world size that tp*pp*cp does not divide is reported besides the unsupported tp."""
    found = problems(world_size=8, tp=3)
    assert set(found) == {"tp", "world_size"}
    assert "not divisible by tp*pp*cp = 3" in found["world_size"]


# Rule 5: experts ----------------------------------------------------------------------------------


def test_ep_must_divide_dp():
    """ep must divide the data-parallel size."""
    found = problems(ep=3, num_moe_experts=6)
    assert set(found) == {"ep"}
    assert "does not divide the data-parallel size 8" in found["ep"]


def test_ep_needs_num_moe_experts():
    """ep > 1 without num_moe_experts is rejected, asking for the number of experts."""
    found = problems(ep=2)
    assert set(found) == {"num_moe_experts"}
    assert "not set" in found["num_moe_experts"]


def test_num_moe_experts_must_be_divisible_by_ep():
    """Every expert-parallel rank must hold the same number of experts."""
    found = problems(ep=4, num_moe_experts=6)
    assert set(found) == {"num_moe_experts"}
    assert "not divisible by ep 4" in found["num_moe_experts"]


@pytest.mark.parametrize(("ep", "experts"), [(1, 3), (2, 8), (8, 8)])
def test_valid_expert_configs(ep, experts):
    """Experts with an ep that divides dp and their count are valid; expert_dp is dp / ep."""
    cfg = LayoutConfig(world_size=8, ep=ep, num_moe_experts=experts)
    assert cfg.expert_dp == 8 // ep


def test_expert_outer_needs_expert_instances():
    """The expert outer axis is opt-in: expert_outer other than no_shard needs expert_instances > 1."""
    found = problems(ep=2, num_moe_experts=4, expert_outer="optim")
    assert set(found) == {"expert_outer"}
    assert "expert_instances is 1" in found["expert_outer"]


def test_expert_outer_must_not_shard_more_than_expert_strategy():
    """The expert outer strategy obeys the outer-versus-inner rule against the expert strategy."""
    found = problems(
        ep=2, num_moe_experts=4, expert_strategy="optim", expert_instances=2, expert_outer="optim_grads_params"
    )
    assert set(found) == {"expert_outer"}
    assert "cross instances" in found["expert_outer"]


def test_expert_outer_is_judged_against_inner_when_expert_strategy_is_unset():
    """Without an expert strategy, the expert outer strategy is compared with the dense inner one."""
    found = problems(inner="optim", ep=2, num_moe_experts=4, expert_instances=2, expert_outer="optim_grads")
    assert set(found) == {"expert_outer"}


def test_expert_instances_must_divide_expert_dp():
    """expert_instances must divide the expert data-parallel size dp / ep."""
    found = problems(ep=2, num_moe_experts=4, expert_instances=3)
    assert set(found) == {"expert_instances"}
    assert "expert data-parallel size (dp / ep) 4" in found["expert_instances"]


def test_valid_expert_outer_axis():
    """An expert outer axis no stronger than the expert strategy is valid and splits expert_dp."""
    cfg = LayoutConfig(
        world_size=8, ep=2, num_moe_experts=4, expert_strategy="optim_grads", expert_instances=2, expert_outer="optim"
    )
    assert (cfg.expert_dp, cfg.expert_inner_size, cfg.expert_outer) == (4, 2, S.OPTIM)


# Rule 6: batch sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize(("gbs", "mbs"), [(60, 2), (8, 2), (12, 3)])
def test_global_batch_must_split_into_microbatches(gbs, mbs):
    """global_batch_size must be a multiple of micro_batch_size * dp; the fix names that multiple."""
    found = problems(global_batch_size=gbs, micro_batch_size=mbs)
    assert set(found) == {"global_batch_size"}
    assert f"use a multiple of {mbs * 8}" in found["global_batch_size"]


@pytest.mark.parametrize(("gbs", "mbs", "micro"), [(64, 2, 4), (8, 1, 1), (96, 4, 3)])
def test_num_microbatches(gbs, mbs, micro):
    """num_microbatches is global / (micro * dp)."""
    assert LayoutConfig(world_size=8, global_batch_size=gbs, micro_batch_size=mbs).num_microbatches == micro


def test_one_batch_size_alone_is_allowed():
    """Giving only one batch size is valid and leaves num_microbatches unknown."""
    assert LayoutConfig(world_size=8, global_batch_size=64).num_microbatches is None


# Rule 7: sizes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [True, False, "2", 2.0, 0, -1])
@pytest.mark.parametrize("name", SIZE_FIELDS + OPTIONAL_SIZE_FIELDS)
def test_sizes_must_be_positive_integers(name, value):
    """Every size field rejects bool, str, float, zero and negatives, naming the field and the value as the user
    wrote it (no Python type names; a number in quotes is called text)."""
    found = problems(**{name: value})
    assert name in found
    written = str(value).lower() if isinstance(value, bool) else "the text '2'" if value == "2" else repr(value)
    assert f"{name} must be a positive integer, got {written};" in found[name]


@pytest.mark.parametrize("name", ["world_size", "instances", "tp"])
def test_none_is_not_a_required_size(name):
    """A required size given as None is rejected like any other non-integer."""
    assert "must be a positive integer, got nothing (null)" in problems(**{name: None})[name]


def test_several_problems_are_reported_at_once():
    """Independent problems are all reported in one ConfigError, not one at a time."""
    found = problems(inner="optim_grad", pp=2, ep=3, num_moe_experts=6, micro_batch_size=0)
    assert set(found) == {"inner", "micro_batch_size", "pp", "ep"}
    found = problems(outer="optim", ep=3, num_moe_experts=6, global_batch_size=10, micro_batch_size=1)
    assert set(found) == {"outer", "ep", "global_batch_size"}


def test_instances_must_divide_the_expert_data_parallel_domain():
    """With ep > 1, instances must divide dp / ep (megatron-core splits that domain into instances too)."""
    with pytest.raises(ConfigError) as err:
        LayoutConfig(world_size=2, instances=2, ep=2, num_moe_experts=4)
    assert [p.field for p in err.value.problems] == ["instances"]
    assert "dp / ep = 1" in err.value.problems[0].message
    LayoutConfig(world_size=4, instances=2, ep=2, num_moe_experts=4)  # dp / ep = 2 splits into 2 instances
