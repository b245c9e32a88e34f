"""Frozen parameters (`requires_grad=False`: a LoRA base) are sharded like the others, cast to the compute dtype,
and never reduced or stepped; peft's LoRA trains on a frozen bf16 base with a frozen share per rank that falls
with the ranks that shard it.

Each case runs on HSDP 2x3 and HFSDP 3x2 (and ZeRO-3 over all 6 ranks for the per-rank bytes) against the
unsharded model trained the same way in one process.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.steps import causal_lm_steps
from tests.support.toy_models import TINY_LLAMA, make_toy, microbatch, plain_steps

STEPS = 2
#: name -> (world, outer, inner, instances)
LAYOUTS = {
    "HSDP 2x3": (6, "no_shard", "optim_grads_params", 2),
    "HFSDP 3x2": (6, "optim", "optim_grads_params", 3),
    "ZeRO-3 1x6": (6, "no_shard", "optim_grads_params", 1),
}
FROZEN = ("inp.weight", "layers.0.up.weight", "layers.1.up.weight", "layers.2.up.weight")


def _frozen_toy():
    model = make_toy()
    for name, param in model.named_parameters():
        param.requires_grad_(name not in FROZEN)
    return model


def _cfg(layout: str):
    from hfsdp.core import LayoutConfig

    world, outer, inner, instances = LAYOUTS[layout]
    return LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)


def _frozen_bytes(model) -> int:
    """The bytes this rank holds for the frozen parameters (their main weights and any compute-dtype shard)."""
    from hfsdp.core import sharding_of

    storages = {}  # the main weights may be a view of the kept shard: each storage once
    for group in (g for g in sharding_of(model).groups if g.frozen):
        for tensor in (group.main, group.param_shard):
            if tensor is not None:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def _toy(layout: str, bf16: bool, rank: int, world: int) -> dict:
    from hfsdp.core import MixedPrecision, build_meshes, fully_shard

    model = _frozen_toy()
    mp = MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    cfg = _cfg(layout)
    model = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp)
    seen = {}
    model.layers[0].up.register_forward_pre_hook(lambda m, i: seen.update(dtype=m.weight.dtype))
    pieces = {n: (p.numel(), p.requires_grad) for n, p in model.named_parameters() if n in FROZEN}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # frozen pieces included, as users do
    losses = []
    for step in range(STEPS):
        loss = model(*microbatch(step, 0, 1, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    held = _frozen_bytes(model)
    return {"losses": losses, "weights": weights, "pieces": pieces, "dtype": seen["dtype"], "bytes": held}


def _lora(layout: str, rank: int, world: int) -> dict:
    """peft's LoRA on a frozen bf16 Llama, bf16 compute: losses, the dtype the base computes in, the bytes held."""
    from peft import LoraConfig, get_peft_model

    from hfsdp.core import MixedPrecision, build_meshes, fully_shard
    from hfsdp.models import hf

    base = hf.build_causal_lm(hf.config_from_dict(TINY_LLAMA), seed=0).to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"))
    cfg = _cfg(layout)
    layers = list(model.base_model.model.model.layers)
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    model = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=layers, mp=mp)
    seen = {}
    base_layer = layers[0].self_attn.q_proj.base_layer
    base_layer.register_forward_pre_hook(lambda m, i: seen.update(dtype=m.weight.dtype))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = causal_lm_steps(model, opt, _lora_batch(world)[rank : rank + 1], 4)  # this rank's own losses
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    held = {"elements": sum(p.numel() for p in frozen), "dtypes": {p.dtype for p in frozen}}
    return {"losses": losses, "dtype": seen["dtype"], "bytes": _frozen_bytes(model), "trainable": trainable, **held}


LORA_STEPS = 3


def _fp32_lora():
    """peft's LoRA (q_proj, v_proj, rank 4, Gaussian A) on the tiny Llama in fp32, its adapters' init seeded."""
    from peft import LoraConfig, get_peft_model

    from hfsdp.models import hf

    base = hf.build_causal_lm(hf.config_from_dict(TINY_LLAMA), seed=0)
    torch.manual_seed(1)
    return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"))


def _lora_batch(world: int) -> torch.Tensor:
    return torch.randint(0, 64, (world, 16), generator=torch.Generator().manual_seed(0))


def _fp32_lora_sharded(layout: str, rank: int, world: int) -> dict:
    """The fp32 LoRA sharded (its frozen base too), AdamW over the adapters: losses and the trained adapters."""
    from hfsdp.core import build_meshes, fully_shard

    model = _fp32_lora()
    cfg = _cfg(layout)
    model = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.base_model.model.model.layers))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = causal_lm_steps(model, opt, _lora_batch(world)[rank : rank + 1], LORA_STEPS, world)
    adapters = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    return {"losses": losses, "adapters": adapters}


def _toggled_after_sharding(layout: str, rank: int, world: int) -> dict[str, str]:
    """`requires_grad` changed after `fully_shard`, both ways: what the next forward said."""
    from hfsdp.core import build_meshes, fully_shard

    out = {}
    for toggle in ("freeze a trained weight", "unfreeze a frozen weight"):
        model = _frozen_toy()
        cfg = _cfg(layout)
        model = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers))
        name = "layers.1.down.weight" if toggle.startswith("freeze") else "layers.1.up.weight"
        model.get_parameter(name).requires_grad_(toggle.startswith("unfreeze"))
        try:
            model(*microbatch(0, 0, 1, rank, world)).backward()
            out[toggle] = "accepted"
        except RuntimeError as err:
            out[toggle] = str(err)
    return out


