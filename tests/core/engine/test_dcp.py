"""torch.distributed.checkpoint on hfsdp models, as torchtitan and FSDP2 users drive it.

Each flow saves after one step, then resumes into a fresh model and optimizer (other initial weights) and takes the
next step; the resumed weights must equal, bit for bit, those of the run that went on without stopping. Flows:
torchtitan's (`get_state_dict` -> `dcp.save` / `dcp.async_save` -> `get_state_dict` -> `dcp.load` -> `set_state_dict`),
`dcp.save` of `model.state_dict()` and `opt.state_dict()` taken directly, and torch's full state dicts (every rank,
and from rank 0 by broadcast). They run on HSDP 2x3 and HFSDP 3x2 with torch's AdamW and hfsdp's FusedAdamW (fp32
and fp8 moments, whose per-element scales are state too). A checkpoint written on 6 ranks (HFSDP 3x2) is then
loaded by DCP's own resharding on 4 ranks in two other layouts, and the state it restores must equal the saved
state exactly.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.toy_models import OPTIMIZERS, global_batch, make_toy, microbatch

#: name -> (world, outer, inner, instances)
LAYOUTS = {
    "HSDP 2x3": (6, "no_shard", "optim_grads_params", 2),
    "HFSDP 3x2": (6, "optim", "optim_grads_params", 3),
    "HFSDP 2x2": (4, "optim", "optim_grads_params", 2),
    "ZeRO-3 x4": (4, "no_shard", "optim_grads_params", 1),
}
SAVED_ON, RESHARDED_TO = "HFSDP 3x2", ("HFSDP 2x2", "ZeRO-3 x4")
FLOWS = (
    "torchtitan",
    "torchtitan async_save",
    "state_dict()s taken directly",
    "full on every rank",
    "full from rank 0",
)
OPTIMIZER_KINDS = ("AdamW", "FusedAdamW", "FusedAdamW fp8 moments")


def _shard(model, layout: str):
    from hfsdp.core import LayoutConfig, build_meshes, fully_shard

    world, outer, inner, instances = LAYOUTS[layout]
    cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
    return fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers))


def _optimizer(model, kind: str):
    from hfsdp.core import FusedAdamW

    if kind.startswith("FusedAdamW"):
        moments = "fp8" if kind.endswith("fp8 moments") else "fp32"  # fp8: a uint8 scale per element beside each
        return FusedAdamW(
            model.parameters(),
            lr=1e-2,
            weight_decay=0.1,
            backend="torch",
            exp_avg_dtype=moments,
            exp_avg_sq_dtype=moments,
        )
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model, opt, step: int, rank: int, world: int) -> None:
    model(*microbatch(step, 0, 1, rank, world)).backward()
    opt.step()
    opt.zero_grad()


def _save(flow: str, model, opt, path: str):
    """Write the checkpoint the way `flow` does; what the full flows keep in memory instead (or None)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if flow.startswith("torchtitan"):
        model_sd, optim_sd = get_state_dict(model, opt)
        if flow.endswith("async_save"):
            dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path).result()
        else:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    elif flow == "state_dict()s taken directly":
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    else:
        from_rank0 = flow == "full from rank 0"
        options = StateDictOptions(full_state_dict=True, cpu_offload=from_rank0)
        return copy.deepcopy(get_state_dict(model, opt, options=options))  # as written to disk: no live `step`
    return None


def _resume(flow: str, model, opt, path: str, kept) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    if flow.startswith("torchtitan"):
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    elif flow == "state_dict()s taken directly":
        state = {"model": model.state_dict(), "optim": opt.state_dict()}  # opt has state: it has stepped
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    else:
        from_rank0 = flow == "full from rank 0"
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0)
        if from_rank0:  # one call each, as torchtitan makes them (`set_state_dict` with an empty model dict on ranks
            # other than 0 would skip the model there: torch's own behaviour, FSDP2's too)
            set_model_state_dict(model, kept[0], options=options)
            set_optimizer_state_dict(model, opt, kept[1], options=options)
        else:
            set_state_dict(model, opt, model_state_dict=kept[0], optim_state_dict=kept[1], options=options)


