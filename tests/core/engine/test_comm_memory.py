"""Real bytes sent and model-state bytes held, against docs/formulas.md's formulas (plus padding)."""

from __future__ import annotations

import pytest
import torch

from hfsdp.core import sharding_of

from tests.support.distributed import run_distributed

MICROBATCHES = 4
LAYOUTS = {
    "DDP": ("no_shard", "no_shard", 1),
    "ZeRO-1": ("no_shard", "optim", 1),
    "ZeRO-2": ("no_shard", "optim_grads", 1),
    "ZeRO-3": ("no_shard", "optim_grads_params", 1),
    "HSDP": ("no_shard", "optim_grads_params", 2),
    "HFSDP": ("optim", "optim_grads_params", 2),
    "ZeRO-1 over ZeRO-2": ("optim", "optim_grads", 2),
    "ZeRO-2 over ZeRO-3": ("optim_grads", "optim_grads_params", 2),
}


def _allocated_bytes(sharded, opt) -> int:
    """Bytes of every distinct storage the engine and the optimizer hold: the flat buffers and everything in them
    (module parameters, main params and their gradients are views), and the optimizer's per-element state.

    Storages are measured, not ranges: a buffer that is zeroed instead of freed, or a copy kept by mistake,
    shows up here. 0-d optimizer bookkeeping (AdamW's `step`) is not model state and is left out.
    """
    tensors: list[torch.Tensor] = []
    for group in sharding_of(sharded).groups:
        for value in [*vars(group).values(), *vars(group.grads).values()]:
            values = value if isinstance(value, list | tuple) else [value]
            tensors += [v for v in values if isinstance(v, torch.Tensor)]
        tensors += [slot.param for slot in group.slots]
    for piece in sharding_of(sharded).main_params:
        tensors += [piece.param] + ([piece.param.grad] if piece.param.grad is not None else [])
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _measure(rank, world):
    import gc
    import weakref

    import torch.distributed as dist

    from hfsdp.core import fully_shard
    from hfsdp.core.buffers.collectives import record_comms
    from hfsdp.core.buffers.mixed_precision import MixedPrecision
    from hfsdp.core.engine.mesh import build_meshes
    from hfsdp.core.rules.config import LayoutConfig

    from tests.support.toy_models import make_toy, microbatch

    def one_step(sharded, opt, step):
        for index in range(MICROBATCHES):
            sharded.set_microbatch(index, MICROBATCHES)
            sharded(*microbatch(step, index, MICROBATCHES, rank, world)).float().backward()

    out = {}
    for name, (outer, inner, instances) in LAYOUTS.items():
        cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
        model = make_toy()
        # Compute in bf16 and reduce in fp32, so the formula's b_p and b_g differ.
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp)
        opt = torch.optim.AdamW(sharded.parameters())
        with record_comms() as log:
            one_step(sharded, opt, 0)
            opt.step()
        groups = [
            {"padded": g.padded, "root": g.unit_index == len(sharding_of(sharded).units) - 1}
            for g in sharding_of(sharded).groups
        ]
        out[name] = {
            "records": [(r.op, r.axis, r.group_size, r.numel, r.element_size) for r in log.records],
            "bytes": {axis: log.bytes_sent(axis) for axis in ("dp_shard", "dp_outer")},
            "outer_reductions": log.count("dp_outer", "reduce_scatter") + log.count("dp_outer", "all_reduce"),
            "outer_gathers": log.count("dp_outer", "all_gather"),
            "groups": groups,
        }
        dist.barrier()
    # Memory in the formula's own precision: bf16 params and grads, fp32 main weights and Adam.
    for name, (outer, inner, instances) in LAYOUTS.items():
        cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances)
        model = make_toy()
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        sharded = fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), mp=mp)
        opt = torch.optim.AdamW(sharded.parameters())
        one_step(sharded, opt, 0)
        opt.step()  # creates the optimizer state
        one_step(sharded, opt, 1)
        with_grads = _allocated_bytes(sharded, opt)
        grad_buffers = [weakref.ref(g.grads.buffer) for g in sharding_of(sharded).groups]
        opt.step()
        opt.zero_grad()
        # torch's gloo all-reduce keeps its input (here a view of the buffer) alive in a reference cycle until the
        # garbage collector runs (seen with a plain dist.all_reduce too); collect first, so only the engine's own
        # references count.
        gc.collect()
        out[name]["memory"] = with_grads
        out[name]["memory after step"] = _allocated_bytes(sharded, opt)
        out[name]["grad buffers alive after step"] = sum(ref() is not None for ref in grad_buffers)
        out[name]["unsharded bytes"] = sum(
            g.unsharded.untyped_storage().nbytes() for g in sharding_of(sharded).groups if g.transient_unsharded
        )
        out[name]["padded_total"] = sum(g.padded for g in sharding_of(sharded).groups)
        # The optimizer keeps state for the main params only, not for the padding in this rank's range.
        optim_elements = sum(g.optim_range[1] - g.optim_range[0] for g in sharding_of(sharded).groups)
        out[name]["optim_padding"] = optim_elements - sum(p.param.numel() for p in sharding_of(sharded).main_params)
        out[name]["grad_total"] = sum(g.grad_range[1] - g.grad_range[0] for g in sharding_of(sharded).groups)
    return out


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_measure, 4)


