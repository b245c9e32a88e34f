"""`FusedAdamW`: torch's AdamW as one pass per flat run of hfsdp's main params (opt-in).

`torch.optim.AdamW(fused=True)` is already one kernel over the update (28 bytes per fp32 element), but
a clipped bf16 step around it moves more: `clip_grad_norm_` reads the gradient for the norm and then
reads and writes it again to scale it, and after the step each new fp32 weight is read again to be
cast to bf16 for the next forward (where a bf16 shard is kept, or when the next gather casts it).
`FusedAdamW` steps each contiguous run of a group's main params with `adamw_kernel.adamw_run`, which
scales the gradient by the clip coefficient as it loads it and stores the new weights in the compute
dtype beside the fp32 ones. Per element that is 28 + 2 bytes instead of 28 + 8 + 6.

It is a `torch.optim.AdamW` (same constructor arguments, parameter groups, LR schedulers, and the
state torch's AdamW keeps: `exp_avg`, `exp_avg_sq`, `step`), so checkpoints written with one load
into the other. Its arithmetic is torch's AdamW formula in fp32, one rounding per operation; torch's
own fused kernel computes parts of it in double, so the two agree to fp32 rounding, not bit for bit:
that is why it is opt-in rather than swapped in for `torch.optim.AdamW`.

- `max_grad_norm`: clip inside the step (the global norm over all ranks, as `hfsdp.core.clip_grad_norm_`
  computes it, `grad_norm` keeps it for logging) instead of calling `clip_grad_norm_` before the step;
  the result is the same, bit for bit, and the gradient is read once less.
- `prestage_gathers`: where no compute-dtype shard is kept (ZeRO-3, HSDP, one GPU), write the next
  forward's gather input during the step (allocated then, held until the unit's forward); the
  gather then skips its cast. Each group's gradient buffer is freed as soon as it is stepped, so
  the step itself needs less memory, not more.
- `overlap_next_forward` (CUDA, with `prestage_gathers`): each group's kernels run on a side stream, groups
  in the next forward's order (the root first), and the next forward waits for each group's step only where
  that group's unit runs, so the memory-bound step fills what the forward's compute leaves of the GPU. The
  arithmetic is the same kernels' on the same inputs: the weights are the same bits as without it. The clip
  is exact (the norm is taken before any group steps). The price: `step()` returns with the new weights not
  yet written; read parameters or this optimizer's state only after the model's `wait_for_weights()` (or
  `FusedAdamW.wait()`); hfsdp's state dicts and checkpoints do it themselves. Offloaded groups and DiLoCo
  instances step in order as before.
- `capturable` (torch's AdamW's name and meaning; Megatron's --optimizer-cuda-graph): each "step" is a 0-dim fp32
  tensor on the parameter's device, the per-step scalars are computed there from it (`adamw_kernel.device_scalars`:
  the host's double operations, then rounded to fp32, so the same bits as without it; only `pow` is the device's,
  which could differ from the host's in the last bit of a double, far below fp32) and the kernels read them from a
  tensor: nothing in `step()` reads a tensor on the host, and a `torch.cuda.CUDAGraph` that captured `step()`
  advances the step counts on the device at each replay. Baked into a captured graph: a float `lr` (give a 0-dim
  tensor on the device, which LR schedulers fill in place, to have each replay read the current one), betas, eps,
  weight decay, which parameters have a gradient, and every tensor's address (hfsdp's gradient buffers stay at
  one address from step to step under a capturable optimizer, at the price of holding them through the forward:
  4 bytes per element of the rank's gradient range in fp32, 2 in bf16). Step once eagerly before capturing (it
  makes the state and the constants). A tensor lr and the step tensors stay the same tensors through
  `load_state_dict` (they take the loaded values). Refused with
  capturable=True: `prestage_gathers` and `overlap_next_forward` (the step allocates the next gather's input and
  frees the gradient buffer: host bookkeeping a replay would not redo), and offloaded groups (stepped on the CPU).
  The clip's global norm stays on the device (an all-reduce, no host read).

- `store_param_remainders` (Megatron's name): keep each stepped group's fp32 main weights as its bf16 parameter shard
  plus a 16-bit remainder (`buffers/param_remainders.py`), converted when the optimizer is built: exact fp32 masters
  in 4 bytes per element instead of the fp32 copy beside the bf16 shard (6), which saves 2 bytes per element of the
  rank's optimizer range where a bf16 shard is kept (HFSDP's outer axis, ZeRO-1/2) and keeps the shard (no cast
  before a gather or forward) where none was. The kernel joins the halves in registers and splits the new master
  (the bf16 weight rounded to nearest, ties away from zero): the weights it writes are the next forward's. The
  model's parameters, outside forward, are then bf16 views; state dicts and checkpoints still hold the fp32 masters
  (joined), so they load into any run, with or without remainders. Needs bf16 compute
  (`MixedPrecision(param_dtype=torch.bfloat16)`), every parameter of each group it touches in this optimizer, and no
  offload or `overlap_next_forward` (`prestage_gathers` has nothing to stage: the gathers read the kept
  shard; weights gathered in fp8 are quantized from it); any other optimizer is then refused on those parameters at
  its first step.

Moment dtypes (Megatron's precision-aware optimizer, `exp_avg_dtype`, `exp_avg_sq_dtype`: torch.float32 by default,
torch.bfloat16, torch.float16, or fp8; Megatron's names "fp32", "bf16", "fp16", "fp8" work too, through
`optimizer_dtypes.parse_state_dtype`). The kernel loads each moment in its dtype, upcasts it in registers (exactly),
computes in fp32, uses the fp32 moments for the update and stores each back in its dtype, rounded to nearest even
(every store: bf16, fp16 and fp8 alike); no fp32 copy of a moment is ever made on the GPU. The torch path (CPU)
computes the same operations in the same order, so CPU tests check the GPU's arithmetic.

- fp8 `exp_avg` is float8_e4m3fn (3 mantissa bits; the first moment is signed and spans the gradient's range).
  fp8 `exp_avg_sq` is float8_e5m2: it is the mean of g**2, so it spans twice the binades of the gradient: e5m2 holds
  32 binades down to its subnormals (e4m3: 18), and a second moment flushed to zero makes the element step by
  m / eps, the failure that matters; its coarser mantissa (2 bits, at most 6.25% relative rounding of v, 3% of
  sqrt(v)) costs far less than such a flush.
- fp8 scales: one fp32 power of two per block of 128 elements of each piece (a block never spans two pieces; the
  last block of a piece is shorter), the smallest with `amax <= fmax * scale` (fmax 448 / 57344), so dividing by it
  is exact and each store rounds once; stored in their own flat fp32 buffer per group beside the moments (4 bytes
  per 128 elements). Decided by `bench/bench_fp8_scaling.py` (CPU, the torch path, 100 AdamW steps of a 512x2048
  tensor, gradients with log-normal row (sigma 1.5) and column (0.5) magnitudes and Student-t noise; relative
  error of the total update against fp32 moments, and the share of exp_avg_sq flushed to 0):
  dense gradients, e4m3/e5m2: per tensor 7.8 (4.3% flushed), per 4096 elements 0.18, per 256 or 128 0.18 (none
  flushed); embedding-like rows (each row touched at 5% of steps): per tensor 795 (9.0% flushed), per 4096 9.1,
  per 256 0.27, per 128 0.27, per 32 0.26; with e4m3 for exp_avg_sq the embedding case stays broken at any block
  (438 at 128). bf16/bf16 for comparison: 0.002 and 0.004. Per tensor fails as soon as magnitudes differ across a
  tensor; 128 is where the error stops improving, and is a power of two the kernel tiles by.

Bytes moved per element per step (fp32 weights read and written, gradient read, each moment read and written,
plus 2 for the bf16 compute weights the step writes; fp8 adds its scales, 8 bytes per 128 elements per fp8 moment,
and the block table, about 8 bytes per 128 elements):

    exp_avg / exp_avg_sq   fp32 gradient   bf16 gradient
    fp32 / fp32            30              28
    bf16 / bf16            22              20
    fp16 / fp16            22              20
    bf16 / fp8             20.125          18.125
    fp8 / bf16             20.125          18.125
    fp8 / fp8              18.19           16.19

With `store_param_remainders` the master is read and written as its two 16-bit halves (the fp32 weights' 8 bytes)
and the bf16 half is the compute weight, so no `out` is written: 2 bytes less in every row.

State dicts hold each moment in its dtype; an fp8 moment adds `<moment>_scale` (uint8 per element, E8M0: its block's
scale is 2**(byte - 127)), per-element state that hfsdp's checkpoints cut and reshard like the moment itself (so an
fp8 moment takes 2 bytes per element in a checkpoint). `load_state_dict` converts once into this optimizer's dtypes:
the same dtypes on the same blocks bit for bit, fp32 (torch's AdamW) or another dtype rounded to nearest even, fp8
cut into other blocks (another layout) dequantized exactly and requantized. torch's AdamW loading an hfsdp checkpoint
of fp8 moments gets them dequantized (exactly); it cannot read the fp8 state dict itself.

Gradients: with `MixedPrecision(reduce_dtype=torch.bfloat16)` the step reads the bf16 reduced gradient from the
group's buffer, upcast in registers, instead of the fp32 copies the engine makes for other optimizers (it makes
none for FusedAdamW's pieces): the same values, so the same bits, and 2 bytes per element less read and 8 less
written and read for the copies.

Each group's `exp_avg` and `exp_avg_sq` live in one flat buffer aligned with its main weights, and the
per-parameter state entries are views into them; state loaded through `load_state_dict` is converted into
them there and then. Parameters that are not hfsdp main params are stepped one tensor at a time. Pieces
offloaded to host memory are stepped by the plain-torch path on the CPU, slower than torch's fused CPU AdamW:
with `offload`, `torch.optim.AdamW(fused=True)` is the better choice.
"""

