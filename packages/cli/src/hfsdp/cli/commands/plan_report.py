"""`hfsdp plan`'s output: a table for people (the standard layouts and the fastest others), or one JSON object.

Memory is per rank at the step's peak, in GiB; traffic is what one rank sends per optimizer
step on each mesh axis, with the link the axis runs on (NV: inside a node, net: between
nodes). Communication times rest on the links' nominal bandwidths and are unvalidated.
"""

from __future__ import annotations

import json
from typing import Any

from hfsdp.planning.candidates import Evaluated, layout_name
from hfsdp.planning.cluster import INTRA
from hfsdp.planning.model_shape import billions

GIB = 2**30
#: A longer candidate list is cut to the standard layouts and this many of the fastest others (--all shows all).
FASTEST_OTHERS = 10
UNVALIDATED = "communication times use nominal link bandwidths and are not yet checked against a multi-GPU run"


def _header(inputs) -> list[str]:
    run, c, cfg = inputs.run, inputs.cluster, inputs.cfg
    layout = cfg.layout
    return [
        f"Plan for {inputs.shape.describe()} on {c.nodes} x {c.gpus_per_node} GPUs ({c.world} ranks).",
        f"Step: {run.microbatches} microbatch(es) of {run.micro_batch} x {run.seq} tokens per rank (global batch "
        f"{layout.global_batch_size}), {cfg.dtype}{_fp8(inputs)}, recompute {'on' if run.recompute else 'off'}, "
        f"offload {cfg.offload}{_remainders(run)}.",
        f"Cluster: {c.gpu_memory_gib:.1f} GiB per GPU, {c.intra_gbps:g} GB/s inside a node, {c.inter_gbps:g} GB/s "
        f"between nodes, {c.peak_tflops:g} TFLOP/s x MFU {inputs.mfu:.2f}.",
    ]


def _remainders(run) -> str:
    """', fp32 main weights kept as the bf16 shard plus a 16-bit remainder' with --store-param-remainders."""
    return ", fp32 main weights kept as the bf16 shard plus a 16-bit remainder" if run.store_param_remainders else ""


def _fp8(inputs) -> str:
    """', fp8 hybrid tensorwise on 5 Linear layers per transformer layer (in*out/(in+out) >= 2048), weights gathered
    in fp8' (or nothing without fp8): what the header says of it. Its faster matmuls are not modelled (compute runs
    at --mfu of --peak-tflops); its gathers are counted."""
    cfg = inputs.cfg
    if cfg.fp8 is None:
        return ""
    per_layer = max(u.fp8_weights for u in inputs.shape.units)
    size = f"in*out/(in+out) >= {cfg.fp8_min_size:g}"
    said = f", fp8 {cfg.fp8} {cfg.fp8_recipe}"
    if not per_layer:
        return f"{said} on no Linear layer (none has dims multiples of 16 and {size}), so all {cfg.dtype}"
    gathered = "fp8" if inputs.run.fp8_param_gather else cfg.dtype
    return f"{said} on {per_layer} Linear layers per transformer layer ({size}), weights gathered in {gathered}"


def _shown_rows(rows: list[Evaluated], inputs, show_all: bool) -> list[Evaluated]:
    if show_all or len(rows) <= 2 * FASTEST_OTHERS:
        return rows
    mine = inputs.cfg.layout if inputs.layout_given else None
    others = [r for r in rows if not r.standard and r.fits][:FASTEST_OTHERS]
    return [r for r in rows if r.standard or r in others or (mine is not None and r.cfg == mine)]


