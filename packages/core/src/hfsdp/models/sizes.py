"""How large a model and a batch hfsdp trains: the documented bounds, checked before any rank starts.

A size that no rank could hold fails inside every rank with an allocator traceback, or
makes no progress at all (a billion-layer model takes minutes to build even on the
`meta` device). So every size a run is given (flags, a config file, a Hugging Face
`config.json`) is checked here first, with one message per size saying the bound and
what the run would have needed. The bounds sit far above every published model (the
largest public dense models have a vocabulary of 262,144, a hidden size of 16,384,
126 layers and 128 heads), so no real run meets them; they are what docs/cli.md lists.

The whole model is not bounded here: a 70B or 405B model is a valid config to plan, to
import and to describe. What limits it is the machine (`hfsdp train` builds the model
whole in fp32 on every rank before sharding it, and checks that the machine can, before
launch: `hfsdp.cli.checks.memory_check`). Nothing here imports torch or transformers:
`validate-config` and the planner call it for free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: kind -> (least, most, what it is). docs/cli.md lists the same table.
LIMITS: dict[str, tuple[int, int, str]] = {
    "vocab": (2, 1 << 22, "vocabulary size"),
    "hidden": (1, 1 << 16, "hidden size"),
    "ffn": (1, 1 << 18, "MLP (intermediate) size"),
    "layers": (1, 1024, "number of layers"),
    "heads": (1, 1024, "number of attention heads"),
    "kv_heads": (1, 1024, "number of key/value heads"),
    "head_dim": (1, 1 << 14, "head dimension"),
    "experts": (1, 1024, "number of experts"),
    "seq_len": (1, 1 << 20, "sequence length"),
}
#: Tokens of one global batch: every rank draws the whole batch (int64 tokens and labels) before taking its share.
MAX_BATCH_TOKENS = 1 << 27
#: Tokens of one microbatch on one rank: the activations of one forward.
MAX_MICROBATCH_TOKENS = 1 << 24
#: Attention scores of one microbatch where attention is computed unfused (the megatron-core GPT's local spec):
#: micro batch x heads x sequence length squared values, 16 GiB in fp32 at the bound.
MAX_ATTENTION_SCORES = 1 << 32


@dataclass(frozen=True)
class ModelSizes:
    """The sizes that fix a decoder-only transformer's parameter count."""

    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0  # 0: a dense MLP
    gated: bool = True  # SwiGLU: three MLP matrices, not two
    tied: bool = False  # one embedding matrix for input and output

    def parameters(self) -> int:
        """The parameter count, norms and biases aside (they are a few per cent of one layer)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = (3 if self.gated else 2) * self.hidden * self.ffn * max(1, self.experts)
        router = self.hidden * self.experts
        return self.layers * (attention + mlp + router) + (1 if self.tied else 2) * self.vocab * self.hidden


def limit_problem(kind: str, value: object) -> str | None:
    """What is wrong with `value` as a size of this kind, finishing a sentence that starts with its name, or None."""
    least, most, what = LIMITS[kind]
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be a whole number from {least} to {most:,}"
    if value < least:
        return f"must be at least {least}" + (": the data needs two tokens to draw from" if kind == "vocab" else "")
    if value > most:
        return f"is above {most:,}, the largest {what} hfsdp trains"
    return None


def check_sizes(
    values: Mapping[str, tuple[str, object]], model: ModelSizes | None = None
) -> list[tuple[str | None, str]]:
    """(name, what is wrong) for each size outside its bound: `values` maps the caller's name of a size (a flag, a
    config key) to (its kind, its value). A size too large also says what `model` (built from the same values, when
    they are whole numbers) would hold."""
    problems: list[tuple[str | None, str]] = []
    for name, (kind, value) in values.items():
        wrong = limit_problem(kind, value)
        if wrong:
            problems.append((name, wrong))
    if model is None or not problems:
        return problems
    params = model.parameters()
    need = f" (the model would hold {params:,} parameters, {_bytes(4 * params)} in fp32 on every rank)"
    return [(name, wrong + need if "is above" in wrong else wrong) for name, wrong in problems]


def check_batch(seq_len: int, micro_batch: int, global_batch: int) -> list[tuple[str, str]]:
    """(kind, what is wrong) for token counts no rank could hold: kind is "global_batch" or "micro_batch"."""
    problems = []
    tokens = seq_len * global_batch
    if tokens > MAX_BATCH_TOKENS:
        problems.append(
            (
                "global_batch",
                f"makes global batches of {tokens:,} tokens (global batch x sequence length), above the bound of "
                f"{MAX_BATCH_TOKENS:,}: every rank draws the whole batch, {_bytes(16 * tokens)} of token ids, before "
                "taking its share; use a smaller global batch or shorter sequences",
            )
        )
    micro = seq_len * micro_batch
    if micro > MAX_MICROBATCH_TOKENS:
        problems.append(
            (
                "micro_batch",
                f"makes microbatches of {micro:,} tokens on every rank (micro batch x sequence length), above the "
                f"bound of {MAX_MICROBATCH_TOKENS:,}; use a smaller micro batch (gradient accumulation keeps the "
                "global batch)",
            )
        )
    return problems


def check_attention(seq_len: int, micro_batch: int, heads: int) -> str | None:
    """What is wrong with an unfused attention of this shape (its scores are materialised), or None."""
    scores = micro_batch * heads * seq_len * seq_len
    if scores <= MAX_ATTENTION_SCORES:
        return None
    return (
        f"makes attention scores of {scores:,} values per layer and microbatch (micro batch x heads x sequence "
        f"length squared, {_bytes(4 * scores)} in fp32), above the bound of {MAX_ATTENTION_SCORES:,}: the "
        "megatron-core GPT computes attention unfused; use shorter sequences or a smaller micro batch"
    )


def _bytes(count: int) -> str:
    """`count` bytes in words: '3.1 GB', '512 TB'."""
    for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if count >= size:
            return f"{count / size:,.1f} {unit}"
    return f"{count:,} bytes"