from __future__ import annotations

import itertools
import math
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from hfsdp.core.buffers.main_params import MainParam, piece_of
from hfsdp.core.engine.clip import pieces_norm
from hfsdp.core.engine.optimizer_state import as_pieces, local_state_dict
from hfsdp.core.kernels.adamw_kernel import (
    SCALE_BLOCK,
    AdamWScalars,
    ScaleBlocks,
    adamw_run,
    is_fp8,
    store_moment,
    triton,
)
from hfsdp.core.kernels.capturable import CapturableSteps, device_step, prepare_params, refuse_offloaded
from hfsdp.core.kernels.optimizer_dtypes import state_dtype
from hfsdp.core.kernels.remainder_groups import keep_remainders

BACKENDS = ("auto", "triton", "torch")
#: The per-element state FusedAdamW keeps, and the keys under which a state dict carries fp8 moments' scales.
MOMENTS = ("exp_avg", "exp_avg_sq")
SCALE_KEYS = {key: f"{key}_scale" for key in MOMENTS}


@dataclass
class _Run:
    """Consecutive pieces of one group, in one parameter group, at one step count: one kernel launch."""

    start: int  # offset in the group's optimizer range
    stop: int
    options: dict
    step: int | None  # None: capturable, a count not known on the host (the run is one piece)
    states: list[dict] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # of its pieces, in order (their fp8 scale blocks)


