"""DiLoCo checkpoints: every instance's own state, the outer state, the cycle position; resume and reshard.

(d) a save at a step inside the cycle and a resume give the uninterrupted run bit for bit (fp32 exchange with one
fragment, int8 with two and their anchor); a resume on 2x3 of a 2x2 save (the instances keep their data) gives it to
fp32 rounding; a resume on another instance count (2x2 -> 3x2) follows the documented rule, instance o' taking
instance o' mod R's weights and inner optimizer state while the outer state is resharded, online and offline alike.
Plus: verify and inspect without torch, format 4 only where there is DiLoCo state, export of the global weights, and
the layouts without DiLoCo on either side. Two spawned groups: 4 ranks (save, same-layout resume), then 6.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch

from hfsdp.ckpt import CheckpointError, export, inspect, read_index, reshard, resolve, verify
from hfsdp.core.outer.outer_config import DiLoCoConfig
from hfsdp.core.rules.config import LayoutConfig

from tests.support.ckpt_files import edit_index
from tests.support.diloco import MICROBATCHES, instance_microbatch, shard_toy, train_step
from tests.support.distributed import run_distributed

ZERO3 = "optim_grads_params"
STEPS, SAVE_AT = 8, 3  # 3 is inside every cycle below
CASES = {
    "fp32 H=5": DiLoCoConfig(sync_every=5),
    "int8 H=4 F=2": DiLoCoConfig(sync_every=4, comm_dtype="int8", fragments=2),
}


def _optimizer(sharded):
    return torch.optim.AdamW(sharded.parameters(), lr=1e-2, weight_decay=0.1)


def _train(sharded, opt, rank, world, instances, start, stop):
    import torch.distributed as dist

    losses = []
    for step in range(start, stop):
        batch = functools.partial(
            instance_microbatch, step, count=MICROBATCHES, rank=rank, world=world, instances=instances
        )
        total = train_step(sharded, opt, batch)
        dist.all_reduce(total)
        losses.append(total.item() / (MICROBATCHES * world))
    return losses


def _snapshot(sharded, opt) -> dict:
    """What this rank holds: its main params with their inner optimizer state (by instance), its outer pieces."""
    from hfsdp.ckpt.format.pieces import instance_of
    from hfsdp.core import sharding_of

    sharding = sharding_of(sharded)
    inner = []
    for p in sharding.main_params:
        if p.holds:
            state = opt.state.get(p.param, {})
            copies = {k: v.detach().reshape(-1).clone() for k, v in state.items() if torch.is_tensor(v) and v.dim()}
            instance = instance_of(p.group.layout, p.group.coord)
            inner.append((p.name, p.start, p.stop, instance, p.param.detach().reshape(-1).clone(), copies))
    outer = []
    if sharding.outer is not None:
        for piece in sharding.outer.pieces():
            numel, state = piece.stop - piece.start, piece.state
            momentum = sharding.outer.momentum(state)
            outer.append(
                (
                    piece.name,
                    piece.start,
                    piece.stop,
                    state.theta.detach()[piece.offset : piece.offset + numel].clone(),
                    None if momentum is None else momentum[piece.offset : piece.offset + numel].clone(),
                )
            )
    steps = sharding.outer.steps if sharding.outer is not None else None
    return {"inner": inner, "outer": outer, "steps": steps}


def _world4(rank, world, root):
    from hfsdp.ckpt import load_checkpoint, save_checkpoint

    out = {}
    for name, diloco in CASES.items():
        sharded = shard_toy(world, "diloco", ZERO3, 2, diloco)
        opt = _optimizer(sharded)
        first = _train(sharded, opt, rank, world, 2, 0, SAVE_AT)
        saved = _snapshot(sharded, opt)
        save_checkpoint(f"{root}/{name}", sharded, opt, step=SAVE_AT)
        rest = _train(sharded, opt, rank, world, 2, SAVE_AT, STEPS)
        whole = {"losses": first + rest, "final": _snapshot(sharded, opt), "saved": saved}
        resumed = shard_toy(world, "diloco", ZERO3, 2, diloco)
        opt = _optimizer(resumed)
        step = load_checkpoint(f"{root}/{name}", resumed, opt)["step"]
        after = _train(resumed, opt, rank, world, 2, step, STEPS)
        out[name] = {**whole, "resumed losses": after, "resumed final": _snapshot(resumed, opt)}
    # An HSDP checkpoint, for the diloco model to start from.
    hsdp = shard_toy(world, "no_shard", ZERO3, 2)
    opt = _optimizer(hsdp)
    _train(hsdp, opt, rank, world, 2, 0, 2)
    save_checkpoint(f"{root}/hsdp", hsdp, opt, step=2)
    out["hsdp saved"] = _snapshot(hsdp, opt)
    return out


def _world6(rank, world, root):
    from hfsdp.ckpt import load_checkpoint

    out = {}
    diloco = CASES["fp32 H=5"]
    jobs = {
        "2x3 on load": (f"{root}/fp32 H=5", "diloco", 2),
        "3x2 on load": (f"{root}/fp32 H=5", "diloco", 3),
        "3x2 offline": (f"{root}/fp32 H=5 to 3x2", "diloco", 3),
        "hsdp 2x3 on load": (f"{root}/fp32 H=5", "no_shard", 2),
    }
    for name, (path, outer, instances) in jobs.items():
        sharded = shard_toy(world, outer, ZERO3, instances, diloco if outer == "diloco" else None)
        opt = _optimizer(sharded)
        step = load_checkpoint(path, sharded, opt)["step"]
        loaded = _snapshot(sharded, opt)
        losses = _train(sharded, opt, rank, world, instances, step, STEPS)
        out[name] = {"loaded": loaded, "losses": losses, "final": _snapshot(sharded, opt)}
    sharded = shard_toy(world, "diloco", ZERO3, 3, diloco)
    opt = _optimizer(sharded)
    load_checkpoint(f"{root}/hsdp", sharded, opt)
    out["from hsdp"] = _snapshot(sharded, opt)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("diloco-ckpt")
    four = run_distributed(_world4, 4, str(root))
    reshard(root / "fp32 H=5", root / "fp32 H=5 to 3x2", LayoutConfig(world_size=6, outer="diloco", instances=3))
    six = run_distributed(_world6, 6, str(root))
    return {"root": root, "four": four, "six": six}


def _by_instance(snapshots, what="inner", kind=None) -> dict[tuple[str, int], torch.Tensor]:
    """Whole flat tensors by (name, instance) from every rank's pieces (main, or an optimizer state `kind`)."""
    out: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
    for snap in snapshots:
        for name, start, _stop, instance, main, states in snap[what]:
            value = main if kind is None else states[kind]
            out.setdefault((name, instance), {})[start] = value
    return {key: torch.cat([parts[s] for s in sorted(parts)]) for key, parts in out.items()}


