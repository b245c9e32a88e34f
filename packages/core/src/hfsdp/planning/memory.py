"""Per-rank memory at the step's peak, split into parameters, gradients, optimizer state, communication
buffers and activations, from the engine's own buffers (`FlatParamGroup`) group by group.

What each group holds on the device (c = bytes of the compute dtype, b_g of the reduce dtype: 4, or 2 with
Megatron's `main_grads_dtype` bf16; b_m, b_v of AdamW's moments, `moment_bytes`):

- parameters: the compute-dtype shard (`param_len · c`) where one is kept: with fp32 compute
  (it then holds the main weights), with `offload`, where parameters are sharded less than
  the optimizer (s_p ≠ s_o), or with `store_param_remainders` (it then holds the main weights'
  upper halves); elsewhere every gather casts the main weights instead;
- optimizer state: the fp32 main weights of the optimizer piece where they are a buffer of
  their own (`optim_len · 4`), or with `store_param_remainders` their 16-bit remainders beside
  the bf16 shard (`optim_len · 2`), and AdamW's two moments for its real elements (`(b_m + b_v) · optim_real`:
  4 bytes each in fp32, 2 in bf16 or fp16, 1 in fp8 plus FusedAdamW's fp32 scale per block of 128, 4·⌈n/128⌉);
  with `offload` all of it is in host memory, with a host copy of the reduced gradient (fp32 whatever b_g);
- gradients: the buffer kept between microbatches (`grad_len · b_g`), alive from a step's first
  backward to the optimizer step;
- communication buffers: parameters gathered (or cast) for compute (`padded · c` per unit while
  it runs, the next one prefetched) and the flat gradient a reduce-scatter reads.

A group of weights gathered in fp8 (`Settings.fp8_param_gather`, `Group.gathers_fp8`) gathers
`padded · 1` bytes instead, and keeps its quantized piece (`param_len · 1`, counted with the
parameters) from one optimizer step to the next.

The step peaks at one of three moments, and the largest is reported with its split:
the loss of the last microbatch (every layer's activations kept, the loss's own peak on top,
gradient buffers present from the second microbatch on), the backward of the last layer (its
gathered parameters, the prefetched next unit's, the root's, their gradients and the layer's
backward workspace), and the optimizer step (all gradients, no activations).
"""

from __future__ import annotations

from dataclasses import dataclass

from hfsdp.planning.activations import Activations
from hfsdp.planning.groups import Group, kinds
from hfsdp.planning.model_shape import ModelShape

LOSS, BACKWARD, OPTIMIZER = "loss", "backward", "optimizer step"
REDUCE_BYTES = 4  # gradients are reduced in fp32 by default (hfsdp train and the bench); bf16 with main_grads_dtype
#: Bytes per element of an AdamW moment, by Megatron's name (`--exp-avg-dtype`, `--exp-avg-sq-dtype`).
MOMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
#: FusedAdamW's fp8 moments keep one fp32 scale per block of this many elements of each piece (`fused_adamw`).
SCALE_BLOCK = 128
SCALE_BYTES = 4


