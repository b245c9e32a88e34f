"""Part of the optimizer state in host memory: which units go, how "auto" sizes the share, and that training is the
single-process reference's whatever the share (the gradient copied to the host during backward and clipped there).
"""

from __future__ import annotations

import pytest
import torch

from hfsdp.core.offload.offload_plan import check_offload, fraction_for, per_element_bytes, plan_offload
from hfsdp.core.rules.layout import dense_layout

from tests.support.distributed import run_distributed
from tests.support.toy_models import OPTIMIZERS, global_batch, make_toy, microbatch, plain_steps

CLIP, LOOSE, STEPS, MICRO = 0.05, 1e6, 3, 2  # LOOSE never binds: the gradient goes to the host during backward
CPU = torch.device("cpu")


def _layout(world=1, **kw):
    from hfsdp.core import LayoutConfig

    return dense_layout(LayoutConfig(world_size=world, **kw))


@pytest.mark.parametrize(
    "offload, expected",
    [
        (0.0, (False, False, False, False)),
        (0.1, (False, False, True, False)),  # the last unit first
        (0.5, (False, True, True, False)),
        (0.9, (True, True, True, False)),
        (0.95, (True, True, True, True)),  # the root only when every unit is not enough
        (True, (True, True, True, True)),
        (False, (False, False, False, False)),
    ],
)
def test_a_fraction_offloads_the_last_units_first_and_at_least_that_share(offload, expected):
    sizes = [30, 30, 30, 10]  # three units, then the root
    plan = plan_offload(offload, sizes, _layout(), 2, CPU, 0)
    assert plan.units == expected
    moved = sum(size for size, off in zip(sizes, expected, strict=True) if off)
    assert plan.fraction >= float(offload) and plan.fraction == moved / 100


def test_auto_offloads_the_smallest_share_that_fits():
    """ZeRO-3 on one GPU in bf16: a unit kept on the device holds 12 bytes of fp32 state and 4 of gradient per
    element, an offloaded one 2 of bf16 weights and 4 of gradient; 100 elements in a budget of 1000 bytes need
    f with 100 * (16 - 10 f) = 1000, f = 0.6; a budget of 1600 needs nothing, one of 500 everything."""
    kept, offloaded = per_element_bytes(_layout(), 2)
    assert (kept, offloaded) == (16.0, 6.0)
    assert fraction_for(100, kept, offloaded, 1000) == pytest.approx(0.6)
    assert fraction_for(100, kept, offloaded, 1600) == 0.0
    assert fraction_for(100, kept, offloaded, 500) == 1.0
    hfsdp = _layout(4, outer="optim", instances=2)  # s_p = 2, s_o = 4: a bf16 shard is kept beside the main weights
    assert per_element_bytes(hfsdp, 2) == (12 / 4 + 4 / 2 + 2 / 2, 2 / 2 + 4 / 2)
    assert plan_offload("auto", [30, 30, 30, 10], _layout(), 2, CPU, 0).units == (False,) * 4  # host = device here


def test_auto_counts_the_optimizer_state_and_gradient_dtypes_it_is_told():
    """FusedAdamW's bf16 / fp8 moments (2 + 1 + 4/128 bytes per element with fp8's block scale) and bf16
    gradients: a kept element costs 4 + 3.03125 + 2 bytes instead of 16, so the same budget needs less offloaded."""
    from hfsdp.planning.memory import state_bytes_per_element

    state = state_bytes_per_element("bf16", "fp8")
    assert state == 2 + 1 + 4 / 128 and state_bytes_per_element("fp32", "fp32") == 8
    kept, offloaded = per_element_bytes(_layout(), 2, 2, state)
    assert (kept, offloaded) == (4 + state + 2, 2 + 2)
    assert fraction_for(100, kept, offloaded, 700) < fraction_for(100, *per_element_bytes(_layout(), 2), 700)


@pytest.mark.parametrize("bad", [-1, float("nan"), "8", True])
def test_a_bad_optimizer_state_bytes_is_refused(bad):
    from hfsdp.core import LayoutConfig, fully_shard
    from hfsdp.core.engine.module import HFSDPModule

    model = make_toy()
    with pytest.raises(ValueError, match="optimizer_state_bytes must be a number of bytes per element"):
        fully_shard(model, LayoutConfig(world_size=1), None, units=[], optimizer_state_bytes=bad)  # refused first
    assert not isinstance(model, HFSDPModule)  # refused before anything was sharded


@pytest.mark.parametrize("bad", [1.5, -0.1, "half", float("nan"), None])
def test_a_bad_offload_value_is_refused_with_what_it_may_be(bad):
    with pytest.raises(ValueError, match=r"a fraction from 0 to 1 .* or 'auto'"):
        check_offload(bad)


