"""One pass of AdamW over a contiguous run of elements, optionally writing the new weights in the compute dtype.

torch's fused AdamW reads the parameter, gradient and both moments and writes the parameter and the
moments: 28 bytes per fp32 element, the floor for the update itself. Around it hfsdp used to add two
more passes: clipping's multiply of the gradient (8 bytes: read and write) and the cast of the new
fp32 weights to the compute dtype for the next forward (6 bytes: read 4, write 2). `adamw_run` does
all three in one pass: the clip coefficient multiplies the gradient as it is loaded, and the new
weights are stored in the compute dtype beside the fp32 ones (2 bytes more), 30 bytes per element.

Two implementations compute the same function:

- a Triton kernel (`_adamw_kernel`), used for CUDA tensors where Triton imports (it ships with
  torch's CUDA builds), and under Triton's interpreter (`TRITON_INTERPRET=1`) for CPU tensors;
- plain torch operations (`_torch_run`), used everywhere else (CPU CI, no Triton).

Both apply the same IEEE-rounded fp32 operations in the same order (the kernel is compiled with
floating-point contraction off and uses correctly rounded square root and division), so they give
the same bits; tests check both against a float64 reference and against each other. The compute-dtype
store rounds to nearest even, as `Tensor.to` does (bf16 by integer rounding, which Triton's
interpreter would otherwise truncate).

The moments may be kept in fp32, bf16, fp16 or fp8 (`fused_adamw` explains the choice): each is loaded in its
dtype and upcast exactly (fp8: times its block's power-of-two scale), the step computes in fp32, and each is
stored back rounded to nearest even (fp8: after the block's new scale, the smallest power of two that maps its
largest magnitude into the format, is divided out exactly). The gradient may be bf16 (upcast exactly). fp8 runs
use `_adamw_blocks_kernel`: each program steps 32 scale blocks of 128 elements (a table of their starts and
lengths, since blocks start at each piece's start) and reduces each block's amax in registers. Whole blocks and
each piece's short last block are two launches: a whole block's mask is per row, so its loads can be vectorised
(the first version, one launch with a per-element mask, ran at 30-37% of the H200's bandwidth).

The master weights may be fp32, or a bf16 weight plus an int16 remainder (`param_remainders`: exact fp32 in
4 bytes where the bf16 weight is kept anyway): the run then loads both halves, joins them into the fp32 master
in registers, and stores the new master split the same way (rounded to nearest, ties away from zero), so the
bf16 weight it writes is the next forward's weight: 4 bytes read and 4 written, as for fp32, and no `out`.

The formula is torch's AdamW (decoupled weight decay, bias-corrected moments):

    g = grad * coef;  p *= 1 - lr*wd;  m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*g*g
    p -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from hfsdp.core.buffers.param_remainders import join_master, write_master

try:  # Triton ships with torch's CUDA wheels; CPU-only installs usually lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None

#: Elements per Triton program and warps per program: 16 fp32 elements per thread, four 16-byte loads per tensor.
BLOCK, NUM_WARPS = 4096, 8
#: Elements per fp8 scale (a block of one piece; see `fused_adamw` for the measurement behind 128).
SCALE_BLOCK = 128
#: The largest finite value of each fp8 format and the exponent of its leading binade (448 = 1.75 * 2**8).
FP8_MAX = {torch.float8_e4m3fn: (448.0, 8), torch.float8_e5m2: (57344.0, 15)}
#: The kernel's code of each moment dtype.
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
GRAD_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class AdamWScalars:
    """The per-step scalars of one run, computed once on the host in double precision and rounded to fp32 by
    both implementations in the same way."""

    decay: float  # 1 - lr * weight_decay
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float  # lr / (1 - beta1^t)
    inv_bc2_sqrt: float  # 1 / sqrt(1 - beta2^t)
    eps: float

    @classmethod
    def of(cls, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> AdamWScalars:
        bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
        return cls(
            decay=1.0 - lr * weight_decay,
            beta1=beta1,
            one_minus_beta1=1.0 - beta1,
            beta2=beta2,
            one_minus_beta2=1.0 - beta2,
            step_size=lr / bc1,
            inv_bc2_sqrt=1.0 / math.sqrt(bc2),
            eps=eps,
        )


#: The order of `AdamWScalars`' fields in the fp32 tensor `device_scalars` makes (one row of 8 per run).
SCALAR_FIELDS = (
    "decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "step_size", "inv_bc2_sqrt", "eps",
)  # fmt: skip


def scalar_constants(options: list[tuple[float, float, float, float, float]], device) -> torch.Tensor:
    """The step-independent inputs of `device_scalars`, one row per run from (lr, beta1, beta2, eps,
    weight_decay) as host floats (lr: any number where the run's lr is a tensor): float64 (lr, beta1, 1 - beta1,
    beta2, 1 - beta2, eps, weight_decay), the differences taken on the host in double as `AdamWScalars.of` takes
    them. Made before a CUDA graph is captured (a copy from the host), then reused."""
    rows = [(lr, b1, 1.0 - b1, b2, 1.0 - b2, eps, wd) for lr, b1, b2, eps, wd in options]
    return torch.tensor(rows, dtype=torch.float64, device=device).reshape(len(rows), 7)


def device_scalars(steps: list[torch.Tensor], lrs: list, constants: torch.Tensor) -> torch.Tensor:
    """`AdamWScalars.of` computed on the device, for a run per step tensor: `steps` are the runs' step counts
    before this step (0-dim tensors on the device), `lrs` each run's lr (None: the float in `constants`, else a
    0-dim tensor on the device, read when the computation runs), `constants` from `scalar_constants`. The same
    double operations as the host's, each rounded once (IEEE: +, -, *, / and sqrt agree everywhere; `pow` is the
    device's, which may differ from the host's libm in the last bit of a double, far below fp32's precision),
    then rounded to fp32 as the host's floats are when a kernel takes them. Returns a (runs, 8) fp32 tensor in
    `SCALAR_FIELDS` order; nothing is read on the host, so it can run in a captured CUDA graph."""
    t = torch.stack([s.reshape(()) for s in steps]).to(torch.float64) + 1.0
    c = constants
    if any(lr is not None for lr in lrs):
        lr = torch.stack([c[i, 0] if x is None else x.reshape(()).to(torch.float64) for i, x in enumerate(lrs)])
    else:
        lr = c[:, 0]
    bc1 = 1.0 - torch.pow(c[:, 1], t)
    bc2 = 1.0 - torch.pow(c[:, 3], t)
    decay = 1.0 - lr * c[:, 6]
    step_size = lr / bc1
    inv_bc2_sqrt = torch.reciprocal(torch.sqrt(bc2))
    columns = (decay, c[:, 1], c[:, 2], c[:, 3], c[:, 4], step_size, inv_bc2_sqrt, c[:, 5])
    return torch.stack(columns, dim=1).to(torch.float32)


class _TensorScalars:
    """`AdamWScalars`' fields as 0-dim fp32 tensors, views into one row of `device_scalars` (the torch path)."""

    def __init__(self, row: torch.Tensor):
        for i, name in enumerate(SCALAR_FIELDS):
            setattr(self, name, row[i])


