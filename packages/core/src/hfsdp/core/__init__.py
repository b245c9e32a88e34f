"""hfsdp.core: hybrid-sharded data parallelism for any PyTorch module.

The public API, imported lazily so that `hfsdp.core.config` (and the CLI's
`validate-config`) never pays for importing torch:

    from hfsdp.core import LayoutConfig, build_meshes, fully_shard, MixedPrecision

    model = fully_shard(model, cfg, build_meshes(cfg, "cuda"), units=model.model.layers)
    opt = torch.optim.AdamW(model.parameters())  # this rank's fp32 pieces, under the original names
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LayoutConfig": "hfsdp.core.config",
    "ConfigError": "hfsdp.core.config",
    "DiLoCoConfig": "hfsdp.core.outer_config",
    "Strategy": "hfsdp.core.strategy",
    "build_meshes": "hfsdp.core.mesh",
    "HybridMeshes": "hfsdp.core.mesh",
    "fully_shard": "hfsdp.core.module",
    "HFSDPModule": "hfsdp.core.module",
    "sharding_of": "hfsdp.core.sharding",
    "MixedPrecision": "hfsdp.core.mixed_precision",
    "clip_grad_norm_": "hfsdp.core.clip",
    "global_grad_norm": "hfsdp.core.clip",
    "param_groups": "hfsdp.core.main_params",
    "register_elementwise": "hfsdp.core.main_params",
    "FusedAdamW": "hfsdp.core.fused_adamw",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hfsdp.core' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
