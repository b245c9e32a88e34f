"""A small model whose Linear layers fp8 can take (features multiples of 16), and its data.

Three residual MLP blocks (the units) between an input projection and a scalar head, in bf16. A
norm weight of 8 elements beside each block's two weights makes every flat group need padding on
meshes of 3, 4 and 6 ranks.
"""

from __future__ import annotations

import torch
from torch import nn

WIDTH, HIDDEN, BATCH = 32, 48, 96


class Fp8Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)
        self.gate = nn.Linear(WIDTH, 8, bias=False)  # a router: stays in bf16

    def forward(self, x):
        h = self.up(self.norm(x))
        return x + self.down(torch.nn.functional.gelu(h)) + self.gate(x).mean(-1, keepdim=True)


class Fp8Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.layers = nn.ModuleList(Fp8Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        h = self.inp(x.to(self.inp.weight.dtype))
        for layer in self.layers:
            h = layer(h)
        return ((self.head(h).squeeze(-1).float() - y) ** 2).mean()


def make_fp8_toy(seed: int = 0, dtype=torch.float32) -> Fp8Toy:
    torch.manual_seed(seed)
    return Fp8Toy().to(dtype)


def fp8_batch(step: int, rank: int, world: int, index: int = 0, count: int = 1):
    """Rank `rank`'s microbatch `index` of `count` of step `step`'s global batch (rows of 16 tokens each)."""
    gen = torch.Generator().manual_seed(2000 + step)
    x, y = torch.randn(BATCH, 16, 8, generator=gen), torch.randn(BATCH, 16, generator=gen)
    size = BATCH // (count * world)
    chunk = index * world + rank
    return x[chunk * size : (chunk + 1) * size], y[chunk * size : (chunk + 1) * size]


def run_microbatches(model, step: int, rank: int, world: int, count: int) -> list[float]:
    """Forward and backward of this rank's `count` microbatches of step `step` on a sharded model (hfsdp scales by
    `set_microbatch`); their losses."""
    losses = []
    for index in range(count):
        model.set_microbatch(index, count)
        loss = model(*fp8_batch(step, rank, world, index, count))
        loss.backward()
        losses.append(loss.item())
    return losses
