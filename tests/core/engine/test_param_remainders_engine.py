"""`FusedAdamW(store_param_remainders=True)` in the engine: gloo ranks, bf16 compute, clipped steps.

On HFSDP 2x3 and 3x2, HSDP 3x2, ZeRO-2 and DDP over 6 ranks, a run whose masters are kept as the bf16 shard plus
a remainder takes the fp32-master run's steps bit for bit (losses and every master) up to the first step whose
masters hold an exact tie: there the bf16 weights differ by design (rounded away from zero, torch's cast to even)
and the runs part. Its model-state bytes are the fp32 run's less 2 per element of each optimizer piece that sits
beside a kept bf16 shard. Checkpoints and full state dicts hold the joined fp32 masters: a resume continues bit for bit,
through hfsdp.ckpt and DCP alike; a checkpoint moves between runs with and without remainders exactly, and loads on 2x2.
Weights gathered in fp8 are quantized from the kept bf16 shard: the same steps again. torch's clip over the (now
bf16) parameters, the model's clip and a capturable step give the same masters.
DiLoCo's outer step works on the joined masters (the same steps again). Other optimizers are refused on such
masters, and so is what the option cannot serve (fp32 compute, part of a group, offload), once per kind of problem.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.fp8_models import make_fp8_toy, run_microbatches
from tests.support.toy_models import accumulated_loss, make_toy, toy_steps

#: name -> (inner, outer, instances) on 6 ranks
LAYOUTS = {
    "HFSDP 2x3": ("optim_grads_params", "optim", 2),
    "HFSDP 3x2": ("optim_grads_params", "optim", 3),
    "HSDP 3x2": ("optim_grads_params", "no_shard", 3),
    "ZeRO-2 x6": ("optim_grads", "no_shard", 1),
    "DDP x6": ("no_shard", "no_shard", 1),
}
STEPS, MICRO, LR, WD = 5, 2, 3e-3, 0.1


def _model(world: int, layout: tuple, seed: int = 0, remainders: bool = True, dtype=torch.bfloat16, **options):
    from hfsdp.core import FusedAdamW, LayoutConfig, MixedPrecision, build_meshes, fully_shard

    inner, outer, instances = layout
    cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
    model = make_toy(seed)
    mp = MixedPrecision(param_dtype=dtype)
    sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp, **options)
    opt = FusedAdamW(
        sharded.parameters(),
        lr=LR,
        weight_decay=WD,
        max_grad_norm=0.05,
        backend="torch",
        store_param_remainders=remainders,
    )
    return sharded, opt


def _masters(sharded) -> dict[str, torch.Tensor]:
    from hfsdp.core import sharding_of

    return {p.name: p.master().detach().reshape(-1).clone() for p in sharding_of(sharded).main_params}


def _bits_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


def _exact_until_a_tie(rows: list[tuple[bool, bool, int]]) -> bool:
    """Whether two runs' (same losses, same masters, ties among the masters) rows agree at every step up to and
    including the first step whose masters hold a tie (the step that makes the tie is still exact: it is the next
    forward that reads the bf16 weights rounded otherwise)."""
    first_tie = next((i for i, (_, _, ties) in enumerate(rows) if ties), len(rows) - 1)
    return all(same_losses and same_masters for same_losses, same_masters, _ in rows[: first_tie + 1])


def _ties(masters: dict) -> int:
    """Masters whose low 16 bits are exactly half a bf16 ulp, over every rank (collective)."""
    import torch.distributed as dist

    count = torch.tensor(sum(int(((m.view(torch.int32) & 0xFFFF) == 0x8000).sum()) for m in masters.values()))
    dist.all_reduce(count)
    return int(count)


def _steps(sharded, opt, rank, world, start, count) -> list[float]:
    return toy_steps(sharded, opt, rank, world, start, count, MICRO)


def _side_by_side(rank: int, world: int, layout: tuple) -> dict:
    """Both runs, step by step: whether losses and masters agree, and the fp32 run's ties after each step."""
    from hfsdp.core import sharding_of

    fp32, fp32_opt = _model(world, layout, remainders=False)
    split, split_opt = _model(world, layout)
    expected_saving = sum(
        2 * g.main.numel() for g in sharding_of(fp32).groups if g.param_range != g.optim_range and not g.frozen
    )
    rows = []
    for step in range(STEPS):
        a = _steps(fp32, fp32_opt, rank, world, step, 1)
        b = _steps(split, split_opt, rank, world, step, 1)
        masters = _masters(fp32)
        rows.append((a == b, _bits_equal(masters, _masters(split)), _ties(masters)))
    return {
        "rows": rows,
        "bytes": (sharding_of(fp32).state_bytes(), sharding_of(split).state_bytes(), expected_saving),
        "dtypes": {str(p.dtype) for p in split.parameters()},
        "remainders": all(g.remainder is not None for g in sharding_of(split).groups),
    }


