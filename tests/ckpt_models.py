"""Toy models, training loops and synthetic checkpoints for the checkpoint tests.

Two models, sized oddly so every layout has padding:
- `Toy`: input layer, three residual blocks (the units), head.
- `MoEToy`: the same shape with mixture-of-experts blocks. Expert parameters are
  named `...local_experts.{j}...` and marked `allreduce = False`; local expert j
  on ep rank e is initialised from the seed of its global index, so every ep
  builds the same global model. Under ep > 1 each rank gathers the tokens of its
  expert-parallel group, runs them through its local experts, and the partial
  outputs are summed back to the owning rank (autograd functions whose backward
  is the matching collective), which is exactly the single-process model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hfsdp.ckpt.groups import retarget_groups
from hfsdp.ckpt.index import GroupSpec

from toy_models import Block

NUM_EXPERTS = 4
GLOBAL_BATCH, MICROBATCHES = 12, 1
LR, WEIGHT_DECAY = 1e-2, 0.1


class Expert(nn.Module):
    """An MLP expert with a persistent buffer (`gain`), which checkpoints must carry per global expert."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1 = nn.Linear(d, 11)
        self.fc2 = nn.Linear(11, d)
        self.register_buffer("gain", torch.rand(11) + 0.5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)) * self.gain.to(x.dtype))


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over the ep group; backward sums the gradients and keeps this rank's part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)].contiguous(), None


class _ScatterSum(torch.autograd.Function):
    """Sum partial outputs over the ep group and keep this rank's tokens; backward all-gathers the gradients."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y.chunk(dist.get_world_size(group))[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class MoEBlock(nn.Module):
    def __init__(self, d: int, layer: int, ep: int, ep_rank: int, group, seed: int):
        super().__init__()
        self.router = nn.Linear(d, NUM_EXPERTS)
        self.first, self.group = ep_rank * (NUM_EXPERTS // ep), group
        experts = []
        for j in range(NUM_EXPERTS // ep):
            with torch.random.fork_rng():
                torch.manual_seed(seed * 1000 + 100 * layer + self.first + j)
                experts.append(Expert(d))
        self.local_experts = nn.ModuleList(experts)
        for p in self.local_experts.parameters():
            p.allreduce = False

    def forward(self, x):
        d = x.shape[-1]
        both = torch.cat([x, torch.softmax(self.router(x), -1)], -1)
        if self.group is not None:
            both = _GatherTokens.apply(both, self.group)
        xs, gates = both[:, :d], both[:, d:]
        out = torch.zeros_like(xs)
        for j, expert in enumerate(self.local_experts):
            k = self.first + j
            out = out + gates[:, k : k + 1] * expert(xs)
        if self.group is not None:
            out = _ScatterSum.apply(out, self.group)
        return x + out


class Toy(nn.Module):
    """Besides its trained parameters, a frozen parameter and two buffers (float, and an int64 counter that
    forward advances): the module tensors the engine does not shard, which checkpoints store whole."""

    def __init__(self, moe: bool = False, ep: int = 1, ep_rank: int = 0, group=None, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.input_scale = nn.Parameter(torch.rand(8) + 0.5, requires_grad=False)
        self.register_buffer("shift", torch.randn(16) * 0.1)
        self.register_buffer("forward_calls", torch.zeros((), dtype=torch.int64))
        self.inp = nn.Linear(8, 16)
        blocks = [MoEBlock(16, i, ep, ep_rank, group, seed) if moe else Block(16) for i in range(2 if moe else 3)]
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(16, 1)

    def forward(self, x, y):
        self.forward_calls += 1
        h = self.inp(x * self.input_scale.to(x.dtype)) + self.shift.to(x.dtype)
        for layer in self.layers:
            h = layer(h)
        return ((self.head(h).squeeze(-1) - y) ** 2).mean()


def data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, generator=g)


def reference(moe: bool, steps: int):
    """Single-process torch.optim.AdamW run: losses per step and the state dict after each step."""
    model = Toy(moe=moe)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, params = [], []
    for k in range(steps):
        x, y = data(k)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        params.append({n: t.detach().clone() for n, t in model.state_dict().items()})
    return losses, params


def _ep_group(ep: int):
    """This rank's expert-parallel group (consecutive ranks), created collectively on every rank."""
    if ep == 1:
        return None
    mine = None
    for first in range(0, dist.get_world_size(), ep):
        group = dist.new_group(list(range(first, first + ep)))
        if first <= dist.get_rank() < first + ep:
            mine = group
    return mine


def engine(layout: dict, moe: bool = False, seed: int = 0, bf16: bool = False):
    """A sharded Toy (or MoEToy) and torch's AdamW over its main params on this process group, for `layout`."""
    from hfsdp.core.config import LayoutConfig
    from hfsdp.core.expert_naming import ExpertNaming
    from hfsdp.core.flat_group import MixedPrecision
    from hfsdp.core.mesh import build_meshes
    from hfsdp.core.sharded_model import fully_shard

    cfg = LayoutConfig(world_size=dist.get_world_size(), **layout)
    meshes = build_meshes(cfg, "cpu")
    ep_rank = dist.get_rank() % cfg.ep
    model = Toy(moe, cfg.ep, ep_rank, _ep_group(cfg.ep), seed)
    naming = ExpertNaming(NUM_EXPERTS, cfg.ep, ep_rank) if moe else None
    mp = MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    sm = fully_shard(model, cfg, meshes, units=list(model.layers), mp=mp, expert_naming=naming)
    return sm, torch.optim.AdamW([p for _, p in sm.named_main_params()], lr=LR, weight_decay=WEIGHT_DECAY)