@dataclass
class _Moments:
    """A group's flat moments (or one loose tensor's), in their dtypes, with each fp8 moment's scales: one fp32
    power of two per block of `SCALE_BLOCK` elements of each piece (`first[offset]`: its first block)."""

    flat: tuple[torch.Tensor, torch.Tensor]
    scales: tuple[torch.Tensor | None, torch.Tensor | None]
    first: dict[int, int]
    blocks: dict[tuple[int, int], ScaleBlocks] = field(default_factory=dict)  # by run (start, stop)

    def scale(self, index: int, offset: int, count: int) -> torch.Tensor | None:
        """The scales of moment `index` for `count` blocks from the piece at `offset` on, or None (not fp8)."""
        scales = self.scales[index]
        if scales is None:
            return None
        first = self.first[offset]
        return scales[first : first + count]

    def run_blocks(self, run: _Run, device) -> ScaleBlocks | None:
        if self.scales == (None, None):
            return None
        found = self.blocks.get((run.start, run.stop))
        if found is None:
            found = self.blocks[run.start, run.stop] = ScaleBlocks(run.lengths, device)
        return found


def _count(numel: int) -> int:
    """Scale blocks of a piece of `numel` elements."""
    return -(-numel // SCALE_BLOCK)


class FusedAdamW(torch.optim.AdamW):
    """AdamW (decoupled weight decay) stepping hfsdp's main params in one pass per contiguous run."""

    #: What a checkpoint records as the optimizer's kind: the state is torch's AdamW's, so the two are interchangeable.
    state_format = "AdamW"
    #: `load_state_dict` takes fp8 moments with their `<moment>_scale` entries (hfsdp's checkpoints check this).
    loads_scaled_state = True
    #: Read a bf16 reduced gradient from the group's buffer (False: from the fp32 copies the engine would make).
    _direct_grads = True
    #: Steps masters kept as a bf16 weight plus a remainder (the engine refuses other optimizers on them).
    steps_param_remainders = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: float | None = None,
        prestage_gathers: bool = False,
        overlap_next_forward: bool = False,
        backend: str = "auto",
        exp_avg_dtype: torch.dtype | str = torch.float32,
        exp_avg_sq_dtype: torch.dtype | str = torch.float32,
        capturable: bool = False,
        store_param_remainders: bool = False,
    ):
        problems = _check_arguments(lr, betas, eps, weight_decay, max_grad_norm, prestage_gathers, backend, capturable)
        dtypes = []
        for key, value in (("exp_avg", exp_avg_dtype), ("exp_avg_sq", exp_avg_sq_dtype)):
            try:
                dtypes.append(state_dtype(value, key))
            except ValueError as err:
                problems.append(str(err))
        if not isinstance(overlap_next_forward, bool):
            problems.append(f"overlap_next_forward must be True or False, got {overlap_next_forward!r}")
        elif overlap_next_forward and not prestage_gathers:
            problems.append(
                "overlap_next_forward=True needs prestage_gathers=True (the step must write the next forward's "
                "gather input, or the gather would cast weights the step has not written yet)"
            )
        if capturable is True and prestage_gathers is True:
            problems.append(
                "capturable=True cannot be combined with prestage_gathers=True (or overlap_next_forward=True): that "
                "step allocates the next forward's gather input and frees the gradient buffer, host bookkeeping "
                "that a replayed CUDA graph would not redo"
            )
        if not isinstance(store_param_remainders, bool):
            problems.append(f"store_param_remainders must be True or False, got {store_param_remainders!r}")
        elif store_param_remainders and overlap_next_forward is True:
            problems.append(
                "store_param_remainders=True cannot be combined with overlap_next_forward=True: the overlapped step "
                "writes the next forward's bf16 weights into a buffer of their own, while with remainders it writes "
                "the bf16 weights the gathers read in place, so there is nothing to overlap"
            )
        if problems:
            raise ValueError("FusedAdamW: " + "; ".join(problems) + ".")
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            foreach=False,
            fused=False,
            **({"capturable": True} if capturable else {}),
        )
        self.capturable = capturable
        self._capture = CapturableSteps() if capturable else None  # its host bookkeeping (`capturable.py`)
        if capturable:
            prepare_params(self.param_groups)
        self.max_grad_norm, self.prestage_gathers, self.backend = max_grad_norm, prestage_gathers, backend
        self.overlap_next_forward = overlap_next_forward
        self._in_flight: list = []  # groups whose last step ran on the optim stream
        self.grad_norm: torch.Tensor | None = None  # the last step's global gradient norm, before clipping
        self.backends_used: set[str] = set()  # which implementations stepped (for benchmarks and tests)
        self.exp_avg_dtype, self.exp_avg_sq_dtype = dtypes
        self._moments: dict[int, _Moments] = {}  # id(group) -> its flat moments (and fp8 scales)
        self._loose: dict[torch.Tensor, _Moments] = {}  # a tensor that is no hfsdp piece -> its fp8 scales
        for options in self.param_groups:
            for param in options["params"]:
                if (piece := piece_of(param)) is not None and self._direct_grads:
                    piece.grad_reader = weakref.ref(self)  # the engine makes no fp32 copy of a bf16 gradient
        self.store_param_remainders = store_param_remainders
        if store_param_remainders:
            keep_remainders(self)

    # -- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for options in self.param_groups:
            if options.get("amsgrad") or options.get("maximize"):
                raise ValueError("FusedAdamW implements plain AdamW: amsgrad and maximize are not supported.")
        self.wait()  # a step still in flight (step called twice with no forward between)
        by_group, loose, empty = self._members()
        coef = self._clip_coefficient(by_group, loose)
        stepped = [self._empty_state(piece)["step"] for piece in empty]
        if self.capturable:
            stepped.extend(self._step_on_device(by_group, loose, coef))
        else:
            for group, members in by_group.values():
                stepped.extend(self._step_group(group, members, coef))
            for options, param in loose:
                stepped.append(self._step_tensor(options, param, coef))
        if stepped:
            torch._foreach_add_(stepped, 1.0)
        return loss

    def _step_on_device(self, by_group, loose, coef) -> list[torch.Tensor]:
        """`capturable`: every group's runs and every loose tensor, their scalars computed on the device from their
        step tensors in one batch, then stepped as without it. Nothing is read on the host."""
        planned = []
        for group, members in by_group.values():
            refuse_offloaded(group)
            moments = self._flat_moments(group)
            planned.append((group, members, _runs(members, self.state, moments, group.grads.main_grad, self._capture)))
        tensors = [(options, param, self._tensor_state(param)) for options, param in loose]
        steps = [run.states[0]["step"] for _, _, runs in planned for run in runs] + [t[2]["step"] for t in tensors]
        if not steps:
            return []
        options = [run.options for _, _, runs in planned for run in runs] + [t[0] for t in tensors]
        scalars = self._capture.scalars(steps, options)
        stepped, at = [], 0
        for group, members, runs in planned:
            stepped.extend(self._step_group(group, members, coef, (runs, scalars[at : at + len(runs)])))
            at += len(runs)
        for (options, param, _), row in zip(tensors, scalars[at:], strict=True):
            stepped.append(self._step_tensor(options, param, coef, row))
        return stepped

    def _tensor_state(self, param: torch.Tensor) -> dict:
        """A loose tensor's state with its step on its device (capturable)."""
        state = self.state[param]
        state["step"] = device_step(state.get("step"), param.device)
        return state

    def _empty_state(self, piece: MainParam) -> dict:
        """The state of a piece with no element on this rank: empty moments and a step that counts with the others',
        as torch's AdamW keeps (every rank then has the same state names and step counts, which DCP relies on:
        it writes a step count once, from any rank)."""
        entry = self.state[piece.param]
        if self.capturable:
            entry["step"] = device_step(entry.get("step"), piece.param.device)
        elif not isinstance(entry.get("step"), torch.Tensor):
            entry["step"] = torch.tensor(float(entry.get("step") or 0.0))
        for key, dtype in zip(MOMENTS, self.dtypes, strict=True):
            if entry.get(key) is None:
                entry[key] = torch.zeros(piece.param.shape, dtype=dtype, device=piece.param.device)
        return entry

    def wait(self) -> None:
        """Make the current stream wait for the last step's kernels on the optim stream (`overlap_next_forward`),
        before the parameters or this optimizer's state are read or written outside the model's forward."""
        for group in self._in_flight:
            group.wait_for_publish()
        self._in_flight = []

    @property
    def dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """The dtypes `exp_avg` and `exp_avg_sq` are kept in."""
        return self.exp_avg_dtype, self.exp_avg_sq_dtype

    def state_dict(self):
        """torch's AdamW state dict, each moment in its own dtype; an fp8 moment adds `<moment>_scale`: its scale
        per element (uint8, E8M0: the scale is 2**(byte - 127), the same for every element of a block), so it is
        per-element state that hfsdp's checkpoints cut and reshard like the moments."""
        self.wait()
        packed = super().state_dict()
        if not any(is_fp8(d) for d in self.dtypes):
            return packed
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for index, param in enumerate(params):
            if index in packed["state"]:
                packed["state"][index] = dict(packed["state"][index])
                packed["state"][index].update(self._scale_entries(param, packed["state"][index]))
        return as_pieces(self, packed) if getattr(self, "_hfsdp_state_hooks", False) else packed

    def checkpoint_state(self, param: torch.Tensor) -> dict:
        """`param`'s state as `state_dict` gives it (hfsdp's checkpoints save this)."""
        self.wait()
        entry = self.state.get(param, {})
        if not any(is_fp8(d) for d in self.dtypes) or not entry:
            return entry
        return {**entry, **self._scale_entries(param, entry)}

    def load_state_dict(self, state_dict) -> None:
        """torch's `load_state_dict`, but the moments are converted once into this optimizer's dtypes instead of
        torch's cast to the parameter's dtype: the same dtypes (fp8 with the same blocks) are copied bit for bit,
        fp32 (torch's AdamW) or another dtype is rounded to nearest even, fp8 from other blocks (another layout)
        is dequantized exactly and requantized with this layout's blocks."""
        self.wait()
        state_dict = local_state_dict(self, state_dict)  # DCP's and torch's sharded tensors as this rank's pieces
        # Steps go where this optimizer keeps them (torch's rule: on the parameter's device when capturable), whatever
        # the saved groups say; a tensor lr stays the same tensor (a captured graph reads it), given the saved value.
        lrs = [g["lr"] for g in self.param_groups]
        old_steps = {id(p): e.get("step") for p, e in self.state.items()} if self.capturable else {}
        saved_groups = [dict(g) for g in state_dict["param_groups"]]
        for group in saved_groups:
            if self.capturable or "capturable" in group:
                group["capturable"] = self.capturable
        state_dict = {**state_dict, "param_groups": saved_groups}
        held: dict = {}
        stripped = {}
        for index, entry in state_dict["state"].items():
            keys = (*MOMENTS, *SCALE_KEYS.values())
            held[index] = {k: v for k, v in entry.items() if k in keys and isinstance(v, torch.Tensor)}
            stripped[index] = {k: v for k, v in entry.items() if k not in held[index]}
        super().load_state_dict({**state_dict, "state": stripped})
        saved = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        mine = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        by_index = dict(zip(saved, mine, strict=True))
        for index, tensors in held.items():
            if tensors:
                self._adopt_loaded(by_index[index], tensors)
        if self.capturable:
            self._capture.after_load(self.param_groups, self.state, lrs, old_steps)

    def _scale_entries(self, param: torch.Tensor, entry: dict) -> dict:
        """`<moment>_scale` of each fp8 moment of `param` (uint8 E8M0 per element, shaped like it)."""
        out = {}
        piece = piece_of(param)
        for index, key in enumerate(MOMENTS):
            if piece is not None and not piece.holds and is_fp8(self.dtypes[index]) and key in entry:
                out[SCALE_KEYS[key]] = torch.zeros(param.shape, dtype=torch.uint8, device=param.device)  # no element
                continue
            scale = self._scale_of(param, index)
            if scale is None or key not in entry:
                continue
            n = param.numel()
            ids = torch.arange(n, device=scale.device) // SCALE_BLOCK
            out[SCALE_KEYS[key]] = (scale.view(torch.int32) >> 23).to(torch.uint8)[ids].view(param.shape)
        return out

    def _scale_of(self, param: torch.Tensor, index: int) -> torch.Tensor | None:
        """The fp32 scales of `param`'s moment `index` (None: not fp8)."""
        piece = piece_of(param)
        if piece is None:
            found = self._loose.get(param)
            return None if found is None else found.scales[index]
        if not piece.holds:
            return None
        return self._flat_moments(piece.group).scale(index, piece.offset, _count(piece.param.numel()))

    def _adopt_loaded(self, param: torch.Tensor, tensors: dict) -> None:
        """Convert loaded moments into `param`'s state (views into the flat moments for a piece)."""
        entry = self.state[param]
        piece = piece_of(param)
        if piece is not None and not piece.holds:
            self._empty_state(piece)
            return
        if piece is None:
            moments = self._loose_moments(param)
            lo = 0
        else:
            moments = self._flat_moments(piece.group)
            lo = piece.offset
        n = param.numel()
        for index, key in enumerate(MOMENTS):
            if key not in tensors:
                continue
            flat = moments.flat[index][lo : lo + n]
            scale = moments.scale(index, lo, _count(n))
            _convert_into(flat, scale, tensors[key].to(flat.device), tensors.get(SCALE_KEYS[key]))
            entry[key] = flat.view(param.shape)

    def _members(self):
        """The parameters with a gradient: hfsdp pieces by group (engine order: collectives follow it), the rest,
        and the pieces with no element here. Each piece comes with its parameter group's options."""
        by_group: dict[int, tuple[object, list[tuple[dict, MainParam]]]] = {}
        loose, empty = [], []
        for options in self.param_groups:
            for param in options["params"]:
                piece = piece_of(param)
                if param.grad is None and not (piece is not None and _reads_buffer(piece, self)):
                    continue
                if param.grad is not None and param.grad.is_sparse:
                    raise RuntimeError("FusedAdamW does not support sparse gradients.")
                if piece is None:
                    loose.append((options, param))
                elif piece.holds:
                    by_group.setdefault(id(piece.group), (piece.group, []))[1].append((options, piece))
                else:
                    empty.append(piece)
        order = {id(g): i for i, g in enumerate(_engine_groups(by_group))}
        return dict(sorted(by_group.items(), key=lambda kv: order[kv[0]])), loose, empty

    def _clip_coefficient(self, by_group, loose) -> torch.Tensor | None:
        if self.max_grad_norm is None:
            return None
        if loose:
            raise ValueError(
                "FusedAdamW(max_grad_norm=...) clips by the global norm of hfsdp's sharded gradients, but it also "
                "steps tensors that are not an hfsdp model's parameters; clip those apart and leave max_grad_norm "
                "unset."
            )
        pieces = [piece for options in self.param_groups for p in options["params"] if (piece := piece_of(p))]
        # In the model's order, so the norm is summed exactly as hfsdp.core.clip_grad_norm_(model) sums it.
        order = {}
        for owner in {id(o): o for p in pieces if (o := p.group.owner()) is not None}.values():
            order.update((id(q), len(order)) for q in owner.main_params)
        pieces.sort(key=lambda p: order.get(id(p), len(order)))
        norm = pieces_norm(pieces)  # collective: every rank steps, and computes the same global norm
        self.grad_norm = norm
        return torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s coefficient

    def _step_group(self, group, members: list[tuple[dict, MainParam]], coef, planned=None) -> list[torch.Tensor]:
        """Step every piece of `group` this optimizer holds; return their step counters (incremented by the caller).
        `planned`: capturable, the group's runs and their rows of `device_scalars`."""
        moments = self._flat_moments(group)
        exp_avg, exp_avg_sq = moments.flat
        mine = {id(piece) for _, piece in members}
        whole = all(id(p) in mine for p in group.main_params if p.holds)
        out = group.compute_weights_out(self.prestage_gathers and whole)
        if out is not None and group.param_shard is None and not whole:
            out = None  # a gather input must be written whole
        main_grad = group.grads.main_grad
        device_coef = coef.to(group.main.device) if coef is not None else None
        cut = _runs(members, self.state, moments, main_grad) if planned is None else planned[0]
        runs = [  # every tensor the kernels read, made here on the compute stream
            (run, main_grad[run.start : run.stop] if not run.grads else torch.cat([g.reshape(-1) for g in run.grads]))
            for run in cut
        ]
        aside = self.overlap_next_forward and out is not None and _steps_aside(group)
        inputs = (*(grad for _, grad in runs), *([device_coef] if device_coef is not None else []))
        with group.step_on_optim_stream(inputs) if aside else nullcontext():
            for index, (run, grad) in enumerate(runs):
                lo, hi = run.start, run.stop
                blocks = moments.run_blocks(run, group.main.device)
                count = 0 if blocks is None else blocks.count
                used = adamw_run(
                    group.main[lo:hi],  # the fp32 masters, or their bf16 halves with `remainder`
                    grad,
                    exp_avg[lo:hi],
                    exp_avg_sq[lo:hi],
                    _scalars(run.options, run.step + 1) if planned is None else planned[1][index],
                    device_coef,
                    None if out is None else out[lo:hi],
                    self.backend,
                    scales=(moments.scale(0, lo, count), moments.scale(1, lo, count)),
                    blocks=blocks,
                    remainder=None if group.remainder is None else group.remainder[lo:hi],
                )
                self.backends_used.add(used)
            if out is not None:
                covered = max((p.offset + p.stop - p.start for _, p in members), default=0)
                if group.param_shard is None:
                    out[covered:].zero_()  # the padding of a gather input: zero, as the cast of `main` would give
        if aside:
            self._in_flight.append(group)
        if out is not None:
            group.compute_weights_written()
        steps = [self.state[piece.param]["step"] for _, piece in members]
        if planned is not None:
            self._capture.stepped(piece.param for _, piece in members)
        if whole and self.prestage_gathers:
            group.release_grads()  # stepped: its gradient buffer is free for the gather inputs written after it
        return steps

    def _flat_moments(self, group) -> _Moments:
        """The group's flat `exp_avg`, `exp_avg_sq` (zeros at first, in their dtypes), aligned with its main
        weights, and the scales of the fp8 ones (one per block of each piece this rank holds, 1 at first)."""
        found = self._moments.get(id(group))
        if found is None:
            first, count = {}, 0
            for piece in sorted((p for p in group.main_params if p.holds), key=lambda p: p.offset):
                first[piece.offset] = count
                count += _count(piece.param.numel())
            found = self._new_moments(group.main, count, first)
            self._moments[id(group)] = found
        return found

    def _loose_moments(self, param: torch.Tensor) -> _Moments:
        """A tensor that is no hfsdp piece: its moments in its state, its fp8 scales here."""
        found = self._loose.get(param)
        if found is None:
            found = self._loose[param] = self._new_moments(param.detach().reshape(-1), _count(param.numel()), {0: 0})
        return found

    def _new_moments(self, like: torch.Tensor, blocks: int, first: dict[int, int]) -> _Moments:
        flat = tuple(torch.zeros(like.numel(), dtype=d, device=like.device) for d in self.dtypes)
        scales = tuple(torch.ones(blocks, device=like.device) if is_fp8(d) else None for d in self.dtypes)
        return _Moments(flat, scales, first)

    def _step_tensor(self, options: dict, param: torch.Tensor, coef, row: torch.Tensor | None = None) -> torch.Tensor:
        """A parameter that is no hfsdp piece: its own state tensors, stepped on their own (capturable: with its row
        of `device_scalars`)."""
        state = self.state[param]
        moments = self._loose_moments(param)
        state.setdefault("step", torch.tensor(0.0))
        for index, key in enumerate(MOMENTS):
            if key not in state:
                state[key] = moments.flat[index].view(param.shape)
            elif state[key].data_ptr() != moments.flat[index].data_ptr():  # given by torch's load_state_dict
                self._adopt_loaded(param, {key: state[key]})
        if param.dtype != torch.float32:
            raise TypeError(f"FusedAdamW steps fp32 parameters; this one is {param.dtype}.")
        data = param if param.is_contiguous() else param.contiguous()
        scalars = _scalars(options, int(state["step"].item()) + 1) if row is None else row
        grad = param.grad.reshape(-1).float().contiguous()
        c = coef.to(param.device) if coef is not None else None
        view = data.view(-1)
        n = param.numel()
        used = adamw_run(
            view,
            grad,
            *moments.flat,
            scalars,
            c,
            None,
            self.backend,
            scales=moments.scales,
            blocks=moments.run_blocks(_Run(0, n, options, 0, lengths=[n]), param.device),
        )
        self.backends_used.add(used)
        if data is not param:
            param.copy_(data)
        return state["step"]