def _checkpoints(rank: int, world: int, root: str) -> dict:
    """HFSDP 2x3: hfsdp.ckpt and DCP resumes, and checkpoints moved between runs with and without remainders."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from hfsdp.ckpt import load_checkpoint, save_checkpoint
    from hfsdp.core import sharding_of

    layout = LAYOUTS["HFSDP 2x3"]
    out = {}
    model, opt = _model(world, layout)
    _steps(model, opt, rank, world, 0, 2)
    save_checkpoint(f"{root}/split", model, opt, step=2)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/dcp")
    saved = _masters(model)
    full = model.state_dict()  # rank 0: whole fp32 parameters
    if rank == 0:
        torch.save(full, f"{root}/full.pt")
        out["full"] = all(
            full[name].dtype == torch.float32 and torch.equal(full[name].reshape(-1)[p.start : p.stop], saved[name])
            for name, p in ((p.name, p) for p in _pieces(model))
        )
    after = _steps(model, opt, rank, world, 2, 2), _masters(model)

    resumed, resumed_opt = _model(world, layout, seed=7)
    load_checkpoint(f"{root}/split", resumed, resumed_opt)
    out["ckpt loaded"] = _bits_equal(_masters(resumed), saved)
    out["ckpt resumed"] = (_steps(resumed, resumed_opt, rank, world, 2, 2), _masters(resumed))
    out["uninterrupted"] = after

    fresh, fresh_opt = _model(world, layout, seed=7)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=f"{root}/dcp")
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["dcp loaded"] = _bits_equal(_masters(fresh), saved)
    out["dcp resumed"] = (_steps(fresh, fresh_opt, rank, world, 2, 2), _masters(fresh))

    whole, _ = _model(world, layout, seed=7)
    whole.load_state_dict(full)  # rank 0's full state dict (the others' are empty): broadcast, then split
    out["full loaded"] = _bits_equal(_masters(whole), saved)
    out["sharded buffers"] = all(v["main"].dtype == torch.float32 for v in sharding_of(whole).sharded_buffers())

    plain, plain_opt = _model(world, layout, seed=7, remainders=False)
    load_checkpoint(f"{root}/split", plain, plain_opt)
    out["into fp32 masters"] = _bits_equal(_masters(plain), saved)
    _steps(plain, plain_opt, rank, world, 2, 1)
    save_checkpoint(f"{root}/plain", plain, plain_opt, step=3)
    plain_saved = _masters(plain)
    again, again_opt = _model(world, layout, seed=7)
    load_checkpoint(f"{root}/plain", again, again_opt)
    out["from fp32 masters"] = _bits_equal(_masters(again), plain_saved)
    return out


def _pieces(model):
    from hfsdp.core import sharding_of

    return [p for p in sharding_of(model).main_params if p.holds]


def _refusals(rank: int, world: int) -> dict:
    """What is refused, each at once, with its message."""
    from hfsdp.core import FusedAdamW

    layout = LAYOUTS["HFSDP 2x3"]
    out = {}
    model, _ = _model(world, layout)
    torch_opt = torch.optim.AdamW(model.parameters(), lr=LR)
    accumulated_loss(model, 0, MICRO, rank, world)
    try:
        torch_opt.step()
        out["torch AdamW"] = "stepped"
    except TypeError as err:
        out["torch AdamW"] = str(err)
    models = {  # held here: a main param knows its model only while the model lives
        "fp32 compute": _model(world, layout, remainders=False, dtype=None)[0],
        "a subset": _model(world, layout, remainders=False)[0],
        "offload": _model(world, layout, remainders=False, offload=True)[0],
    }
    for what, params in (
        ("fp32 compute", list(models["fp32 compute"].parameters())),
        ("a subset", list(models["a subset"].layers[0].parameters())[:1]),
        ("no sharded parameter", [torch.nn.Parameter(torch.zeros(3))]),
        ("offload", list(models["offload"].parameters())),
    ):
        try:
            FusedAdamW(params, store_param_remainders=True)
            out[what] = "built"
        except ValueError as err:
            out[what] = str(err)
    return out


def _doors(rank: int, world: int) -> dict:
    """HFSDP 2x3, three steps each way: clipping with torch's clip over the parameters, the model's clip_grad_norm_
    or FusedAdamW's max_grad_norm; and a capturable FusedAdamW (the masters after each, to compare)."""
    from hfsdp.core import FusedAdamW

    layout = LAYOUTS["HFSDP 2x3"]
    out = {}
    for how in ("max_grad_norm", "torch clip", "model clip", "capturable"):
        model, _ = _model(world, layout, remainders=False)
        clip = 0.05 if how in ("max_grad_norm", "capturable") else None
        opt = FusedAdamW(
            model.parameters(),
            lr=LR,
            weight_decay=WD,
            max_grad_norm=clip,
            backend="torch",
            store_param_remainders=True,
            capturable=how == "capturable",
        )
        for step in range(3):
            accumulated_loss(model, step, MICRO, rank, world)
            if how == "torch clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            elif how == "model clip":
                model.clip_grad_norm_(0.05)
            opt.step()
            opt.zero_grad()
        out[how] = _masters(model)
    return out


