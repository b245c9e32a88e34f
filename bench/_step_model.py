"""The model every engine of bench_step.py trains, and its data: the same seeded megatron-core GPT or transformers
Llama, cast, compiled and recomputed alike for every engine, and the same synthetic batches.

One module, so that no engine builds its model its own way: a difference here would be a difference in the rows.
"""

from __future__ import annotations

import torch

SEED = 1234


def gpt_shape(args):
    from hfsdp.models.megatron.gpt import GPTShape

    return GPTShape(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        vocab_size=args.vocab,
        seq_length=args.seq_len,
    )


def llama_config(args):
    from transformers import LlamaConfig

    ffn = args.ffn or (8 * args.hidden // 3 + 255) // 256 * 256
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def build_model(cfg, shape, device: torch.device, init_groups: bool = True, on_device: bool = False):
    """The same model for every engine, seeded. GPT: megatron-core groups for `cfg` (collective; the plain
    engine, rank 0 alone, reuses the ones already built), re-initialised by name. A Llama is initialised on the
    CPU, or with `on_device` on the device itself (the weights then differ from a CPU-built model's, but are the
    same for every engine)."""
    if not hasattr(shape, "num_layers"):  # a transformers config
        from hfsdp.models import hf

        if on_device:
            return hf.build_causal_lm(shape, seed=SEED, device=device)
        return hf.build_causal_lm(shape, seed=SEED).to(device)
    from hfsdp.models.megatron.adapter import expert_naming_for, initialize_parallel
    from hfsdp.models.megatron.cpu_shim import seed_megatron
    from hfsdp.models.megatron.gpt import build_gpt, reinit_by_global_name

    if init_groups:
        initialize_parallel(cfg)
    seed_megatron(SEED)
    model = build_gpt(shape)
    reinit_by_global_name(model, expert_naming_for(cfg), SEED)
    return model.to(device)


def cast_parameters(model, dtype: torch.dtype | None) -> None:
    """The parameters alone into the compute dtype, as a mixed-precision engine computes with them: `model.to` would
    cast the buffers too, and a Llama's rotary inverse frequencies in bf16 move a 3B model's first loss by 2e-3."""
    if dtype is not None:
        for param in model.parameters():
            param.data = param.data.to(dtype)


def units_of(model) -> list:
    return list(model.model.layers) if hasattr(model, "model") else list(model.decoder.layers)


#: Set by --liger: the output projection and the loss are one Liger kernel, which never builds the logits.
FUSED_LINEAR_CROSS_ENTROPY = False


def loss_of(model, tokens, labels):
    if hasattr(getattr(model, "module", model), "model"):  # a transformers causal LM, sharded or not
        from hfsdp.models.hf import causal_lm_loss

        if FUSED_LINEAR_CROSS_ENTROPY:  # Liger's forward: `shift_labels` are the next tokens, as `labels` here
            return model(input_ids=tokens, shift_labels=labels, use_cache=False, skip_logits=True).loss
        return causal_lm_loss(model, tokens, labels)
    from hfsdp.models.megatron.gpt import lm_loss

    return lm_loss(model, tokens, labels)


#: Liger's kernels --liger applies (and --liger-without may leave out); flce: the output projection fused with the loss.
LIGER_KERNELS = ("rope", "rms_norm", "swiglu", "flce")


def apply_liger(without: tuple[str, ...] = ()) -> None:
    """Patch transformers' Llama with Liger's kernels, before any model is built (the classes change)."""
    global FUSED_LINEAR_CROSS_ENTROPY
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    kept = {k: k not in without for k in LIGER_KERNELS}
    apply_liger_kernel_to_llama(rope=kept["rope"], rms_norm=kept["rms_norm"], swiglu=kept["swiglu"],
                                cross_entropy=False, fused_linear_cross_entropy=kept["flce"])  # fmt: skip
    FUSED_LINEAR_CROSS_ENTROPY = kept["flce"]


#: dynamo's recompile limit under --compile. Every unit compiled on its own shares one code object (the layer class's
#: forward), and each unit whose guards fail adds an entry to it: past the default limit of 8 dynamo silently runs
#: the remaining units eagerly (seen with torchao's float8 at 16 layers), and that engine's row is half eager.
RECOMPILE_LIMIT = 64


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> dict[str, int]:
    """Raise dynamo's recompile limit to at least `limit`, under both of its names (`cache_size_limit`, and
    `recompile_limit` where this torch has it); returns the values now in force."""
    import torch._dynamo

    config = torch._dynamo.config
    now = {}
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), limit))
            now[name] = getattr(config, name)
    return now


def maybe_compile(args, model) -> None:
    """torch.compile and/or activation recomputation of every unit, as the flags ask (every engine alike). Compiling
    raises dynamo's recompile limit first, so that no engine runs some of its units eagerly."""
    from hfsdp.core.engine.unit_forward import compile_units, recompute

    if args.compile:
        raise_recompile_limit()
    if args.compile and args.compile_style == "forward":
        compile_units(units_of(model))
    elif args.compile:
        for unit in units_of(model):
            unit.compile()
    if args.recompute:
        recompute(units_of(model))


def flops_per_token(model, shape) -> tuple[int, float]:
    """(parameter count, training FLOPs per token): 6 x matmul weights + 12 x layers x hidden x seq (attention)."""
    total = sum(p.numel() for p in model.parameters())
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n)
    layers = getattr(shape, "num_layers", None) or shape.num_hidden_layers
    seq = getattr(shape, "seq_length", None) or shape.max_position_embeddings
    return total, 6.0 * matmul + 12.0 * layers * shape.hidden_size * seq


def make_batches(shape, count_steps, gbs, microbatches, rank, dp, device):
    """Every step's microbatches for this rank, on the device (built before timing)."""
    from hfsdp.recipes.data import SyntheticTokens, microbatch

    seq = getattr(shape, "seq_length", None) or shape.max_position_embeddings
    data = SyntheticTokens(shape.vocab_size, seq, seed=SEED)
    out = []
    for step in range(count_steps):
        batch = data.global_batch(step, gbs)
        out.append(
            [tuple(t.to(device) for t in microbatch(batch, i, microbatches, rank, dp)) for i in range(microbatches)]
        )
    return out
