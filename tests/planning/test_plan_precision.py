"""`hfsdp plan` with Megatron's precision-aware optimizer: gradient and moment dtypes counted in every layout.

A 70B Llama on 1,024 x 8 GPUs (its units need no padding on 8 ranks, so every figure below is exact): the model
state per rank of HSDP, HFSDP and HSDP with the optimizer offloaded, computed here by hand from formulas.md's rules
(b_g bytes per gradient element, 4 per fp32 main weight, b_m + b_v per moment element; an fp8 moment 1 byte per
element plus FusedAdamW's fp32 scale per block of 128 of the rank's piece), equals the plan's bytes exactly.
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from hfsdp.cli.main import app

from tests.cli.commands.test_plan import LLAMA_70B, NODES, _hand_70b

GPUS = 8
BASE = ["--nodes", str(NODES), "--seq-len", "4096", "--micro-batch-size", "1", "--dtype", "bf16", "--recompute"]
#: Separate fp32 masters, as these counts assume (the remainders' bytes: test_plan_remainders.py).
PRECISION = ["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16", "--no-store-param-remainders"]
#: (exp_avg, exp_avg_sq) options the tests plan, by the flags that ask for them.
MOMENTS = {
    ("fp32", "fp32"): [],
    ("bf16", "bf16"): [*PRECISION, "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],
    ("fp8", "fp8"): [*PRECISION, "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp8"],
    ("bf16", "fp8"): [*PRECISION, "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "fp8"],
}
ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@pytest.fixture(scope="module")
def llama_70b(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama70b") / "config.json"
    path.write_text(json.dumps(LLAMA_70B))
    return path


def _plan(llama_70b, *flags: str) -> dict:
    result = CliRunner().invoke(app, ["plan", "--model-config", str(llama_70b), *BASE, *flags, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _row(plan: dict, name: str) -> dict:
    (row,) = [r for r in plan["layouts"] if r["layout"] == name]
    return row["memory_bytes"], row


def _moments(dtypes: tuple[str, str], elements: int) -> int:
    """Both moments of a piece of `elements`, by hand: fp8 adds a 4-byte scale per started block of 128."""
    return sum(ELEMENT[d] * elements + (4 * math.ceil(elements / 128) if d == "fp8" else 0) for d in dtypes)


def _pieces(shards: int) -> list[tuple[int, int]]:
    """(elements of rank 0's piece, how many such groups): 80 layers and the root, cut `shards` ways."""
    *_, layer, root = _hand_70b()
    assert layer % shards == 0 and root % shards == 0
    return [(layer // shards, 80), (root // shards, 1)]


@pytest.mark.parametrize("dtypes", list(MOMENTS))
def test_hsdp_and_hfsdp_count_the_gradient_and_moment_dtypes(llama_70b, dtypes):
    """HSDP 1024x8 (s_p = s_g = s_o = 8: no bf16 shard, gradients and all state over 8) and HFSDP 1024x8 (bf16 shard
    and gradients over 8, main weights and moments over 8,192): b_g = 2 with --main-grads-dtype bf16, else 4."""
    *_, layer, root = _hand_70b()
    psi = 80 * layer + root
    b_g = 2 if dtypes != ("fp32", "fp32") else 4
    plan = _plan(llama_70b, *MOMENTS[dtypes])

    hsdp, _ = _row(plan, "HSDP 1024x8")
    assert hsdp["params"] == 0
    assert hsdp["grads"] == b_g * psi // GPUS
    assert hsdp["optimizer"] == 4 * psi // GPUS + sum(n * _moments(dtypes, e) for e, n in _pieces(GPUS))

    hfsdp, row = _row(plan, "HFSDP 1024x8")
    world = NODES * GPUS
    assert hfsdp["params"] == 2 * psi // GPUS
    assert hfsdp["grads"] == b_g * psi // GPUS
    # Rank 0's optimizer piece of each group: numel / 8,192 elements (not a multiple of 128: the last block is short).
    optim = [(layer // world, 80), (root // world, 1)]
    assert any(e % 128 for e, _ in optim)
    assert hfsdp["optimizer"] == sum(n * (4 * e + _moments(dtypes, e)) for e, n in optim)
    # The outer axis carries the bf16 (or fp32) reduce-scatter and the bf16 gather: α(1024)(Ψ/8)(b_g + 2).
    assert row["bytes_per_step"]["dp_outer"] == pytest.approx((NODES - 1) / NODES * psi / GPUS * (b_g + 2), rel=1e-12)


def test_bytes_per_parameter_of_hsdp_are_megatrons_18_10_and_8(llama_70b):
    """HSDP's model state times N over Ψ: 16 by default (fp32 gradients, main weights, moments; no bf16 shard kept),
    10 with bf16 gradients and moments, 8.0625 with fp8 moments (their scales included): Megatron's 18 / 10 / 8
    less the bf16 parameter that HSDP does not keep (it casts the main weights into each gather)."""
    *_, layer, root = _hand_70b()
    psi = 80 * layer + root
    per_param = {}
    for dtypes, flags in MOMENTS.items():
        memory, _ = _row(_plan(llama_70b, *flags), "HSDP 1024x8")
        per_param[dtypes] = (memory["params"] + memory["grads"] + memory["optimizer"]) * GPUS / psi
    assert per_param[("fp32", "fp32")] == 16
    assert per_param[("bf16", "bf16")] == 10
    assert per_param[("fp8", "fp8")] == 8 + 2 * 4 / 128
    assert per_param[("bf16", "fp8")] == 9 + 4 / 128


@pytest.mark.parametrize("dtypes", list(MOMENTS))
def test_offloaded_state_counts_the_moment_dtypes_in_host_memory(llama_70b, dtypes):
    """HSDP 1024x8 with --offload optim: the device keeps the bf16 shard and the gradients (b_g over 8); the host
    holds the fp32 main weights, the moments in their dtypes and the fp32 copy of the gradient the CPU step reads:
    16 bytes per element with fp32 moments, 12 with bf16, 10.0625 with fp8."""
    *_, layer, root = _hand_70b()
    psi = 80 * layer + root
    b_g = 2 if dtypes != ("fp32", "fp32") else 4
    memory, _ = _row(_plan(llama_70b, *MOMENTS[dtypes], "--offload", "optim"), "HSDP 1024x8")
    assert memory["params"] == 2 * psi // GPUS
    assert memory["grads"] == b_g * psi // GPUS
    assert memory["optimizer"] == 0
    assert memory["host"] == 8 * psi // GPUS + sum(n * _moments(dtypes, e) for e, n in _pieces(GPUS))
    per_element = {("fp32", "fp32"): 16, ("bf16", "bf16"): 12, ("fp8", "fp8"): 10.0625, ("bf16", "fp8"): 11.03125}
    assert memory["host"] * GPUS / psi == per_element[dtypes]


def test_plan_refuses_what_train_refuses(llama_70b):
    """The plan takes train's rules: a moment dtype without the precision-aware optimizer is one paragraph, exit 1."""
    result = CliRunner().invoke(app, ["plan", "--model-config", str(llama_70b), *BASE, "--exp-avg-dtype", "fp8"])
    assert result.exit_code == 1
    assert "--exp-avg-dtype 'fp8' needs the precision-aware optimizer" in result.output
    assert "add --use-precision-aware-optimizer" in result.output