#: The fp8 runs' layouts: HSDP quantizes each rank's piece, HFSDP 3x2 the optimizer piece before its fp8 gather.
FP8_LAYOUTS = ("HSDP 3x2", "HFSDP 3x2")


def _fp8_side_by_side(rank: int, world: int, layout: tuple) -> list[tuple[bool, bool, int]]:
    """Weights gathered in fp8 (hybrid, tensorwise), fp32 masters against bf16 + remainder, step by step."""
    from hfsdp.core import (
        Float8Config,
        FusedAdamW,
        LayoutConfig,
        MixedPrecision,
        build_meshes,
        convert_to_float8,
        fully_shard,
    )

    runs = []
    for remainders in (False, True):
        model = make_fp8_toy()
        convert_to_float8(model, Float8Config("hybrid", "tensorwise"), units=list(model.layers), min_size=0)
        inner, outer, instances = layout
        cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
        mp = MixedPrecision(torch.bfloat16)
        sharded = fully_shard(
            model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp, fp8_param_gather=True
        )
        opt = FusedAdamW(sharded.parameters(), lr=1e-2, backend="torch", store_param_remainders=remainders)
        runs.append((sharded, opt))
    rows = []
    for step in range(3):
        losses = []
        for sharded, opt in runs:
            losses.append(run_microbatches(sharded, step, rank, world, MICRO))
            opt.step()
            opt.zero_grad()
        masters = _masters(runs[0][0])
        rows.append((losses[0] == losses[1], _bits_equal(masters, _masters(runs[1][0])), _ties(masters)))
    return rows


def _diloco(rank: int, world: int, root: str) -> dict:
    """DiLoCo over 2 instances of 3 (an outer step every 2 inner ones, 5 inner steps), its exchange in fp32 and in
    bf16 (anchored: the update over an fp32 anchor): fp32 masters against bf16 + remainder, step by step; and the
    bf16 run saved after step 3 (hfsdp.ckpt: the instances' masters and the outer state) and resumed."""
    from hfsdp.ckpt import load_checkpoint, save_checkpoint
    from hfsdp.core import DiLoCoConfig

    out = {}
    for exchange in ("fp32", "bf16"):
        config = DiLoCoConfig(sync_every=2, comm_dtype=exchange)
        layout = ("optim_grads_params", "diloco", 2)
        runs = [_model(world, layout, remainders=r, diloco=config) for r in (False, True)]
        rows = []
        for step in range(STEPS):
            if step == 3 and exchange == "bf16":
                save_checkpoint(f"{root}/diloco", *runs[1], step=3)
            losses = [_steps(model, opt, rank, world, step, 1) for model, opt in runs]
            masters = _masters(runs[0][0])
            rows.append((losses[0] == losses[1], _bits_equal(masters, _masters(runs[1][0])), _ties(masters)))
        out[exchange] = rows
    resumed, opt = _model(world, layout, seed=7, diloco=config)
    load_checkpoint(f"{root}/diloco", resumed, opt)
    _steps(resumed, opt, rank, world, 3, STEPS - 3)
    out["resumed"] = _bits_equal(_masters(resumed), _masters(runs[1][0]))
    return out


def _six(rank: int, world: int, root: str) -> dict:
    out = {name: _side_by_side(rank, world, layout) for name, layout in LAYOUTS.items()}
    out["diloco"] = _diloco(rank, world, root)
    out["fp8"] = {name: _fp8_side_by_side(rank, world, LAYOUTS[name]) for name in FP8_LAYOUTS}
    out["doors"] = _doors(rank, world)
    out["checkpoints"] = _checkpoints(rank, world, root)
    out["refusals"] = _refusals(rank, world)
    return out