def _resumed(layout: str, flow: str, kind: str, rank: int, world: int, tmp: str) -> bool:
    """Save after one step, resume into a fresh model, step: the same weights as the run that never stopped?"""
    path = f"{tmp}/{layout}-{flow}-{kind}".replace(" ", "_")
    model = _shard(make_toy(), layout)
    opt = _optimizer(model, kind)
    _step(model, opt, 0, rank, world)
    kept = _save(flow, model, opt, path)
    _step(model, opt, 1, rank, world)
    want = model.state_dict()

    fresh = _shard(make_toy(seed=7), layout)
    fresh_opt = _optimizer(fresh, kind)
    if flow == "state_dict()s taken directly":
        _step(fresh, fresh_opt, 5, rank, world)  # as with FSDP2: the optimizer needs state to load into
    _resume(flow, fresh, fresh_opt, path, kept)
    _step(fresh, fresh_opt, 1, rank, world)
    got = fresh.state_dict()
    return all(torch.equal(want[k], got[k]) for k in want) and set(want) == set(got)


def _full_state(model, opt) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _saved_for_resharding(rank: int, world: int, tmp: str) -> tuple[dict, dict]:
    """One step on HFSDP 3x2, then `dcp.save` (torchtitan's way): the full state it saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _shard(make_toy(), SAVED_ON)
    opt = _optimizer(model, "AdamW")
    _step(model, opt, 0, rank, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{tmp}/reshard")
    return _full_state(model, opt)


def _pickled(rank: int, world: int) -> bool:
    """`torch.save` of `opt.state_dict()` writes plain pieces, which `torch.load(weights_only=True)` reads and the
    same layout loads back."""
    model = _shard(make_toy(), "HSDP 2x3")
    opt = _optimizer(model, "AdamW")
    _step(model, opt, 0, rank, world)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    plain = all(type(v) is torch.Tensor for entry in loaded["state"].values() for v in entry.values())
    opt.load_state_dict(loaded)
    return plain and bool(loaded["state"])


FROZEN = ("inp.weight", "layers.0.up.weight", "layers.1.up.weight")


def _frozen_toy(seed: int):
    model = make_toy(seed)
    for name, param in model.named_parameters():
        param.requires_grad_(name not in FROZEN)
    return model


def _frozen_resumed(rank: int, world: int, tmp: str) -> bool:
    """A frozen base (sharded in its own groups) under bf16 compute, torchtitan's flow on HFSDP 3x2: bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from hfsdp.core import LayoutConfig, MixedPrecision, build_meshes, fully_shard

    def sharded(seed):
        world_size, outer, inner, instances = LAYOUTS["HFSDP 3x2"]
        cfg = LayoutConfig(world_size=world_size, inner=inner, outer=outer, instances=instances)
        model = _frozen_toy(seed)
        mp = MixedPrecision(param_dtype=torch.bfloat16)
        model = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    model, opt = sharded(0)
    _step(model, opt, 0, rank, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{tmp}/frozen")
    _step(model, opt, 1, rank, world)
    want = model.state_dict()
    fresh, fresh_opt = sharded(7)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=f"{tmp}/frozen")
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _step(fresh, fresh_opt, 1, rank, world)
    got = fresh.state_dict()
    return set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)


