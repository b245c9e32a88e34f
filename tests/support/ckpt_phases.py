"""Phases that every rank runs in the resume and collective tests: train, save, load, compare."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support.ckpt_files import damage_rng_tensor
from tests.support.ckpt_models import (
    GLOBAL_BATCH,
    HFSDP,
    HFSDP_3X2,
    HSDP,
    MOE_EP1,
    MOE_EP2,
    ZERO1,
    ZERO3,
    engine,
    local_state,
    step_of,
    train,
)


def save_and_continue(root, layout: dict, moe: bool = False, bf16: bool = False, save: bool = True):
    """Train 2 steps, save at step 2, train 2 more: the uninterrupted run, with its final local state."""
    from hfsdp.ckpt import save_checkpoint

    sm, opt = engine(layout, moe, seed=0, bf16=bf16)
    first = train(sm, opt, 2)
    if save:
        save_checkpoint(root, sm, opt, step=2, extra={"consumed_samples": 2 * GLOBAL_BATCH})
    second = train(sm, opt, 2, start=2)
    return {"first": first, "second": second, "state": local_state(sm, opt)}


def load_and_train(path, layout: dict, moe: bool = False, bf16: bool = False, save_to=None):
    """Build a differently initialised engine, load `path` into it, train steps 2 and 3 (then save step 4 into
    root `save_to`, when given)."""
    from hfsdp.ckpt import load_checkpoint, save_checkpoint
    from hfsdp.ckpt.live.model_state import unsharded_state

    sm, opt = engine(layout, moe, seed=1, bf16=bf16)
    extra = load_checkpoint(path, sm, opt)
    step_count = step_of(opt)
    unsharded = {name: t.detach().clone() for name, t in unsharded_state(sm).items()}
    losses = train(sm, opt, 2, start=2)
    if save_to is not None:
        save_checkpoint(save_to, sm, opt, step=4)
    return {
        "losses": losses,
        "extra": extra,
        "step_count": step_count,
        "state": local_state(sm, opt),
        "unsharded": unsharded,
    }


def world6_phase(rank: int, world: int, root: str):
    """HFSDP 3x2 (three instances of two ranks): the uninterrupted run that saves at step 2, and its resume."""
    from pathlib import Path

    root = Path(root)
    out = {"hfsdp3x2": save_and_continue(root / "hfsdp3x2", HFSDP_3X2)}
    out["hfsdp3x2->hfsdp3x2"] = load_and_train(root / "hfsdp3x2", HFSDP_3X2)
    return out


def world4_phase(rank: int, world: int, root: str):
    """Every 4-rank run of the resume tests: saves, same-layout resumes, offline and on-load reshards."""
    from pathlib import Path

    from hfsdp.ckpt import reshard
    from hfsdp.core.rules.config import LayoutConfig

    root = Path(root)
    out = {}

    def offline(src: str, dst: str, layout: dict) -> None:
        if rank == 0:
            reshard(root / src, root / dst, LayoutConfig(world_size=4, **layout), io_threads=2)
        dist.barrier()

    out["hsdp"] = save_and_continue(root / "hsdp", HSDP)
    out["hsdp->hsdp"] = load_and_train(root / "hsdp", HSDP)
    out["hfsdp_bf16"] = save_and_continue(root / "hfsdp_bf16", HFSDP, bf16=True)
    out["hfsdp_bf16->hfsdp_bf16"] = load_and_train(root / "hfsdp_bf16", HFSDP, bf16=True)
    offline("hsdp", "hsdp_to_zero3", ZERO3)
    out["hsdp->zero3 offline"] = load_and_train(root / "hsdp_to_zero3", ZERO3)
    out["hsdp->zero3 on load"] = load_and_train(root / "hsdp", ZERO3)
    out["zero1"] = save_and_continue(root / "zero1", ZERO1)
    offline("zero1", "zero1_to_hfsdp", HFSDP)
    out["zero1->hfsdp offline"] = load_and_train(root / "zero1_to_hfsdp", HFSDP)
    out["zero1->hfsdp on load"] = load_and_train(root / "zero1", HFSDP)
    out["hfsdp"] = save_and_continue(root / "hfsdp", HFSDP)
    out["moe_ep2"] = save_and_continue(root / "moe_ep2", MOE_EP2, moe=True)
    out["moe_ep2->moe_ep2"] = load_and_train(root / "moe_ep2", MOE_EP2, moe=True)
    offline("moe_ep2", "moe_ep2_to_ep1", MOE_EP1)
    out["moe_ep2->ep1 offline"] = load_and_train(root / "moe_ep2_to_ep1", MOE_EP1, moe=True)
    out["moe_ep2->ep1 on load"] = load_and_train(root / "moe_ep2", MOE_EP1, moe=True)
    out["moe_ep1"] = save_and_continue(root / "moe_ep1", MOE_EP1, moe=True)
    offline("moe_ep1", "moe_ep1_to_ep2", MOE_EP2)
    out["moe_ep1->ep2 offline"] = load_and_train(root / "moe_ep1_to_ep2", MOE_EP2, moe=True)
    out["moe_ep1->ep2 on load"] = load_and_train(root / "moe_ep1", MOE_EP2, moe=True)
    # saved on the non-square HFSDP 3x2 by world6_phase, resharded offline by the test before this phase
    out["hfsdp3x2->hfsdp2x2 offline"] = load_and_train(root / "hfsdp3x2_to_2x2", HFSDP, save_to=root / "resumed2x2")
    out["hfsdp3x2->hfsdp2x2 on load"] = load_and_train(root / "hfsdp3x2", HFSDP)
    return out


def error_phase(rank: int, world: int, jobs: list[tuple[str, str, dict, bool]]):
    """Loads that must fail: the CheckpointError message each rank got (every rank must raise, none hang)."""
    from hfsdp.ckpt import CheckpointError

    out = {}
    for label, path, layout, moe in jobs:
        try:
            load_and_train(path, layout, moe)
            out[label] = None
        except CheckpointError as err:
            out[label] = str(err)
    return out


def load_phase(rank: int, world: int, jobs, error_jobs=()):
    """`load_and_train` for each (label, path, layout, moe), then the loads that must fail."""
    out = {label: load_and_train(path, layout, moe) for label, path, layout, moe in jobs}
    out["errors"] = error_phase(rank, world, list(error_jobs))
    return out


# -- collective behaviour of save and load (tests/ckpt/test_collective.py) -----------------------


def rng_states() -> tuple:
    """This process's torch, Python and NumPy generator states, comparable with ==."""
    import random

    import numpy as np

    _, keys, position, has_gauss, cached = np.random.get_state()
    return torch.get_rng_state().tolist(), random.getstate(), (keys.tolist(), position, has_gauss, cached)


