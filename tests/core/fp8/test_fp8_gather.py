"""fully_shard(fp8_param_gather=True): the weights gathered in fp8 are exactly those the layers quantize.

Every case trains the same fp8 model (hybrid, tensorwise) twice on 6 ranks, with and without the fp8
gather, three steps of two microbatches in bf16, and asserts that the losses and the full weights after
the last step are equal bit for bit (a weight quantized on its shards and one quantized whole give the
same bits, so nothing downstream may differ), and that the gathers of the fp8 weights moved one byte per
element. Layouts of unequal axes both ways (HSDP 2x3, HFSDP 3x2 and 2x3, ZeRO-3 x6), torch's AdamW and
hfsdp's FusedAdamW (prestaged gathers), weights kept from forward to backward, recomputed units, the optimizer
offloaded to host memory.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.fp8_models import fp8_batch, make_fp8_toy, run_microbatches

#: name -> (outer, inner, instances) on 6 ranks
LAYOUTS = {
    "HSDP 2x3": ("no_shard", "optim_grads_params", 2),
    "HFSDP 3x2": ("optim", "optim_grads_params", 3),
    "HFSDP 2x3": ("optim", "optim_grads_params", 2),
    "ZeRO-3 x6": ("no_shard", "optim_grads_params", 1),
}
#: name -> (layout, optimizer, reshard_after_forward, recompute, offload)
CASES = {
    **{layout: (layout, "AdamW", True, False, False) for layout in LAYOUTS},
    "HFSDP 3x2, FusedAdamW prestaged": ("HFSDP 3x2", "FusedAdamW", True, False, False),
    "HSDP 2x3, FusedAdamW prestaged": ("HSDP 2x3", "FusedAdamW", True, False, False),
    "HSDP 2x3, kept through backward": ("HSDP 2x3", "AdamW", False, False, False),
    "HFSDP 3x2, recomputed units": ("HFSDP 3x2", "AdamW", True, True, False),
    "ZeRO-3 x6, optimizer offloaded": ("ZeRO-3 x6", "AdamW", True, False, True),
}
STEPS, MICROBATCHES = 3, 2


def _train(rank, world, case, gather: bool):
    from hfsdp.core import (
        Float8Config,
        FusedAdamW,
        LayoutConfig,
        MixedPrecision,
        build_meshes,
        convert_to_float8,
        fully_shard,
    )
    from hfsdp.core.buffers.collectives import record_comms
    from hfsdp.core.engine.unit_forward import recompute

    layout, optimizer, keep, recomputed, offload = CASES[case]
    outer, inner, instances = LAYOUTS[layout]
    model = make_fp8_toy()
    convert_to_float8(model, Float8Config("hybrid", "tensorwise"), units=list(model.layers), min_size=0)
    if recomputed:
        recompute(model.layers)
    cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
    model = fully_shard(
        model,
        cfg,
        build_meshes(cfg, "cpu"),
        units=list(model.layers),
        mp=MixedPrecision(torch.bfloat16),
        reshard_after_forward=keep,
        offload=offload,
        fp8_param_gather=gather,
    )
    if optimizer == "FusedAdamW":
        opt = FusedAdamW(model.parameters(), lr=1e-2, backend="torch", prestage_gathers=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        with record_comms() as log:
            losses += run_microbatches(model, step, rank, world, MICROBATCHES)
        with record_comms() as step_log:
            opt.step()
        opt.zero_grad()
    from hfsdp.core import sharding_of

    # an fp8 group that keeps no compute-dtype shard quantized what the optimizer step wrote (prestaged gathers),
    # which it holds until compute has waited for that quantization
    groups = [g for g in sharding_of(model).groups if g.fp8 is not None and g.param_shard is None]
    staged = [g.fp8.reading is not None for g in groups]
    post_step = sorted({(r.axis, r.element_size) for r in step_log.records if r.op == "all_gather"})
    # every group's compute-dtype piece as state views give it: where the post-step gather moved fp8 it is gathered
    # on demand (collective), and must equal the cast of the main weights
    views = sharding_of(model).sharded_buffers()
    cast_ok = all(
        torch.equal(v["param"].full_tensor(), v["main"].full_tensor().to(torch.bfloat16))
        for v, g in zip(views, sharding_of(model).groups, strict=True)
        if not g.frozen
    )

    gathers = [(r.element_size, r.numel) for r in log.records if r.op == "all_gather"]
    return {
        "losses": losses,
        "state": model.state_dict(),
        "gathers": gathers,
        "bytes": log.bytes_sent(op="all_gather"),
        "staged": staged,
        "post_step": post_step,
        "cast_ok": cast_ok,
    }


def _shard(model, layout: str, world: int, **kwargs):
    from hfsdp.core import LayoutConfig, MixedPrecision, build_meshes, fully_shard

    outer, inner, instances = LAYOUTS[layout]
    cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
    mp = MixedPrecision(torch.bfloat16)
    return fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp, **kwargs)


def _refusals(world) -> dict[str, str]:
    from hfsdp.core import Float8Config, convert_to_float8

    out = {}
    for name, fmt, recipe, flag in (
        ("not converted", None, None, True),
        ("rowwise", "e4m3", "rowwise", True),
        ("not a bool", "hybrid", "tensorwise", "yes"),
    ):
        model = make_fp8_toy()
        if fmt is not None:
            convert_to_float8(model, Float8Config(fmt, recipe), units=list(model.layers), min_size=0)
        try:
            _shard(model, "HSDP 2x3", world, fp8_param_gather=flag)
            out[name] = "accepted"
        except ValueError as err:
            out[name] = str(err)
    return out


def _checkpoint_across(rank, world, path: str) -> dict:
    """An fp8-gather run (HFSDP 3x2: its outer post-step gather moves fp8) saved by DCP and by hfsdp's checkpoints,
    each loaded into a bf16 model with no fp8 at all (HSDP 2x3) and back into an fp8 one; the full state dicts after
    each load equal the saved one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from hfsdp.core import Float8Config, convert_to_float8

    def fp8_model(layout):
        model = make_fp8_toy(seed=1)
        convert_to_float8(model, Float8Config("hybrid"), units=list(model.layers), min_size=0)
        return _shard(model, layout, world, fp8_param_gather=True)

    source = fp8_model("HFSDP 3x2")
    opt = torch.optim.AdamW(source.parameters(), lr=1e-2)
    source(*fp8_batch(0, rank, world)).backward()
    opt.step()
    from hfsdp.ckpt import load_checkpoint, save_checkpoint

    dcp.save(get_model_state_dict(source), checkpoint_id=path)
    save_checkpoint(f"{path}-hfsdp", source, opt, step=1)
    saved = source.state_dict()
    out = {}
    for how in ("dcp", "hfsdp"):
        for name, target in (("bf16", _shard(make_fp8_toy(seed=2), "HSDP 2x3", world)), ("fp8", fp8_model("HSDP 2x3"))):
            if how == "dcp":
                state = get_model_state_dict(target)
                dcp.load(state, checkpoint_id=path)
                set_model_state_dict(target, state)
            else:
                load_checkpoint(f"{path}-hfsdp", target, torch.optim.AdamW(target.parameters(), lr=1e-2))
            loaded = target.state_dict()
            key = name if how == "dcp" else f"{name} ({how})"
            out[key] = rank != 0 or all(torch.equal(saved[k], loaded[k]) for k in saved)
            out[key + " loss"] = target(*fp8_batch(1, rank, world)).item()
    return out


