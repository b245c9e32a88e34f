"""What `export --format hf` writes: the transformers config, and every HF tensor as flat ranges of the checkpoint's.

The checkpoint's model record says which model its weights are
(`model_record.py`):

- `"transformers"`: the names are already transformers' own (identity);
- `"megatron-gpt"`: a Llama-style GPT maps to `LlamaForCausalLM` through the
  adapter beside the GPT (`hfsdp.models.megatron.hf_adapter`), whose split
  tensors (QKV, fc1) are row ranges, i.e. flat ranges, of the checkpoint's; a GPT
  that is not a Llama is refused, naming the feature.

Either way the result is checked against the model transformers builds from
the config (`hf_model.skeleton`, on the meta device): the exported tensors
must be exactly its tensors with its shapes, so `from_pretrained` finds nothing
missing and nothing unexpected. They are written in its state-dict order, under
the names `save_pretrained` would write: fused mixture-of-experts tensors one
tensor per expert (`hf_experts.py`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.groups import model_order
from hfsdp.ckpt.format.index import TRANSFORMERS, CheckpointIndex
from hfsdp.ckpt.hf.experts import DiskNaming, disk_naming
from hfsdp.ckpt.hf.model import Skeleton, check_layer_count, skeleton

NO_RECORD = (
    "--format hf needs to know which model the weights are, and this checkpoint does not record it (it was saved "
    "without a model record, by an earlier hfsdp or without `model_record=`). Export it with --format megatron "
    "(the consolidated state dict, under the model's own names, without config.json) instead."
)


@dataclass(frozen=True)
class Mapped:
    """One exported tensor: its HF name and shape, and the flat ranges of checkpoint tensor `source` it is made
    of, concatenated."""

    name: str
    shape: tuple[int, ...]
    source: str
    ranges: tuple[tuple[int, int], ...]


def hf_plan(index: CheckpointIndex, src_dir: Path) -> tuple[Skeleton, list[Mapped]]:
    """The transformers model of the checkpoint and its tensors, or CheckpointError saying why there is none."""
    if index.model is None:
        raise CheckpointError(f"{src_dir}: {NO_RECORD}")
    saved = model_order(index)
    if index.model["format"] == TRANSFORMERS:
        config = index.model["config"]
        mapped = [Mapped(name, shape, name, ((0, math.prod(shape)),)) for name, shape in saved]
    else:
        config, mapped = _megatron_plan(index, src_dir, dict(saved))
    model = skeleton(config, f"the model record of {src_dir}", [m.name for m in mapped])
    _check_same(src_dir, model, {m.name: m.shape for m in mapped})
    position = {name: i for i, name in enumerate(model.order)}
    mapped.sort(key=lambda m: position[m.name])
    naming = disk_naming(model.config.model_type)
    return model, mapped if naming is None else [m for whole in mapped for m in _on_disk(whole, naming)]


def _on_disk(mapped: Mapped, naming: DiskNaming) -> list[Mapped]:
    """One exported tensor under the name transformers saves it with: a fused expert tensor as its per-expert
    tensors (flat ranges of it), anything else renamed where the model type renames its module on disk."""
    (start, _), *rest = mapped.ranges
    parts = naming.split(mapped.name, mapped.shape) if not rest else None
    if parts is None:
        return [dataclasses.replace(mapped, name=naming.disk_name(mapped.name))]
    return [Mapped(name, shape, mapped.source, ((start + a, start + b),)) for name, shape, a, b in parts]


def _megatron_plan(index, src_dir: Path, saved: dict[str, tuple[int, ...]]):
    from hfsdp.models.megatron.hf_adapter import UnmappableModel, llama_mapping

    check_layer_count(index.model["config"].get("num_layers"), saved, f"the model record of {src_dir}")
    try:
        mapping = llama_mapping(index.model["config"])
    except UnmappableModel as err:
        raise CheckpointError(f"{src_dir}: {err}") from None
    expected = mapping.megatron_shapes()
    problem = _difference(expected, saved)
    if problem:
        raise CheckpointError(
            f"The checkpoint {src_dir} does not hold the megatron GPT its model record describes: {problem}. The "
            "record and the weights disagree (a record of another model was passed when saving); export with "
            "--format megatron to get the weights under their own names."
        )
    mapped = []
    for name, shape in expected.items():
        row = math.prod(shape[1:])
        mapped += [Mapped(p.hf_name, p.shape, name, tuple(p.flat_ranges(row))) for p in mapping.parts(name)]
    return mapping.config, mapped


def _check_same(src_dir: Path, model: Skeleton, exported: dict[str, tuple[int, ...]]) -> None:
    problem = _difference(model.shapes(), exported)
    if problem:
        raise CheckpointError(
            f"The checkpoint {src_dir} does not hold the {model.architecture} its model record describes: {problem}, "
            "so transformers could not load the export. The record and the weights disagree; export with --format "
            "megatron to get the weights under their own names."
        )


def _difference(expected: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]]) -> str | None:
    """The first way `got` (name -> shape) differs from `expected`, in words; None if it does not."""
    missing = [n for n in expected if n not in got]
    if missing:
        return f"it lacks {missing[0]!r} ({len(missing)} missing in all)"
    unexpected = [n for n in got if n not in expected]
    if unexpected:
        return f"it has {unexpected[0]!r}, which the model lacks ({len(unexpected)} unexpected in all)"
    wrong = next((n for n in expected if tuple(got[n]) != tuple(expected[n])), None)
    if wrong is not None:
        return f"'{wrong}' has shape {list(got[wrong])} where the model has {list(expected[wrong])}"
    return None


def config_json(model: Skeleton, dtype: torch.dtype) -> str:
    """config.json of the export: the model's config as transformers writes it, naming the architecture and the
    exported dtype under both keys transformers has used for it (`dtype` since 5.0, `torch_dtype` before), so
    that either release loads the weights in that dtype with `dtype="auto"`."""
    config = model.config
    config.architectures = [model.architecture]
    data = json.loads(config.to_json_string(use_diff=True))
    data["dtype"] = data["torch_dtype"] = str(dtype).removeprefix("torch.")
    return json.dumps(data, indent=2, sort_keys=True) + "\n"
