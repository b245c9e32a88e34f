"""The CUDA path's ordering logic (side streams, events, prefetch), exercised on CPU through TracingStreams."""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.toy_models import reference_run

STEPS, MICROBATCHES = 2, 2


def _traced_training(rank, world):
    import torch.distributed as dist

    from hfsdp.core import fully_shard
    from hfsdp.core.buffers.streams import TracingStreams
    from hfsdp.core.engine.mesh import build_meshes
    from hfsdp.core.rules.config import LayoutConfig

    from tests.support.toy_models import OPTIMIZERS, make_toy, microbatch

    out = {}
    for name, kw in {
        "ZeRO-3 1x4": {},
        "HSDP 2x2": dict(instances=2),
        "HFSDP 2x2": dict(instances=2, outer="optim"),
    }.items():
        cfg = LayoutConfig(world_size=world, **kw)
        model = make_toy()
        streams = TracingStreams()
        sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), streams=streams)
        for index, layer in enumerate(model.layers):
            layer.register_forward_pre_hook(lambda *_, i=index, s=streams: s.mark("forward", i))
        opt = OPTIMIZERS["adamw"](sharded.parameters())
        losses = []
        for step in range(STEPS):
            total = torch.zeros(())
            for index in range(MICROBATCHES):
                sharded.set_microbatch(index, MICROBATCHES)
                loss = sharded(*microbatch(step, index, MICROBATCHES, rank, world))
                loss.backward()
                streams.mark("backward_done", -1)
                total += loss.detach()
            dist.all_reduce(total)
            losses.append(total.item() / (MICROBATCHES * world))
            streams.mark("step", -1)
            opt.step()
            streams.mark("step_done", -1)
            opt.zero_grad()
        sharded.wait_for_weights()
        streams.mark("weights_ready", -1)
        out[name] = {"losses": losses, "trace": streams.trace}
    out["outer issued before unit"] = _outer_reductions_during_backward(world)
    return out


def _outer_reductions_during_backward(world):
    """HSDP and HFSDP 2x2, last microbatch: how many outer-axis reductions were issued when each unit's backward
    began, and how many in all."""
    from hfsdp.core import fully_shard
    from hfsdp.core.buffers.collectives import record_comms
    from hfsdp.core.buffers.streams import TracingStreams
    from hfsdp.core.engine.mesh import build_meshes
    from hfsdp.core.rules.config import LayoutConfig

    from tests.support.toy_models import make_toy, microbatch

    out = {}
    for name, kw in {"HSDP 2x2": dict(instances=2), "HFSDP 2x2": dict(instances=2, outer="optim")}.items():
        cfg = LayoutConfig(world_size=world, **kw)
        model = make_toy()
        sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), streams=TracingStreams())
        seen = {}
        with record_comms() as log:
            for index, layer in enumerate(model.layers):
                layer.register_full_backward_pre_hook(
                    lambda *_, i=index, seen=seen: seen.__setitem__(i, log.count(axis="dp_outer"))
                )
            for index in range(MICROBATCHES):
                sharded.set_microbatch(index, MICROBATCHES)
                sharded(*microbatch(0, index, MICROBATCHES, 0, world)).backward()
        out[name] = {"at unit": seen, "total": log.count(axis="dp_outer")}
    return out


@pytest.fixture(scope="module")
def traced():
    return run_distributed(_traced_training, 4)[0]


def _recorded(trace, kind):
    return [e for op, k, e in trace if op == "record" and k == kind]