def _scalars(options: dict, step: int) -> AdamWScalars:
    beta1, beta2 = (float(b) for b in options["betas"])
    lr, eps, decay = float(options["lr"]), float(options["eps"]), float(options["weight_decay"])
    return AdamWScalars.of(lr, beta1, beta2, eps, decay, step)


def _reads_buffer(piece: MainParam, optimizer) -> bool:
    """Whether `optimizer` steps `piece` from its group's reduced gradient in the reduce dtype (no `.grad` copy)."""
    grads = piece.group.grads
    mine = piece.grad_reader is not None and piece.grad_reader() is optimizer
    needed = grads.reduce_dtype != torch.float32 or piece.group.remainder is not None  # bf16 params take no fp32 .grad
    return mine and needed and grads.holds and not piece.group.offload


def _runs(members, state, moments: _Moments, main_grad, capturable=None) -> list[_Run]:
    """Cut the pieces of one group into runs, giving each piece its state (views into the flat moments, starting at
    zero). A piece whose gradient is not the view into the group's reduced gradient (an fp32 copy made for another
    reduce dtype, where the optimizer does not read the buffer itself) brings it along. `capturable` (a capturable
    optimizer's `CapturableSteps`): steps live on the device and are never read; pieces join a run where the host
    knows their counts are equal (`CapturableSteps.counts`), and a piece of unknown count is a run of its own."""
    runs: list[_Run] = []
    for options, piece in sorted(members, key=lambda m: m[1].offset):
        lo, hi = piece.offset, piece.offset + piece.stop - piece.start
        entry = state[piece.param]
        for index, key in enumerate(MOMENTS):
            _adopt(entry, key, moments.flat[index][lo:hi], piece.param.shape)
        step = entry.get("step")
        if capturable is not None:
            if step is None:
                capturable.counts[id(piece.param)] = 0
            entry["step"] = device_step(step, piece.param.device)
            count = capturable.counts.get(id(piece.param))
        else:
            if not isinstance(step, torch.Tensor) or step.device.type != "cpu" or step.dtype != torch.float32:
                entry["step"] = step = torch.tensor(float(step or 0.0))
            count = int(step.item())
        grad = piece.param.grad
        own = grad is not None and (
            main_grad is None or grad.data_ptr() != main_grad[lo:].data_ptr() or not grad.is_contiguous()
        )
        last = runs[-1] if runs else None
        joins = last is not None and last.stop == lo and last.options is options and last.step == count is not None
        if joins and bool(last.grads) == own:
            last.stop = hi
        else:
            last = _Run(lo, hi, options, count)
            runs.append(last)
        last.states.append(entry)
        last.lengths.append(hi - lo)
        if own:
            last.grads.append(grad)
    return runs


