"""`single_rank_collectives()`: one rank runs the gathers and reductions a larger mesh would, as copies, and trains
exactly as without them.

It is how `bench/gpu_correctness.py` checks on one GPU the stream ordering of collectives that one rank otherwise
skips (the fp8 gather above all), so what it must show is that the collectives are really planned and issued (the
communication log records them, the fp8 weights in one byte per element) and that nothing else changes: the same
losses and weights, bit for bit, as the same model trained on one rank without them. One process, bf16 compute, the
fp8 model with and without its fp8 gather, torch's AdamW and FusedAdamW with prestaged gathers.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.fp8_models import make_fp8_toy, run_microbatches

#: name -> (fp8 layers, fp8 gather, optimizer)
CASES = {
    "bf16, AdamW": (False, False, "AdamW"),
    "bf16, FusedAdamW prestaged": (False, False, "FusedAdamW"),
    "fp8 gathered in fp8, AdamW": (True, True, "AdamW"),
    "fp8 gathered in fp8, FusedAdamW prestaged": (True, True, "FusedAdamW"),
}
STEPS, MICROBATCHES = 3, 2


def _train(case: str, planned: bool) -> dict:
    from hfsdp.core import (
        Float8Config,
        FusedAdamW,
        LayoutConfig,
        MixedPrecision,
        build_meshes,
        convert_to_float8,
        fully_shard,
        sharding_of,
    )
    from hfsdp.core.buffers.collectives import record_comms
    from hfsdp.core.rules.comm_plan import single_rank_collectives

    fp8, gather, optimizer = CASES[case]
    model = make_fp8_toy()
    if fp8:
        convert_to_float8(model, Float8Config("hybrid", "tensorwise"), units=list(model.layers), min_size=0)
    cfg = LayoutConfig(world_size=1)
    with single_rank_collectives() if planned else nullcontext():
        model = fully_shard(
            model,
            cfg,
            build_meshes(cfg, "cpu"),
            units=list(model.layers),
            mp=MixedPrecision(torch.bfloat16),
            fp8_param_gather=gather,
        )
    if optimizer == "FusedAdamW":
        opt = FusedAdamW(model.parameters(), lr=1e-2, backend="torch", prestage_gathers=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with record_comms() as log:
        for step in range(STEPS):
            losses += run_microbatches(model, step, 0, 1, MICROBATCHES)
            opt.step()
            opt.zero_grad()
    fp8_groups = sum(g.fp8 is not None for g in sharding_of(model).groups)
    return {
        "losses": losses,
        "state": model.state_dict(),
        "ops": sorted({(r.op, r.element_size) for r in log.records}),
        "fp8_groups": fp8_groups,
    }


def _all_cases(rank, world):
    return {case: {planned: _train(case, planned) for planned in (False, True)} for case in CASES}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_cases, 1, timeout=300)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_one_rank_trains_the_same_bits_with_its_collectives_planned(results, case):
    plain, planned = results[case][False], results[case][True]
    assert planned["losses"] == plain["losses"]
    assert plain["state"].keys() == planned["state"].keys()
    for name, value in plain["state"].items():
        assert torch.equal(planned["state"][name], value), name


@pytest.mark.parametrize("case", list(CASES))
def test_the_collectives_are_issued_only_when_planned(results, case):
    plain, planned = results[case][False], results[case][True]
    assert plain["ops"] == []  # one rank plans none of them
    ops = {op for op, _ in planned["ops"]}
    assert {"all_gather", "reduce_scatter"} <= ops
    _, gather, _ = CASES[case]
    gathered_sizes = {size for op, size in planned["ops"] if op == "all_gather"}
    if gather:  # the fp8 layers' weights gather one byte per element, the others (norms, routers) in bf16
        assert gathered_sizes == {1, 2}
        assert planned["fp8_groups"] == 3 and plain["fp8_groups"] == 0
    else:
        assert gathered_sizes == {2}
