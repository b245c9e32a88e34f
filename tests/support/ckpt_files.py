"""Checkpoints written without training, and the damage the error tests do to them."""

from __future__ import annotations

import torch

from hfsdp.ckpt.format.groups import retarget_groups
from hfsdp.ckpt.format.index import GroupSpec

from tests.support.ckpt_models import LR, NUM_EXPERTS, WEIGHT_DECAY

# -- synthetic checkpoints (one process, no training) -------------------------------------


def synthetic_groups(moe: bool, ep: int = 1) -> list[GroupSpec]:
    """The group structure of Toy / MoEToy for expert-parallel size `ep`."""

    def linear(prefix, n_in, n_out):
        return [(f"{prefix}.weight", (n_out, n_in)), (f"{prefix}.bias", (n_out,))]

    groups = []
    for i in range(2 if moe else 3):
        if moe:
            groups.append(GroupSpec(i, False, "float32", None, tuple(linear(f"layers.{i}.router", 16, NUM_EXPERTS))))
            experts = []
            for k in range(NUM_EXPERTS):
                experts += linear(f"layers.{i}.local_experts.{k}.fc1", 16, 11)
                experts += linear(f"layers.{i}.local_experts.{k}.fc2", 11, 16)
            groups.append(GroupSpec(i, True, "float32", 0, tuple(experts)))
        else:
            block = linear(f"layers.{i}.up", 16, 13) + linear(f"layers.{i}.down", 13, 16)
            groups.append(GroupSpec(i, False, "float32", None, tuple(block)))
    root = tuple(linear("inp", 8, 16) + linear("head", 16, 1))
    groups.append(GroupSpec(2 if moe else 3, False, "float32", None, root))
    return retarget_groups(groups, NUM_EXPERTS if moe else None, ep)


def synthetic_checkpoint(
    path, layout: dict, moe: bool = False, model_dtype=torch.bfloat16, seed: int = 0, extra: dict | None = None
):
    """Write a checkpoint of random tensors (model, main, exp_avg, exp_avg_sq, and the unsharded module tensors)
    for `layout`; returns them by kind ("unsharded" for the module tensors) and global name."""
    from hfsdp.ckpt import write_from_tensors
    from hfsdp.core.rules.config import LayoutConfig

    cfg = LayoutConfig(**layout)
    groups = synthetic_groups(moe, cfg.ep)
    dtype = str(model_dtype).removeprefix("torch.")
    groups = [GroupSpec(g.unit_index, g.is_expert, dtype, g.ep_rank, g.members) for g in groups]
    gen = torch.Generator().manual_seed(seed)
    shapes = {n: s for g in groups for n, s in g.members}
    main = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    tensors = {
        "model": {n: t.to(model_dtype) for n, t in main.items()},
        "main": main,
        "exp_avg": {n: torch.randn(s, generator=gen) for n, s in shapes.items()},
        "exp_avg_sq": {n: torch.rand(s, generator=gen) for n, s in shapes.items()},
    }
    unsharded = {
        "input_scale": torch.rand(8, generator=gen),
        "shift": torch.randn(16, generator=gen),
        "forward_calls": torch.tensor(3, dtype=torch.int64),
    }
    if moe:
        unsharded.update(
            (f"layers.{i}.local_experts.{k}.gain", torch.rand(11, generator=gen))
            for i in range(2)
            for k in range(NUM_EXPERTS)
        )
    optimizer = {
        "type": "AdamW",
        "param_groups": [{"hyper": {"lr": LR, "weight_decay": WEIGHT_DECAY}, "params": list(shapes)}],
        "states": ["exp_avg", "exp_avg_sq"],
        "scalars": {"step": {"tensor": True, "values": dict.fromkeys(shapes, 3.0)}},
    }
    write_from_tensors(
        path,
        cfg,
        groups,
        tensors,
        step=3,
        extra={"consumed_samples": 72} if extra is None else extra,
        optimizer=optimizer,
        unsharded=unsharded,
    )
    return {**tensors, "unsharded": unsharded}


# -- damaged checkpoints (the hostile inputs of tests/ckpt/test_errors.py) ------------------------


def seal(raw: bytes) -> str:
    """The checksum line hfsdp writes for index bytes `raw` (or records for a file)."""
    import xxhash

    return f"xxh3_128:{xxhash.xxh3_128(raw).hexdigest()}"


def write_index_bytes(ckpt, raw: bytes, reseal: bool = True) -> None:
    """Replace the index of checkpoint `ckpt` by `raw`; with `reseal`, also its checksum file, as a tool that writes
    wrong but self-consistent indexes would (without it, the damage is one the index checksum must catch)."""
    from pathlib import Path

    (Path(ckpt) / "index.json").write_bytes(raw)
    if reseal:
        (Path(ckpt) / "index.json.checksum").write_text(seal(raw) + "\n")


def as_legacy_optimizer(data: dict) -> None:
    """Rewrite an index's optimizer record (in place) as hfsdp 0.1 wrote it in format versions 1-2: its own
    ShardedAdamW with a step count, one set of hyper-parameters and the state names."""
    record = data.get("optimizer")
    if record is None:
        return
    steps = {int(v) for v in record["scalars"].get("step", {}).get("values", {}).values()} or {0}
    hyper = {k: v for k, v in record["param_groups"][0]["hyper"].items() if k in ("lr", "betas", "eps", "weight_decay")}
    data["optimizer"] = {"type": "ShardedAdamW", "step_count": steps.pop(), "hyper": hyper, "states": record["states"]}


def edit_index(ckpt, edit, reseal: bool = True) -> None:
    """Apply `edit` to the parsed index of `ckpt` and write it back (see `write_index_bytes`)."""
    import json
    from pathlib import Path

    data = json.loads((Path(ckpt) / "index.json").read_text())
    edit(data)
    write_index_bytes(ckpt, json.dumps(data).encode(), reseal)


def reseal_file(ckpt, name: str) -> None:
    """Record the present size and checksum of file `name` in the index: damage that no checksum catches."""
    from pathlib import Path

    raw = (Path(ckpt) / name).read_bytes()
    edit_index(ckpt, lambda data: data["files"][name].update(checksum=seal(raw), bytes=len(raw)))


def rewrite_header(ckpt, name: str, edit) -> None:
    """Apply `edit` to the parsed safetensors header of file `name`, keep its data, and reseal the file."""
    import json
    import struct
    from pathlib import Path

    path = Path(ckpt) / name
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + length :])
    reseal_file(ckpt, name)


def damage_rng_tensor(ckpt, rank: int) -> None:
    """Overwrite rank `rank`'s saved torch RNG state with bytes no generator accepts, and reseal the file."""
    import struct
    from pathlib import Path

    from hfsdp.ckpt.format.headers import read_header

    name = f"rank-{rank:05d}.safetensors"
    path = Path(ckpt) / name
    entry = read_header(path)["rng/torch_cpu"]
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 + length + entry.begin : 8 + length + entry.end] = b"\xff" * (entry.end - entry.begin)
    path.write_bytes(bytes(data))
    reseal_file(ckpt, name)
