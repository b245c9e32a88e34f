"""A model as the planner sees it: how many parameters each unit holds, and the sizes activations follow.

The engine shards a model unit by unit (each transformer layer, then the root with
everything else), and inside a unit groups parameters by mesh: dense parameters on the
dense mesh, expert parameters on the expert mesh. Padding is per group, so the planner
needs exactly these counts, not just the total. `gpt_shape.py` and `hf_shape.py` compute
them in closed form; tests check them against the real models built on the meta device.

With FP8 training (`convert_to_float8`, `fully_shard(fp8_param_gather=True)`) the weights of a
unit's converted Linear layers form a flat group of their own, gathered one byte per element;
each unit says how many elements and weights that is (`fp8`, `fp8_weights`, by `fp8_linears`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The families whose activations the planner models (docs/planning.md, "Activations").
MEGATRON_GPT = "megatron-gpt"
HF_FAMILIES = ("llama", "mistral", "qwen2", "mixtral")
#: fp8 matmuls take a Linear layer only when both its dims are multiples of this (`hfsdp.core.fp8.convert`).
FP8_MULTIPLE = 16
#: `hfsdp.core.fp8.convert`'s size rule, repeated here so that planning imports no torch (convert.py imports
#: torch.nn): a Linear layer is converted only when `fp8_size` reaches the run's min size (`--fp8-min-size`), by
#: default this, `DEFAULT_MIN_SIZE` there (tests/planning/test_plan_fp8.py checks that both agree).
FP8_MIN_SIZE = 2048


class ModelShapeError(ValueError):
    """A model description the planner cannot turn into parameter counts; the message says what to change."""


@dataclass(frozen=True)
class UnitParams:
    """The parameter elements of one unit: dense ones, and expert ones over all experts (a rank holds 1/ep).

    `active_matmul` is the weight elements one token multiplies on its way through the unit
    (the router's top-k experts only), which is what its FLOPs follow. `fp8` is the elements of
    the dense weights `convert_to_float8` would convert (the unit's Linear layers with both dims
    multiples of 16 and in*out/(in+out) at least the run's min size; no router, no bias),
    `fp8_weights` how many weights they are: with the fp8 gather they are a group of their own, and
    each weight has one amax in its all-reduce.
    """

    name: str
    dense: int
    expert: int = 0
    active_matmul: int = 0
    fp8: int = 0
    fp8_weights: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.expert


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only transformer and its units (layers first, the root last, as the engine orders them).

    `loss_inside` is true when the model computes its loss in its own forward (megatron-core),
    so the root's parameters are still gathered while the loss peaks.
    """

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    norm: str  # "LayerNorm" or "RMSNorm"
    gated: bool  # a gated MLP (SwiGLU): two input projections
    units: tuple[UnitParams, ...]
    experts: int | None = None
    topk: int = 0
    loss_inside: bool = False
    max_positions: int | None = None

    @property
    def params(self) -> int:
        """Every parameter, each expert counted once (tied embeddings once)."""
        return sum(u.total for u in self.units)

    @property
    def root(self) -> UnitParams:
        return self.units[-1]

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def describe(self) -> str:
        """`llama, 80 layers, hidden 8192, 70.55B parameters`: what a report names the model by."""
        moe = f", {self.experts} experts (top {self.topk})" if self.experts else ""
        return f"{self.family}, {self.layers} layers, hidden {self.hidden}{moe}, {billions(self.params)} parameters"


def fp8_size(out_features: int, in_features: int) -> float:
    """in * out / (in + out): what decides whether fp8 pays for a Linear layer (`hfsdp.core.fp8.convert.size_of`,
    the same expression, so the same float)."""
    return in_features * out_features / (in_features + out_features)


def fp8_linears(shapes: list[tuple[int, int]], min_size: float = FP8_MIN_SIZE) -> tuple[int, int]:
    """(elements, weights) of the Linear layers of (out_features, in_features) `shapes` that fp8 converts: those
    whose dims are both multiples of 16 and whose `fp8_size` is at least `min_size` (0: every one whose dims fit);
    the others stay in the compute dtype, as `convert_to_float8` leaves them."""
    taken = [o * i for o, i in shapes if o % FP8_MULTIPLE == 0 and i % FP8_MULTIPLE == 0 and fp8_size(o, i) >= min_size]
    return sum(taken), len(taken)


def billions(count: int) -> str:
    """A parameter count people read: 936,513,536 -> '0.94B'; 7,241,732 -> '7.24M'."""
    if count >= 10**9:
        return f"{count / 1e9:.2f}B"
    if count >= 10**6:
        return f"{count / 1e6:.2f}M"
    return f"{count:,}"