def _alpha(n: int) -> float:
    return (n - 1) / n


def _expected_inner(name: str, padded: int, root: bool, n: int, m: int, b_p: int = 2, b_g: int = 4) -> float:
    """docs/formulas.md's inner-axis bytes for one buffer; the root keeps its parameters through backward (one
    gather)."""
    kind = LAYOUTS[name][1]
    if kind == "no_shard":
        return 2 * _alpha(n) * padded * b_g
    if kind == "optim":
        return _alpha(n) * padded * (b_g + b_p)
    if kind == "optim_grads":
        return _alpha(n) * padded * (m * b_g + b_p)
    gathers = 1 if root else 2
    return _alpha(n) * padded * m * (gathers * b_p + b_g)


@pytest.mark.parametrize("name", ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "HSDP", "HFSDP"])
def test_inner_axis_bytes_match_the_formula(measured, name):
    """Bytes each rank sends over dp_shard in one step of 4 microbatches equal §4's table, buffer by buffer."""
    n = 4 if LAYOUTS[name][2] == 1 else 2
    for result in measured:
        case = result[name]
        expected = sum(_expected_inner(name, g["padded"], g["root"], n, MICROBATCHES) for g in case["groups"])
        assert case["bytes"]["dp_shard"] == pytest.approx(expected, rel=1e-12)


def test_outer_axis_bytes_match_the_formula(measured):
    """HSDP all-reduces the inner shard over dp_outer (2α(R)Ψ/N·b_g); HFSDP reduce-scatters and all-gathers it."""
    for result in measured:
        shard = sum(g["padded"] for g in result["HSDP"]["groups"]) / 2
        assert result["HSDP"]["bytes"]["dp_outer"] == pytest.approx(2 * _alpha(2) * shard * 4)
        assert result["HFSDP"]["bytes"]["dp_outer"] == pytest.approx(_alpha(2) * shard * (4 + 2))
        for one_instance in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"):
            assert result[one_instance]["bytes"]["dp_outer"] == 0


@pytest.mark.parametrize("name", ["HSDP", "HFSDP", "ZeRO-1 over ZeRO-2", "ZeRO-2 over ZeRO-3"])
def test_outer_axis_reduces_once_per_step(measured, name):
    """With 4 microbatches each buffer sees exactly one gradient reduction over dp_outer per optimizer step."""
    for result in measured:
        case = result[name]
        assert case["outer_reductions"] == len(case["groups"])
        gathers_after_step = 0 if name == "HSDP" else len(case["groups"])
        assert case["outer_gathers"] == gathers_after_step


@pytest.mark.parametrize("name", ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "HSDP", "HFSDP", "ZeRO-1 over ZeRO-2"])
def test_model_state_bytes_match_the_formula(measured, name):
    """Storage actually allocated for params, grads, main weights and Adam state, measured during a step, is
    Ψ·(2/s_p + 2/s_g + 12/s_o) with the bf16 parameter shard kept only where s_p != s_o, padding included in the
    flat buffers (the optimizer's 8 bytes of state per element cover the main params only, not padding)."""
    from hfsdp.core.rules.config import LayoutConfig
    from hfsdp.core.rules.layout import dense_layout

    outer, inner, instances = LAYOUTS[name]
    layout = dense_layout(LayoutConfig(world_size=4, inner=inner, outer=outer, instances=instances))
    for result in measured:
        expected = result[name]["padded_total"] * layout.bytes_per_param() - 8 * result[name]["optim_padding"]
        assert result[name]["memory"] == expected


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gradient_buffers_are_freed_by_the_step_and_parameters_by_reshard(measured, name):
    """After optimizer.step() and zero_grad() the gradient buffers no longer exist (freed, not zeroed), so exactly
    their bytes are gone; unsharded parameters built for compute hold no storage between units."""
    for result in measured:
        case = result[name]
        assert case["grad buffers alive after step"] == 0
        assert case["memory"] - case["memory after step"] == 2 * case["grad_total"]
        assert case["unsharded bytes"] == 0


def test_outer_grad_sharding_keeps_the_inner_gradient_shard(measured):
    """With an outer axis that shards grads, the gradient buffer stays at the inner shard (Ψ/N) between microbatches.

    The outer reduction happens once per step, so the buffer cannot shrink to Ψ/(N·R) before the last
    microbatch; the memory formula's 2/s_g term is then 2/N, which is what is measured.
    """
    for result in measured:
        case = result["ZeRO-2 over ZeRO-3"]
        padded = case["padded_total"]
        expected = padded * (2 / 2 + 2 / 2 + 12 / 4) - 8 * case["optim_padding"]
        assert case["memory"] == expected


def test_hfsdp_holds_less_than_hsdp(measured):
    """HFSDP's model state per rank is smaller than HSDP's on the same 2x2 mesh (4/N + 12/(N·R) < 14/N: HSDP keeps no
    bf16 parameter shard beside its fp32 main weights, HFSDP keeps one for its outer axis)."""
    for result in measured:
        hfsdp, hsdp = result["HFSDP"], result["HSDP"]
        assert hfsdp["memory"] < hsdp["memory"]
        per_param = [(c["memory"] + 8 * c["optim_padding"]) / c["padded_total"] for c in (hfsdp, hsdp)]
        assert per_param == [4 / 2 + 12 / 4, 14 / 2]
