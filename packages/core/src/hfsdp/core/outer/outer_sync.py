"""DiLoCo's outer step: every H inner steps the instances meet, over the axis along which they train apart.

Between two outer steps each instance trains alone (its placements along a `diloco` axis are
Independent, so `comm_plan.py` gives that axis no per-step collective). The outer step of one
group, on the rank at (o, i) whose inner optimizer piece is P (Ψ/N elements) and whose outer
piece is the o-th of R equal chunks of P (Ψ/(N·R), the `Shard(0)` of the table's outer column):

1. each rank encodes, chunk by chunk, its weights θ_o minus the anchor A (exactly: θ_o, with no
   anchor) and sends chunk j to the rank of instance j (one all-to-all over the axis);
2. the rank sums the R chunks it got in instance order, in fp32, and divides by R: the mean;
   the pseudo-gradient is Δ = (θ_g − A) − mean (exactly: θ_g − mean(θ_o)), the global weights
   minus the mean of the instances' own;
3. a `torch.optim.SGD` (Nesterov, lr 0.7, momentum 0.9 by default) steps θ_g with Δ as its
   gradient, on this rank's outer piece only: θ_g and the momentum are 8 bytes an element of
   Ψ/(N·R), never of the whole model;
4. the update U = θ_g − A (exactly: θ_g) is encoded and all-gathered over the axis; every rank
   of every instance then holds the same new weights over P: A + U (exactly: θ_g), which become
   its main weights, and the compute weights are republished.

Why an all-to-all and not a reduce-scatter: the receiver sums what it got itself, in a fixed
order and in fp32, so the outer step is the same bits on any backend and mesh (the tests check
it against `torch.optim.SGD` run on whole tensors in one process), and the chunks may travel
compressed (bf16, int8 with per-block scales), which a backend's reduce-scatter cannot sum. A
ring reduce-scatter sends the same α(R) of the buffer.

The anchor: a lossy exchange needs the pseudo-gradient before it is encoded, so every rank keeps
A, the weights every instance started the cycle from (fp32, over P: 4Ψ/N bytes). Error feedback
of the broadcast comes with it: θ_g stays exact on its owner, the instances hold A, and the next
pseudo-gradient measures from θ_g, so the rounding of one update is sent again with the next.
The rounding of the instances' chunks is not fed back (that would cost another 4Ψ/N a rank).

Streaming DiLoCo: the units are cut into F contiguous fragments of about equal size; fragment f
syncs after inner steps t with t mod H = ((f + 1) H / F) mod H (`DiLoCoConfig.offset`), so each
outer exchange carries one fragment. The inner optimizer and its state are left alone throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hfsdp.core.buffers.flat_group import FlatParamGroup
from hfsdp.core.buffers.flat_layout import FlatLayout
from hfsdp.core.outer.outer_codec import Codec
from hfsdp.core.outer.outer_config import DiLoCoConfig


@dataclass(eq=False)
class GroupOuter:
    """One group's outer state: θ_g over its outer piece (an nn.Parameter the outer SGD steps), the anchor over its
    optimizer piece (None when the exchange is exact), its fragment, and the axis the instances lie along."""

    group: FlatParamGroup
    fragment: int
    axis: int
    theta: nn.Parameter
    anchor: torch.Tensor | None
    codec: Codec

    @property
    def instances(self) -> int:
        return self.group.layout.axes[self.axis].size

    @property
    def within(self) -> slice:
        """The outer piece as a slice of the optimizer piece (`main`, the anchor)."""
        return FlatLayout.within(self.group.optim_range, self.group.flat.outer_range)


@dataclass(frozen=True)
class OuterPiece:
    """Elements [start, stop) of parameter `name` in this rank's outer piece, and where they are in `state`'s theta."""

    name: str
    start: int
    stop: int
    state: GroupOuter
    offset: int  # in the outer piece


class OuterSync:
    """The outer state of every group of one sharded model, the fragment schedule and the outer step."""

    def __init__(self, config: DiLoCoConfig, groups: list[FlatParamGroup], units: int):
        self.config = config
        self._steps = 0  # inner optimizer steps done: where each fragment is in its cycle
        self.synced_at = [0] * config.fragments  # the step count at each fragment's last outer step
        fragment_of_unit = fragments(_unit_sizes(groups, units), config.fragments)
        self.states: list[GroupOuter] = []
        for group in groups:
            (axis,) = group.plan.outer_sync
            lo, hi = group.flat.outer_range
            main = group.master_weights()  # fp32 (joined where kept as a bf16 shard plus a remainder)
            theta = nn.Parameter(main[FlatLayout.within(group.optim_range, (lo, hi))].detach().clone())
            anchor = main.detach().clone() if config.anchored else None
            codec = Codec(config.comm_dtype, hi - lo)
            self.states.append(GroupOuter(group, fragment_of_unit[group.unit_index], axis, theta, anchor, codec))
        self.optimizer = torch.optim.SGD(
            [s.theta for s in self.states],
            lr=config.lr,
            momentum=config.momentum,
            nesterov=config.uses_nesterov,
        )
        if config.momentum > 0:  # a zero buffer steps exactly as torch's first step without one: buf = grad
            for s in self.states:
                self.optimizer.state[s.theta]["momentum_buffer"] = torch.zeros_like(s.theta)

    # -- the schedule ------------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        return self._steps

    @steps.setter
    def steps(self, value: int) -> None:
        """Set the optimizer steps done (a resume): each fragment's last outer step is its last scheduled one."""
        self._steps = value
        h = self.config.sync_every
        self.synced_at = [max(0, value - (value - self.config.offset(f)) % h) for f in range(self.config.fragments)]

    def inner_step_done(self) -> list[FlatParamGroup]:
        """Count one inner optimizer step; run the outer step of the fragments now due (collective). Returns the
        groups whose main weights it rewrote (the caller republishes them)."""
        self._steps += 1
        return self.sync(self.config.due(self._steps))

    def sync(self, due: list[int] | None = None) -> list[FlatParamGroup]:
        """The outer step of fragments `due` (when None: every fragment not synced since the last inner step), in
        group order on every rank (collective)."""
        if due is None:
            due = [f for f in range(self.config.fragments) if self.synced_at[f] != self._steps]
        for fragment in due:
            self.synced_at[fragment] = self._steps
        due_now = set(due)
        states = [s for s in self.states if s.fragment in due_now]
        if not states:
            return []
        with torch.no_grad():
            for state in states:
                state.theta.grad = self._pseudo_gradient(state)
            self.optimizer.step()
            for state in states:
                state.theta.grad = None
                self._broadcast(state)
        return [s.group for s in states]

    # -- one group's outer step ----------------------------------------------------------------------

    def _pseudo_gradient(self, state: GroupOuter) -> torch.Tensor:
        """Δ on this rank's outer piece: θ_g minus the mean of every instance's weights (all-to-all over the axis)."""
        group, count = state.group, state.instances
        main = group.master_weights()
        rows = main if state.anchor is None else main - state.anchor
        payload = state.codec.encode(rows.view(count, -1))
        received = torch.empty_like(payload)
        group.comms.all_to_all(state.axis, received, payload)
        decoded = state.codec.decode(received)
        mean = decoded[0].clone()
        for row in decoded[1:]:  # instance order: the same sum on every backend
            mean += row
        mean /= count
        theta = state.theta.detach()
        if state.anchor is None:
            return theta - mean
        return (theta - state.anchor[state.within]) - mean

    def _broadcast(self, state: GroupOuter) -> None:
        """All-gather the new global weights (or their update over the anchor) over the axis into the main weights."""
        group, count = state.group, state.instances
        theta = state.theta.detach()
        update = theta if state.anchor is None else theta - state.anchor[state.within]
        mine = state.codec.encode(update.view(1, -1))
        gathered = torch.empty((count, mine.shape[1]), dtype=mine.dtype, device=mine.device)
        group.comms.all_gather(state.axis, gathered.view(-1), mine.view(-1))
        new = state.codec.decode(gathered).reshape(-1)
        if state.anchor is None:
            group.write_master(0, new)
        else:
            state.anchor += new
            group.write_master(0, state.anchor)

    # -- the state, for checkpoints and state dicts ------------------------------------------------------

    def restart_from_main(self) -> None:
        """Make the main weights the global ones (θ_g and the anchor from them), keeping the momentum: after the
        weights were written from outside (a state dict, a checkpoint without outer state)."""
        with torch.no_grad():
            for state in self.states:
                main = state.group.master_weights()
                state.theta.copy_(main[state.within])
                if state.anchor is not None:
                    state.anchor.copy_(main)

    def momentum(self, state: GroupOuter) -> torch.Tensor | None:
        return self.optimizer.state[state.theta].get("momentum_buffer")

    def pieces(self) -> list[OuterPiece]:
        """This rank's outer piece cut at parameter boundaries, in group order (pieces with no element left out)."""
        out = []
        for state in self.states:
            lo, hi = state.group.flat.outer_range
            for slot in state.group.slots:
                start, stop = max(lo, slot.offset), min(hi, slot.stop)
                if start < stop:
                    out.append(OuterPiece(slot.global_name, start - slot.offset, stop - slot.offset, state, start - lo))
        return out

    def state_bytes(self) -> int:
        """Bytes of outer state on this rank: θ_g, the momentum and the anchor."""
        total = 0
        for state in self.states:
            total += state.theta.numel() * 4
            momentum = self.momentum(state)
            total += 0 if momentum is None else momentum.numel() * 4
            total += 0 if state.anchor is None else state.anchor.numel() * 4
        return total