def _outer(snapshots, index=3) -> dict[str, torch.Tensor]:
    out: dict[str, dict[int, torch.Tensor]] = {}
    for snap in snapshots:
        for piece in snap["outer"]:
            out.setdefault(piece[0], {})[piece[1]] = piece[index]
    return {name: torch.cat([parts[s] for s in sorted(parts)]) for name, parts in out.items()}


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# -- (d) resume mid-cycle --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_resume_mid_cycle_is_the_uninterrupted_run_bit_for_bit(runs, case):
    """Saved at step 3 of a cycle of 4 or 5 (each instance's weights and AdamW state, the outer state, the anchor,
    the step count), then resumed on the same layout: losses, every instance's weights and optimizer state, the
    global weights and the momentum equal the run that never stopped, bit for bit."""
    ranks = [r[case] for r in runs["four"]]
    assert ranks[0]["resumed losses"] == ranks[0]["losses"][SAVE_AT:]
    whole = [r["final"] for r in ranks]
    resumed = [r["resumed final"] for r in ranks]
    _equal(_by_instance(resumed), _by_instance(whole))
    for kind in ("exp_avg", "exp_avg_sq"):
        _equal(_by_instance(resumed, kind=kind), _by_instance(whole, kind=kind))
    _equal(_outer(resumed), _outer(whole))
    _equal(_outer(resumed, 4), _outer(whole, 4))
    assert resumed[0]["steps"] == whole[0]["steps"] == STEPS


