"""The bytes of device memory traffic hfsdp's own kernels move in one optimizer step, read off its groups, and the
fewest any engine with the same memory contract must move: the bandwidth floor of the engine's cost.

Counted per group from what the code does (flat_group.py, grad_buffer.py, clip.py, the optimizer), each kernel's
reads plus writes, with Ψ_x the elements of this rank's x range (padding included where the kernel touches it):

| work | when | bytes |
|---|---|---|
| gradient copy into the flat buffer (`_written_grads`) | each microbatch that writes | b_c·numel + b_r·padded |
| gradient accumulation (no per-microbatch reduction) | later microbatches | (2b_r + b_c)·numel |
| adding a reduce-scattered microbatch (`buffer.add_`) | later microbatches | 3·b_r·Ψ_g |
| copy of a once-per-step reduce-scatter's output into the buffer | last microbatch | 2·b_r·Ψ_target |
| scaling the reduced piece to the mean (`mul_`) | M·dp > 1 | 2·b_r·Ψ_o |
| cast of the fp32 main weights into a gather's input (no compute-dtype shard kept) | each gather | (4 + b_c)·Ψ_p |
| clip: norm, then multiply | per step | b_r·Ψ_o + 2·b_r·Ψ_o |
| AdamW (torch fused, or FusedAdamW): read p, g, m, v, write p, m, v | per step | 28·Ψ_o |
| cast of the new weights into a kept compute-dtype shard (`publish_main_weights`) | per step | (4 + b_c)·Ψ_o |

b_c is the compute dtype's size (2 for bf16), b_r the reduction dtype's (4). A gather happens once per
microbatch for a unit that keeps its parameters from forward to backward and twice for one resharded after
forward. Collectives are left out (they move data between GPUs, and on one GPU there are none), and so is
host-device traffic (offload).

FusedAdamW changes three rows: with the clip inside the step the multiply goes (the norm's read stays),
the kept shard's cast becomes b_c·Ψ_o written by the step, and with prestaged gathers the first forward's
cast becomes the same b_c·Ψ_p write.

The floor keeps what the memory contract forces: AdamW's 28 bytes, the norm's read, one write of the new
weights in the compute dtype, the gradient copies and accumulations, and a cast for every gather after the
first where no compute-dtype copy is kept between them (ZeRO-3 frees the gathered weights after forward, so
backward must cast again). The rest can go: a reduce-scatter can write its output in place, and the scaling
to the mean can ride on the optimizer's multiply (not done yet: the rows above count it where it runs).
"""

from __future__ import annotations

from collections import Counter


def _sizes(group):
    n_o = group.optim_range[1] - group.optim_range[0]
    n_p = group.param_range[1] - group.param_range[0]
    n_g = group.grad_range[1] - group.grad_range[0]
    b_c = group.compute_dtype.itemsize
    b_r = group.grads.reduce_dtype.itemsize
    return n_o, n_p, n_g, b_c, b_r


def _gathers_per_microbatch(sharding, group) -> int:
    unit = next(u for u in sharding.units if any(g is group for g in u.groups))
    return 2 if unit.reshard_after_forward else 1


def _common(sharding, group, microbatches: int) -> Counter:
    """What every variant and the floor share: the gradient's way into the buffer and its reductions."""
    n_o, _, n_g, b_c, b_r = _sizes(group)
    plan = group.plan
    out: Counter = Counter()
    out["gradient copy"] += b_c * group.numel + b_r * group.padded  # the first (or only) microbatch writes
    later = microbatches - 1
    if plan.microbatch_reduce:
        out["gradient copy"] += later * (b_c * group.numel + b_r * group.padded)
        out["reduce-scattered microbatch add"] += later * 3 * b_r * n_g
    else:
        out["gradient accumulation"] += later * (2 * b_r + b_c) * group.numel
    out["AdamW"] += 28 * n_o
    return out


def _gather_casts(sharding, group, microbatches: int) -> int:
    if group.param_shard is not None:
        return 0
    return _gathers_per_microbatch(sharding, group) * microbatches


def step_bytes(sharding, variant: set[str], microbatches: int, clip: bool, dp: int) -> Counter:
    """Bytes hfsdp's kernels move in one step of `variant` ({"fused", "clip", "prestage"} or a subset; empty: torch's
    AdamW and hfsdp's clip), summed over groups, by kind of work."""
    fused, clip_inside, prestage = "fused" in variant, "clip" in variant, "prestage" in variant
    moment = 1 + 2 / 128 if "fp8m" in variant else 2 if "bf16m" in variant else 4  # a scale byte per 128 (r and w)
    total: Counter = Counter()
    for group in sharding.groups:
        n_o, n_p, _, b_c, b_r = _sizes(group)
        total += _common(sharding, group, microbatches)
        total["AdamW"] += (4 + 4 + b_r + 2 * 2 * moment - 28) * n_o  # weights r/w, gradient, two moments r/w
        sharded = list(group.plan.microbatch_reduce)
        for k, op in group.plan.final_reduce:  # as GradBuffer._final_reductions: out, then copied into the buffer
            if op != "all_reduce":
                sharded.append(k)
                lo, hi = group.flat.range_over(tuple(sharded))
                total["reduce-scatter output copy"] += 2 * b_r * (hi - lo)
        if microbatches * dp > 1:
            total["scaling to the mean"] += 2 * b_r * n_o
        if clip:
            total["clip: norm"] += b_r * n_o
            if not clip_inside:
                total["clip: multiply"] += 2 * b_r * n_o
        casts = _gather_casts(sharding, group, microbatches)
        writes_compute = b_c < 4 and not group.offload
        if fused and prestage and casts and writes_compute:
            total["gather casts"] += (casts - 1) * (4 + b_c) * n_p
            total["compute-dtype write in the step"] += b_c * n_p
        else:
            total["gather casts"] += casts * (4 + b_c) * n_p
        kept = group.param_shard is not None and group.param_shard.data_ptr() != group.main.data_ptr()
        if kept and not group.offload and "rem" not in variant:  # remainders: the step writes the shard itself
            if fused:
                total["compute-dtype write in the step"] += b_c * n_o
            else:
                total["shard cast after the step"] += (4 + b_c) * n_o
    return total


def floor_bytes(sharding, microbatches: int, clip: bool) -> Counter:
    """The fewest bytes a step of this layout must move (see the module docstring), by kind of work."""
    total: Counter = Counter()
    for group in sharding.groups:
        n_o, n_p, _, b_c, b_r = _sizes(group)
        total += _common(sharding, group, microbatches)
        if clip:
            total["clip: norm"] += b_r * n_o
        if b_c < 4 and not group.offload:
            total["compute-dtype write in the step"] += b_c * n_o
        casts = _gather_casts(sharding, group, microbatches)
        if casts > 1:
            total["gather casts"] += (casts - 1) * (4 + b_c) * n_p
    return total
