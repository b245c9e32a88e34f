"""hfsdp.core: hybrid-sharded data parallelism for any PyTorch module.

The public API, imported lazily so that `hfsdp.core.rules.config` (and the CLI's
`validate-config`) never pays for importing torch:

    from hfsdp.core import LayoutConfig, build_meshes, fully_shard, MixedPrecision

    model = fully_shard(model, cfg, build_meshes(cfg, "cuda"), units=model.model.layers)
    opt = torch.optim.AdamW(model.parameters())  # this rank's fp32 pieces, under the original names
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LayoutConfig": "hfsdp.core.rules.config",
    "ConfigError": "hfsdp.core.rules.config",
    "DiLoCoConfig": "hfsdp.core.outer.outer_config",
    "Strategy": "hfsdp.core.rules.strategy",
    "build_meshes": "hfsdp.core.engine.mesh",
    "HybridMeshes": "hfsdp.core.engine.mesh",
    "fully_shard": "hfsdp.core.engine.module",
    "HFSDPModule": "hfsdp.core.engine.module",
    "sharding_of": "hfsdp.core.engine.sharding",
    "MixedPrecision": "hfsdp.core.buffers.mixed_precision",
    "clip_grad_norm_": "hfsdp.core.engine.clip",
    "global_grad_norm": "hfsdp.core.engine.clip",
    "param_groups": "hfsdp.core.engine.weight_decay",
    "register_elementwise": "hfsdp.core.buffers.main_params",
    "FusedAdamW": "hfsdp.core.kernels.fused_adamw",
    "Float8Config": "hfsdp.core.fp8.config",
    "Float8Linear": "hfsdp.core.fp8.linear",
    "convert_to_float8": "hfsdp.core.fp8.convert",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hfsdp.core' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
