"""Toy models and their training loop for the checkpoint tests.

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

from hfsdp.core import sharding_of

from tests.support.steps import accumulate
from tests.support.toy_models import Block

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
    from hfsdp.core import fully_shard
    from hfsdp.core.buffers.mixed_precision import MixedPrecision
    from hfsdp.core.engine.mesh import build_meshes
    from hfsdp.core.rules.config import LayoutConfig
    from hfsdp.core.rules.expert_naming import ExpertNaming

    cfg = LayoutConfig(world_size=dist.get_world_size(), **layout)
    meshes = build_meshes(cfg, "cpu")
    ep_rank = dist.get_rank() % cfg.ep
    model = Toy(moe, cfg.ep, ep_rank, _ep_group(cfg.ep), seed)
    naming = ExpertNaming(NUM_EXPERTS, cfg.ep, ep_rank) if moe else None
    mp = MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    sm = fully_shard(model, cfg, meshes, units=list(model.layers), mp=mp, expert_naming=naming)
    return sm, torch.optim.AdamW(sm.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def train(sm, opt, steps: int, start: int = 0) -> list[float]:
    """`steps` optimizer steps on the global batches start.. ; returns the global mean loss of each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    b = GLOBAL_BATCH // (MICROBATCHES * world)
    losses = []
    for k in range(start, start + steps):
        x, y = data(k)

        def loss_of(mb, x=x, y=y):
            c = mb * world + rank
            return sm(x[c * b : (c + 1) * b], y[c * b : (c + 1) * b])

        total = accumulate(sm, MICROBATCHES, loss_of)
        dist.all_reduce(total)
        losses.append(total.item() / (MICROBATCHES * world))
        opt.step()
        opt.zero_grad()
    return losses


def step_of(opt) -> int:
    """The optimizer's step count: AdamW's `step` of its main params (all equal), 0 before the first step."""
    steps = {int(state["step"]) for state in opt.state.values()}
    assert len(steps) <= 1, steps
    return steps.pop() if steps else 0


def local_state(sm, opt) -> list[dict[str, torch.Tensor]]:
    """This rank's state per group (compute-dtype params, fp32 main weights, each optimizer state over the group's
    main params), for bitwise comparisons."""
    out = []
    for g in sharding_of(sm).groups:
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