def collective_phase(rank: int, world: int, base: str):
    """Save and load on every rank: RNG round trip, a damaged RNG state, a write failure on rank 1 only, a
    published step saved again, an `extra` no index may hold. Returns what each rank saw."""
    import random
    from pathlib import Path

    import numpy as np

    import hfsdp.ckpt.tensors.writer as writer_module
    from hfsdp.ckpt import CheckpointError, load_checkpoint, save_checkpoint

    root, out = Path(base) / "root", {}

    def attempt(call) -> str | None:
        try:
            call()
        except CheckpointError as err:
            return str(err)
        return None

    def on_disk() -> dict:
        dist.barrier()
        return {
            "latest": (root / "latest").read_text().strip(),
            "steps": sorted(p.name for p in root.iterdir() if p.name.startswith("step-")),
            "hidden": sorted(p.name for p in root.iterdir() if p.name.startswith(".")),
        }

    # RNG states: saved, perturbed, restored by a load on the same world size (rank r gets rank r's)
    sm, opt = engine(ZERO3)
    torch.manual_seed(100 + rank), random.seed(200 + rank), np.random.seed(300 + rank)
    torch.rand(3), random.gauss(0, 1), np.random.randn()  # leave a cached gaussian in Python's and NumPy's
    saved = rng_states()
    save_checkpoint(root, sm, opt, step=1)
    torch.rand(5), random.random(), np.random.rand(7)
    perturbed = rng_states()
    load_checkpoint(root, sm, opt)
    out["rng"] = (saved, perturbed, rng_states())

    # a torch RNG state no generator accepts (resealed, so only the RNG check can catch it)
    if rank == 0:
        import shutil

        shutil.copytree(root / "step-1", Path(base) / "bad-rng")
        damage_rng_tensor(Path(base) / "bad-rng", 1)
    dist.barrier()
    fresh, fresh_opt = engine(ZERO3, seed=1)
    before = local_state(fresh, fresh_opt)
    out["bad rng"] = attempt(lambda: load_checkpoint(Path(base) / "bad-rng", fresh, fresh_opt))
    after = local_state(fresh, fresh_opt)
    unchanged = [torch.equal(a[k], b[k]) for a, b in zip(before, after, strict=True) for k in a]
    out["bad rng left the model alone"] = all(unchanged)

    # a write failure on rank 1 only: every rank raises the same error, nothing is published
    original = writer_module.TensorFileWriter.write
    if rank == 1:

        def write(self, chunk):
            raise OSError(28, "No space left on device (injected)", str(self.path))

        writer_module.TensorFileWriter.write = write
    try:
        out["write failure"] = attempt(lambda: save_checkpoint(root, sm, opt, step=2))
    finally:
        writer_module.TensorFileWriter.write = original
    out["after write failure"] = on_disk()
    save_checkpoint(root, sm, opt, step=2)
    out["after a later save"] = on_disk()

    # published steps are never overwritten; an index hfsdp would refuse is never written
    out["save published step"] = attempt(lambda: save_checkpoint(root, sm, opt, step=1))
    out["save NaN extra"] = attempt(lambda: save_checkpoint(root, sm, opt, step=3, extra={"loss": float("nan")}))
    out["after refused saves"] = on_disk()
    return out


def crash_load_phase(rank: int, world: int, roots: list[str]):
    """Resume each crashed root in a fresh engine (its state after loading is returned), train the step the crash
    interrupted and save it again: over the orphan step-2 where the crash hit after the rename."""
    from hfsdp.ckpt import load_checkpoint, save_checkpoint

    out = []
    for root in roots:
        sm, opt = engine(ZERO3, seed=1)
        extra = load_checkpoint(root, sm, opt)
        out.append((extra["step"], local_state(sm, opt)))
        train(sm, opt, 1, start=1)
        save_checkpoint(root, sm, opt, step=2)
    return out
