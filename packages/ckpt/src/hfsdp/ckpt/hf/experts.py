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

Export goes the other way, as `save_pretrained` does: a fused tensor is
written as its per-expert parts, each a flat range of it, under the names
transformers uses for that model type on disk. Those names come from
transformers' own conversion mapping (`disk_naming`), accepted only when it
consists of the renames and per-expert layouts above; for anything else the
fused names are written, which transformers 5 loads as they are.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hfsdp.ckpt.hf.directory import HFDir, HFTensor

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
            sources = _expert_names(module, experts, naming)
            if not all(s in tensors for s in sources):
                continue
            parts = tuple(tensors[s] for s in sources)
            dtypes = {p.dtype for p in parts}
            rows, left = divmod(shape[1], len(naming))
            if left or len(dtypes) != 1 or any(tuple(p.shape) != (rows, shape[2]) for p in parts):
                continue  # not the model's experts: the import reports the parameter as missing
            return sources, HFConcat(parts, dtypes.pop(), shape)
    return None


def _expert_names(module: str, experts: int, naming: tuple[str, ...]) -> list[str]:
    """The per-expert tensor names of one fused parameter, in the order of its data: expert by expert."""
    return [f"{module}experts.{e}.{part}" for e in range(experts) for part in naming]


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


# Export ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiskNaming:
    """How one model type's experts are named on disk: module renames (model path, disk path), and the
    per-expert tensor names of each fused parameter suffix."""

    renames: tuple[tuple[str, str], ...]
    parts: dict[str, tuple[str, ...]]

    def disk_name(self, name: str) -> str:
        for model_path, disk_path in self.renames:
            name = name.replace(model_path, disk_path)
        return name

    def split(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], int, int]] | None:
        """A fused expert parameter as (disk name, shape, first, stop) of its flattened data, expert by expert;
        None for any other parameter."""
        suffix = next((s for s in self.parts if name.endswith("." + s)), None)
        if suffix is None or len(shape) != 3:
            return None
        naming = self.parts[suffix]
        rows = shape[1] // len(naming)
        numel = rows * shape[2]
        names = _expert_names(self.disk_name(name[: -len(suffix)]), shape[0], naming)
        assert len(names) * numel == math.prod(shape)
        return [(part, (rows, shape[2]), i * numel, (i + 1) * numel) for i, part in enumerate(names)]


def disk_naming(model_type: str) -> DiskNaming | None:
    """The on-disk expert naming of `model_type`, read from transformers' conversion mapping; None when it has
    none or has a rule other than the renames and per-expert layouts this module knows."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        rules = get_checkpoint_conversion_mapping(model_type) or []
    except Exception:  # an older or newer transformers without this mapping: write the fused names
        return None
    renames, parts = [], {}
    for rule in rules:
        sources, targets = _patterns(rule, "source_patterns"), _patterns(rule, "target_patterns")
        if len(targets) != 1:
            return None
        if type(rule).__name__ == "WeightRenaming":
            if len(sources) != 1 or (targets[0], sources[0]) not in MODULE_RENAMES:
                return None
            renames.append((targets[0], sources[0]))
            continue
        suffix = next((s for s in FUSED_EXPERTS if targets[0].endswith(s)), None)
        names = tuple(src.split("experts.*.", 1)[-1] for src in sources)
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(rule, "operations", [])]
        expected_ops = [("MergeModulelist", 0)] + ([("Concatenate", 1)] if len(names) > 1 else [])
        if suffix is None or names not in FUSED_EXPERTS[suffix] or ops != expected_ops:
            return None
        parts[suffix] = names
    return DiskNaming(tuple(renames), parts) if parts else None


def _patterns(rule, attribute: str) -> list[str]:
    value = getattr(rule, attribute, None)
    return [value] if isinstance(value, str) else list(value or [])