def _adopt(entry: dict, key: str, flat: torch.Tensor, shape: torch.Size) -> None:
    """Make `entry[key]` the view `flat` (state loaded through `load_state_dict` is one already; anything else put
    there is copied in, rounded to the moment's dtype)."""
    current = entry.get(key)
    if current is not None and current.data_ptr() == flat.data_ptr() and current.numel() == flat.numel():
        return
    if current is not None:
        if is_fp8(flat.dtype):
            raise RuntimeError(f"FusedAdamW: an fp8 '{key}' can only be loaded through load_state_dict")
        flat.copy_(current.reshape(-1))
    entry[key] = flat.view(shape)


def _convert_into(flat: torch.Tensor, scale: torch.Tensor | None, value: torch.Tensor, value_scale) -> None:
    """Store the loaded moment `value` (any float dtype; fp8 with its per-element E8M0 `value_scale`, or unscaled)
    into `flat`, one piece, and its fp8 `scale`. Exact where the dtypes and the blocks agree."""
    value = value.reshape(-1)
    n = value.numel()
    if is_fp8(value.dtype) and value_scale is not None:
        exponent = value_scale.reshape(-1).to(device=value.device, dtype=torch.int32)
        firsts = exponent[::SCALE_BLOCK]
        ids = torch.arange(n, device=value.device) // SCALE_BLOCK
        if value.dtype == flat.dtype and torch.equal(exponent, firsts[ids]):  # its blocks are this piece's
            flat.copy_(value)
            scale.copy_((firsts << 23).view(torch.float32))  # E8M0: byte b is 2**(b - 127)
            return
        value = value.float().mul_((exponent << 23).view(torch.float32))  # exact: times a power of two
    if is_fp8(flat.dtype):
        store_moment(flat, value.to(torch.float32, copy=True), scale, ScaleBlocks([n], value.device))
    else:
        flat.copy_(value)


