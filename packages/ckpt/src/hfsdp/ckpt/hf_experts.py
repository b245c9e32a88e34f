"""Mixture-of-experts weights as transformers 5 stores them on disk, read as the fused tensors its models hold.

transformers 5 keeps an MoE layer's experts in two 3-D parameters,
`...experts.gate_up_proj` [E, 2F, H] and `...experts.down_proj` [E, H, F], but
`save_pretrained` writes them per expert, as the 2-D weights earlier releases
held: `experts.{e}.w1/w3/w2.weight` under `block_sparse_moe` (Mixtral) or
`experts.{e}.gate_proj/up_proj/down_proj.weight` (Qwen2-MoE, Qwen3-MoE, OLMoE
and the other families built like them). Its loader fuses them by stacking
each list over the experts and concatenating gate and up along dim 1. In
row-major order that is a plain concatenation: the fused tensor's data is, for
expert 0, 1, ..., that expert's gate weight then its up weight (down: its down
weight). So an import reads a fused tensor as its parts one after the other,
each a contiguous span of its file, and needs no memory for the fusion.

Only the two layouts above are recognised; any other on-disk naming is left
alone, and the import then names the tensor it misses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hfsdp.ckpt.hf_dir import HFDir, HFTensor

#: fused parameter suffix -> the per-expert tensors it is made of, one tuple per family's naming
FUSED_EXPERTS = {
    "experts.gate_up_proj": (("w1.weight", "w3.weight"), ("gate_proj.weight", "up_proj.weight")),
    "experts.down_proj": (("w2.weight",), ("down_proj.weight",)),
}
#: module path in the model -> the path older checkpoints use for it (Mixtral's `block_sparse_moe`)
MODULE_RENAMES = ((".mlp.", ".block_sparse_moe."),)


@dataclass(frozen=True)
class HFConcat:
    """A tensor whose flattened data is `parts`' flattened data one after the other (all of one dtype)."""

    parts: tuple[HFTensor, ...]
    dtype: str
    shape: tuple[int, ...]

    @property
    def file(self) -> str:
        files = sorted({p.file for p in self.parts})
        return files[0] if len(files) == 1 else f"{files[0]} (and {len(files) - 1} more files)"


def fuse_expert_weights(hf: HFDir, parameters: dict[str, tuple[int, ...]]) -> HFDir:
    """`hf` with each parameter it lacks, but holds per expert or under an older module name, put together
    from those tensors (which then leave the listing). Parameters found neither way stay missing."""
    tensors = dict(hf.tensors)
    for name, shape in parameters.items():
        if name in tensors:
            continue
        found = _renamed(name, tensors) or _per_expert(name, shape, tensors)
        if found is None:
            continue
        sources, tensor = found
        for source in sources:
            del tensors[source]
        tensors[name] = tensor
    return dataclasses.replace(hf, tensors=tensors)


def _prefixes(name: str) -> list[str]:
    out = [name]
    for new, old in MODULE_RENAMES:
        if new in name:
            out.append(name.replace(new, old))
    return out


def _renamed(name: str, tensors: dict) -> tuple[list[str], HFTensor] | None:
    for candidate in _prefixes(name)[1:]:
        if candidate in tensors:
            return [candidate], tensors[candidate]
    return None


def _per_expert(name: str, shape: tuple[int, ...], tensors: dict) -> tuple[list[str], HFConcat] | None:
    suffix = next((s for s in FUSED_EXPERTS if name.endswith("." + s)), None)
    if suffix is None or len(shape) != 3:
        return None
    experts = shape[0]
    for module in _prefixes(name[: -len(suffix)]):
        for naming in FUSED_EXPERTS[suffix]:
            sources = [f"{module}experts.{e}.{part}" for e in range(experts) for part in naming]
            if not all(s in tensors for s in sources):
                continue
            parts = tuple(tensors[s] for s in sources)
            dtypes = {p.dtype for p in parts}
            rows, left = divmod(shape[1], len(naming))
            if left or len(dtypes) != 1 or any(tuple(p.shape) != (rows, shape[2]) for p in parts):
                continue  # not the model's experts: the import reports the parameter as missing
            return sources, HFConcat(parts, dtypes.pop(), shape)
    return None


def missing_hint(name: str) -> str:
    """What an import looks for when a fused expert parameter is missing ('' for any other parameter)."""
    suffix = next((s for s in FUSED_EXPERTS if name.endswith("." + s)), None)
    if suffix is None:
        return ""
    module = name[: -len(suffix)]
    namings = " or ".join("/".join(naming) for naming in FUSED_EXPERTS[suffix])
    return (
        f" It is read from one tensor per expert, {module}experts.<e>.{{{namings}}} (also under "
        f"{_prefixes(module)[-1]} for Mixtral), and at least one of them is missing or has another shape or dtype."
    )
