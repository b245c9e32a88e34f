"""FSDP2 habits beyond the module contract: torch's and torchtitan's clipping however imported, accumulation declared
with FSDP2's flags (the user scales the loss), nested units, and the calls hfsdp cannot honour refused at
`fully_shard` with the fix named.

Every training case runs on HSDP 2x3 and HFSDP 3x2 against the unsharded toy trained on whole global batches in
one process; the refusals run there too and must leave the model untouched.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

# Bound at import, before any model is sharded in the process, as a script's first lines bind them.
from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_, get_total_norm

from tests.support.distributed import run_distributed
from tests.support.steps import causal_lm_steps
from tests.support.toy_models import TINY_LLAMA, make_toy, microbatch, reference_run

STEPS, MICROBATCHES, CLIP = 2, 2, 0.05
#: name -> (world, outer, inner, instances)
LAYOUTS = {
    "HSDP 2x3": (6, "no_shard", "optim_grads_params", 2),
    "HFSDP 3x2": (6, "optim", "optim_grads_params", 3),
}
CLIP_STYLES = ("torch's clip_grad_norm_ imported first", "torchtitan's get_total_norm + clip_grads_with_norm_")
ACCUMULATION_STYLES = ("set_requires_gradient_sync", "no_sync", "set_requires_all_reduce")
NESTINGS = ("outer listed first", "inner listed first")


def _shard(model, layout: str, units=None):
    from hfsdp.core import LayoutConfig, build_meshes, fully_shard

    world, outer, inner, instances = LAYOUTS[layout]
    cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
    return fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers) if units is None else units)


def _full_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _clipped(layout: str, style: str, rank: int, world: int) -> dict:
    """Training clipped by torch's utilities bound before sharding: the norms they returned and the weights."""
    model = _shard(make_toy(), layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for step in range(STEPS):
        model(*microbatch(step, 0, 1, rank, world)).backward()
        if style == CLIP_STYLES[0]:
            norm = clip_grad_norm_(model.parameters(), CLIP)
        else:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norm = get_total_norm(grads, 2.0, False, None)
            clip_grads_with_norm_(model.parameters(), CLIP, norm)
        norms.append(norm.item())
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "weights": _full_weights(model)}


def _hidden_grads_refused(layout: str, rank: int, world: int) -> str:
    """Offloaded, the gradients become `.grad` only at the step: torchtitan's norm of no gradients is refused."""
    from hfsdp.core import LayoutConfig, build_meshes, fully_shard

    world_size, outer, inner, instances = LAYOUTS[layout]
    cfg = LayoutConfig(world_size=world_size, inner=inner, outer=outer, instances=instances)
    model = make_toy()
    model = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), offload=True)
    model(*microbatch(0, 0, 1, rank, world)).backward()
    try:
        get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    except RuntimeError as err:
        return str(err)
    finally:
        model.zero_grad()
    return "accepted"