@pytest.mark.parametrize("name", ["ZeRO-3 1x4", "HSDP 2x2", "HFSDP 2x2"])
def test_stream_machinery_keeps_the_math(traced, name):
    """With side streams and prefetch switched on, losses still equal the single-process reference."""
    ref_losses, _, _ = reference_run(STEPS)
    torch.testing.assert_close(torch.tensor(traced[name]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["ZeRO-3 1x4", "HSDP 2x2"])
def test_compute_waits_for_every_gather_but_the_prefetched_one(traced, name):
    """Before a unit computes, compute has waited on every gather issued so far except at most the next unit's."""
    trace = traced[name]["trace"]
    waited: set[int] = set()
    issued: list[int] = []
    overlapped = 0
    for op, kind, event in trace:
        if op == "record" and kind == "gather":
            issued.append(event)
        elif op == "wait" and kind == "compute":
            waited.add(event)
        elif op == "forward":
            pending = [e for e in issued if e not in waited]
            assert len(pending) <= 1, f"unit {event} computes while gathers {pending} are unwaited"
            overlapped += len(pending)
    assert overlapped > 0, "no gather was ever in flight during compute: prefetch did not happen"


@pytest.mark.parametrize("name", ["ZeRO-3 1x4", "HSDP 2x2"])
def test_side_streams_wait_for_compute_before_writing(traced, name):
    """Every gather and reduction first waits on an event the compute stream recorded (allocation / filled grads)."""
    trace = traced[name]["trace"]
    compute_events: set[int] = set()
    entered = {"gather": 0, "reduce": 0}
    for position, (op, kind, event) in enumerate(trace):
        if op == "record" and kind == "compute":
            compute_events.add(event)
        if op == "enter":
            entered[kind] += 1
            following = trace[position + 1]
            assert following[0] == "wait" and following[1] == kind and following[2] in compute_events
    assert entered["gather"] > 0 and entered["reduce"] > 0, entered


@pytest.mark.parametrize("name", ["ZeRO-3 1x4", "HSDP 2x2"])
def test_reductions_are_released_before_backward_returns(traced, name):
    """Compute has waited on every reduce-scatter's event by the time backward returns (buffers freed safely)."""
    trace = traced[name]["trace"]
    waited: set[int] = set()
    reductions = 0
    for position, (op, kind, event) in enumerate(trace):
        if op == "record" and kind == "reduce":
            reductions += 1
        elif op == "wait" and kind == "compute":
            waited.add(event)
        elif op == "backward_done":
            assert set(_recorded(trace[:position], "reduce")) <= waited
    assert reductions > 0


@pytest.mark.parametrize("name", ["HSDP 2x2", "HFSDP 2x2"])
def test_outer_reductions_overlap_the_backward_of_earlier_units(traced, name):
    """On the last microbatch each unit's once-per-step outer reduction is issued as soon as its gradients are
    reduced over the inner axis, while earlier units still run backward: by the time unit 0's backward starts,
    units 2 and 1 have issued theirs. Only the last microbatch reduces over the outer axis (one per group)."""
    result = traced["outer issued before unit"][name]
    assert result["at unit"][2] == 0 and result["at unit"][0] == 2
    assert result["total"] == 4  # three units and the root, each one group


def test_post_step_gathers_overlap_the_next_forward(traced):
    """HFSDP's gathers of the new weights over the outer axis run on the gather stream: compute waits on none
    of them inside the optimizer step, on every one of them before the next backward, and on some only after
    the first unit has started its forward (they overlap it)."""
    trace = traced["HFSDP 2x2"]["trace"]
    marks = [(i, op) for i, (op, _, _) in enumerate(trace) if op in ("step", "step_done", "forward", "backward_done")]
    start = next(i for i, op in marks if op == "step")
    done = next(i for i, op in marks if op == "step_done")
    first_forward = next(i for i, op in marks if op == "forward" and i > done)
    next_backward = next(i for i, op in marks if op == "backward_done" and i > done)

    def compute_waits(lo, hi):
        return {e for op, kind, e in trace[lo:hi] if op == "wait" and kind == "compute"}

    published = set(_recorded(trace[start:done], "gather"))
    assert published
    assert not published & compute_waits(start, done)
    assert published <= compute_waits(done, next_backward)
    assert published - compute_waits(done, first_forward), "every new weight was waited for before any unit ran"


def test_wait_for_weights_waits_for_the_last_steps_gathers(traced):
    """After the last step no forward follows: `wait_for_weights` makes compute wait on every gather it issued."""
    trace = traced["HFSDP 2x2"]["trace"]
    ops = [op for op, _, _ in trace]
    start = len(ops) - 1 - ops[::-1].index("step")
    done, ready = ops.index("step_done", start), ops.index("weights_ready", start)
    published = set(_recorded(trace[start:done], "gather"))
    waited = {e for op, kind, e in trace[done:ready] if op == "wait" and kind == "compute"}
    assert published and published <= waited