def _four(rank: int, world: int, root: str) -> dict:
    """The 2x3 checkpoint on HFSDP 2x2, into masters with and without remainders."""
    from hfsdp.ckpt import load_checkpoint

    full = torch.load(f"{root}/full.pt")
    out = {}
    for remainders in (True, False):
        model, opt = _model(world, ("optim_grads_params", "optim", 2), seed=7, remainders=remainders)
        load_checkpoint(f"{root}/split", model, opt)
        out[remainders] = all(
            torch.equal(full[p.name].reshape(-1)[p.start : p.stop].view(torch.int32), m.view(torch.int32))
            for p, m in zip(_pieces(model), (p.master().reshape(-1) for p in _pieces(model)), strict=True)
        )
    return out


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("remainders"))
    return run_distributed(_six, 6, root, timeout=600), root


@pytest.fixture(scope="module")
def four(six):
    return run_distributed(_four, 4, six[1], timeout=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_run_takes_the_fp32_master_runs_steps_bit_for_bit_until_a_tie(six, layout):
    for rank in six[0]:
        assert _exact_until_a_tie(rank[layout]["rows"])
        assert rank[layout]["remainders"] and rank[layout]["dtypes"] == {"torch.bfloat16"}


@pytest.mark.parametrize("exchange", ["fp32", "bf16"])
def test_dilocos_outer_step_works_on_the_joined_masters(six, exchange):
    """DiLoCo 2x3, two outer steps in five: the run with remainders is the fp32-master run's until a tie."""
    for rank in six[0]:
        assert _exact_until_a_tie(rank["diloco"][exchange])


def test_a_diloco_run_with_remainders_resumes_bit_for_bit(six):
    for rank in six[0]:
        assert rank["diloco"]["resumed"]


@pytest.mark.parametrize("layout", FP8_LAYOUTS)
def test_weights_gathered_in_fp8_are_quantized_from_the_kept_shard_as_from_the_fp32_masters(six, layout):
    """fp8 gather (hybrid, tensorwise): the run with remainders is the fp32-master run's, step by step, until a tie."""
    for rank in six[0]:
        assert _exact_until_a_tie(rank["fp8"][layout])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_masters_take_2_bytes_less_per_element_beside_a_kept_bf16_shard(six, layout):
    for rank in six[0]:
        fp32, split, saving = rank[layout]["bytes"]
        assert split == fp32 - saving
        if layout.startswith(("HFSDP", "ZeRO-2")):
            assert saving > 0
        else:
            assert saving == 0  # the optimizer piece is the parameter piece: bf16 + remainder is the fp32's 4 bytes


def test_checkpoints_and_state_dicts_hold_the_joined_fp32_masters(six):
    assert six[0][0]["checkpoints"]["full"]
    for rank in six[0]:
        ckpt = rank["checkpoints"]
        assert ckpt["ckpt loaded"] and ckpt["dcp loaded"] and ckpt["full loaded"] and ckpt["sharded buffers"]
        assert ckpt["into fp32 masters"] and ckpt["from fp32 masters"]


@pytest.mark.parametrize("flow", ["ckpt resumed", "dcp resumed"])
def test_a_resume_continues_bit_for_bit(six, flow):
    for rank in six[0]:
        ckpt = rank["checkpoints"]
        (losses, masters), (want_losses, want) = ckpt[flow], ckpt["uninterrupted"]
        assert losses == want_losses and _bits_equal(masters, want)


def test_a_checkpoint_loads_on_another_layout_exactly_with_and_without_remainders(four):
    for rank in four:
        assert rank[True] and rank[False]


def test_another_optimizer_and_what_the_option_cannot_serve_are_refused(six):
    for rank in six[0]:
        said = rank["refusals"]
        assert "update the bf16 half alone" in said["torch AdamW"] and "FusedAdamW" in said["torch AdamW"]
        assert "computes in torch.float32" in said["fp32 compute"] and "MixedPrecision" in said["fp32 compute"]
        assert "is not in this optimizer" in said["a subset"]
        assert "steps no parameter" in said["no sharded parameter"]
        assert "cannot be combined with offload ('inp.weight'" in said["offload"] and said["offload"].count(";") == 0


@pytest.mark.parametrize("how", ["torch clip", "model clip", "capturable"])
def test_torchs_clip_the_models_clip_and_a_capturable_step_give_the_same_masters(six, how):
    """The main params take no fp32 `.grad` (they are bf16): torch's clip over them and the model's still see the
    global norm, and a capturable FusedAdamW steps the same bits as FusedAdamW(max_grad_norm=...)."""
    for rank in six[0]:
        assert _bits_equal(rank["doors"][how], rank["doors"]["max_grad_norm"])
