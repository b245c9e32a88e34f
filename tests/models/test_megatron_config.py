"""Megatron users bring their own DistributedDataParallelConfig: hfsdp reads its layout fields unchanged."""

from __future__ import annotations

import warnings

import pytest

from hfsdp.core.rules.config import ConfigError
from hfsdp.core.rules.strategy import Strategy
from hfsdp.models.megatron.adapter import layout_from_ddp_config


def _ddp(**fields):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(**fields)


def test_megatron_ddp_config_becomes_a_layout():
    """The inner and outer strategies and num_distributed_optimizer_instances carry over unchanged."""
    ddp = _ddp(
        data_parallel_sharding_strategy="optim_grads_params",
        outer_dp_sharding_strategy="optim",
        num_distributed_optimizer_instances=2,
    )
    cfg = layout_from_ddp_config(ddp, world_size=8, ep=2, num_moe_experts=4)
    assert (cfg.inner, cfg.outer, cfg.instances) == (Strategy.OPTIM_GRADS_PARAMS, Strategy.OPTIM, 2)
    assert (cfg.inner_size, cfg.expert_dp) == (4, 4)


def test_megatron_ddp_config_is_validated_by_the_same_rules():
    """An outer strategy stronger than the inner one is refused, as for any other config."""
    ddp = _ddp(
        data_parallel_sharding_strategy="optim",
        outer_dp_sharding_strategy="optim_grads",
        num_distributed_optimizer_instances=2,
    )
    with pytest.raises(ConfigError) as err:
        layout_from_ddp_config(ddp, world_size=4)
    assert [p.field for p in err.value.problems] == ["outer"]
