"""`FusedAdamW(overlap_next_forward=True)`: the step on a side stream, the next forward waiting group by group.

On CPU the streams are `TracingStreams`: everything runs in program order (so the numbers must be exactly those of
the step in order), and the trace of records and waits is the ordering the CUDA path would enforce. Checked on 2
gloo ranks, bf16 compute, clipping inside the step, for a layout whose next gather input the step writes (ZeRO-3)
and one that keeps a bf16 shard and gathers it after the step (HFSDP).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hfsdp.core.kernels.fused_adamw import FusedAdamW

from tests.support.distributed import run_distributed
from tests.support.toy_models import accumulated_loss, make_toy

LR, WD, CLIP, STEPS, MICRO = 1e-2, 0.1, 0.05, 3, 2
LAYOUTS = {"ZeRO-3 1x2": ("no_shard", 1), "HFSDP 2x1": ("optim", 2)}


def _run(rank, world):
    from hfsdp.core import LayoutConfig, MixedPrecision, build_meshes, fully_shard, sharding_of
    from hfsdp.core.buffers.streams import TracingStreams

    out = {}
    for name, (outer, instances) in LAYOUTS.items():
        for overlap in (False, True):
            cfg = LayoutConfig(world_size=world, outer=outer, instances=instances)
            model, streams = make_toy(), TracingStreams()
            sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers),
                                  mp=MixedPrecision(param_dtype=torch.bfloat16), streams=streams)  # fmt: skip
            sharding = sharding_of(sharded)
            model.inp.register_forward_pre_hook(lambda *_, s=streams: s.mark("forward", -1))  # the root's first
            for index, layer in enumerate(model.layers):
                layer.register_forward_pre_hook(lambda *_, i=index, s=streams: s.mark("forward", i))
            opt = FusedAdamW(sharded.parameters(), lr=LR, weight_decay=WD, max_grad_norm=CLIP,
                             prestage_gathers=True, overlap_next_forward=overlap)  # fmt: skip
            losses, held_after_step = [], []
            for step in range(STEPS):
                losses.append(accumulated_loss(sharded, step, MICRO, rank, world))
                streams.mark("step", step)
                opt.step()
                opt.zero_grad()
                held_after_step.append([g.grads.holds for g in sharding.groups])
            state = opt.state_dict()  # waits for the last step
            out[name, overlap] = {
                "losses": losses,
                "held_after_step": held_after_step,
                "in_flight_after_state_dict": [g._stepped is not None for g in sharding.groups],
                "held_after_state_dict": [g.grads.holds for g in sharding.groups],
                "main": [g.main.clone() for g in sharding.groups],
                "moments": [v["exp_avg_sq"].clone() for v in state["state"].values()],
                "trace": streams.trace,
            }
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_run, 2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_overlapped_steps_train_bit_for_bit_as_steps_in_order(ranks, name):
    for rank in ranks:
        plain, overlapped = rank[name, False], rank[name, True]
        assert overlapped["losses"] == plain["losses"]
        for a, b in zip(overlapped["main"], plain["main"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(overlapped["moments"], plain["moments"], strict=True):
            assert torch.equal(a, b)


def _steps(trace):
    """The trace cut at each step mark: [(ops of step t through the next forward)]."""
    cuts = [i for i, (op, _, _) in enumerate(trace) if op == "step"] + [len(trace)]
    return [trace[a:b] for a, b in itertools.pairwise(cuts)]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_unit_waits_for_its_own_step_and_no_other(ranks, name):
    """After a step, the kernels of each group run on the optim stream after an event recorded on compute once its
    inputs exist; the groups step in the forward's order (the root first); before a unit computes, compute has
    waited for the steps of the root and of every unit up to it, and not yet for those of later units; every step
    is waited for by the gather stream (the next gather reads its output) before compute waits for it."""
    for rank in ranks:
        steps = _steps(rank[name, True]["trace"])
        assert len(steps) == STEPS
        for ops in steps[:-1]:  # the last step has no next forward
            stepped = [e for op, kind, e in ops if op == "record" and kind == "optim"]
            assert len(stepped) == 4  # the root and 3 layers
            enters = [i for i, (op, kind, _) in enumerate(ops) if op == "enter" and kind == "optim"]
            for i in enters:
                assert ops[i - 1][:2] == ("record", "compute") and ops[i + 1] == ("wait", "optim", ops[i - 1][2])
            waited_compute, waited_gather, first_forward = set(), set(), True
            for op, kind, event in ops:
                if op == "wait" and event in stepped:
                    if kind == "compute":
                        assert event in waited_gather, "compute waited for a step no gather had waited for"
                        waited_compute.add(event)
                    elif kind == "gather":
                        waited_gather.add(event)
                if op == "forward" and event >= 0 and first_forward:  # the root's step is stepped[0], layer i's i + 1
                    assert set(stepped[: event + 2]) <= waited_compute, (event, stepped, waited_compute)
                    assert not waited_compute & set(stepped[event + 2 :]), "a unit waited for a later unit's step"
                    first_forward = event < 2  # the next microbatch's forward finds every step waited for
            assert waited_compute == set(stepped)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_gradient_memory_a_step_reads_is_freed_only_after_compute_waited(ranks, name):
    """Right after step() and zero_grad() every gradient buffer is still held when the step overlaps (the optim
    stream reads it), and freed when it does not; the optimizer's state_dict waits for the step, which frees
    them."""
    for rank in ranks:
        assert rank[name, False]["held_after_step"] == [[False] * 4] * STEPS
        assert rank[name, True]["held_after_step"] == [[True] * 4] * STEPS
        assert rank[name, True]["in_flight_after_state_dict"] == [False] * 4
        assert rank[name, True]["held_after_state_dict"] == [False] * 4


def test_overlap_needs_prestaged_gathers():
    with pytest.raises(ValueError, match="overlap_next_forward=True needs prestage_gathers=True"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(2))], overlap_next_forward=True)
    with pytest.raises(ValueError, match="overlap_next_forward must be True or False"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(2))], prestage_gathers=True, overlap_next_forward=1)