def test_resume_on_another_inner_size_keeps_each_instances_run(runs):
    """A 2x2 save resumed on 2x3: each instance keeps its data (instance-contiguous), so the run continues as the
    uninterrupted 2x2 one, to fp32 rounding (the sums inside an instance run over 3 ranks instead of 2)."""
    whole = runs["four"][0]["fp32 H=5"]
    got = runs["six"][0]["2x3 on load"]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(whole["losses"][SAVE_AT:]), rtol=1e-6, atol=0)
    expected = _by_instance([r["fp32 H=5"]["final"] for r in runs["four"]])
    for key, value in _by_instance([r["2x3 on load"]["final"] for r in runs["six"]]).items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=str(key))


@pytest.mark.parametrize("how", ["3x2 on load", "3x2 offline"])
def test_another_instance_count_takes_instance_o_mod_r(runs, how):
    """2 -> 3 instances mid-cycle: instance o' holds saved instance o' mod 2's weights and AdamW state, the global
    weights and outer momentum are the saved ones (resharded over 3), the step count carries on; the offline
    reshard gives the same state as the reshard on load, and training goes on through the next outer step."""
    saved = [r["fp32 H=5"]["saved"] for r in runs["four"]]
    loaded = [r[how]["loaded"] for r in runs["six"]]
    for kind in (None, "exp_avg", "exp_avg_sq"):
        before, after = _by_instance(saved, kind=kind), _by_instance(loaded, kind=kind)
        assert {i for _, i in after} == {0, 1, 2}
        for (name, instance), value in after.items():
            assert torch.equal(value, before[name, instance % 2]), (name, instance, kind)
    _equal(_outer(loaded), _outer(saved))
    _equal(_outer(loaded, 4), _outer(saved, 4))
    assert loaded[0]["steps"] == SAVE_AT
    final = _by_instance([r[how]["final"] for r in runs["six"]])
    names = {name for name, _ in final}
    for name in names:  # step 5 synced every instance; three more steps since, apart: still finite
        assert all(torch.isfinite(final[name, i]).all() for i in range(3))
    if how == "3x2 offline":
        online = [r["3x2 on load"]["loaded"] for r in runs["six"]]
        _equal(_by_instance(loaded), _by_instance(online))
        assert runs["six"][0][how]["losses"] == runs["six"][0]["3x2 on load"]["losses"]


def test_a_layout_without_diloco_is_instance_0_and_a_plain_checkpoint_starts_the_outer_step_fresh(runs):
    """Loaded into HSDP, a DiLoCo checkpoint gives instance 0's weights and optimizer state; an HSDP checkpoint
    loaded into DiLoCo 3x2 gives every instance those weights, the global weights too, and step count 0."""
    saved = _by_instance([r["fp32 H=5"]["saved"] for r in runs["four"]])
    hsdp = _by_instance([r["hsdp 2x3 on load"]["loaded"] for r in runs["six"]])
    for (name, instance), value in hsdp.items():
        assert instance == 0 and torch.equal(value, saved[name, 0]), name
    plain = _by_instance([r["hsdp saved"] for r in runs["four"]])
    fresh = [r["from hsdp"] for r in runs["six"]]
    for (name, instance), value in _by_instance(fresh).items():
        assert torch.equal(value, plain[name, 0]), (name, instance)
    _equal(_outer(fresh), {name: plain[name, 0] for name, _ in plain})
    assert fresh[0]["steps"] == 0


# -- the format -------------------------------------------------------------------------------------------------------


def test_format_4_holds_every_instance_and_the_outer_record(runs):
    """A DiLoCo save is format 4 with the outer record (settings, steps done, each fragment's last outer step);
    per-instance kinds have the instance count in front, the outer kinds the parameter's shape; an HSDP save stays
    format 3."""
    index = read_index(resolve(runs["root"] / "int8 H=4 F=2"))
    assert index.version == 4 and index.outer == {
        "strategy": "diloco",
        **CASES["int8 H=4 F=2"].to_dict(),
        "inner_steps": SAVE_AT,
        "synced_at": index.outer["synced_at"],
    }
    diloco = CASES["int8 H=4 F=2"]
    assert index.outer["synced_at"] == [SAVE_AT - (SAVE_AT - diloco.offset(f)) % 4 for f in range(2)]
    source, resharded = (read_index(resolve(runs["root"] / n)) for n in ("fp32 H=5", "fp32 H=5 to 3x2"))
    assert "synced_at" in source.outer and resharded.outer == source.outer  # the offline reshard keeps the record
    assert set(index.kinds) == {
        "model",
        "main",
        "exp_avg",
        "exp_avg_sq",
        "outer_main",
        "outer_momentum",
        "outer_anchor",
    }
    shape = dict(index.groups[0].members)["layers.0.up.weight"]
    assert index.tensors["main"]["layers.0.up.weight"].shape == (2, *shape)
    assert index.tensors["exp_avg"]["layers.0.up.weight"].shape == (2, *shape)
    assert index.tensors["outer_main"]["layers.0.up.weight"].shape == shape
    assert read_index(resolve(runs["root"] / "hsdp")).version == 3