def _engine_groups(by_group) -> list:
    """The groups in the next forward's order, the root first (the same on every rank): stepped on a side stream,
    the forward can start on the first while the others step."""
    groups = [g for g, _ in by_group.values()]
    ordered = []
    for owner in {id(o): o for g in groups if (o := g.owner()) is not None}.values():
        ordered.extend(owner.in_forward_order(groups))
    ordered.extend(g for g in groups if not any(g is h for h in ordered))
    return ordered


def _steps_aside(group) -> bool:
    """Whether `group` can step on the optim stream: on a device with side streams, its state on that device, and
    not a DiLoCo instance's (the outer step reads the main weights right after the inner one)."""
    owner = group.owner()
    return group.streams.overlaps and not group.offload and (owner is None or owner.outer is None)


def _check_arguments(lr, betas, eps, weight_decay, max_grad_norm, prestage, backend, capturable) -> list[str]:
    def number(x) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)

    problems = []
    if not isinstance(capturable, bool):
        problems.append(f"capturable must be True or False, got {capturable!r}")
    if capturable is True and isinstance(lr, torch.Tensor):
        if lr.dim() != 0 or not lr.is_floating_point() or not math.isfinite(float(lr)) or float(lr) < 0:
            problems.append(f"lr must be a number >= 0 or a 0-dim floating tensor holding one, got {lr!r}")
    elif not number(lr) or lr < 0:
        tensor = " or, with capturable=True, a 0-dim tensor" if capturable is True else " (a float, not a tensor)"
        problems.append(f"lr must be a number >= 0{tensor}, got {lr!r}")
    if not (isinstance(betas, tuple | list) and len(betas) == 2 and all(number(b) and 0 <= b < 1 for b in betas)):
        problems.append(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not number(eps) or eps < 0:
        problems.append(f"eps must be a number >= 0, got {eps!r}")
    if not number(weight_decay) or weight_decay < 0:
        problems.append(f"weight_decay must be a number >= 0, got {weight_decay!r}")
    if max_grad_norm is not None and (not number(max_grad_norm) or max_grad_norm <= 0):
        problems.append(f"max_grad_norm must be None (no clipping) or a positive number, got {max_grad_norm!r}")
    if not isinstance(prestage, bool):
        problems.append(f"prestage_gathers must be True or False, got {prestage!r}")
    if backend not in BACKENDS:
        problems.append(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    elif backend == "triton" and triton is None:
        problems.append("backend='triton' needs Triton, which does not import here (use 'auto' or 'torch')")
    return problems
