"""Streaming DiLoCo resumed mid-cycle: every fragment's schedule survives the checkpoint.

With F fragments each one syncs at its own step of the cycle, and `sync_outer()` syncs exactly the fragments not
synced since the last optimizer step: so after a resume the model must know, per fragment, when it last synced. Each
case saves an uninterrupted run at step R, resumes it in a fresh model, trains on to step E (through the fragments
due on the way), calls `sync_outer()` twice and compares with the uninterrupted run doing the same, bit for bit. One
spawned group of 4 ranks (DiLoCo 2x2 over ZeRO-3, CPU gloo).
"""

from __future__ import annotations

import functools

import pytest
import torch

from hfsdp.core.outer.outer_config import DiLoCoConfig

from tests.support.diloco import MICROBATCHES, group_states, instance_microbatch, shard_toy, train_step
from tests.support.distributed import run_distributed

ZERO3 = "optim_grads_params"
#: Per config, the (R, E) cases: saved at step R, resumed and trained to step E, then synced. With H=6, F=3 the
#: fragments sync after steps 2, 4, 0 (mod 6); with H=4, F=2 after steps 2, 0 (mod 4).
CASES = {
    "fp32 H=6 F=3": (
        DiLoCoConfig(sync_every=6, fragments=3),
        [(4, 4), (5, 5), (8, 8), (3, 8)],  # just after fragment 1's sync; between syncs; cycle 2; through 3 syncs
    ),
    "int8 H=4 F=2": (
        DiLoCoConfig(sync_every=4, comm_dtype="int8", fragments=2),
        [(3, 4), (6, 6), (2, 6)],  # the next due fragment, then sync_outer; at fragment 0's sync; through 2 syncs
    ),
}


def _train(sharded, opt, rank, world, start, stop):
    for step in range(start, stop):
        batch = functools.partial(instance_microbatch, step, count=MICROBATCHES, rank=rank, world=world, instances=2)
        train_step(sharded, opt, batch)


def _snapshot(sharded) -> dict:
    """This rank's groups (main weights, global weights, momentum, anchor) and each fragment's last synced step."""
    from hfsdp.core import sharding_of

    outer = sharding_of(sharded).outer
    return {"groups": group_states(sharded), "synced_at": list(outer.synced_at), "steps": outer.steps}


def _sync_twice(sharded) -> list[dict]:
    """The state before `sync_outer()`, after it, and after a second call (which must change nothing)."""
    out = [_snapshot(sharded)]
    for _ in range(2):
        sharded.sync_outer()
        out.append(_snapshot(sharded))
    return out


def _ranks(rank, world, root):
    from hfsdp.ckpt import load_checkpoint, save_checkpoint

    def build(diloco):
        sharded = shard_toy(world, "diloco", ZERO3, 2, diloco)
        return sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2, weight_decay=0.1)

    out = {}
    for name, (diloco, cases) in CASES.items():
        for end in sorted({e for _, e in cases}):
            sharded, opt = build(diloco)
            saves = sorted(r for r, e in cases if e == end)
            done = 0
            for at in saves:
                _train(sharded, opt, rank, world, done, at)
                save_checkpoint(f"{root}/{name}/{at}-{end}", sharded, opt, step=at)
                done = at
            _train(sharded, opt, rank, world, done, end)
            out[name, "whole", end] = _sync_twice(sharded)
        for at, end in cases:
            sharded, opt = build(diloco)
            step = load_checkpoint(f"{root}/{name}/{at}-{end}", sharded, opt)["step"]
            loaded = _snapshot(sharded)
            _train(sharded, opt, rank, world, step, end)
            out[name, "resumed", at, end] = {"loaded": loaded, "synced": _sync_twice(sharded)}
    # sync_outer() at step 5 (between scheduled syncs), then a save: the resumed model is synced at step 5 too.
    diloco = CASES["fp32 H=6 F=3"][0]
    sharded, opt = build(diloco)
    _train(sharded, opt, rank, world, 0, 5)
    sharded.sync_outer()
    save_checkpoint(f"{root}/synced", sharded, opt, step=5)
    out["synced", "whole"] = _sync_twice(sharded)
    sharded, opt = build(diloco)
    load_checkpoint(f"{root}/synced", sharded, opt)
    out["synced", "resumed"] = _sync_twice(sharded)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_ranks, 4, str(tmp_path_factory.mktemp("fragments") / "ck"))


def _same(got: dict, want: dict, where: str) -> None:
    assert got["steps"] == want["steps"], where
    assert got["synced_at"] == want["synced_at"], where
    for index, (a, b) in enumerate(zip(got["groups"], want["groups"], strict=True)):
        for key in ("main", "theta", "momentum", "anchor"):
            x, y = a.get(key), b.get(key)
            assert (x is None) == (y is None), (where, index, key)
            assert x is None or torch.equal(x, y), (where, index, key)


@pytest.mark.parametrize(("name", "at", "end"), [(n, r, e) for n, (_, cases) in CASES.items() for r, e in cases])
def test_a_resumed_fragment_schedule_syncs_as_the_uninterrupted_run(ranks, name, at, end):
    """Saved at step R, resumed, trained to E: on every rank each fragment's last sync step, the instances' weights,
    the global weights, the outer momentum and the anchor equal the uninterrupted run's bit for bit before
    `sync_outer()`, after it, and after a second call (a no-op)."""
    for rank, states in enumerate(ranks):
        whole = states[name, "whole", end]
        resumed = states[name, "resumed", at, end]["synced"]
        for phase, got, want in zip(("before sync_outer", "after", "after again"), resumed, whole, strict=True):
            _same(got, want, f"rank {rank}, {phase}")
        _same(resumed[2], resumed[1], f"rank {rank}, a second sync_outer")


def test_a_sync_outer_before_the_save_is_remembered_by_the_resumed_run(ranks):
    """sync_outer() at step 5, saved, resumed: the resumed model's sync_outer() is a no-op, as it is for the run that
    never stopped (the same weights, global weights and momentum, bit for bit)."""
    for rank, states in enumerate(ranks):
        _same(states["synced", "resumed"][1], states["synced", "whole"][1], f"rank {rank}")


def test_the_cases_cover_synced_and_unsynced_fragments_at_the_resume():
    """Some cases call `sync_outer()` right at the resume where a fragment has just synced, one where none has, so a
    schedule reset on load (to 'never synced' or to 'all synced now') changes what it syncs."""
    fresh = [r for diloco, cases in CASES.values() for r, e in cases if r == e and diloco.due(r)]
    between = [r for diloco, cases in CASES.values() for r, e in cases if r == e and not diloco.due(r)]
    assert fresh and between
