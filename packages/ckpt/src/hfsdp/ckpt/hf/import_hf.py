"""Import: a Hugging Face `save_pretrained` directory as an hfsdp checkpoint of any layout.

The result is what an online save of the same model, sharded with
`fully_shard(model, cfg, meshes, units=hf.decoder_layers(model))`, would write
at step 0 without an optimizer: the same groups, files, pieces and order
(`hf_model.skeleton` derives them from config.json on the meta device), kinds
"model" (the compute dtype) and "main" (fp32, cast from the file's dtype), no
optimizer state, and the model record `{"format": "transformers", "config":
config.to_dict()}` so that `export --format hf` can write it back. A training
run loads it with `load_checkpoint(path, model, optimizer=None)` and starts its
optimizer fresh.

The directory is untrusted input (`hf_dir.py`), and it must hold exactly the
model's tensors: every one config.json's model has, with its shape, and no
other (a tied weight's second name, which some tools write, is accepted when
its shape is right and left out, as transformers ties it again). Mixture-of-
experts weights that transformers saves per expert are read as the fused
tensors the model holds (`hf_experts.py`). Weights are
streamed within the memory budget (`hf_source.py` through `build.write_layout`),
into a hidden directory next to DST, read back and checksummed, then renamed
into place: no failure leaves a DST, and the source is never written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.index import MAIN, MODEL, TRANSFORMERS, UNSHARDED, CheckpointIndex, meshes_of
from hfsdp.ckpt.format.index_file import write_index
from hfsdp.ckpt.format.model_record import checked_record
from hfsdp.ckpt.format.staging import check_apart, ensure_absent, staged_dir
from hfsdp.ckpt.hf.directory import HFDir, read_hf_dir
from hfsdp.ckpt.hf.experts import fuse_expert_weights, missing_hint
from hfsdp.ckpt.hf.model import Skeleton, skeleton
from hfsdp.ckpt.hf.source import HFSource
from hfsdp.ckpt.tensors.build import Progress, write_layout
from hfsdp.core.rules.config import LayoutConfig

#: Weights must be floating point: a quantized checkpoint's integer codes are not weights.
FLOAT_CODES = ("F64", "F32", "F16", "BF16")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ImportResult:
    source: Path
    destination: Path
    bytes_written: int
    files: int
    tensors: int
    seconds: float


def import_hf(
    src: str | Path,
    dst: str | Path,
    layout_config: LayoutConfig,
    *,
    compute_dtype: str = "float32",
    io_threads: int = 4,
    memory_budget_bytes: int = 256 << 20,
    progress: Progress | None = None,
    verify_result: bool = True,
) -> ImportResult:
    """Write the `save_pretrained` directory `src` as the checkpoint directory `dst` of layout `layout_config`.

    `compute_dtype` ("float32", "bfloat16" or "float16") is the dtype of the
    "model" kind and of the groups, as the training run's mixed precision has
    it; the fp32 main weights, which a load reads, do not depend on it.
    """
    started = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if compute_dtype not in COMPUTE_DTYPES:
        raise CheckpointError(f"Compute dtype '{compute_dtype}' is not supported; use one of {COMPUTE_DTYPES}.")
    check_apart([src], dst, "import")
    ensure_absent(dst, "import")
    hf = read_hf_dir(src)
    model = skeleton(hf.config, str(src / "config.json"), hf.tensors, compute_dtype)
    hf = fuse_expert_weights(hf, model.parameters)
    _check_tensors(hf, model)
    record = checked_record({"format": TRANSFORMERS, "config": model.config.to_dict()})
    dtypes = {
        (kind, name): dtype for name in model.parameters for kind, dtype in ((MODEL, compute_dtype), (MAIN, "float32"))
    }
    dtypes.update(((UNSHARDED, name), entry.dtype) for name, entry in model.unsharded.items())

    with staged_dir(dst, "import") as tmp:
        tensors, unsharded, files = write_layout(
            tmp,
            layout_config,
            model.groups,
            [MODEL, MAIN],
            dtypes,
            lambda: HFSource(hf, dtypes),
            unsharded=model.unsharded,
            io_threads=io_threads,
            memory_budget_bytes=memory_budget_bytes,
            progress=progress,
            verify_written=verify_result,
        )
        index = CheckpointIndex(
            step=0,
            layout=layout_config.to_dict(),
            meshes=meshes_of(layout_config),
            extra={},
            optimizer=None,
            groups=model.groups,
            tensors=tensors,
            files=files,
            order=model.order,
            unsharded=unsharded,
            model=record,
        )
        write_index(tmp, index)
    total = sum(f.bytes for f in files.values())
    return ImportResult(src, dst, total, len(files), len(model.order), time.perf_counter() - started)


def _check_tensors(hf: HFDir, model: Skeleton) -> None:
    """The directory holds exactly the model's tensors (tied aliases aside), with its shapes, in floating point."""
    expected = model.shapes()
    what = f"the {model.architecture} its config.json describes"
    fix = (
        "The weights belong to another model, the directory is incomplete, or transformers renames these weights "
        "while loading in a way an import does not know (legacy names); pass a complete directory "
        "whose files use the model's own parameter names."
    )
    missing = [name for name in expected if name not in hf.tensors]
    if missing:
        raise CheckpointError(
            f"The Hugging Face directory {hf.path} has no tensor {missing[0]!r}, which {what} has "
            f"({len(missing)} missing in all).{missing_hint(missing[0])} {fix}"
        )
    for name, tensor in hf.tensors.items():
        shape = expected.get(name)
        if shape is None and name in model.aliases:
            shape = expected[model.aliases[name]]
        where = hf.path / tensor.file
        if shape is None:
            extra = sum(1 for n in hf.tensors if n not in expected and n not in model.aliases)
            raise CheckpointError(
                f"{where} holds tensor {name!r}, which {what} does not have ({extra} unexpected in all); an import "
                f"takes exactly the model's tensors. {fix}"
            )
        if tensor.shape != shape:
            raise CheckpointError(
                f"Tensor {name!r} in {where} has shape {list(tensor.shape)}, but {what} has {list(shape)}. {fix}"
            )
        if name in model.parameters and tensor.dtype not in FLOAT_CODES:
            raise CheckpointError(
                f"Tensor {name!r} in {where} is {tensor.dtype}, but weights must be floating point "
                f"({', '.join(FLOAT_CODES)}): quantized weights cannot be imported. Dequantize the model and "
                "save_pretrained it again."
            )