def _cases(rank, world, path):
    out = {(case, gather): _train(rank, world, case, gather) for case in CASES for gather in (False, True)}
    out["refusals"] = _refusals(world)
    out["checkpoint"] = _checkpoint_across(rank, world, path)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_cases, 6, str(tmp_path_factory.mktemp("dcp")), timeout=900)


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_gather_trains_bit_for_bit_like_the_layers_quantizing_themselves(results, case):
    plain, fp8 = results[0][(case, False)], results[0][(case, True)]
    assert plain["losses"] == fp8["losses"]
    assert plain["state"].keys() == fp8["state"].keys()
    for name, value in plain["state"].items():
        assert torch.equal(value, fp8["state"][name]), name
    assert fp8["cast_ok"] and plain["cast_ok"]
    if case == "HSDP 2x3, FusedAdamW prestaged":
        assert fp8["staged"] and all(fp8["staged"])  # the step's own bf16 weights are what gets quantized
    losses = torch.tensor(fp8["losses"])
    assert torch.isfinite(losses).all() and losses[-2:].mean() < losses[:2].mean()  # it trains


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_the_fp8_weights_are_gathered_one_byte_per_element(results, case):
    for rank_results in results:
        plain, fp8 = rank_results[(case, False)], rank_results[(case, True)]
        assert all(size == 2 or size == 4 for size, _ in plain["gathers"])
        one_byte = [numel for size, numel in fp8["gathers"] if size == 1]
        # 3 units x 2 microbatches x (forward + backward) gathers on the inner axis
        assert len(one_byte) == 3 * MICROBATCHES * 2
        # the fp8 weights are 3072 of each unit's 3440 elements (the root gathers 321 in bf16): ~57% of the bytes
        assert 0.50 < fp8["bytes"] / plain["bytes"] < 0.60
        # HFSDP's post-step gather over the outer axis moves the fp8 weights in fp8 too, the rest in bf16
        if case.startswith("HFSDP"):
            assert plain["post_step"] == [("dp_outer", 2)] and fp8["post_step"] == [("dp_outer", 1), ("dp_outer", 2)]
        else:
            assert plain["post_step"] == fp8["post_step"] == []


def test_fully_shard_refuses_fp8_gather_it_cannot_do(results):
    refusals = results[0]["refusals"]
    assert "found no Float8Linear layer" in refusals["not converted"]
    assert "convert_to_float8" in refusals["not converted"]
    assert "needs the tensorwise fp8 recipe" in refusals["rowwise"]
    assert "layers.0.down (and 5 more)" in refusals["rowwise"]
    assert "fp8_param_gather must be True or False, got 'yes'" in refusals["not a bool"]


def test_an_fp8_gather_checkpoint_loads_into_a_bf16_run_and_back(results):
    for rank_results in results:
        found = rank_results["checkpoint"]
        assert found["bf16"] and found["fp8"] and found["bf16 (hfsdp)"] and found["fp8 (hfsdp)"]
    bf16, fp8 = results[0]["checkpoint"]["bf16 loss"], results[0]["checkpoint"]["fp8 loss"]
    assert abs(bf16 - fp8) < 0.05 * abs(bf16)  # the same weights; fp8 matmuls differ from bf16 ones by their rounding