def triton_usable(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernel can step `tensor`: CUDA with Triton present, or CPU under Triton's interpreter."""
    if triton is None:
        return False
    if tensor.is_cuda:
        return True
    return tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


class ScaleBlocks:
    """The fp8 scale blocks of one run: each piece of the run is cut into blocks of `block` elements from its own
    start (the last one shorter), so a block never spans two pieces and the same piece always has the same blocks.
    `starts` and `lens` (int32, on the run's device) are what the kernel reads; `ids` (the block of each element,
    made on first use) is what the torch path gathers and reduces by."""

    def __init__(self, lengths: list[int], device, block: int = SCALE_BLOCK):
        starts, lens, at = [], [], 0
        for length in lengths:
            for lo in range(0, length, block):
                starts.append(at + lo)
                lens.append(min(block, length - lo))
            at += length
        self.numel, self.count, self.block = at, len(starts), block
        index = torch.int32 if at < 2**31 else torch.int64
        self.starts = torch.tensor(starts, dtype=index, device=device)
        self.lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self._ids: torch.Tensor | None = None
        # For the kernel, whole blocks and the short last blocks apart: a whole block needs no per-element mask, so
        # its loads can be vectorised (and, where every start is a multiple of 16 elements, aligned).
        whole = [i for i, length in enumerate(lens) if length == block]
        short = [i for i, length in enumerate(lens) if length != block]
        self.whole = _Table(whole, starts, lens, index, device)
        self.short = _Table(short, starts, lens, index, device)
        self.whole_aligned = all(starts[i] % 16 == 0 for i in whole)

    @property
    def ids(self) -> torch.Tensor:
        if self._ids is None:
            blocks = torch.arange(self.count, device=self.lens.device)
            self._ids = torch.repeat_interleave(blocks, self.lens.long(), output_size=self.numel)
        return self._ids


class _Table:
    """Some of a run's scale blocks, as the kernel reads them: their starts, lengths and block numbers (where each
    one's scale lives)."""

    def __init__(self, chosen: list[int], starts: list[int], lens: list[int], index, device):
        self.count = len(chosen)
        self.starts = torch.tensor([starts[i] for i in chosen], dtype=index, device=device)
        self.lens = torch.tensor([lens[i] for i in chosen], dtype=torch.int32, device=device)
        self.ids = torch.tensor(chosen, dtype=torch.int32, device=device)


def adamw_run(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalars: AdamWScalars | torch.Tensor,
    coef: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    blocks: ScaleBlocks | None = None,
    remainder: torch.Tensor | None = None,
) -> str:
    """Step one run in place: `param` (contiguous fp32), `grad` (fp32 or bf16, read as it is), `exp_avg` and
    `exp_avg_sq` (each fp32, bf16, fp16 or fp8, same length, stored back in their dtype), the gradient first
    multiplied by the one-element fp32 tensor `coef`; `out` (bf16 or fp16, same length) receives the new weights.
    An fp8 moment needs its fp32 `scales` entry (one power of two per block of `blocks`; by default the run is one
    piece). `scalars` may be a row of `device_scalars` (8 fp32 values on the parameter's device): the kernel then reads
    them there, and nothing is read on the host (capturable). With `remainder` (int16, same length) `param` is the
    bf16 upper half of the fp32 master and `remainder` its lower half (`param_remainders`): both are updated in place
    and `out` must be None. Returns the backend used ("triton" or "torch")."""
    n = param.numel()
    if isinstance(scalars, torch.Tensor) and (
        scalars.dtype != torch.float32 or scalars.shape != (8,) or scalars.device != param.device
    ):
        raise ValueError(f"adamw_run: tensor scalars must be 8 fp32 values on {param.device} (a device_scalars row)")
    if remainder is not None:
        if param.dtype != torch.bfloat16 or not param.is_contiguous() or out is not None:
            raise ValueError("adamw_run: with a remainder the parameter run is its contiguous bf16 half, and no out")
        if remainder.dtype != torch.int16 or remainder.numel() != n or not remainder.is_contiguous():
            raise ValueError(f"adamw_run: the remainder must be a contiguous int16 tensor of {n} elements")
        if remainder.device != param.device:
            raise ValueError(f"adamw_run: the remainder must be on {param.device}")
    elif param.dtype != torch.float32 or not param.is_contiguous():
        raise ValueError("adamw_run: the parameter run must be a contiguous fp32 tensor")
    checks = (("grad", grad, GRAD_DTYPES), ("exp_avg", exp_avg, KINDS), ("exp_avg_sq", exp_avg_sq, KINDS))
    for name, t, dtypes in checks:
        if t.numel() != n or t.dtype not in dtypes or t.device != param.device or not t.is_contiguous():
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(
                f"adamw_run: {name} must be a contiguous tensor ({allowed}) of {n} elements on {param.device}"
            )
    if out is not None and (out.numel() != n or out.dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"adamw_run: out must be a bf16 or fp16 tensor of {n} elements")
    if (is_fp8(exp_avg.dtype) or is_fp8(exp_avg_sq.dtype)) and blocks is None:
        blocks = ScaleBlocks([n], param.device)
    for name, t, scale in (("exp_avg", exp_avg, scales[0]), ("exp_avg_sq", exp_avg_sq, scales[1])):
        if is_fp8(t.dtype) and (
            blocks.numel != n
            or scale is None
            or scale.dtype != torch.float32
            or scale.numel() != blocks.count
            or not scale.is_contiguous()
        ):
            raise ValueError(f"adamw_run: an fp8 {name} needs a contiguous fp32 scale per block ({n} elements)")
    if backend == "auto":
        backend = "triton" if triton_usable(param) else "torch"
    if n == 0:
        return backend
    if backend == "triton":
        _triton_run(param, grad, exp_avg, exp_avg_sq, scalars, coef, out, scales, blocks, remainder)
    elif remainder is not None:  # the fp32 master joined, stepped, and split back
        master = join_master(param, remainder)
        _torch_run(master, grad, exp_avg, exp_avg_sq, scalars, coef, None, scales, blocks)
        write_master(param, remainder, master)
    else:
        _torch_run(param, grad, exp_avg, exp_avg_sq, scalars, coef, out, scales, blocks)
    return backend


def _torch_run(param, grad, exp_avg, exp_avg_sq, s: AdamWScalars, coef, out, scales=(None, None), blocks=None) -> None:
    """The reference implementation: one IEEE-rounded fp32 operation at a time, in the kernel's order. The moments
    are loaded into fp32 (exactly: an upcast, times a power of two for fp8), updated in fp32, used in fp32 for the
    update, and rounded to their dtype once, when stored (round to nearest even)."""
    if isinstance(s, torch.Tensor):
        s = _TensorScalars(s)
    g = grad if grad.dtype == torch.float32 else grad.float()
    if coef is not None:
        g = g * coef
    m = load_moment(exp_avg, scales[0], blocks)  # exp_avg itself where it is fp32 (updated in place)
    v = load_moment(exp_avg_sq, scales[1], blocks)
    param.mul_(s.decay)
    m.mul_(s.beta1).add_(g * s.one_minus_beta1)
    v.mul_(s.beta2).add_((g * g).mul_(s.one_minus_beta2))
    denom = _sqrt_rn(v).mul_(s.inv_bc2_sqrt).add_(s.eps)
    param.sub_(torch.div(m, denom).mul_(s.step_size))
    store_moment(exp_avg, m, scales[0], blocks)
    store_moment(exp_avg_sq, v, scales[1], blocks)
    if out is not None:
        out.copy_(param)


def load_moment(stored: torch.Tensor, scale: torch.Tensor | None, blocks: ScaleBlocks | None) -> torch.Tensor:
    """A moment's values in fp32: `stored` itself when it is fp32, its exact upcast otherwise (an fp8 value times
    its block's power-of-two scale, which is exact too)."""
    if stored.dtype == torch.float32:
        return stored
    values = stored.float()
    if is_fp8(stored.dtype):
        values.mul_(scale[blocks.ids])
    return values


def store_moment(stored: torch.Tensor, values: torch.Tensor, scale: torch.Tensor | None, blocks) -> None:
    """Round fp32 `values` into `stored`'s dtype (to nearest even); for fp8, first give each block the power-of-two
    scale that maps its largest magnitude into the format's range (`pow2_scale`), and divide by it (exactly)."""
    if values is stored:
        return
    if not is_fp8(stored.dtype):
        stored.copy_(values)
        return
    amax = torch.zeros(blocks.count, dtype=torch.float32, device=values.device)
    amax.scatter_reduce_(0, blocks.ids, values.abs(), "amax")
    new_scale, inverse = pow2_scale(amax, stored.dtype)
    stored.copy_(values.mul_(inverse[blocks.ids]))
    scale.copy_(new_scale)


def pow2_scale(amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest power of two `s` with `amax <= fmax * s` (fmax: the fp8 format's largest finite value), and
    `1 / s`, both exact fp32, from the bits of `amax` (the kernel computes the same with the same integer steps).
    Clamped to 2**±126, so that both are normal floats; a zero block gets 2**-126."""
    fmax, top = FP8_MAX[dtype]
    e = (amax.view(torch.int32) >> 23) - (127 + top)  # floor(log2 amax) - floor(log2 fmax)
    e = e.clamp(-126, 126)
    e = torch.where(amax > fmax * _exp2(e), e + 1, e).clamp(max=126)
    return _exp2(e), _exp2(-e)


def _exp2(e: torch.Tensor) -> torch.Tensor:
    """2**e as fp32, exactly, for int32 `e` in [-126, 127]."""
    return ((e + 127) << 23).view(torch.float32)


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root. CUDA's is; torch's vectorised CPU one is not (about one element in
    five is 1 ulp off on AVX2), so on the CPU it is taken in double and rounded once more, which is exact for
    square roots of floats (double has more than twice float's precision)."""
    return x.sqrt() if x.is_cuda else x.double().sqrt().float()


def _kernel_view(t: torch.Tensor) -> torch.Tensor:
    """What the kernel is given for a moment: bf16 as its int16 bits (loaded and rounded by integer steps)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _triton_run(
    param, grad, exp_avg, exp_avg_sq, s: AdamWScalars, coef, out, scales=(None, None), blocks=None, remainder=None
):
    n = param.numel()
    has_remainder = remainder is not None
    r_arg = remainder if has_remainder else grad  # a placeholder pointer where the master is fp32
    if has_remainder:
        param = param.view(torch.int16)  # the master's upper half, as bits
    bf16 = out is not None and out.dtype == torch.bfloat16
    out_arg = out.view(torch.int16) if bf16 else (out if out is not None else param)
    coef_arg = coef if coef is not None else param
    m_kind, v_kind = KINDS[exp_avg.dtype], KINDS[exp_avg_sq.dtype]
    on_device = isinstance(s, torch.Tensor)
    if on_device:  # read from the tensor by the kernel; the float arguments are placeholders
        scalars, s_arg = (0.0,) * 8, s
    else:
        scalars = (s.decay, s.beta1, s.one_minus_beta1, s.beta2, s.one_minus_beta2, s.step_size, s.inv_bc2_sqrt, s.eps)
        s_arg = param  # a placeholder pointer
    flags = {"HAS_COEF": coef is not None, "HAS_OUT": out is not None, "OUT_BF16": bf16, "M_KIND": m_kind}
    flags["DEVICE_SCALARS"] = on_device
    flags["REMAINDER"] = has_remainder
    flags.update(V_KIND=v_kind, num_warps=NUM_WARPS, enable_fp_fusion=False)  # one rounding per operation
    m_arg, v_arg = _kernel_view(exp_avg), _kernel_view(exp_avg_sq)
    if m_kind < 3 and v_kind < 3:
        grid = (triton.cdiv(n, BLOCK),)
        _adamw_kernel[grid](
            param, r_arg, grad, m_arg, v_arg, out_arg, coef_arg, s_arg, n, *scalars, BLOCK=BLOCK, **flags
        )
        return
    m_scale = scales[0] if scales[0] is not None else param  # a placeholder pointer where the moment has no scale
    v_scale = scales[1] if scales[1] is not None else param
    rows = BLOCK // blocks.block
    for table, whole in ((blocks.whole, True), (blocks.short, False)):
        if table.count == 0:
            continue
        _adamw_blocks_kernel[(triton.cdiv(table.count, rows),)](
            param,
            r_arg,
            grad,
            m_arg,
            v_arg,
            out_arg,
            coef_arg,
            s_arg,
            m_scale,
            v_scale,
            table.starts,
            table.lens,
            table.ids,
            table.count,
            *scalars,
            M_MAX=FP8_MAX[exp_avg.dtype][0] if m_kind >= 3 else 0.0,
            M_TOP=FP8_MAX[exp_avg.dtype][1] if m_kind >= 3 else 0,
            V_MAX=FP8_MAX[exp_avg_sq.dtype][0] if v_kind >= 3 else 0.0,
            V_TOP=FP8_MAX[exp_avg_sq.dtype][1] if v_kind >= 3 else 0,
            ROWS=rows,
            SB=blocks.block,
            WHOLE=whole,
            ALIGNED=whole and blocks.whole_aligned,
            **flags,
        )


if triton is not None:

    @triton.jit
    def _bf16_bits(x):
        """fp32 -> bf16 bits, round to nearest even on the bits (as torch's cast does; NaN to the canonical NaN)."""
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
        return tl.where(x != x, 0x7FC0, rounded)

    @triton.jit
    def _load_master(p_ptr, r_ptr, offs, mask, REMAINDER: tl.constexpr):
        """The fp32 master: loaded, or joined from its bf16 upper half (int16 bits) and int16 remainder
        (`param_remainders.join_master`)."""
        if REMAINDER:
            high = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32)
            low = tl.load(r_ptr + offs, mask=mask, other=0).to(tl.int32)
            high = tl.where(low < 0, high - 1, high)
            return ((high << 16) | (low & 0xFFFF)).to(tl.float32, bitcast=True)
        else:
            return tl.load(p_ptr + offs, mask=mask, other=0.0)

    @triton.jit
    def _store_master(p_ptr, r_ptr, offs, p, mask, REMAINDER: tl.constexpr):
        """Store the fp32 master, or split it (`param_remainders.split_master`: the upper half rounded to nearest,
        ties away from zero; a NaN as the canonical bf16 NaN)."""
        if REMAINDER:
            bits = p.to(tl.int32, bitcast=True)
            low = bits & 0xFFFF
            high = (bits >> 16) + tl.where(low >= 0x8000, 1, 0)
            high = tl.where(p != p, 0x7FC0, high)
            tl.store(p_ptr + offs, high.to(tl.int16), mask=mask)
            tl.store(r_ptr + offs, low.to(tl.int16), mask=mask)
        else:
            tl.store(p_ptr + offs, p, mask=mask)

    @triton.jit
    def _load_moment(ptr, offs, mask, KIND: tl.constexpr):
        """A moment of kind 0-2 (fp32, bf16 as int16 bits, fp16) upcast to fp32 in registers (exact)."""
        if KIND == 1:
            bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
            return (bits << 16).to(tl.float32, bitcast=True)
        else:
            return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _store_moment(ptr, offs, x, mask, KIND: tl.constexpr):
        """Store fp32 `x` as a moment of kind 0-2, rounded to nearest even."""
        if KIND == 1:
            tl.store(ptr + offs, _bf16_bits(x), mask=mask)
        elif KIND == 2:
            tl.store(ptr + offs, x.to(tl.float16, fp_downcast_rounding="rtne"), mask=mask)
        else:
            tl.store(ptr + offs, x, mask=mask)

    @triton.jit
    def _exp2_bits(e):
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _store_fp8(ptr, scale_ptr, rows, row_mask, offs, x, mask, FMAX: tl.constexpr, TOP: tl.constexpr):
        """`pow2_scale` and the store of `store_moment`, per row (one scale block) of the tile `x`."""
        amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)
        e = (amax.to(tl.int32, bitcast=True) >> 23) - (127 + TOP)
        e = tl.minimum(tl.maximum(e, -126), 126)
        e = tl.where(amax > FMAX * _exp2_bits(e), e + 1, e)
        e = tl.minimum(e, 126)
        q = (x * _exp2_bits(-e)[:, None]).to(ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(ptr + offs, q, mask=mask)
        tl.store(scale_ptr + rows, _exp2_bits(e), mask=row_mask)

    @triton.jit
    def _adamw_math(p, g, m, v, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bc2_sqrt, eps):
        p = p * decay
        m = m * beta1 + g * one_minus_beta1
        v = v * beta2 + (g * g) * one_minus_beta2
        denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
        p = p - tl.div_rn(m, denom) * step_size
        return p, m, v

    @triton.jit
    def _load_scalars(s_ptr):
        """The 8 scalars of a `device_scalars` row, in `SCALAR_FIELDS` order."""
        return (
            tl.load(s_ptr + 0), tl.load(s_ptr + 1), tl.load(s_ptr + 2), tl.load(s_ptr + 3),
            tl.load(s_ptr + 4), tl.load(s_ptr + 5), tl.load(s_ptr + 6), tl.load(s_ptr + 7),
        )  # fmt: skip

    @triton.jit
    def _store_out(out_ptr, offs, p, mask, OUT_BF16: tl.constexpr):
        if OUT_BF16:
            tl.store(out_ptr + offs, _bf16_bits(p), mask=mask)
        else:
            tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _adamw_kernel(
        p_ptr,
        r_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        out_ptr,
        coef_ptr,
        s_ptr,
        n,
        decay,
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        step_size,
        inv_bc2_sqrt,
        eps,
        HAS_COEF: tl.constexpr,
        HAS_OUT: tl.constexpr,
        OUT_BF16: tl.constexpr,
        M_KIND: tl.constexpr,
        V_KIND: tl.constexpr,
        DEVICE_SCALARS: tl.constexpr,
        REMAINDER: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Moments in fp32, bf16 or fp16: BLOCK consecutive elements per program. DEVICE_SCALARS: the scalars are
        read from `s_ptr` (a `device_scalars` row), not the float arguments."""
        if DEVICE_SCALARS:
            decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bc2_sqrt, eps = _load_scalars(s_ptr)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = _load_master(p_ptr, r_ptr, offs, mask, REMAINDER)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        m = _load_moment(m_ptr, offs, mask, M_KIND)
        v = _load_moment(v_ptr, offs, mask, V_KIND)
        if HAS_COEF:
            g = g * tl.load(coef_ptr)
        p, m, v = _adamw_math(
            p, g, m, v, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bc2_sqrt, eps
        )
        _store_master(p_ptr, r_ptr, offs, p, mask, REMAINDER)
        _store_moment(m_ptr, offs, m, mask, M_KIND)
        _store_moment(v_ptr, offs, v, mask, V_KIND)
        if HAS_OUT:
            _store_out(out_ptr, offs, p, mask, OUT_BF16)

    @triton.jit
    def _adamw_blocks_kernel(
        p_ptr,
        r_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        out_ptr,
        coef_ptr,
        s_ptr,
        ms_ptr,
        vs_ptr,
        starts_ptr,
        lens_ptr,
        ids_ptr,
        count,
        decay,
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        step_size,
        inv_bc2_sqrt,
        eps,
        HAS_COEF: tl.constexpr,
        HAS_OUT: tl.constexpr,
        OUT_BF16: tl.constexpr,
        M_KIND: tl.constexpr,
        V_KIND: tl.constexpr,
        DEVICE_SCALARS: tl.constexpr,
        REMAINDER: tl.constexpr,
        M_MAX: tl.constexpr,
        M_TOP: tl.constexpr,
        V_MAX: tl.constexpr,
        V_TOP: tl.constexpr,
        ROWS: tl.constexpr,
        SB: tl.constexpr,
        WHOLE: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        """Some moment in fp8: a tile of ROWS scale blocks (one row each, SB elements at most) per program, so each
        block's amax is a row reduction in registers and its scale is computed and stored by this program. WHOLE:
        every block of the table has SB elements, so the mask is per row and the loads can be vectorised; ALIGNED:
        every start is a multiple of 16 elements. DEVICE_SCALARS: as in `_adamw_kernel`."""
        if DEVICE_SCALARS:
            decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bc2_sqrt, eps = _load_scalars(s_ptr)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < count
        starts = tl.load(starts_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        if ALIGNED:
            starts = tl.multiple_of(starts, 16)
        blk = tl.load(ids_ptr + rows, mask=row_mask, other=0)
        cols = tl.arange(0, SB)
        offs = starts[:, None] + cols[None, :]
        if WHOLE:
            mask = tl.broadcast_to(row_mask[:, None], (ROWS, SB))
        else:
            lens = tl.load(lens_ptr + rows, mask=row_mask, other=0)
            mask = cols[None, :] < lens[:, None]
        p = _load_master(p_ptr, r_ptr, offs, mask, REMAINDER)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if M_KIND >= 3:
            m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            m = m * tl.load(ms_ptr + blk, mask=row_mask, other=1.0)[:, None]
        else:
            m = _load_moment(m_ptr, offs, mask, M_KIND)
        if V_KIND >= 3:
            v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            v = v * tl.load(vs_ptr + blk, mask=row_mask, other=1.0)[:, None]
        else:
            v = _load_moment(v_ptr, offs, mask, V_KIND)
        if HAS_COEF:
            g = g * tl.load(coef_ptr)
        p, m, v = _adamw_math(
            p, g, m, v, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bc2_sqrt, eps
        )
        _store_master(p_ptr, r_ptr, offs, p, mask, REMAINDER)
        if M_KIND >= 3:
            _store_fp8(m_ptr, ms_ptr, blk, row_mask, offs, m, mask, M_MAX, M_TOP)
        else:
            _store_moment(m_ptr, offs, m, mask, M_KIND)
        if V_KIND >= 3:
            _store_fp8(v_ptr, vs_ptr, blk, row_mask, offs, v, mask, V_MAX, V_TOP)
        else:
            _store_moment(v_ptr, offs, v, mask, V_KIND)
        if HAS_OUT:
            _store_out(out_ptr, offs, p, mask, OUT_BF16)
