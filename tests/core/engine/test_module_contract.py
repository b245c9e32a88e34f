"""The sharded module behaves like the module users know: every FSDP2 habit works, or fails at once.

Each habit runs on one rank and on HFSDP 2x2, with fp32 compute, bf16 compute, offload, and bf16 with
offload, against the unsharded model trained the same way in one process:

a. `torch.optim.AdamW(model.parameters())` trains, and `torch.nn.utils.clip_grad_norm_(model.parameters())`
   returns the global norm and clips by it;
b. `torch.save(model.state_dict())` / `torch.load` round-trips, under the original names, into the unsharded model;
c. `model.load_state_dict(sd)` writes the weights, and they last through later steps;
d. dtype and device moves after sharding are refused with the right way named (a no-op move goes through);
e. two optimizers over one model (AdamW for matrices, SGD for vectors) both train;
and the wrapper points: `fully_shard` returns the module itself (class, attributes, methods such as
`generate`), and reading norms and buffers allocates no gradient.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.toy_models import GLOBAL_BATCH, OPTIMIZERS, TINY_LLAMA, global_batch, make_toy

STEPS, CLIP = 3, 0.05
MODES = ("fp32", "bf16", "offload", "bf16+offload")
#: name -> (world, outer, inner, instances)
LAYOUTS = {
    "one rank": (1, "no_shard", "optim_grads_params", 1),
    "HFSDP 2x2": (4, "optim", "optim_grads_params", 2),
    "ZeRO-1 1x4": (4, "no_shard", "optim", 1),  # keeps a bf16 parameter copy: stale after a step, the loss stays flat
}
#: the modes run on each layout (ZeRO-1 in fp32 is covered by tests/core/engine/test_engine.py)
LAYOUT_MODES = {"ZeRO-1 1x4": ("bf16", "bf16+offload")}


# -- what every rank runs ----------------------------------------------------------------------------


def _shard(layout: str, mode: str, model=None):
    from hfsdp.core import LayoutConfig, MixedPrecision, build_meshes, fully_shard

    model = make_toy() if model is None else model
    world, outer, inner, instances = LAYOUTS[layout]
    cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
    mp = MixedPrecision(param_dtype=torch.bfloat16) if "bf16" in mode else None
    units = list(model.layers) if hasattr(model, "layers") else list(model.model.layers)
    return fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=units, mp=mp, offload="offload" in mode)


def _batch(step: int, rank: int, world: int):
    x, y = global_batch(step)
    size = GLOBAL_BATCH // world
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def _mean_loss(loss: torch.Tensor, world: int) -> float:
    import torch.distributed as dist

    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / world


def _fsdp2_loop(model, optimizers, rank, world, steps=STEPS, clip=None, start=0):
    """The loop an FSDP2 user writes: backward, clip with torch's utility, step every optimizer, zero_grad."""
    losses, norms = [], []
    for step in range(start, start + steps):
        loss = model(*_batch(step, rank, world))
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad()
        losses.append(_mean_loss(loss, world))
    return losses, norms


def _full_weights(model) -> dict[str, torch.Tensor] | None:
    sd = model.state_dict()
    return {k: v.clone() for k, v in sd.items()} or None


