"""Shard a plain PyTorch module with hfsdp.core alone: no megatron-core, no transformers, no hfsdp.ckpt.

Run by CI in a fresh venv holding only torch and `pip install -e packages/core` (`scripts/core_alone.sh`);
it exits non-zero unless one optimizer step on a 1-rank gloo group changes the model, and nothing beyond
torch and the engine was imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from hfsdp.core import LayoutConfig, build_meshes, fully_shard


def main() -> int:
    missing = [name for name in ("megatron", "transformers", "hfsdp.ckpt") if importlib.util.find_spec(name)]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29512", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    before = [p.detach().clone() for p in model.parameters()]
    cfg = LayoutConfig(world_size=1)
    model = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=[model[0]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    changed = any(not torch.equal(a, b.detach().view_as(a)) for a, b in zip(before, model.parameters(), strict=True))
    dist.destroy_process_group()
    loaded = sorted({m.split(".")[0] for m in sys.modules} & {"megatron", "transformers"})
    print(f"installed beside torch: {missing or 'nothing'}; imported: {loaded or 'nothing'}; trained: {changed}")
    return 0 if changed and not loaded and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