def test_the_cli_takes_a_fraction_or_auto_and_only_with_offload_optim():
    from hfsdp.cli.rank.build_model import offload_of
    from hfsdp.cli.settings.train_config import build_train_config
    from hfsdp.core.rules.config import ConfigError

    def build(**flags):
        return build_train_config({"nproc": 1, **flags})

    assert offload_of(build(offload="optim", offload_fraction="0.4")) == 0.4
    assert offload_of(build(offload="optim", offload_fraction="auto")) == "auto"
    assert offload_of(build(offload="optim")) is True  # the default share is all of it, as before
    assert offload_of(build()) is False
    with pytest.raises(ConfigError) as err:
        build(offload="optim", offload_fraction="1.5")
    assert "--offload-fraction" in str(err.value) and "from 0 to 1" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build(offload_fraction="0.5")
    assert "add --offload optim" in str(err.value)


# -- training with a share offloaded: 2 gloo ranks ---------------------------------------------------------------

LAYOUTS = {"ZeRO-3 1x2": ("no_shard", "optim_grads_params", 1), "HFSDP 2x1": ("optim", "optim_grads_params", 2)}


def _ranks(rank, world):
    import torch.distributed as dist

    from hfsdp.core import LayoutConfig, build_meshes, clip_grad_norm_, fully_shard, sharding_of

    out = {}
    cases = [(name, optimizer, CLIP) for name in LAYOUTS for optimizer in ("adamw", "sgd")]
    cases.append(("HFSDP 2x1", "sgd", LOOSE))
    for name, optimizer, clip in cases:
        outer, inner, instances = LAYOUTS[name]
        cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
        model = make_toy()
        sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), offload=0.5)
        opt = OPTIMIZERS[optimizer](sharded.parameters())
        losses, norms = [], []
        for step in range(STEPS):
            total = torch.zeros(())
            for index in range(MICRO):
                sharded.set_microbatch(index, MICRO)
                loss = sharded(*microbatch(step, index, MICRO, rank, world))
                loss.backward()
                total += loss.detach()
            dist.all_reduce(total)
            losses.append(total.item() / (MICRO * world))
            norms.append(clip_grad_norm_(sharded, clip).item())
            early = [g._host_grad_fresh for g in sharding_of(sharded).groups if g.offload]
            opt.step()
            opt.zero_grad()
        engine = sharding_of(sharded)
        out[name, optimizer, clip] = {
            "early copy at the last step": early,
            "losses": losses,
            "norms": norms,
            "offloaded": [g.offload for g in engine.groups],
            # fp32 compute steps the parameter shard in place, unless its main weights went to the host apart
            "separate": [g.main.data_ptr() != g.param_shard.data_ptr() for g in engine.groups],
            "pieces": [(p.name, p.start, p.stop, p.param.detach().reshape(-1).clone()) for p in engine.main_params],
        }
    return out


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_ranks, 2)


CASES = [(n, o, CLIP) for n in LAYOUTS for o in ("adamw", "sgd")] + [("HFSDP 2x1", "sgd", LOOSE)]


@pytest.mark.parametrize("name, optimizer, clip", CASES, ids=[f"{n}-{o}-clip{c:g}" for n, o, c in CASES])
def test_half_offloaded_training_matches_the_single_process_reference(world2, name, optimizer, clip):
    """offload=0.5: the last two of three units keep their state in host memory (separate main weights, a kept
    shard), and 3 clipped steps of 2 microbatches give the reference's losses, norms and parameters (rtol 1e-5).
    Clipping at 0.05 binds: the first step's gradient, copied to the host during backward, is scaled there too,
    and later steps copy after the clip. A clip that never binds keeps copying during backward."""
    case = world2[0][name, optimizer, clip]
    assert case["offloaded"] == [False, True, True, False] and case["separate"] == case["offloaded"]
    model = make_toy()
    ref_losses, ref_norms = plain_steps(
        model, OPTIMIZERS[optimizer](model.parameters()), lambda s: model(*global_batch(s)), STEPS, clip
    )
    binds = min(ref_norms) > clip
    assert binds == (clip == CLIP)  # the tight clip binds at every step, the loose one at none
    assert case["early copy at the last step"] == [not binds, not binds]
    torch.testing.assert_close(torch.tensor(case["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(case["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    full = {n: torch.full((p.numel(),), float("nan")) for n, p in model.named_parameters()}
    for r in world2:
        for n, start, stop, values in r[name, optimizer, clip]["pieces"]:
            full[n][start:stop] = values
    for n, p in model.named_parameters():
        torch.testing.assert_close(full[n].view(p.shape), p.detach(), rtol=1e-5, atol=1e-6, msg=n)