def _habits(rank: int, world: int, layout: str, mode: str, tmp: str) -> dict:
    import torch.distributed as dist

    from hfsdp.core import HFSDPModule, global_grad_norm, sharding_of

    from tests.support.toy_models import Toy

    out: dict = {}
    # The wrapper points: the same object, its class and attributes, the original parameter names.
    model = make_toy()
    model.note = "kept"
    names = [n for n, _ in model.named_parameters()]
    returned = _shard(layout, mode, model)
    out["same object"] = returned is model
    out["isinstance"] = isinstance(model, Toy) and isinstance(model, HFSDPModule)
    out["attribute"] = model.note
    out["names"] = [n for n, _ in model.named_parameters()] == names
    out["dims"] = {n: p.dim() for n, p in model.named_parameters()}
    # Reading state allocates nothing.
    norm = global_grad_norm(model).item()
    buffers = sharding_of(model).sharded_buffers()
    out["read allocates nothing"] = (
        norm == 0.0
        and all(b["grad"] is None for b in buffers)
        and not any(g.grads.holds for g in sharding_of(model).groups)
    )

    # a. AdamW over model.parameters(), clipped by torch's own utility.
    opt = OPTIMIZERS["adamw"](model.parameters())
    out["a"] = _fsdp2_loop(model, [opt], rank, world, clip=CLIP)
    out["a weights"] = _full_weights(model)

    # b. torch.save / torch.load of the full state dict (rank 0 holds it, the others an empty dict).
    sd = model.state_dict()
    out["b empty elsewhere"] = (rank == 0) == bool(sd)
    if rank == 0:
        torch.save(sd, f"{tmp}/{mode}-{layout}.pt")
        back = torch.load(f"{tmp}/{mode}-{layout}.pt")
        plain = Toy()
        plain.load_state_dict(back)
        out["b loaded"] = {k: v.clone() for k, v in plain.state_dict().items()}
    dist.barrier()

    # c. load_state_dict writes the weights; they last through a step at lr 0 (the optimizer has state by now).
    other = make_toy(seed=7).state_dict()
    out["c result"] = str(model.load_state_dict(other))
    for group in opt.param_groups:
        group["lr"] = 0.0
    out["c losses"], _ = _fsdp2_loop(model, [opt], rank, world, steps=2, start=STEPS)
    out["c weights"] = _full_weights(model)
    # ... and from rank 0 alone (the others pass the empty dict state_dict() gave them).
    model.load_state_dict(make_toy(seed=8).state_dict() if rank == 0 else {})
    out["c rank0 weights"] = _full_weights(model)

    # d. Dtype and device moves are refused; a move that changes nothing goes through.
    refused = {}
    for what, move in {
        "double": lambda m: m.double(),
        "half": lambda m: m.half(),
        "to bf16": lambda m: m.to(torch.bfloat16),
        "to meta": lambda m: m.to("meta"),
    }.items():
        try:
            move(model)
            refused[what] = None
        except RuntimeError as err:
            refused[what] = str(err)
    out["d refused"] = refused
    model.float().to("cpu")
    out["d after"] = _full_weights(model)
    model.layers[0].double()  # a submodule: caught when its gradients arrive, or at the next step
    try:
        model(*_batch(0, rank, world)).backward()
        opt.step()
        out["d submodule"] = None
    except RuntimeError as err:
        out["d submodule"] = str(err)

    # e. Two optimizers: AdamW for matrices, SGD with momentum for vectors (by dim, as nanoGPT splits them).
    model = _shard(layout, mode)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    adamw = OPTIMIZERS["adamw"](matrices)
    sgd = OPTIMIZERS["sgd"](vectors)
    out["e"] = _fsdp2_loop(model, [adamw, sgd], rank, world)
    out["e weights"] = _full_weights(model)
    out["e norm method"] = model.clip_grad_norm_(1.0).item()  # no gradients left: 0, and nothing allocated
    return out


def _model_class(sharded) -> type:
    """The user's own class under the dynamic one `fully_shard` made (the first in its MRO that hfsdp did not add)."""
    from hfsdp.core import HFSDPModule

    return next(c for c in type(sharded).__mro__[1:] if c not in HFSDPModule.__mro__)


def _generate(layout: str) -> dict:
    """A transformers Llama keeps `config` and `generate`: greedy decoding equals the unsharded model's."""
    from hfsdp.models import hf

    config = hf.config_from_dict(TINY_LLAMA)
    model = hf.build_causal_lm(config, seed=0)
    sharded = _shard(layout, "fp32", model)
    prompt = torch.arange(5).reshape(1, 5)
    with torch.no_grad():
        tokens = sharded.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return {
        "class": _model_class(sharded).__name__,
        "vocab": sharded.config.vocab_size,
        "tokens": tokens,
        "groups": _decay_groups(sharded),
        "toy groups": _decay_groups(_shard(layout, "fp32")),
    }


def _decay_groups(model) -> dict[str, set[str]]:
    """The parameter names `param_groups` puts in each group, with the group's weight decay."""
    from hfsdp.core import param_groups
    from hfsdp.core.buffers.main_params import piece_of

    return {
        f"{g['name']} {g['weight_decay']}": {piece_of(p).name for p in g["params"]} for g in param_groups(model, 0.1)
    }


def _all(rank: int, world: int, tmp: str, layouts: list[str]) -> dict:
    out = {}
    for index, layout in enumerate(layouts):
        out[layout] = {mode: _habits(rank, world, layout, mode, tmp) for mode in LAYOUT_MODES.get(layout, MODES)}
        if index == 0:
            out[layout]["generate"] = _generate(layout)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout's results, a list over its ranks; one spawned group per world size."""
    tmp = str(tmp_path_factory.mktemp("contract"))
    out = {}
    for world in sorted({w for w, *_ in LAYOUTS.values()}):
        names = [name for name, (w, *_) in LAYOUTS.items() if w == world]
        ranks = run_distributed(_all, world, tmp, names)
        out.update({name: [r[name] for r in ranks] for name in names})
    return out