def test_verify_and_inspect_need_no_torch_and_show_the_strategy_and_h(runs):
    """`hfsdp ckpt verify` and `inspect` of a DiLoCo checkpoint run without importing torch; inspect names the
    strategy, H, the outer optimizer and the place in the cycle."""
    path = str(runs["root"] / "fp32 H=5")
    code = (
        "import sys; from hfsdp.cli.main import app; from typer.testing import CliRunner; r = CliRunner(); "
        f"a = r.invoke(app, ['ckpt', 'verify', {path!r}]); b = r.invoke(app, ['ckpt', 'inspect', {path!r}]); "
        "print(a.exit_code, b.exit_code, 'torch' in sys.modules); print(b.stdout)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "0 0 False"
    assert "DiLoCo 2x2 (diloco over optim_grads_params)" in out
    assert "Outer: diloco over 2 instances, sync every 5 steps (H=5), Nesterov SGD lr 0.7 momentum 0.9" in out
    assert "3 of 5 steps into the cycle" in out
    assert verify(path)["version"] == 4 and inspect(path)["outer"]["sync_every"] == 5


def test_export_writes_the_global_weights(runs, tmp_path):
    """Export of a DiLoCo checkpoint writes the global weights (the outer state), not one instance's."""
    from safetensors.torch import load_file

    export(runs["root"] / "fp32 H=5", tmp_path / "out", "fp32", format="megatron")
    written = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        written.update(load_file(f))
    outer = _outer([r["fp32 H=5"]["saved"] for r in runs["four"]])
    for name, value in outer.items():
        assert torch.equal(written[name].reshape(-1), value), name


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("outer"), "has no outer record"),
        (lambda d: d.update(version=3), "format version 3 does not define"),
        (lambda d: d["outer"].update(fragments=9), "not a valid DiLoCo record"),
        (lambda d: d["outer"].update(inner_steps=-1), "outer.inner_steps"),
        (lambda d: d["outer"].update(synced_at=[0, 0]), "where the format has a list of 1 steps"),
        (lambda d: d["outer"].update(synced_at=[99]), r"outer.synced_at\[0\] is 99, after the 3 optimizer steps"),
        (lambda d: d["outer"].update(synced_at=["1"]), r"outer.synced_at\[0\]"),
        (lambda d: d["layout"].update(outer="no_shard"), "outer strategy is 'no_shard'"),
        (lambda d: d["tensors"]["main"]["layers.0.up.weight"].update(shape=[13, 16]), "for each of 2 instances"),
    ],
)
def test_a_damaged_outer_record_is_refused_naming_the_field(runs, tmp_path, edit, message):
    """verify refuses an index whose DiLoCo fields are missing, out of bounds or disagree, naming what is wrong."""
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(resolve(runs["root"] / "fp32 H=5"), copy)
    edit_index(copy, edit)
    with pytest.raises(CheckpointError, match=message):
        verify(copy)


def test_the_cli_inspect_json_carries_the_outer_record(runs):
    """`hfsdp ckpt inspect --format json` gives the outer record as the index has it."""
    from typer.testing import CliRunner

    from hfsdp.cli.main import app

    result = CliRunner().invoke(app, ["ckpt", "inspect", str(runs["root"] / "int8 H=4 F=2"), "--format", "json"])
    info = json.loads(result.stdout)
    assert info["outer"]["comm_dtype"] == "int8" and info["outer"]["fragments"] == 2