def _meta_init(layout: str, rank: int, world: int) -> dict:
    """torchtitan's flow: build on the meta device, shard, `to_empty`, load the eager-built model's initial weights,
    train; and `to_empty` on a model sharded with real weights is refused."""
    with torch.device("meta"):
        model = make_toy()
    model = _shard(model, layout)
    model.to_empty(device="cpu")
    try:
        model(*microbatch(0, 0, 1, rank, world))
        unloaded = "accepted"
    except RuntimeError as err:
        unloaded = str(err)
    model.load_state_dict(make_toy().state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        model(*microbatch(step, 0, 1, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    try:
        model.to_empty(device="cpu")
        again = "accepted"
    except RuntimeError as err:
        again = str(err)
    return {"weights": _full_weights(model), "to_empty again": again, "forward before a load": unloaded}


def _accumulate_fsdp2_style(layout: str, style: str, rank: int, world: int) -> dict[str, torch.Tensor]:
    """The FSDP2 user's accumulation loop: M microbatches, `(loss / M).backward()`, the sync declared their way."""
    model = _shard(make_toy(), layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        for index in range(MICROBATCHES):
            last = index == MICROBATCHES - 1
            if style == "set_requires_gradient_sync":
                model.set_requires_gradient_sync(last)
            elif style == "set_requires_all_reduce":
                model.set_is_last_backward(last)
                model.set_requires_all_reduce(last)
            loss = model(*microbatch(step, index, MICROBATCHES, rank, world)) / MICROBATCHES
            if style == "no_sync" and not last:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
    return _full_weights(model)


def _nested(layout: str, nesting: str, rank: int, world: int) -> dict:
    """Each block and its `up` projection both units, in either order: the same training as one unit per block."""
    model = make_toy()
    units = []
    for layer in model.layers:
        units += [layer, layer.up] if nesting == "outer listed first" else [layer.up, layer]
    model = _shard(model, layout, units)
    from hfsdp.core import sharding_of

    owned = [sorted(s.name for g in u.groups for s in g.slots) for u in sharding_of(model).units[:2]]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        model(*microbatch(step, 0, 1, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    return {"weights": _full_weights(model), "owned": owned}


def _llama(seed: int = 0):
    from hfsdp.models import hf

    return hf.build_causal_lm(hf.config_from_dict(TINY_LLAMA), seed=seed)


def _llama_batch() -> torch.Tensor:
    return torch.randint(0, 64, (6, 16), generator=torch.Generator().manual_seed(0))


def _nested_llama(layout: str, nesting: str, rank: int, world: int) -> dict:
    """The issue's case: a transformers Llama's decoder layers and their MLPs all units (FSDP2's bottom-up order, or
    the layer first): the losses of every step (mean over ranks) and the trained weights."""
    from hfsdp.core import LayoutConfig, build_meshes, fully_shard

    model = _llama()
    units = []
    for layer in model.model.layers:
        units += {"flat": [layer], "inner listed first": [layer.mlp, layer]}.get(nesting, [layer, layer.mlp])
    world_size, outer, inner, instances = LAYOUTS[layout]
    cfg = LayoutConfig(world_size=world_size, inner=inner, outer=outer, instances=instances)
    model = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=units)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = causal_lm_steps(model, opt, _llama_batch()[rank : rank + 1], STEPS + 1, world)
    return {"losses": losses, "weights": _full_weights(model)}


def _refusal(layout: str, case: str) -> str:
    """The message `fully_shard` (or the second declaration) refused `case` with, and that the model was left alone."""
    from hfsdp.core import HFSDPModule

    model = make_toy()
    units = None
    if case == "tied across units":
        model.layers[1].up.weight = model.layers[0].up.weight
    elif case == "unit outside the model":
        units = [*model.layers, nn.Linear(2, 2)]
    elif case == "the model in units":
        units = [*model.layers, model]
    elif case == "a unit listed twice":
        units = [*model.layers, model.layers[0]]
    elif case == "FSDP2's per-layer calls":
        for layer in model.layers:
            _shard(layer, layout, units=[])
    elif case == "partly on the meta device":
        model.head.to("meta")
    before = {n: p for n, p in model.named_parameters()}
    try:
        _shard(model, layout, units)
    except ValueError as err:
        untouched = not isinstance(model, HFSDPModule) and dict(model.named_parameters()) == before
        return str(err) if untouched else f"model was changed before the refusal: {err}"
    return "accepted"


def _mixed(layout: str, first: str) -> str:
    model = _shard(make_toy(), layout)
    declare = {
        "set_microbatch": lambda: model.set_microbatch(0, 2),
        "set_requires_gradient_sync": lambda: model.set_requires_gradient_sync(False),
    }
    declare[first]()
    other = next(name for name in declare if name != first)
    try:
        declare[other]()
    except RuntimeError as err:
        return str(err)
    return "accepted"


def _step_before_sync(layout: str, rank: int, world: int) -> str:
    model = _shard(make_toy(), layout)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model.set_requires_gradient_sync(False)
    (model(*microbatch(0, 0, 2, rank, world)) / 2).backward()
    try:
        opt.step()
    except RuntimeError as err:
        return str(err)
    return "accepted"


REFUSALS = {
    "tied across units": "tied",
    "unit outside the model": "not a submodule",
    "the model in units": "root unit already",
    "a unit listed twice": "listed twice",
    "FSDP2's per-layer calls": "already sharded",
    "partly on the meta device": "meta device but others are not",
}


def _all(rank: int, world: int) -> dict:
    out = {}
    for layout in LAYOUTS:
        out[layout] = {
            "clipped": {s: _clipped(layout, s, rank, world) for s in CLIP_STYLES},
            "hidden grads": _hidden_grads_refused(layout, rank, world),
            "accumulate": {s: _accumulate_fsdp2_style(layout, s, rank, world) for s in ACCUMULATION_STYLES},
            "nested": {n: _nested(layout, n, rank, world) for n in NESTINGS},
            "nested llama": {n: _nested_llama(layout, n, rank, world) for n in (*NESTINGS, "flat")},
            "meta": _meta_init(layout, rank, world),
            "refused": {case: _refusal(layout, case) for case in REFUSALS},
            "mixed": {first: _mixed(layout, first) for first in ("set_microbatch", "set_requires_gradient_sync")},
            "step before sync": _step_before_sync(layout, rank, world),
        }
    return out


@pytest.fixture(scope="module")
def every_rank():
    """Every rank's results of every case, both layouts in one spawned group of 6 ranks."""
    return run_distributed(_all, 6, timeout=300)


@pytest.fixture(scope="module")
def runs(every_rank):
    """Rank 0's results."""
    return every_rank[0]


@pytest.fixture(scope="module")
def reference():
    """The unsharded toy trained on whole global batches by the same AdamW."""
    return reference_run(STEPS)[1]


@pytest.fixture(scope="module")
def clipped_reference():
    """The unsharded toy trained by the same AdamW, clipped by torch's global norm: (weights, norms)."""
    _, weights, norms = reference_run(STEPS, clip=CLIP)
    assert norms[0] > CLIP  # the clip acts, so a local norm would show in the weights
    return weights, norms


def _assert_weights(weights: dict, reference: dict) -> None:
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("style", CLIP_STYLES)
def test_torch_and_torchtitan_clipping_imported_before_sharding_use_the_global_norm(
    runs, clipped_reference, layout, style
):
    """`from torch.nn.utils import clip_grad_norm_` (or torchtitan's `get_total_norm` + `clip_grads_with_norm_`)
    bound before `fully_shard`: every rank gets the unsharded model's norm and clips by it."""
    weights, norms = clipped_reference
    case = runs[layout]["clipped"][style]
    torch.testing.assert_close(torch.tensor(case["norms"]), torch.tensor(norms), rtol=1e-5, atol=1e-6)
    _assert_weights(case["weights"], weights)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_norm_of_gradients_held_outside_grad_is_refused(runs, layout):
    """Offloaded gradients are `.grad` only at the step: `get_total_norm` of none of them is refused, not 0."""
    assert "clip_grad_norm_" in runs[layout]["hidden grads"], runs[layout]["hidden grads"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("style", ACCUMULATION_STYLES)
def test_fsdp2_accumulation_with_the_loss_scaled_by_the_user_trains_like_the_unsharded_model(
    runs, reference, layout, style
):
    """FSDP2's `set_requires_gradient_sync(i == M-1)`, FSDP1's `no_sync()`, and `set_is_last_backward` with
    `set_requires_all_reduce` (HSDP's), each with `(loss / M).backward()`: the weights of whole-batch training."""
    _assert_weights(runs[layout]["accumulate"][style], reference)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("nesting", NESTINGS)
def test_nested_units_train_like_the_unsharded_model_and_the_inner_unit_owns_its_parameters(
    runs, reference, layout, nesting
):
    """A block and its `up` projection both units, listed in either order: the inner unit owns `up`'s parameters,
    the block the rest, and training equals the unsharded model's."""
    case = runs[layout]["nested"][nesting]
    expected = [["layers.0.down.bias", "layers.0.down.weight"], ["layers.0.up.bias", "layers.0.up.weight"]]
    assert sorted(case["owned"]) == expected
    _assert_weights(case["weights"], reference)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_model_built_on_the_meta_device_shards_materialises_and_trains_like_the_unsharded_model(
    runs, reference, layout
):
    """Built on `torch.device("meta")`, sharded, `to_empty(device=...)`, given the eager model's initial weights by
    `load_state_dict`: training equals the unsharded model's. A forward before any load (it would train from zeros,
    or from initialisers that saw pieces) and `to_empty` on real weights are refused."""
    case = runs[layout]["meta"]
    _assert_weights(case["weights"], reference)
    assert "would discard them" in case["to_empty again"], case["to_empty again"]
    assert "no weights were loaded" in case["forward before a load"], case["forward before a load"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("nesting", NESTINGS)
def test_nested_llama_layers_and_mlps_train_like_the_unsharded_model(runs, layout, nesting):
    """A transformers Llama's decoder layers and their MLPs all units, either order: every step's loss equals the
    unsharded model's, trained by the same AdamW on the whole batch, and the trained weights equal one unit per layer's
    (to 1e-6) and the unsharded model's to AdamW's own noise (a near-zero gradient's update flips with the last bit
    of a sum's order: 1.7e-5 for q_proj, the same with one unit per layer)."""
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = causal_lm_steps(model, opt, _llama_batch(), STEPS + 1)
    case, flat = runs[layout]["nested llama"][nesting], runs[layout]["nested llama"]["flat"]
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for name, value in model.named_parameters():
        torch.testing.assert_close(case["weights"][name], flat["weights"][name], rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(case["weights"][name], value.detach(), rtol=0, atol=5e-5, msg=name)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", REFUSALS)
def test_what_cannot_be_sharded_is_refused_at_fully_shard_naming_the_fix(runs, layout, case):
    """Ties across units, units outside the model, the model among its units, a unit twice, FSDP2's per-layer calls
    and a model only partly on the meta device: one sentence at the call, the model left as it was."""
    message = runs[layout]["refused"][case]
    assert REFUSALS[case] in message, message
    assert "fully_shard" in message or "units=" in message, message


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_two_accumulation_apis_cannot_be_mixed(runs, layout):
    """`set_microbatch` (hfsdp scales) and FSDP2's flags (the user scales) on one model: the second is refused,
    whichever came first, so the loss is never divided twice or not at all."""
    for message in runs[layout]["mixed"].values():
        assert "who scales the loss" in message, message


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_step_before_the_synced_backward_is_refused(runs, layout):
    """`optimizer.step()` after a backward with gradient sync off would step unreduced gradients: refused."""
    assert "set_requires_gradient_sync(False)" in runs[layout]["step before sync"]


@pytest.mark.parametrize(("outer_axis", "ready"), [(True, False), (False, True)], ids=["HSDP/HFSDP", "one axis"])
def test_requires_all_reduce_holds_back_only_a_layout_with_an_outer_axis(outer_axis, ready):
    """FSDP2's `set_requires_all_reduce(False)` skips HSDP's replica all-reduce; on one axis there is none to skip,
    so a backward with gradient sync on still finishes the step's gradients, as FSDP2's does. Either way the engine
    divides by the data-parallel size alone (the user scaled the loss)."""
    from hfsdp.core.engine.step import StepContext

    step = StepContext(4, lambda: None, lambda: None, outer_axis)
    step.set_sync_flag("set_requires_all_reduce", False)
    assert step.is_last is ready and step.grad_scale == 1 / 4
    step.set_sync_flag("set_requires_all_reduce", True)
    assert step.is_last
