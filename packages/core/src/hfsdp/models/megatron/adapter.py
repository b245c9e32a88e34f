"""Wrap a megatron-core model with hfsdp, consistently with `megatron.core.parallel_state`.

Megatron users bring their own `DistributedDataParallelConfig`; `layout_from_ddp_config`
reads the three fields that define the layout (`data_parallel_sharding_strategy`,
`outer_dp_sharding_strategy`, `num_distributed_optimizer_instances`). The process
groups are built by megatron-core itself, and the hfsdp meshes are checked against
them before any parameter is sharded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hfsdp.core.buffers.mixed_precision import MixedPrecision
from hfsdp.core.engine.mesh import HybridMeshes, build_meshes, check_axis
from hfsdp.core.engine.module import fully_shard
from hfsdp.core.rules.config import LayoutConfig
from hfsdp.core.rules.expert_naming import ExpertNaming
from hfsdp.models.megatron.cpu_shim import apply_cpu_shim, define_missing_te_symbols


def layout_from_ddp_config(ddp_config, world_size: int, **sizes) -> LayoutConfig:
    """A LayoutConfig from megatron-core's DistributedDataParallelConfig plus the parallel sizes."""
    return LayoutConfig(
        world_size=world_size,
        inner=ddp_config.data_parallel_sharding_strategy,
        outer=getattr(ddp_config, "outer_dp_sharding_strategy", "no_shard"),
        instances=ddp_config.num_distributed_optimizer_instances,
        **sizes,
    )


def initialize_parallel(cfg: LayoutConfig) -> None:
    """Build megatron-core's process groups for `cfg` (tp = pp = cp = 1)."""
    from megatron.core import parallel_state

    apply_cpu_shim()
    define_missing_te_symbols()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        context_parallel_size=cfg.cp,
        expert_model_parallel_size=cfg.ep,
        num_distributed_optimizer_instances=cfg.instances,
        create_gloo_process_groups=False,
    )


def check_meshes_against_megatron(meshes: HybridMeshes, cfg: LayoutConfig) -> None:
    """Every mesh axis must hold exactly the ranks of the megatron-core group it stands for."""
    from megatron.core import parallel_state as ps

    def ranks(group):
        return dist.get_process_group_ranks(group)

    dense = meshes.dense
    intra = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=cfg.instances > 1)
    check_axis(dense, "dp_shard", ranks(intra), "megatron intra-instance data-parallel")
    if cfg.instances > 1:
        check_axis(dense, "dp_outer", ranks(ps.get_inter_distributed_optimizer_instance_group()), "inter-instance")
    if meshes.expert is not None and cfg.expert_instances == 1:
        check_axis(meshes.expert, "expert_dp", ranks(ps.get_expert_data_parallel_group()), "expert data-parallel")


def is_expert_param(name: str, param: torch.nn.Parameter) -> bool:
    """megatron-core marks expert weights `allreduce = False`, but only when ep > 1; the module path
    (`...mlp.experts...`) marks them whatever ep is, which hfsdp needs: experts keep their own mesh
    even at ep = 1."""
    return getattr(param, "allreduce", True) is False or ".mlp.experts." in f".{name}"


def expert_naming_for(cfg: LayoutConfig) -> ExpertNaming | None:
    from megatron.core import parallel_state as ps

    if not cfg.num_moe_experts:
        return None
    return ExpertNaming(cfg.num_moe_experts, cfg.ep, ps.get_expert_model_parallel_rank())


def shard_megatron_model(
    model: torch.nn.Module,
    cfg: LayoutConfig,
    device_type: str,
    mp: MixedPrecision | None = None,
    *,
    offload: bool | float | str = False,
    reshard_after_forward: bool = True,
    reshard_root_after_forward: bool = False,
    streams=None,
    diloco=None,
    optimizer_state_bytes: float = 8.0,
) -> torch.nn.Module:
    """Shard a GPTModel in place: each transformer layer is a unit, the root holds embeddings and output layer.

    The meshes are checked against megatron-core's process groups first; the keyword arguments are
    `fully_shard`'s."""
    meshes = build_meshes(cfg, device_type)
    check_meshes_against_megatron(meshes, cfg)
    layers = list(model.decoder.layers)
    naming = expert_naming_for(cfg)
    return fully_shard(
        model,
        cfg,
        meshes,
        units=layers,
        mp=mp,
        is_expert=is_expert_param,
        expert_naming=naming,
        offload=offload,
        optimizer_state_bytes=optimizer_state_bytes,
        reshard_after_forward=reshard_after_forward,
        reshard_root_after_forward=reshard_root_after_forward,
        streams=streams,
        diloco=diloco,
    )