# -- the references: the unsharded model, trained the same way in one process -------------------------------


def _reference(mode: str, world: int, split: bool = False, clip: float | None = CLIP, steps: int = STEPS):
    """The unsharded model trained the same way in one process: AdamW over every parameter (or, with `split`, AdamW
    over the matrices and SGD over the vectors), clipped by torch's global norm. With bf16 compute, each rank's
    batch runs through a bf16 copy of the fp32 weights and the gradients are summed in fp32 over the ranks and
    divided by their count, as the engine does; with fp32, one process runs the whole batch."""
    master = make_toy()
    params = list(master.parameters())
    if split:
        optimizers = [OPTIMIZERS["adamw"]([p for p in params if p.dim() >= 2])]
        optimizers.append(OPTIMIZERS["sgd"]([p for p in params if p.dim() < 2]))
    else:
        optimizers = [OPTIMIZERS["adamw"](params)]
    losses, norms = [], []
    for step in range(steps):
        if "bf16" in mode:
            grads = [torch.zeros_like(p) for p in params]
            total = 0.0
            for rank in range(world):
                copy = make_toy().to(torch.bfloat16)
                copy.load_state_dict({n: p.to(torch.bfloat16) for n, p in master.state_dict().items()})
                x, y = _batch(step, rank, world)
                loss = copy(x.to(torch.bfloat16), y.to(torch.bfloat16)).float()
                loss.backward()
                total += loss.item()
                for grad, p in zip(grads, copy.parameters(), strict=True):
                    grad += p.grad.float()
            for grad, p in zip(grads, params, strict=True):
                p.grad = grad / world
            losses.append(total / world)
        else:
            loss = master(*global_batch(step))
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(params, clip).item())
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}, norms


def _tolerance(mode: str) -> dict:
    return {"rtol": 1e-4, "atol": 1e-5} if "bf16" in mode else {"rtol": 1e-5, "atol": 1e-6}


CASES = [(layout, mode) for layout in LAYOUTS for mode in LAYOUT_MODES.get(layout, MODES)]
GENERATED = ["one rank", "HFSDP 2x2"]  # the first layout of each world also runs the transformers model


@pytest.mark.parametrize(("layout", "mode"), CASES)
def test_fully_shard_returns_the_module_itself(runs, layout, mode):
    """The same object comes back: its class (a subclass of its own), its attributes, its parameter names, and
    partial pieces keep the parameter's number of dimensions (so `dim()`-based rules pick the same parameters)."""
    plain = dict(make_toy().named_parameters())
    for rank in runs[layout]:
        case = rank[mode]
        assert case["same object"] and case["isinstance"] and case["attribute"] == "kept" and case["names"]
        assert case["dims"] == {n: p.dim() for n, p in plain.items()}
        assert case["read allocates nothing"]


@pytest.mark.parametrize(("layout", "mode"), CASES)
def test_an_optimizer_over_model_parameters_trains_like_the_unsharded_model(runs, layout, mode):
    """AdamW over `model.parameters()`, clipped by `torch.nn.utils.clip_grad_norm_(model.parameters())`: the
    losses, the global norms torch's utility returned, and the weights equal the unsharded model's."""
    ref_losses, ref_weights, ref_norms = _reference(mode, LAYOUTS[layout][0])
    losses, norms = runs[layout][0][mode]["a"]
    tol = _tolerance(mode)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **tol)
    assert ref_norms[0] > CLIP  # the clip acted, so a local or unclamped norm would show
    weights = runs[layout][0][mode]["a weights"]
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, **tol, msg=name)


@pytest.mark.parametrize(("layout", "mode"), CASES)
def test_state_dict_round_trips_through_torch_save_into_the_unsharded_model(runs, layout, mode):
    """`model.state_dict()` holds every tensor whole on rank 0 (the others get an empty dict); `torch.save`,
    `torch.load` and the unsharded model's `load_state_dict` give back exactly those tensors."""
    ranks = runs[layout]
    assert all(r[mode]["b empty elsewhere"] for r in ranks)
    saved, loaded = ranks[0][mode]["a weights"], ranks[0][mode]["b loaded"]
    assert list(loaded) == list(make_toy().state_dict())
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name


