"""bench_step.py's loss agreement: every row's first losses against a reference row of the same model and data, so
that a row that trains wrongly is reported as wrong however fast it is.
"""

from __future__ import annotations

import json
import math
import os

from _engine_base import SINGLE_DEVICE_ENGINES, engine_family
from _float8 import float8_recipe

#: Relative loss agreement over the first --loss-steps steps, by dtype. In bf16 the engines differ by the order of
#: a few sums (the clip's norm, FSDP2's microbatch scaling, autocast in `plain`) and flash attention's backward
#: sums with atomics: measured 0.9e-4 to 1.5e-4 on one and two H200s (docs/results/h200-2026-11-30-*). The defect
#: the GPU correctness script found (a compiled unit's hooks traced into its graph) moved step 2 by 6e-4 to 1.2e-3.
LOSS_RTOL = {"fp32": 1e-5, "bf16": 5e-4}
#: The same for a row with its units' matmuls in fp8 (torchao float8), whatever the dtype: fp8 rounds each matmul's
#: inputs to 3 mantissa bits (e4m3), so its losses differ from bf16's by the format, not by a defect; the bound is
#: what a wrong engine (a missing gradient, a doubled step) exceeds by far, not a measure of fp8's quality.
LOSS_RTOL_FLOAT8 = 2e-2


def loss_reference(results: list[dict]) -> dict | None:
    """The row others are checked against: the unsharded `plain` engine where it ran, else FSDP2's first row, else
    hfsdp's first (every layout trains the same model on the same global batch), else any but the model alone; where
    only the model alone ran, its own row (in the compute dtype), which its float8 rows are checked against."""
    for kind in ("plain", "fsdp2", "hfsdp"):
        found = next((r for r in results if r["engine"] == kind), None)
        if found is not None:
            return found
    found = next((r for r in results if engine_family(r["engine"]) != "model"), None)
    return found or next((r for r in results if r["engine"] == "model"), None)


def loss_checks(results: list[dict], args, world: int) -> list[dict]:
    """Every row against a reference row on the first --loss-steps losses: a row whose losses are wrong is a
    failure, however fast. At world size 1 every row has the same data; above it the unsharded engines (`plain`,
    `model`) train rank 0's share, so they are checked against each other and the sharded rows among themselves.
    The `model` engine (no optimizer) is checked on its first step, where it computes with the same bf16 weights."""
    single = [r for r in results if engine_family(r["engine"]) in SINGLE_DEVICE_ENGINES]
    families = [results] if world == 1 else [[r for r in results if r not in single], single]
    earlier = _earlier_reference(args)
    checks = []
    for rows in families:
        ref = earlier if earlier is not None and rows is not single else loss_reference(rows)
        checks += [_loss_check(ref, other, args) for other in rows if ref is not None and other is not ref]
    return checks


def _earlier_reference(args) -> dict | None:
    """The reference row of `--check-against`'s run (its layout tag marked as coming from that file)."""
    if not args.check_against:
        return None
    with open(args.check_against) as f:
        earlier = json.load(f)
    ref = loss_reference([r for r in earlier["results"] if engine_family(r["engine"]) not in SINGLE_DEVICE_ENGINES])
    if ref is None:
        raise SystemExit(f"--check-against {args.check_against}: that run has no sharded row to check against")
    return dict(ref, layout=f"{ref['layout']} of {os.path.basename(args.check_against)}")


def _loss_check(ref: dict, other: dict, args) -> dict:
    fp8 = any(float8_recipe(r["engine"]) or _hfsdp_fp8(r["engine"]) for r in (ref, other))
    rtol = LOSS_RTOL_FLOAT8 if fp8 else LOSS_RTOL[args.dtype]
    steps = 1 if engine_family(other["engine"]) == "model" else args.loss_steps
    a, b = ref["losses"][:steps], other["losses"][:steps]
    rel = max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=False)), default=math.inf)
    pairs = list(zip(ref["losses"], other["losses"], strict=False))[: max(steps, len(other["losses"]))]
    rel_all = max(abs(x - y) / max(abs(x), 1e-12) for x, y in pairs) if steps > 1 else rel
    return {
        "layout": other["layout"],
        "engine": other["engine"],
        "pair": f"{other['engine']} vs {ref['engine']} {ref['layout']}",
        "hfsdp": b,  # the checked row's losses (the key is kept for the reports that read it)
        "reference": a,
        "steps_checked": steps,
        "max_rel_diff_first_steps": rel,
        "max_rel_diff_all_steps": rel_all,
        "rtol": rtol,
        "ok": rel <= rtol and math.isfinite(rel),
    }


def _hfsdp_fp8(engine: str) -> bool:
    """Whether an hfsdp variant computes its units' matmuls in fp8 (`+fp8t`, `+fp8g`, `+fp8r`)."""
    from _engine_hfsdp import FP8_PARTS

    return engine.startswith("hfsdp+") and any(p in FP8_PARTS for p in engine.split("+"))
