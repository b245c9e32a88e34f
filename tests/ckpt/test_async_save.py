"""`AsyncSaver`: the save the training loop does not wait for is the synchronous save, written later.

Each case trains on 4 gloo ranks (HFSDP 2x2), saves asynchronously at step 2 while the write is held back
on one rank, trains on (changing every tensor the snapshot copied) and then publishes; the published
checkpoint must hold exactly what a synchronous save at step 2 holds, and `latest` must not move before
the publish.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from safetensors import safe_open

from tests.support import ckpt_models as cm
from tests.support.distributed import run_distributed


def _save_while_training(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from hfsdp.ckpt import AsyncSaver, save_checkpoint
    from hfsdp.ckpt.format.store import latest_step

    sm, opt = cm.engine(cm.HFSDP)
    cm.train(sm, opt, 2)
    save_checkpoint(f"{root}/sync", sm, opt, step=2, extra={"consumed_samples": 24})
    release = threading.Event()
    saver = AsyncSaver(on_written=lambda step: release.wait(60) if rank == 1 else None)
    waited = saver.save(f"{root}/async", sm, opt, step=2, extra={"consumed_samples": 24})
    saver.before_update()
    losses = cm.train(sm, opt, 2, start=2)  # the weights and optimizer state move on while the file is written
    dist.barrier()
    held = {"in_flight": saver.in_flight, "written": saver.written(), "latest": latest_step(Path(root) / "async")}
    release.set()
    path = saver.publish()
    return {
        **held,
        "waited": waited,
        "path": str(path),
        "latest_after": latest_step(Path(root) / "async"),
        "host_bytes": saver.host_bytes,
        "losses": losses,
        "again": saver.publish(),
    }


def _tensors(step_dir: Path) -> dict[tuple[str, str], torch.Tensor]:
    out = {}
    for path in sorted(step_dir.glob("rank-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({(path.name, key): f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    return out


def test_an_async_save_publishes_what_a_synchronous_save_at_its_step_holds(tmp_path):
    """While one rank's write is held back, no rank counts the save as written on that rank and `latest` does not
    exist; after `publish` it names step-2, whose files hold bit for bit the tensors (weights, main weights, AdamW
    state, module buffers, RNG) of a synchronous save of step 2, though training went on for two more steps; the
    index records the same extra; host memory held is the size of the snapshot; a second publish is a no-op."""
    from hfsdp.ckpt import read_index

    results = run_distributed(_save_while_training, 4, str(tmp_path))
    assert results[1]["written"] is False and all(r["in_flight"] for r in results)
    assert all(r["latest"] is None for r in results)
    assert all(r["latest_after"] == 2 and r["path"] == str(tmp_path / "async" / "step-2") for r in results)
    assert all(r["again"] is None for r in results)
    sync, later = _tensors(tmp_path / "sync" / "step-2"), _tensors(tmp_path / "async" / "step-2")
    assert sync.keys() == later.keys() and sync
    for key, tensor in sync.items():
        assert torch.equal(tensor, later[key]), key
    assert read_index(tmp_path / "async" / "step-2").extra == read_index(tmp_path / "sync" / "step-2").extra
    files = {p.name: p.stat().st_size for p in (tmp_path / "sync" / "step-2").glob("rank-*.safetensors")}
    for rank, result in enumerate(results):
        name = f"rank-{rank:05d}.safetensors"
        assert result["host_bytes"] > 0 and result["host_bytes"] <= files.get(name, 0), (rank, result["host_bytes"])
    assert not list((tmp_path / "async").glob(".tmp-*"))