def train(sm, opt, steps: int, start: int = 0) -> list[float]:
    """`steps` optimizer steps on the global batches start.. ; returns the global mean loss of each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    b = GLOBAL_BATCH // (MICROBATCHES * world)
    losses = []
    for k in range(start, start + steps):
        x, y = data(k)
        total = torch.zeros(())
        for mb in range(MICROBATCHES):
            sm.set_microbatch(mb, MICROBATCHES)
            c = mb * world + rank
            loss = sm(x[c * b : (c + 1) * b], y[c * b : (c + 1) * b])
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (MICROBATCHES * world))
        opt.step()
        opt.zero_grad()
    return losses


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
    from hfsdp.core.config import LayoutConfig

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


# -- damaged checkpoints (the hostile inputs of test_ckpt_errors.py) ------------------------


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


# -- phases run on every rank by the resume tests -----------------------------------------


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
    from hfsdp.ckpt.model_state import unsharded_state

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


def step_of(opt) -> int:
    """The optimizer's step count: AdamW's `step` of its main params (all equal), 0 before the first step."""
    steps = {int(state["step"]) for state in opt.state.values()}
    assert len(steps) <= 1, steps
    return steps.pop() if steps else 0


def local_state(sm, opt) -> list[dict[str, torch.Tensor]]:
    """This rank's state per group (compute-dtype params, fp32 main weights, each optimizer state over the group's
    main params), for bitwise comparisons."""
    out = []
    for g in sm.groups:
        states = {}
        for key in ("exp_avg", "exp_avg_sq"):
            pieces = [opt.state[p.param][key].reshape(-1) for p in g.main_params if p.param in opt.state]
            if pieces:
                states[key] = torch.cat(pieces).clone()
        out.append({"param": g.compute_shard().clone(), "main": g.main.clone(), **states})
    return out


HSDP = {"inner": "optim_grads_params", "outer": "no_shard", "instances": 2}
HFSDP = {"inner": "optim_grads_params", "outer": "optim", "instances": 2}
ZERO1 = {"inner": "optim"}
ZERO3 = {"inner": "optim_grads_params"}
MOE_EP2 = {"inner": "optim_grads_params", "ep": 2, "num_moe_experts": NUM_EXPERTS, "expert_strategy": "optim"}
MOE_EP1 = {"inner": "optim_grads_params", "outer": "optim", "instances": 2, "num_moe_experts": NUM_EXPERTS}
HFSDP_3X2 = {"inner": "optim_grads_params", "outer": "optim", "instances": 3}  # a non-square mesh on 6 ranks


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
    from hfsdp.core.config import LayoutConfig

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


# -- collective behaviour of save and load (test_ckpt_collective.py) -----------------------


def rng_states() -> tuple:
    """This process's torch, Python and NumPy generator states, comparable with ==."""
    import random

    import numpy as np

    _, keys, position, has_gauss, cached = np.random.get_state()
    return torch.get_rng_state().tolist(), random.getstate(), (keys.tolist(), position, has_gauss, cached)


def damage_rng_tensor(ckpt, rank: int) -> None:
    """Overwrite rank `rank`'s saved torch RNG state with bytes no generator accepts, and reseal the file."""
    import struct
    from pathlib import Path

    from hfsdp.ckpt.headers import read_header

    name = f"rank-{rank:05d}.safetensors"
    path = Path(ckpt) / name
    entry = read_header(path)["rng/torch_cpu"]
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 + length + entry.begin : 8 + length + entry.end] = b"\xff" * (entry.end - entry.begin)
    path.write_bytes(bytes(data))
    reseal_file(ckpt, name)


def collective_phase(rank: int, world: int, base: str):
    """Save and load on every rank: RNG round trip, a damaged RNG state, a write failure on rank 1 only, a
    published step saved again, an `extra` no index may hold. Returns what each rank saw."""
    import random
    from pathlib import Path

    import numpy as np

    import hfsdp.ckpt.writer as writer_module
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


# -- a save that dies half-way (run as a script by test_ckpt_crash.py) -----------------------


def crash_main(mode: str, root: str, side: str, init_file: str) -> None:
    """Save step 1 (its state goes to `side`), train on, then die by SIGKILL inside the save of step 2.

    mode "mid-write": after a few tensors of the rank file are written;
    mode "before-latest": after step-2 is renamed into place, before `latest` moves.
    """
    import os
    import signal

    import hfsdp.ckpt.save as save_module
    import hfsdp.ckpt.writer as writer_module
    from hfsdp.ckpt import save_checkpoint

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    sm, opt = engine(ZERO3)
    train(sm, opt, 1)
    save_checkpoint(root, sm, opt, step=1)
    torch.save(local_state(sm, opt), side)
    train(sm, opt, 1, start=1)

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if mode == "mid-write":
        original, calls = writer_module.TensorFileWriter.write, [0]

        def write(self, chunk):
            original(self, chunk)
            calls[0] += 1
            if calls[0] == 3:
                self._file.flush()
                die()

        writer_module.TensorFileWriter.write = write
    else:
        save_module.atomic_write_text = die
    save_checkpoint(root, sm, opt, step=2)


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


if __name__ == "__main__":
    import sys

    crash_main(*sys.argv[1:])
