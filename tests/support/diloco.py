"""DiLoCo in tests: a sharded run that records what every rank holds, and the outer step run unsharded.

`diloco_run` trains the toy model on one spawned rank and records, at every step, each group's main
weights right before the outer step (an optimizer post-hook registered before the engine binds runs
first) and every group's state after the step. `OuterReference` is the outer optimizer on whole flat
buffers in one process: the mean of the instances' weights in instance order, `torch.optim.SGD` on the
global weights, the same codec rows, so the sharded run must equal it bit for bit.
"""

from __future__ import annotations

import torch

from tests.support.steps import accumulate
from tests.support.toy_models import GLOBAL_BATCH, global_batch, make_toy, microbatch

MICROBATCHES = 2


def instance_microbatch(step: int, index: int, count: int, rank: int, world: int, instances: int):
    """Rank `rank`'s microbatch with instance-contiguous data: instance o gets the o-th 1/R of the global batch
    (what `hfsdp.recipes.data.microbatch(..., instances=R)` does), so its data does not depend on its rank count."""
    inner = world // instances
    chunk = (rank // inner) * (count * inner) + index * inner + rank % inner
    x, y = global_batch(step)
    size = GLOBAL_BATCH // (count * world)
    return x[chunk * size : (chunk + 1) * size], y[chunk * size : (chunk + 1) * size]


def train_step(sharded, opt, batch) -> torch.Tensor:
    """One optimizer step over MICROBATCHES microbatches, `batch(index)` giving each; this rank's summed loss."""
    total = accumulate(sharded, MICROBATCHES, lambda index: sharded(*batch(index)))
    opt.step()
    opt.zero_grad()
    return total


def shard_toy(world, outer, inner, instances, diloco=None, is_expert=None, experts=False, mp=None):
    from hfsdp.core import fully_shard
    from hfsdp.core.engine.mesh import build_meshes
    from hfsdp.core.rules.config import LayoutConfig

    extra = {}
    if experts:
        extra = {"num_moe_experts": 1, "expert_outer": outer, "expert_instances": instances}
    cfg = LayoutConfig(world_size=world, inner=inner, outer=outer, instances=instances, **extra)
    model = make_toy()
    kwargs = {"is_expert": is_expert} if is_expert is not None else {}
    return fully_shard(model, cfg, build_meshes(cfg, "cpu"), units=list(model.layers), diloco=diloco, mp=mp, **kwargs)


def group_states(sharded) -> list[dict]:
    """Every group's main weights and outer state (None without DiLoCo) on this rank, with its geometry."""
    from hfsdp.core import sharding_of

    sharding = sharding_of(sharded)
    out = []
    states = sharding.outer.states if sharding.outer is not None else [None] * len(sharding.groups)
    for group, state in zip(sharding.groups, states, strict=True):
        if state is None:
            out.append(
                {
                    "coord": tuple(group.coord),
                    "padded": group.padded,
                    "optim_range": group.optim_range,
                    "main": group.main.detach().clone(),
                    "root": group.unit_index == len(sharding.units) - 1,
                }
            )
            continue
        momentum = sharding.outer.momentum(state)
        out.append(
            {
                "coord": tuple(group.coord),
                "padded": group.padded,
                "optim_range": group.optim_range,
                "outer_range": group.flat.outer_range,
                "fragment": state.fragment,
                "main": group.main.detach().clone(),
                "theta": state.theta.detach().clone(),
                "momentum": None if momentum is None else momentum.clone(),
                "anchor": None if state.anchor is None else state.anchor.clone(),
                "root": group.unit_index == len(sharding.units) - 1,
            }
        )
    return out


def diloco_run(rank, world, layout, diloco, steps, optimizer="adamw", data=microbatch, record=False):
    """Train `steps` steps; return losses, the states before training, before each outer step and after each step,
    and (with `record`) every collective of each step."""
    import torch.distributed as dist

    from hfsdp.core import sharding_of
    from hfsdp.core.buffers.collectives import record_comms

    from tests.support.toy_models import OPTIMIZERS

    outer, inner, instances = layout
    sharded = shard_toy(world, outer, inner, instances, diloco)
    opt = (OPTIMIZERS[optimizer] if isinstance(optimizer, str) else optimizer)(sharded.parameters())
    before_outer = []
    opt.register_step_post_hook(
        lambda *_: before_outer.append([g.main.detach().clone() for g in sharding_of(sharded).groups])
    )
    initial = group_states(sharded)
    after, losses, comms = [], [], []
    extra = () if data is microbatch else (instances,)
    for step in range(steps):
        with record_comms() as log:
            total = train_step(sharded, opt, lambda i, step=step: data(step, i, MICROBATCHES, rank, world, *extra))
        dist.all_reduce(total)
        losses.append(total.item() / (MICROBATCHES * world))
        after.append(group_states(sharded))
        if record:
            comms.append([(r.op, r.axis, r.group_size, r.numel, r.element_size) for r in log.records])
    return {
        "losses": losses,
        "initial": initial,
        "before_outer": before_outer,
        "after": after,
        "comms": comms,
        "outer_bytes": sharding_of(sharded).outer.state_bytes() if sharding_of(sharded).outer is not None else 0,
        "state_bytes": sharding_of(sharded).state_bytes(),
    }


def assemble(ranks: list[list[dict]], key: str, index: int, instances: int) -> list[torch.Tensor]:
    """Instance o's whole flat buffer of group `index` from its ranks' `key` pieces (over their optimizer range)."""
    padded = ranks[0][index]["padded"]
    out = [torch.full((padded,), float("nan")) for _ in range(instances)]
    for states in ranks:
        state = states[index]
        lo, hi = state["optim_range"]
        out[state["coord"][0] if instances > 1 else 0][lo:hi] = state[key]
    assert not any(torch.isnan(t).any() for t in out), "a piece of an instance's buffer is missing"
    return out


class OuterReference:
    """The outer optimizer of one model, unsharded: whole flat buffers per group, in one process."""

    def __init__(self, initial: list[torch.Tensor], config, pieces: int, instances: int):
        from hfsdp.core.outer.outer_codec import Codec

        self.config, self.pieces, self.instances = config, pieces, instances
        self.theta = [torch.nn.Parameter(t.clone()) for t in initial]
        self.anchor = [t.clone() for t in initial] if config.anchored else None
        self.codecs = [Codec(config.comm_dtype, t.numel() // pieces) for t in initial]
        self.opt = torch.optim.SGD(self.theta, lr=config.lr, momentum=config.momentum, nesterov=config.uses_nesterov)

    def _roundtrip(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        codec = self.codecs[index]
        return codec.decode(codec.encode(flat.view(self.pieces, -1))).reshape(-1)

    def sync(self, groups: list[int], local: dict[int, list[torch.Tensor]]) -> dict[int, torch.Tensor]:
        """The outer step of `groups` given every instance's weights (`local[g][o]`); the new weights of each."""
        with torch.no_grad():
            for g in groups:
                anchor = None if self.anchor is None else self.anchor[g]
                rows = [self._roundtrip(g, x if anchor is None else x - anchor) for x in local[g]]
                mean = rows[0].clone()
                for row in rows[1:]:
                    mean += row
                mean /= self.instances
                theta = self.theta[g].detach()
                self.theta[g].grad = theta - mean if anchor is None else (theta - anchor) - mean
            self.opt.step()
            out = {}
            for g in groups:
                self.theta[g].grad = None
                theta = self.theta[g].detach()
                if self.anchor is None:
                    out[g] = self._roundtrip(g, theta)
                else:
                    self.anchor[g] += self._roundtrip(g, theta - self.anchor[g])
                    out[g] = self.anchor[g].clone()
            return out

    def momentum(self, g: int) -> torch.Tensor | None:
        return self.opt.state[self.theta[g]].get("momentum_buffer")