@pytest.mark.parametrize(("layout", "mode"), CASES)
def test_load_state_dict_writes_the_weights_and_they_last(runs, layout, mode):
    """`load_state_dict` of another model's weights: the next two steps at lr 0 compute that model's losses and
    leave its weights in place (the main weights were written, not just a copy the next step overwrites); a
    state dict passed on rank 0 alone loads the same way."""
    case = runs[layout][0][mode]
    assert case["c result"] == "<All keys matched successfully>"
    other = make_toy(seed=7)
    for name, value in other.state_dict().items():
        torch.testing.assert_close(case["c weights"][name], value, rtol=0, atol=0, msg=name)
    world = LAYOUTS[layout][0]
    want = []
    for step in range(STEPS, STEPS + 2):
        if "bf16" in mode:
            copy = make_toy(seed=7).to(torch.bfloat16)
            ranks = [copy(*(t.to(torch.bfloat16) for t in _batch(step, r, world))).float().item() for r in range(world)]
        else:
            ranks = [other(*_batch(step, r, world)).item() for r in range(world)]
        want.append(sum(ranks) / world)
    torch.testing.assert_close(torch.tensor(case["c losses"]), torch.tensor(want), **_tolerance(mode))
    for name, value in make_toy(seed=8).state_dict().items():
        assert torch.equal(case["c rank0 weights"][name], value), name


@pytest.mark.parametrize(("layout", "mode"), CASES)
def test_dtype_and_device_moves_are_refused(runs, layout, mode):
    """`.double()`, `.half()`, `.to(bf16)` and `.to("meta")` are refused naming MixedPrecision and the device, and
    change nothing; `.float().to("cpu")` (no change) goes through; a submodule converted behind the root's back
    is caught when its gradients arrive (at the end of backward)."""
    for rank in runs[layout]:
        case = rank[mode]
        for what, message in case["d refused"].items():
            assert message is not None and "MixedPrecision" in message and "before calling fully_shard" in message, what
        assert case["d submodule"] is not None and "no longer lives in hfsdp's main weights" in case["d submodule"]
    for name, value in make_toy(seed=8).state_dict().items():  # the full weights, on rank 0
        assert torch.equal(runs[layout][0][mode]["d after"][name], value), name


@pytest.mark.parametrize(("layout", "mode"), CASES)
def test_two_optimizers_each_train_their_parameters(runs, layout, mode):
    """AdamW over the matrices and SGD over the vectors, stepped one after the other: each publishes and releases
    only what it stepped, so both train, to the unsharded model's losses and weights under the same split."""
    case = runs[layout][0][mode]
    tol = _tolerance(mode)
    ref_losses, ref_weights, _ = _reference(mode, LAYOUTS[layout][0], split=True, clip=None)
    losses, _ = case["e"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    initial = make_toy().state_dict()
    for name, value in ref_weights.items():
        torch.testing.assert_close(case["e weights"][name], value, **tol, msg=name)
        assert not torch.equal(case["e weights"][name], initial[name]), f"{name} never trained"
    assert case["e norm method"] == 0.0


@pytest.mark.parametrize("layout", GENERATED)
def test_a_transformers_model_keeps_generate_and_config(runs, layout):
    """A sharded LlamaForCausalLM is still one: its `config` is there and greedy `generate` gives the unsharded
    model's tokens."""
    plain = _tiny_llama()
    with torch.no_grad():
        want = plain.generate(torch.arange(5).reshape(1, 5), max_new_tokens=4, do_sample=False, pad_token_id=0)
    for rank in runs[layout]:
        case = rank["generate"]
        assert case["class"] == "LlamaForCausalLM" and case["vocab"] == 64
        assert torch.equal(case["tokens"], want)


@pytest.mark.parametrize("layout", GENERATED)
def test_param_groups_follow_megatrons_no_decay_rule(runs, layout):
    """`param_groups(model, 0.1)` decays the matrices only: norm weights (1-D), biases and embeddings get no weight
    decay, on every rank the same names (empty pieces included)."""
    llama = dict(_tiny_llama().named_parameters())
    toy = dict(make_toy().named_parameters())
    for rank in runs[layout]:
        groups = rank["generate"]["groups"]
        assert groups["no_decay 0.0"] == {n for n in llama if "norm" in n or "embed" in n}
        assert groups["decay 0.1"] == set(llama) - groups["no_decay 0.0"]
        toy_groups = rank["generate"]["toy groups"]
        assert toy_groups["no_decay 0.0"] == {n for n in toy if n.endswith(".bias")}
        assert toy_groups["decay 0.1"] == {n for n in toy if n.endswith(".weight")}


def _tiny_llama():
    from hfsdp.models import hf

    return hf.build_causal_lm(hf.config_from_dict(TINY_LLAMA), seed=0)