def report_text(inputs, rows: list[Evaluated], best: Evaluated | None, why: str, show_all: bool = False) -> str:
    shown = _shown_rows(rows, inputs, show_all)
    axes = sorted({a for r in shown for a in r.bytes_per_axis}, key=lambda a: ("outer" in a, a))
    header = ["layout", "params", "grads", "optim", "comm", "activ", "total", "fits", *axes]
    header += ["compute s", "exposed ms", "step s", "tokens/s/GPU"]
    table = [header]
    mine = inputs.cfg.layout if inputs.layout_given else None
    for r in shown:
        m = r.memory
        mark = (" *" if best is not None and r is best else "") + (
            " (yours)" if mine is not None and r.cfg == mine else ""
        )
        cells = [r.name + mark] + [f"{v / GIB:.1f}" for v in (m.params, m.grads, m.optimizer, m.comm_buffers)]
        cells += [f"{m.activations / GIB:.1f}", f"{m.total / GIB:.1f}", "yes" if r.fits else "NO"]
        for a in axes:
            sent = r.bytes_per_axis.get(a)
            cells.append("-" if sent is None else f"{sent / 1e9:.2f} GB {'NV' if r.links.get(a) == INTRA else 'net'}")
        t = r.time
        cells += [f"{t.compute_s + t.optimizer_s:.3f}", f"{t.exposed_s * 1e3:.1f}", f"{t.step_s:.3f}"]
        cells.append(f"{_tokens_per_s(inputs, r):,.0f}")
        table.append(cells)
    widths = [max(len(row[k]) for row in table) for k in range(len(header))]
    lines = [*_header(inputs), ""]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    left = len(rows) - len(shown)
    lines += [
        "",
        "Memory: GiB per rank at the step's peak. Traffic: what one rank sends per step on each mesh axis (NV: inside "
        "a node, net: between nodes). compute s includes the optimizer step; exposed ms is communication the overlap "
        f"leaves on the critical path. Note: {UNVALIDATED}."
        + (f" {left} more layouts: --all or --format json." if left else ""),
        f"Recommended: {why}" if best is not None else f"Nothing fits: {why}",
    ]
    return "\n".join(lines)


def _tokens_per_s(inputs, r: Evaluated) -> float:
    return inputs.run.microbatches * inputs.run.micro_batch * inputs.run.seq / r.time.step_s


def row_dict(inputs, r: Evaluated) -> dict[str, Any]:
    t = r.time
    return {
        "layout": r.name,
        "outer": r.cfg.outer.value,
        "inner": r.cfg.inner.value,
        "instances": r.cfg.instances,
        "inner_size": r.cfg.inner_size,
        "standard": r.standard,
        "fits": r.fits,
        "memory_bytes": r.memory.as_dict(),
        "bytes_per_step": r.bytes_per_axis,
        "links": r.links,
        "time_s": {
            "compute": t.compute_s,
            "optimizer": t.optimizer_s,
            "communication": t.comm_s,
            "exposed": t.exposed_s,
            "step": t.step_s,
        },
        "tokens_per_s_per_gpu": _tokens_per_s(inputs, r),
    }


def report_json(inputs, rows: list[Evaluated], best: Evaluated | None, why: str) -> str:
    c, run, shape = inputs.cluster, inputs.run, inputs.shape
    out = {
        "model": {"description": shape.describe(), "family": shape.family, "parameters": shape.params,
                  "parameters_text": billions(shape.params), "layers": shape.layers},
        "cluster": {"nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "gpu_memory_bytes": c.gpu_memory_bytes,
                    "intra_node_gb_per_s": c.intra_gbps, "inter_node_gb_per_s": c.inter_gbps,
                    "peak_tflops": c.peak_tflops, "mfu": inputs.mfu},
        "step": {"seq_len": run.seq, "micro_batch_size": run.micro_batch, "microbatches": run.microbatches,
                 "global_batch_size": inputs.cfg.layout.global_batch_size, "dtype": inputs.cfg.dtype,
                 "recompute": run.recompute, "offload": inputs.cfg.offload, "fp8": inputs.cfg.fp8,
                 "fp8_recipe": inputs.cfg.fp8_recipe if inputs.cfg.fp8 else None,
                 "fp8_min_size": inputs.cfg.fp8_min_size if inputs.cfg.fp8 else None,
                 "fp8_param_gather": run.fp8_param_gather,
                 "store_param_remainders": run.store_param_remainders},
        "layouts": [row_dict(inputs, r) for r in rows],
        "recommended": layout_name(best.cfg) if best is not None else None,
        "why": why,
        "unvalidated": UNVALIDATED,
    }  # fmt: skip
    return json.dumps(out, indent=1)
