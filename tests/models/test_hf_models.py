"""Hugging Face causal LMs sharded by hfsdp, with recompute and torch.compile, against the unsharded model.

A tiny Llama (grouped-query attention, tied embeddings) is built by transformers from a config, sharded with
its decoder layers as units, and trained with torch's fused AdamW over Megatron-style parameter groups under a
warmup + cosine LambdaLR; every variant must give the losses and weights of the same optimizer and schedule on
the unsharded model. One spawned group of 2 ranks runs every case.
"""

from __future__ import annotations

import pytest
import torch

from hfsdp.core import sharding_of

from tests.support.distributed import run_distributed
from tests.support.steps import accumulate

STEPS, MICROBATCHES, GLOBAL_BATCH, SEQ = 4, 2, 8, 16
CONFIG = {
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
VARIANTS = {
    "HFSDP 2x1": ({"instances": 2, "outer": "optim"}, {}),
    "ZeRO-3 1x2, recompute": ({}, {"recompute": True}),
    "HSDP 2x1, compile + recompute": ({"instances": 2}, {"recompute": True, "compile": True}),
}


def _batch(step: int):
    gen = torch.Generator().manual_seed(step)
    seq = torch.randint(0, CONFIG["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def _optimizer_and_schedule(groups):
    from hfsdp.recipes.lr_schedule import Schedule, scheduler

    opt = torch.optim.AdamW(groups, lr=3e-3, fused=True)
    return opt, scheduler(opt, Schedule(3e-3, 3e-4, warmup_iters=2, decay_iters=STEPS, style="cosine"))


#: The other families --model-config promises: their own configs, trained on ZeRO-3 1x2 against the unsharded model.
FAMILIES = {
    "qwen2": {**CONFIG, "model_type": "qwen2", "tie_word_embeddings": False},
    "mistral": {**CONFIG, "model_type": "mistral", "sliding_window": None},
    "mixtral": {
        **CONFIG,
        "model_type": "mixtral",
        "sliding_window": None,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
}


def _train_sharded(sharded, rank, world, steps):
    """`steps` steps of MICROBATCHES on the sharded model, fused AdamW over param_groups, warmup + cosine."""
    import torch.distributed as dist

    from hfsdp.core import param_groups
    from hfsdp.models import hf
    from hfsdp.recipes.data import microbatch

    opt, schedule = _optimizer_and_schedule(param_groups(sharded, weight_decay=0.1))
    losses = []
    for step in range(steps):

        def loss_of(index, batch=_batch(step)):
            return hf.causal_lm_loss(sharded, *microbatch(batch, index, MICROBATCHES, rank, world))

        total = accumulate(sharded, MICROBATCHES, loss_of)
        dist.all_reduce(total)
        losses.append(total.item() / (MICROBATCHES * world))
        opt.step()
        opt.zero_grad()
        schedule.step()
    return losses


def _train_unsharded(config: dict, steps: int, compiled: bool = False):
    """The same optimizer, groups and schedule on the unsharded model (its decoder layers compiled as the sharded
    variant's are, so both round alike): losses and final parameters."""
    from hfsdp.core.engine.unit_forward import compile_units
    from hfsdp.core.engine.weight_decay import megatron_no_decay
    from hfsdp.models import hf

    model = hf.build_causal_lm(hf.config_from_dict(config), seed=0)
    if compiled:
        compile_units(hf.decoder_layers(model))
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not megatron_no_decay(n, p.shape)], "weight_decay": 0.1},
        {"params": [p for n, p in named if megatron_no_decay(n, p.shape)], "weight_decay": 0.0},
    ]
    opt, schedule = _optimizer_and_schedule(groups)
    losses = []
    for step in range(steps):
        loss = hf.causal_lm_loss(model, *_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        losses.append(loss.item())
    return losses, model, {n: p.detach().clone() for n, p in named}


def _family_runs(rank, world):

    from hfsdp.core import LayoutConfig, build_meshes, fully_shard
    from hfsdp.models import hf

    out = {}
    for family, config in FAMILIES.items():
        model = hf.build_causal_lm(hf.config_from_dict(config), seed=0)
        cfg = LayoutConfig(world_size=world)
        sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=hf.decoder_layers(model))
        losses = _train_sharded(sharded, rank, world, steps=2)
        out[family] = {"losses": losses, "classes": [c.__name__ for c in type(model).__mro__]}
    return out


def _variants(rank, world):

    from hfsdp.core import LayoutConfig, build_meshes, fully_shard
    from hfsdp.core.engine.unit_forward import compile_units, recompute
    from hfsdp.models import hf

    out = {}
    for name, (layout, wrap) in VARIANTS.items():
        model = hf.build_causal_lm(hf.config_from_dict(CONFIG), seed=0)
        units = hf.decoder_layers(model)
        if wrap.get("compile"):
            compile_units(units)
        if wrap.get("recompute"):
            recompute(units)
        cfg = LayoutConfig(world_size=world, **layout)
        sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=units)
        losses = _train_sharded(sharded, rank, world, steps=STEPS)
        pieces = [
            (p.name, p.start, p.stop, p.param.detach().reshape(-1).clone()) for p in sharding_of(sharded).main_params
        ]
        out[name] = {
            "losses": losses,
            "pieces": pieces,
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        }
    out["families"] = _family_runs(rank, world)
    return out


@pytest.fixture(scope="module")
def sharded_runs():
    return run_distributed(_variants, 2)


@pytest.fixture(scope="module")
def references():
    """The unsharded runs, eager and with compiled decoder layers (compiled kernels round differently from eager
    ones, in fp32 too: a compiled variant is held to the compiled reference)."""
    out = {}
    for compiled in (False, True):
        losses, _, params = _train_unsharded(CONFIG, STEPS, compiled)
        out[compiled] = (losses, params)
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hugging_face_llama_matches_the_unsharded_model(sharded_runs, references, name):
    """A transformers Llama sharded by its decoder layers trains to the unsharded model's losses and weights with
    fused AdamW, no decay for norms and embeddings, and warmup + cosine; recompute and torch.compile change nothing."""
    ref_losses, ref_params = references[bool(VARIANTS[name][1].get("compile"))]
    torch.testing.assert_close(
        torch.tensor(sharded_runs[0][name]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0
    )
    got = {n: torch.full((p.numel(),), float("nan")) for n, p in ref_params.items()}
    for result in sharded_runs:
        assert result[name]["tied"], "sharding untied the embeddings"
        for n, start, stop, values in result[name]["pieces"]:
            got[n][start:stop] = values
    for n, value in ref_params.items():
        torch.testing.assert_close(got[n].view(value.shape), value, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_families_match_the_unsharded_model(sharded_runs, family):
    """A Qwen2 (biased q/k/v, untied), a Mistral and a Mixtral (experts in fused 3-D parameters, top-2 routing)
    causal LM from their configs train on ZeRO-3 1x2 to the unsharded model's losses under the same optimizer,
    groups and schedule."""
    losses, model, _ = _train_unsharded(FAMILIES[family], 2)
    case = sharded_runs[0]["families"][family]
    assert type(model).__name__ in case["classes"] and family in type(model).__name__.lower()
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