def _all(rank: int, world: int) -> dict:
    out = {}
    for layout in LAYOUTS:
        out[layout] = {"toggled": _toggled_after_sharding(layout, rank, world)}
        out[layout]["fp32"], out[layout]["bf16"] = _toy(layout, False, rank, world), _toy(layout, True, rank, world)
        out[layout]["lora"] = _lora(layout, rank, world)
        out[layout]["fp32 lora"] = _fp32_lora_sharded(layout, rank, world)
    return out


@pytest.fixture(scope="module")
def runs():
    """Every rank's results, all layouts in one spawned group of 6 ranks."""
    return run_distributed(_all, 6)


@pytest.fixture(scope="module")
def reference():
    """The unsharded toy with the same parameters frozen, AdamW over every parameter, whole global batches."""
    from tests.support.toy_models import global_batch

    model = _frozen_toy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, _ = plain_steps(model, opt, lambda step: model(*global_batch(step)), STEPS)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_model_with_frozen_weights_trains_like_the_unsharded_model(runs, reference, layout):
    """AdamW over every parameter (frozen ones included): the trained weights equal the unsharded model's, the frozen
    ones unchanged."""
    _, weights = reference
    case = runs[0][layout]["fp32"]
    for name, value in weights.items():
        torch.testing.assert_close(case["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    plain = dict(make_toy().named_parameters())
    for name in FROZEN:
        assert torch.equal(case["weights"][name], plain[name].detach()), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_frozen_weights_are_sharded_and_need_no_gradient(runs, layout):
    """Each rank holds a piece of every frozen weight, not the whole, as a parameter that needs no gradient; the pieces
    of one replica add up to the weight."""
    instances = LAYOUTS[layout][3]
    plain = dict(make_toy().named_parameters())
    for name in FROZEN:
        held = [rank[layout]["fp32"]["pieces"][name] for rank in runs]
        assert all(not needs_grad for _, needs_grad in held)
        assert max(n for n, _ in held) < plain[name].numel(), name
        replicas = instances if "HSDP" in layout else 1  # HSDP replicates the optimizer's pieces over the outer axis
        assert sum(n for n, _ in held) == replicas * plain[name].numel(), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_frozen_weights_compute_in_the_compute_dtype(runs, reference, layout):
    """With MixedPrecision(param_dtype=bf16) a frozen fp32 weight computes in bf16 (no dtype clash in the matmul)
    and the model trains as in fp32, to bf16's precision."""
    ref_losses, _ = reference
    case = runs[0][layout]["bf16"]
    assert case["dtype"] == torch.bfloat16 and runs[0][layout]["fp32"]["dtype"] == torch.float32
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(ref_losses), rtol=2e-2, atol=2e-2)


def test_peft_lora_trains_in_bf16_on_a_frozen_base_whose_share_falls_with_the_ranks(runs):
    """peft's LoRA on a frozen bf16 Llama with bf16 compute: the base computes in bf16, the adapters learn (the loss
    falls), the frozen bytes per rank fall with the ranks that shard them (3 for HSDP 2x3, 6 for ZeRO-3), and the
    base is held in its own bf16, 2 bytes per element held."""
    for layout in LAYOUTS:
        case = runs[0][layout]["lora"]
        assert case["dtype"] == torch.bfloat16, layout
        assert case["trainable"] == 2 * 2 * 2  # q_proj and v_proj, lora_A and lora_B, in 2 layers
        assert case["losses"][-1] < case["losses"][0], (layout, case["losses"])
    hsdp = max(rank["HSDP 2x3"]["lora"]["bytes"] for rank in runs)
    zero3 = max(rank["ZeRO-3 1x6"]["lora"]["bytes"] for rank in runs)
    assert zero3 < 0.6 * hsdp, (zero3, hsdp)
    # A bf16 base is held in bf16, 2 bytes per element of this rank's piece (no fp32 master: nothing updates it).
    for rank in runs:
        case = rank["ZeRO-3 1x6"]["lora"]
        assert case["dtypes"] == {torch.bfloat16}
        assert 2 * case["elements"] <= case["bytes"] < 2.05 * case["elements"], case  # padding: a few elements


@pytest.mark.parametrize("layout", LAYOUTS)
def test_peft_lora_on_a_sharded_frozen_base_trains_like_the_unsharded_model(runs, layout):
    """peft's LoRA in fp32, its frozen base sharded: the losses and the trained adapters equal peft's unsharded model
    trained by the same AdamW on the whole batch in one process."""
    model = _fp32_lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = causal_lm_steps(model, opt, _lora_batch(6), LORA_STEPS)
    case = runs[0][layout]["fp32 lora"]
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    adapters = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert adapters.keys() == case["adapters"].keys() and adapters
    for name, value in adapters.items():
        torch.testing.assert_close(case["adapters"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_requires_grad_changed_after_sharding_is_refused_at_the_next_forward(runs, layout):
    """Freezing a trained weight (it would go on training) or unfreezing a frozen one (it would never get a gradient)
    after `fully_shard` is refused at the next forward, naming the parameter and the fix."""
    for toggle, message in runs[0][layout]["toggled"].items():
        assert "before fully_shard" in message and "layers.1." in message, (toggle, message)
