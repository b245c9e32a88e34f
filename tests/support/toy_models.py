"""A small model, its data, and the single-process plain-PyTorch reference the engine is checked against.

Sizes are odd on purpose (13, 16, 8 -> 1) so flat buffers need padding on every mesh. The global
batch (48) splits evenly over 4 and 6 ranks with 2 or 4 microbatches.
"""

from __future__ import annotations

import torch
from torch import nn

GLOBAL_BATCH = 48


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 13)
        self.down = nn.Linear(13, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Toy(nn.Module):
    """Input projection, three residual blocks (the units), a scalar head, and an MSE loss."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(Block(16) for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return ((self.head(h).squeeze(-1) - y) ** 2).mean()


def make_toy(seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    return Toy()


def global_batch(step: int):
    """The global batch of `step`: the same samples whatever the layout."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=gen), torch.randn(GLOBAL_BATCH, generator=gen)


def microbatch(step: int, index: int, count: int, rank: int, world: int):
    """Rank `rank`'s microbatch `index` of `count`: chunk index*world + rank of the global batch."""
    x, y = global_batch(step)
    size = GLOBAL_BATCH // (count * world)
    chunk = index * world + rank
    return x[chunk * size : (chunk + 1) * size], y[chunk * size : (chunk + 1) * size]


#: The optimizers the engine tests run, by name: the same constructor for the reference and the sharded model.
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1),
}


def reference_run(steps: int, optimizer: str = "adamw", clip: float | None = None):
    """Train the toy model in one process with a torch optimizer on whole global batches: losses, final parameters
    and, when `clip` is given, the gradient norms `clip_grad_norm_` returned (inf: the norm, unclipped)."""
    model = make_toy()
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses, norms = plain_steps(model, opt, lambda step: model(*global_batch(step)), steps, clip)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def plain_steps(model, opt, loss_at, steps: int, clip: float | None = None) -> tuple[list[float], list[float]]:
    """`steps` plain single-process optimizer steps on `loss_at(step)`: the losses, and the gradient norms
    `clip_grad_norm_` returned when `clip` is given."""
    losses, norms = [], []
    for step in range(steps):
        loss = loss_at(step)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def accumulated_loss(sharded, step: int, microbatches: int, rank: int, world: int) -> float:
    """Forward and backward of this rank's `microbatches` of `step` on a sharded toy (declared with
    `set_microbatch`); the global mean loss over every rank (collective)."""
    import torch.distributed as dist

    total = torch.zeros(())
    for index in range(microbatches):
        sharded.set_microbatch(index, microbatches)
        loss = sharded(*microbatch(step, index, microbatches, rank, world))
        loss.float().backward()
        total += loss.detach().float()
    dist.all_reduce(total)
    return total.item() / (microbatches * world)


def toy_steps(sharded, opt, rank: int, world: int, start: int, count: int, microbatches: int) -> list[float]:
    """Optimizer steps `start` .. `start + count - 1` of a sharded toy, each over `microbatches` microbatches: the
    global mean losses (collective)."""
    losses = []
    for step in range(start, start + count):
        losses.append(accumulated_loss(sharded, step, microbatches, rank, world))
        opt.step()
        opt.zero_grad()
    return losses


#: A transformers Llama small enough for many spawned ranks: 2 layers of width 32, GQA 4/2 heads, vocabulary 64.
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 32,
}
