"""Which Linear layers multiply in fp8, and turning them into `Float8Linear` in place.

Only `nn.Linear` layers inside the given units (the transformer layers: attention and MLP projections)
are converted. Embeddings, norms and the output layer stay in the compute dtype: they sit outside the
units, and the output layer's logits are where fp8's error would cost most. Inside the units, MoE
routers (a Linear named `gate` or `router`) stay too: their few FLOPs decide which expert gets a token.
A layer is converted by changing its class, so it keeps its parameters, their names (checkpoints and
Hugging Face exports do not change), its hooks and its place in the model.

Only layers large enough to gain are converted. Per token, an fp8 layer saves a share of its
`in x out` multiply-adds and pays casts of its input and output gradient that grow with `in + out`;
so what decides is `in * out / (in + out)` (half the harmonic mean of the two). Measured on one H200
(compiled, 8,192 tokens; docs/benchmarks.md): at 819 (a 4096 -> 1024 k/v projection) fp8 took 1.6x bf16's
time, at 1,536 (3072 x 3072) 1.5x, at 2,048 (4096 x 4096) it was 1.27x faster, at 2,234 (3072 x 8192)
1.23x and at 3,186 (4096 x 14336) 1.5x. `min_size=2048` (the default) converts from there on; 0 converts
every layer whose dims fit, as tests on small models do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

from hfsdp.core.fp8.config import Float8Config
from hfsdp.core.fp8.linear import Float8Linear

ROUTER_NAMES = ("gate", "router")


@dataclass
class Float8Conversion:
    """What `convert_to_float8` did: the converted layers' names, and each skipped Linear's reason."""

    config: Float8Config
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """One line for a run's start."""
        total = len(self.converted) + len(self.skipped)
        if total == 0:
            return (
                f"fp8 ({self.config.format}, {self.config.recipe}): the units hold no torch.nn.Linear layer, so "
                "nothing multiplies in fp8 (a megatron-core GPT's parallel linears are its own classes, which need "
                "TransformerEngine for fp8)"
            )
        line = (
            f"fp8 ({self.config.format}, {self.config.recipe}): {len(self.converted)} of {total} Linear layers "
            "in the units multiply in fp8"
        )
        if self.skipped:
            reasons = sorted(set(self.skipped.values()))
            line += f"; {len(self.skipped)} stay in the compute dtype ({'; '.join(reasons)})"
        return line


DEFAULT_MIN_SIZE = 2048


def size_of(module: nn.Linear) -> float:
    """in * out / (in + out): what an fp8 matmul saves per token over what its casts cost (module docstring)."""
    return module.in_features * module.out_features / (module.in_features + module.out_features)


def skip_reason(name: str, module: nn.Linear, min_size: float = DEFAULT_MIN_SIZE) -> str | None:
    """Why the Linear `module` (named `name`) stays in the compute dtype, or None to convert it."""
    if name.rsplit(".", 1)[-1] in ROUTER_NAMES:
        return "MoE routers"
    if module.in_features % 16 or module.out_features % 16:
        return "features not multiples of 16, which fp8 matmuls need"
    if size_of(module) < min_size:
        return f"too small to gain: in*out/(in+out) below {min_size:g}"
    return None


def convert_to_float8(
    model: nn.Module,
    config: Float8Config,
    *,
    units: Iterable[nn.Module],
    module_filter: Callable[[str, nn.Linear], bool] | None = None,
    min_size: float = DEFAULT_MIN_SIZE,
) -> Float8Conversion:
    """Make the `nn.Linear` layers inside `units` multiply in fp8 (in place; call before `fully_shard` and before
    compiling). Layers with `in*out/(in+out)` below `min_size` stay in the compute dtype (0: none does);
    `module_filter(name, linear)` may keep more of them (False: keep)."""
    if not isinstance(config, Float8Config):
        raise TypeError(f"convert_to_float8 takes a Float8Config, not {type(config).__name__}")
    names = {id(m): n for n, m in model.named_modules()}
    conversion = Float8Conversion(config)
    seen: set[int] = set()
    for unit in units:
        if id(unit) not in names:
            raise ValueError("convert_to_float8: a unit passed in `units` is not a submodule of `model`.")
        for module in unit.modules():
            if id(module) in seen or type(module) not in (nn.Linear, Float8Linear):
                continue
            seen.add(id(module))
            name = names[id(module)]
            reason = skip_reason(name, module, min_size)
            if reason is None and module_filter is not None and not module_filter(name, module):
                reason = "kept by module_filter"
            if reason is not None:
                conversion.skipped[name] = reason
                continue
            module.__class__ = Float8Linear
            module.fp8_config = config
            conversion.converted.append(name)
    return conversion