def _diloco_refused(rank: int, world: int) -> str:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hfsdp.core import DiLoCoConfig

    from tests.support.diloco import shard_toy

    model = shard_toy(world, "diloco", "optim_grads_params", 3, DiLoCoConfig(sync_every=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        get_state_dict(model, opt)
    except RuntimeError as err:
        return str(err)
    return "accepted"


#: Every case but one: torch's `broadcast_from_rank0` broadcasts fp8 tensors, which gloo cannot ("Invalid scalar
#: type", torch's helper and gloo alone: hfsdp's own gathers move bytes); NCCL can.
CASES = [
    (layout, flow, kind)
    for layout in ("HSDP 2x3", "HFSDP 3x2")
    for flow in FLOWS
    for kind in OPTIMIZER_KINDS
    if not (flow == "full from rank 0" and kind.endswith("fp8 moments"))
]


def _six(rank: int, world: int, tmp: str) -> dict:
    return {
        "resumed": {case: _resumed(*case, rank, world, tmp) for case in CASES},
        "saved": _saved_for_resharding(rank, world, tmp),
        "pickled": _pickled(rank, world),
        "frozen": _frozen_resumed(rank, world, tmp),
        "diloco": _diloco_refused(rank, world),
    }


def _four(rank: int, world: int, tmp: str) -> dict:
    """Load the 6-rank checkpoint into each 4-rank layout: the full state restored."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    for layout in RESHARDED_TO:
        model = _shard(make_toy(seed=7), layout)
        opt = _optimizer(model, "AdamW")
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=f"{tmp}/reshard")
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out[layout] = _full_state(model, opt)
    return out


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dcp"))
    return run_distributed(_six, 6, tmp, timeout=400), tmp


@pytest.fixture(scope="module")
def four(six):
    return run_distributed(_four, 4, six[1], timeout=300)


@pytest.mark.parametrize("case", CASES, ids=" / ".join)
def test_a_dcp_resume_takes_the_next_step_bit_for_bit(six, case):
    assert six[0][0]["resumed"][case]


def test_the_full_state_dicts_are_the_unsharded_models(six):
    """torch's full state dicts of the sharded model equal the unsharded model trained one step by the same AdamW."""
    model_sd, optim_sd = six[0][0]["saved"]
    reference = make_toy()
    opt = OPTIMIZERS["adamw"](reference.parameters())  # lr 1e-2, weight decay 0.1, as _optimizer
    reference(*global_batch(0)).backward()
    opt.step()
    assert set(model_sd) == {n for n, _ in reference.named_parameters()}
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model_sd[name], param.detach(), rtol=1e-5, atol=1e-7, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optim_sd["state"][name][key], opt.state[param][key], rtol=1e-5, atol=1e-9)
    assert all(not six[0][r]["saved"][0] for r in range(1, 6))  # cpu_offload: rank 0 alone


@pytest.mark.parametrize("layout", RESHARDED_TO)
def test_a_checkpoint_saved_on_six_ranks_loads_on_four_in_another_layout_exactly(six, four, layout):
    saved_model, saved_optim = six[0][0]["saved"]
    model_sd, optim_sd = four[0][layout]
    assert set(model_sd) == set(saved_model)
    for name, value in saved_model.items():
        assert torch.equal(model_sd[name], value), name
        for key, state in saved_optim["state"][name].items():
            assert torch.equal(optim_sd["state"][name][key], state), (name, key)


def test_an_optimizer_state_dict_still_round_trips_through_torch_save(six):
    assert all(rank["pickled"] for rank in six[0])


def test_a_frozen_bf16_computed_base_resumes_through_dcp_bit_for_bit(six):
    assert six[0][0]["frozen"]


def test_dcp_with_diloco_is_refused_on_every_rank_naming_hfsdp_ckpt(six):
    for rank in six[0]:
        assert "hfsdp.ckpt.save_checkpoint" in rank["diloco"] and "DiLoCo" in rank["diloco"]


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 5), ()])
def test_a_flat_range_is_the_rectangles_dcp_is_told_in_order(shape):
    """Every range [start, stop) of a row-major tensor: its rectangles, in order, are exactly its elements, each a
    contiguous run of them (so a rectangle is a view of the flat piece)."""
    from hfsdp.core.engine.piece_tensor import chunks_of

    whole = torch.arange(max(1, torch.Size(shape).numel())).view(shape)
    n = whole.numel()
    for start in range(n + 1):
        for stop in range(start, n + 1):
            covered = []
            for offsets, sizes, first in chunks_of(shape, start, stop):
                box = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
                assert box.tolist() == list(range(first, first + box.numel())), (shape, start, stop, offsets)
                covered += box.tolist()
            assert covered == list(range(start, stop)), (shape, start, stop)


def _megatron_round_trips(rank: int, world: int, tmp: str) -> list:
    """A megatron GPT's state dicts carry non-tensor `_extra_state` entries: the full load and DCP's strict load
    both take them back (they are known keys, not unexpected ones)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from hfsdp.core import LayoutConfig
    from hfsdp.models.megatron.adapter import initialize_parallel, shard_megatron_model
    from hfsdp.models.megatron.gpt import GPTShape, build_gpt

    cfg = LayoutConfig(world_size=world)
    initialize_parallel(cfg)
    shape = GPTShape(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)
    model = shard_megatron_model(build_gpt(shape), cfg, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    full = model.state_dict()
    extra = [k for k, v in full.items() if not isinstance(v, torch.Tensor)]
    loaded = model.load_state_dict(full)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd}, checkpoint_id=f"{tmp}/gpt")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd}, checkpoint_id=f"{tmp}/gpt")
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return [
        bool(extra),
        list(loaded.unexpected_keys),
        torch.equal(full["output_layer.weight"], model.state_dict()["output_layer.weight"]),
    ]


def test_a_megatron_gpt_with_extra_state_loads_its_own_state_dicts(tmp_path):
    assert run_distributed(_megatron_round_trips, 1, str(tmp_path), timeout=120)[0] == [True, [], True]