def _unit_sizes(groups: list[FlatParamGroup], units: int) -> list[int]:
    sizes = [0] * units
    for group in groups:
        sizes[group.unit_index] += group.numel
    return sizes


def fragments(sizes: list[int], count: int) -> list[int]:
    """The fragment of each unit: `count` contiguous runs of units, none empty, whose largest sum of `sizes` is as
    small as it can be (so each outer exchange carries about 1/count of the model)."""
    units = len(sizes)
    if count > units:
        raise ValueError(
            f"DiLoCo's fragments {count} is more than the model's {units} units (its layers and the root): each "
            f"fragment is a run of whole units. Use at most {units} fragments."
        )
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[f][u]: the smallest largest part when units u.. are cut into f parts; cut[f][u]: where the first ends.
    inf = float("inf")
    best = [[inf] * (units + 1) for _ in range(count + 1)]
    cut = [[units] * (units + 1) for _ in range(count + 1)]
    best[0][units] = 0
    for f in range(1, count + 1):
        for u in range(units - f, -1, -1):
            for end in range(u + 1, units - f + 2):
                value = max(prefix[end] - prefix[u], best[f - 1][end])
                if value < best[f][u]:
                    best[f][u], cut[f][u] = value, end
    out, u = [], 0
    for f in range(count, 0, -1):
        end = cut[f][u]
        out += [count - f] * (end - u)
        u = end
    return out
