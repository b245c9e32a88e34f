"""The DiLoCo benchmark's model and data: a small Llama in plain torch, and Python's own source as bytes.

The model is Llama-shaped (RMSNorm, rotary positions, SwiGLU, untied embeddings) and needs
nothing but torch, so the benchmark runs on a machine without transformers. The text is every
`.py` file of the running interpreter's standard library (no site-packages), read as bytes
(vocabulary 256): on every machine, no download. Files are ordered by path; every 20th is
held out for evaluation, so the eval loss is measured on whole files the model never saw.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shape:
    hidden: int = 384
    layers: int = 6
    heads: int = 6
    ffn: int = 1024
    vocab: int = 256
    seq: int = 256


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        norm = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        return (x.float() * norm).type_as(x) * self.weight


def rotary(x, positions):
    """Rotate-half rotary embedding over the whole head (x: [batch, heads, seq, head_dim])."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    angles = positions[:, None].float() * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.heads = shape.heads
        self.attn_norm = RMSNorm(shape.hidden)
        self.qkv = nn.Linear(shape.hidden, 3 * shape.hidden, bias=False)
        self.proj = nn.Linear(shape.hidden, shape.hidden, bias=False)
        self.mlp_norm = RMSNorm(shape.hidden)
        self.gate_up = nn.Linear(shape.hidden, 2 * shape.ffn, bias=False)
        self.down = nn.Linear(shape.ffn, shape.hidden, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        positions = torch.arange(s, device=x.device)
        q, k = rotary(q, positions), rotary(k, positions)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = RMSNorm(shape.hidden)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * shape.layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def stdlib_bytes() -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train, held-out) byte streams of the standard library's .py files, and what they are."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    train, held = [], []
    for i, path in enumerate(files):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        (held if i % 20 == 0 else train).append(data)
    info = {"root": str(root), "files": len(files), "train": sum(map(len, train)), "held_out": sum(map(len, held))}
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8).clone()  # noqa: E731
    return as_tensor(train), as_tensor(held), info


def batch(stream: torch.Tensor, rows: int, seq: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` random windows of `seq + 1` bytes: (tokens, next tokens)."""
    starts = torch.randint(0, stream.numel() - seq - 1, (rows,), generator=generator)
    windows = stream[starts[:, None] + torch.arange(seq + 1)].long()
    return windows[:, :-1], windows[:, 1:]


def eval_windows(stream: torch.Tensor, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` windows spread evenly over the held-out stream: the same for every run."""
    starts = torch.linspace(0, stream.numel() - seq - 2, rows).long()
    windows = stream[starts[:, None] + torch.arange(seq + 1)].long()
    return windows[:, :-1], windows[:, 1:]