def moment_bytes(dtype: str, elements: int) -> int:
    """Bytes of one AdamW moment over `elements` in `dtype` (Megatron's name): fp8 adds its fp32 block scales.

    The engine cuts blocks per parameter piece (a block never spans two), so a piece's last short block adds at
    most 4 bytes per parameter of a group beyond this count."""
    scales = SCALE_BYTES * -(-elements // SCALE_BLOCK) if dtype == "fp8" else 0
    return MOMENT_BYTES[dtype] * elements + scales


def state_bytes_per_element(exp_avg: str, exp_avg_sq: str) -> float:
    """AdamW's two moments per element in these dtypes, fp8's block scales included (8 for fp32; what
    `fully_shard(optimizer_state_bytes=...)` is told for its "auto" offload)."""
    return sum(moment_bytes(d, SCALE_BLOCK) / SCALE_BLOCK for d in (exp_avg, exp_avg_sq))


@dataclass(frozen=True)
class Settings:
    """What the memory and time of a step depend on besides the layout."""

    seq: int
    micro_batch: int
    microbatches: int
    compute_bytes: int  # 2 (bf16) or 4 (fp32)
    recompute: bool = False
    offload: bool = False
    root_resharded: bool = False  # the root frees its parameters after forward (hfsdp train: Hugging Face models)
    reduce_bytes: int = REDUCE_BYTES  # the gradients' reduce dtype: 4 (fp32) or 2 (main_grads_dtype bf16)
    moment_dtypes: tuple[str, str] = ("fp32", "fp32")  # exp_avg's and exp_avg_sq's dtypes, by Megatron's names
    fp8_param_gather: bool = False  # the units' fp8 Linear weights in groups of their own, gathered in fp8
    #: Megatron's store_param_remainders (bf16 compute, no offload): every group keeps its bf16 parameter shard, and
    #: the fp32 main weights are that shard plus a 16-bit remainder over the optimizer piece.
    store_param_remainders: bool = False


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank's device at the step's peak, by kind; `host` is what `offload` keeps in host memory."""

    params: int
    grads: int
    optimizer: int
    comm_buffers: int
    activations: int
    host: int
    phase: str

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.comm_buffers + self.activations

    def as_dict(self) -> dict[str, int | str]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "comm_buffers": self.comm_buffers,
            "activations": self.activations,
            "total": self.total,
            "host": self.host,
            "peak_at": self.phase,
        }


def keeps_shard(group: Group, c: int, offload: bool, remainders: bool = False) -> bool:
    """Whether `FlatParamGroup` keeps a compute-dtype parameter shard (else gathers cast the main weights); with
    `remainders` (`store_param_remainders`) every group keeps it: it holds the main weights' upper halves."""
    return c == 4 or offload or remainders or group.param_len != group.optim_len


def transient_unsharded(group: Group, c: int, offload: bool, remainders: bool = False) -> bool:
    """Whether the whole padded buffer is built each time the unit runs (gathered or cast), not kept: a group whose
    parameters are not gathered computes with its kept shard itself."""
    return group.gathers_params or not keeps_shard(group, c, offload, remainders)


def memory(shape: ModelShape, groups: list[Group], acts: Activations, run: Settings) -> Memory:
    """The peak of one step on rank 0 (which holds the most real optimizer elements of any rank)."""
    c, offload, remainders = run.compute_bytes, run.offload, run.store_param_remainders
    counted = kinds(groups)
    params = sum(n * g.param_len * c for g, n in counted if keeps_shard(g, c, offload, remainders))
    params += sum(n * g.param_len for g, n in counted if g.gathers_fp8)  # the quantized piece, one byte each
    optim_len = sum(n * g.optim_len for g, n in counted)
    # fp32 main weights of their own, or (remainders) their low halves: the upper halves are the shard counted above
    main = 0 if c == 4 and not offload else (2 if remainders else 4) * optim_len
    moments = sum(n * sum(moment_bytes(d, g.optim_real) for d in run.moment_dtypes) for g, n in counted)
    optimizer, host = (0, main + moments + 4 * optim_len) if offload else (main + moments, 0)
    grads = sum(n * g.grad_len * run.reduce_bytes for g, n in counted)
    earlier_grads = grads if run.microbatches > 1 else 0

    def unsharded(unit: int) -> int:
        held = [g for g in groups if g.unit == unit and transient_unsharded(g, c, offload, remainders)]
        return sum(g.padded * (1 if g.gathers_fp8 else c) for g in held)

    root, last = len(shape.units) - 1, len(shape.units) - 2
    root_held = shape.loss_inside or not run.root_resharded  # a loss outside the model runs after the root freed
    at_loss = Memory(
        params, earlier_grads, optimizer, unsharded(root) if root_held else 0, acts.at_loss(shape.layers), host, LOSS
    )
    layer_groups = [g for g in groups if g.unit == last]
    flat = sum(g.padded * run.reduce_bytes for g in layer_groups if g.plan.microbatch_reduce)
    layer_grads = sum(g.numel * c for g in layer_groups)
    gathered = unsharded(root) + unsharded(last) + (unsharded(last - 1) if last > 0 else 0)
    root_grads = earlier_grads or shape.root.active_matmul * c  # the output layer's weight gradient, until the end
    in_backward = Memory(
        params,
        root_grads,
        optimizer,
        gathered + layer_grads + flat,
        shape.layers * acts.per_layer + acts.fixed + acts.backward_workspace,
        host,
        BACKWARD,
    )
    at_step = Memory(params, grads, optimizer, 0, acts.fixed, host, OPTIMIZER)
    return max((at_loss, in_backward, at_step), key=lambda m: m.total)
