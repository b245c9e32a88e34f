"""Train a megatron-core GPT under hfsdp, and the same GPT in one process with plain torch.optim.AdamW."""

from __future__ import annotations

import torch

from hfsdp.core import sharding_of

SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)
GLOBAL_BATCH, LR = 8, 3e-3


def train_sharded(rank, world, layout_kwargs, steps, microbatches, shape=None, clip=None):
    """Losses (and clipped norms) of `steps` optimizer steps under hfsdp on this gloo group."""
    import torch.distributed as dist

    from hfsdp.core.engine.clip import clip_grad_norm_
    from hfsdp.core.rules.config import LayoutConfig
    from hfsdp.models.megatron.adapter import expert_naming_for, initialize_parallel, shard_megatron_model
    from hfsdp.models.megatron.cpu_shim import seed_megatron
    from hfsdp.models.megatron.gpt import GPTShape, build_gpt, lm_loss, reinit_by_global_name
    from hfsdp.recipes.data import SyntheticTokens, microbatch

    shape = GPTShape(**(shape or SHAPE))
    cfg = LayoutConfig(world_size=world, num_moe_experts=shape.num_moe_experts, **layout_kwargs)
    initialize_parallel(cfg)
    seed_megatron(0)
    model = build_gpt(shape)
    reinit_by_global_name(model, expert_naming_for(cfg), seed=0)
    sharded = shard_megatron_model(model, cfg, "cpu")
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR, weight_decay=0.01)
    data = SyntheticTokens(shape.vocab_size, shape.seq_length)
    losses, norms = [], []
    for step in range(steps):
        batch = data.global_batch(step, GLOBAL_BATCH)
        total = torch.zeros(())
        for index in range(microbatches):
            sharded.set_microbatch(index, microbatches)
            loss = lm_loss(sharded, *microbatch(batch, index, microbatches, rank, cfg.dp))
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (microbatches * cfg.dp))
        if clip is not None:
            norms.append(clip_grad_norm_(sharded, clip).item())
        opt.step()
        opt.zero_grad()
    experts = [g for g in sharding_of(sharded).groups if g.is_expert]
    return {
        "losses": losses,
        "norms": norms,
        "meshes": {tuple(g.mesh.mesh_dim_names) for g in sharding_of(sharded).groups},
        "expert_meshes": {tuple(g.mesh.mesh_dim_names) for g in experts},
        "expert_param_placements": {tuple(g.layout.placements.param) for g in experts},
        "expert_optim_placements": {tuple(g.layout.placements.optim) for g in experts},
    }


def train_reference(rank, world, steps, shape=None, clip=None):
    """The same GPT in one process (world 1), whole global batches, torch.optim.AdamW."""
    from hfsdp.core.rules.config import LayoutConfig
    from hfsdp.models.megatron.adapter import expert_naming_for, initialize_parallel
    from hfsdp.models.megatron.cpu_shim import seed_megatron
    from hfsdp.models.megatron.gpt import GPTShape, build_gpt, lm_loss, reinit_by_global_name
    from hfsdp.recipes.data import SyntheticTokens

    from tests.support.toy_models import plain_steps

    shape = GPTShape(**(shape or SHAPE))
    cfg = LayoutConfig(world_size=1, num_moe_experts=shape.num_moe_experts)
    initialize_parallel(cfg)
    seed_megatron(0)
    model = build_gpt(shape)
    reinit_by_global_name(model, expert_naming_for(cfg), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    data = SyntheticTokens(shape.vocab_size, shape.seq_length)
    losses, norms = plain_steps(
        model, opt, lambda step: lm_loss(model, *data.global_batch(step, GLOBAL_BATCH)), steps, clip
    )
    return {"losses": losses, "norms": norms}
