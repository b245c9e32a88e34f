"""The rules between settings: what must hold of several settings together, each a full-sentence problem.

`train_config.resolve` checks a rule once every setting it names passed its own check (`settings.py`),
for `hfsdp train` and `hfsdp validate-config` alike. Adding a rule is one function and one `Rule` entry.

They include everything megatron-core's `TransformerConfig`, transformers or the trainer itself would
refuse inside every rank (top-1 routing, an odd rotary head dimension, a one-token vocabulary), and the
documented bounds on sizes (`hfsdp.models.sizes`): `validate-config` promises that a valid file trains.
A `--model-config` file is read here too, by the torch-free reader `hfsdp.models.hf_config`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hfsdp.cli.settings.fp8_rules import FP8_CHECKS
from hfsdp.cli.settings.setting import parse_step_range
from hfsdp.cli.settings.settings import DILOCO_SETTINGS, GPT_SETTINGS, PRECISION_DTYPES
from hfsdp.models import sizes


@dataclass(frozen=True)
class Rule:
    """A rule between settings, checked once each of `names` passed its own check.

    `check(values, said)` returns what is wrong or None; `said(name)` is how the user set a
    setting ("--hidden 30", "model.moe_router_topk 2 (the default)"), `said.name(name)` its
    spelling alone, and `said.explicit(name)` whether the user set it at all. The problem is
    reported under the first name, or, when `check` returns a list of (name, message), each under
    its own. A rule may name layout settings (`outer`), checked once the layout is valid.
    """

    names: tuple[str, ...]
    check: Callable[[dict[str, Any], Callable[[str], str]], str | list[tuple[str, str]] | None]


def _heads_divide_hidden(v: dict[str, Any], said: Callable[[str], str]) -> str | None:
    if v["hidden"] % v["heads"]:
        return (
            f"{said('hidden')} is not divisible by {said('heads')}: every head gets hidden/heads channels; "
            f"choose a hidden size that is a multiple of {v['heads']}."
        )
    return None


def _topk_within_experts(v: dict[str, Any], said: Callable[[str], str]) -> str | None:
    experts = v["num_moe_experts"]
    if experts is not None and v["moe_topk"] > experts:
        return (
            f"{said('moe_topk')} routes each token to more experts than {said('num_moe_experts')} provides; "
            f"choose a top-k of at most {experts}."
        )
    return None


def _needs_save(name: str) -> Rule:
    def check(v: dict[str, Any], said: Callable[[str], str]) -> str | None:
        if v[name] is not None and v["save"] is None:
            return f"{said(name)} needs --save DIR to say where checkpoints go; add --save or drop it."
        return None

    return Rule((name, "save"), check)


def _hf_model_excludes_gpt_flags(v: dict[str, Any], said) -> str | None:
    if v["model_config"] is None:
        return None
    given = [n for n in GPT_SETTINGS if said.explicit(n)]
    if given:
        return (
            f"{said('model_config')} builds the model its config.json describes, but {said(given[0])} shapes the "
            "megatron-core GPT; drop the GPT's model settings, or drop --model-config to train the GPT."
        )
    return None


def _query_groups_divide_heads(v: dict[str, Any], said) -> str | None:
    groups = v["num_query_groups"]
    if groups is not None and v["heads"] % groups:
        return f"{said('num_query_groups')} does not divide {said('heads')}: each key/value head serves whole heads."
    return None


def _min_lr_below_lr(v: dict[str, Any], said) -> str | None:
    if v["min_lr"] > v["lr"]:
        return f"{said('min_lr')} is above {said('lr')}: the decay goes down from --lr to --min-lr."
    return None


def _warmup_before_decay_end(v: dict[str, Any], said) -> str | None:
    end = v["lr_decay_iters"] if v["lr_decay_iters"] is not None else v["steps"]
    if v["lr_decay_style"] != "constant" and v["lr_warmup_iters"] >= end:
        return (
            f"{said('lr_warmup_iters')} reaches the end of the decay at step {end} "
            f"({'--lr-decay-iters' if v['lr_decay_iters'] is not None else '--steps'}); warm up for fewer steps, or "
            "decay later."
        )
    return None


def _rotary_head_dim_even(v: dict[str, Any], said) -> str | None:
    if v["model_config"] is not None or v["hidden"] % v["heads"]:
        return None  # the GPT is not built, or _heads_divide_hidden reports it
    dim = v["hidden"] // v["heads"]
    if dim % 2:
        return (
            f"{said('hidden')} gives {said('heads')} heads of {dim} channels, an odd number: the GPT's rotary "
            "position embeddings rotate pairs of channels; choose a hidden size that is an even multiple of the "
            f"heads (e.g. {2 * v['heads'] * ((dim + 1) // 2)})."
        )
    return None


def _router_needs_two_experts(v: dict[str, Any], said) -> str | None:
    if v["num_moe_experts"] is not None and v["moe_topk"] == 1:
        return (
            f"{said('moe_topk')}: megatron-core refuses top-1 routing with the router hfsdp builds (a softmax over "
            "the one chosen expert is always 1, so the router would learn nothing); route each token to 2 or more "
            "experts."
        )
    return None


#: What the GPT's parameter count depends on (and --model-config, which replaces the GPT).
GPT_SIZES = ("vocab", "hidden", "layers", "heads", "num_query_groups", "num_moe_experts", "swiglu", "model_config")


def _gpt_sizes(v: dict[str, Any], said) -> list[tuple[str, str]] | None:
    """The GPT's sizes within the documented bounds (`hfsdp.models.sizes`)."""
    if v["model_config"] is not None:
        return None  # --model-config's file is checked by its own rule
    experts = v["num_moe_experts"] or 0
    values = {"vocab": ("vocab", v["vocab"]), "hidden": ("hidden", v["hidden"]), "layers": ("layers", v["layers"])}
    values["heads"] = ("heads", v["heads"])
    if experts:
        values["num_moe_experts"] = ("experts", experts)
    heads, groups = v["heads"], v["num_query_groups"] or v["heads"]
    model = sizes.ModelSizes(
        vocab=v["vocab"],
        hidden=v["hidden"],
        ffn=4 * v["hidden"],
        layers=v["layers"],
        heads=heads,
        kv_heads=groups,
        head_dim=max(1, v["hidden"] // heads),
        experts=experts,
        gated=v["swiglu"],
    )
    problems = []
    for name, text in sizes.check_sizes(values, model):
        problems.append((name, f"{said(name)} {text}."))
    return problems or None


def _batch_tokens(v: dict[str, Any], said) -> list[tuple[str, str]] | None:
    if sizes.limit_problem("seq_len", v["seq_len"]):
        return None  # _sequence_length says it
    found = sizes.check_batch(v["seq_len"], v["micro_batch_size"], v["global_batch_size"])
    problems = []
    for kind, text in found:
        name = f"{kind}_size"
        who = said(name) if said.explicit(name) else f"the global batch of {v[name]:,} sequences (the default)"
        problems.append((name, f"{who} with {said('seq_len')} {text}."))
    return problems or None


def _gpt_attention(v: dict[str, Any], said) -> str | None:
    if v["model_config"] is not None or sizes.limit_problem("seq_len", v["seq_len"]):
        return None  # transformers picks its own attention kernel; a sequence too long is reported by itself
    wrong = sizes.check_attention(v["seq_len"], v["micro_batch_size"], v["heads"])
    return f"{said('seq_len')} with {said('micro_batch_size')} and {said('heads')} {wrong}." if wrong else None


def _sequence_length(v: dict[str, Any], said) -> str | None:
    wrong = sizes.limit_problem("seq_len", v["seq_len"])
    return f"{said('seq_len')} {wrong}; train on shorter sequences." if wrong else None


def _hf_config_file(v: dict[str, Any], said) -> list[tuple[str, str]] | None:
    """--model-config: a config.json the torch-free reader accepts, with positions for --seq-len."""
    if v["model_config"] is None:
        return None
    from hfsdp.models.hf_config import HFConfigUnreadable, HFModelError, read_hf_config

    try:
        data = read_hf_config(v["model_config"])
    except HFConfigUnreadable:
        return None  # a path that cannot be used: the pre-launch checks report it (exit 2), as for --load
    except HFModelError as err:
        return [("model_config", str(err))]
    longest = data.get("max_position_embeddings")
    if isinstance(longest, int) and not isinstance(longest, bool) and v["seq_len"] > longest:
        return [("seq_len", seq_len_beyond_positions(said("seq_len"), longest, v["model_config"]))]
    return None


def seq_len_beyond_positions(seq_len: str, longest: int, source: str) -> str:
    return (
        f"{seq_len} is longer than the {longest} positions {source} allows (max_position_embeddings); train on "
        "shorter sequences."
    )


def _only_with_diloco(name: str) -> Rule:
    """A DiLoCo setting the user gave needs `--outer diloco`: otherwise it would be silently ignored."""

    def check(v: dict[str, Any], said) -> str | None:
        if v["outer"] != "diloco" and said.explicit(name):
            return (
                f"{said(name)} is a DiLoCo setting, but {said('outer')} reduces across instances every step; set "
                f"{said.name('outer')} to diloco (with {said.name('instances')} > 1) to train the instances apart, "
                "or drop it."
            )
        return None

    return Rule((name, "outer", "instances"), check)


def _diloco_needs_sync_every(v: dict[str, Any], said) -> str | None:
    if v["outer"] == "diloco" and v["sync_every"] is None:
        return (
            f"{said('outer')} needs {said.name('sync_every')} H: how many optimizer steps the instances train "
            "apart between two outer steps (DiLoCo used 500; at small scale 50 is a start). Set it."
        )
    return None


def _fragments_within_cycle(v: dict[str, Any], said) -> str | None:
    if v["outer"] == "diloco" and v["sync_every"] is not None and v["sync_fragments"] > v["sync_every"]:
        return (
            f"{said('sync_fragments')} is more than {said('sync_every')}: the fragments sync at staggered steps of "
            f"one cycle of H steps; use at most {v['sync_every']} fragments."
        )
    return None


def _fragments_within_units(v: dict[str, Any], said) -> str | None:
    """Each fragment is a run of whole units (the GPT's layers and its root); an HF model is checked in preflight."""
    if v["outer"] == "diloco" and v["model_config"] is None and v["sync_fragments"] > v["layers"] + 1:
        return (
            f"{said('sync_fragments')} is more than the model's {v['layers'] + 1} units ({said('layers')} and the "
            f"root): each fragment is a run of whole units; use at most {v['layers'] + 1} fragments."
        )
    return None


def _diloco_without_offload(v: dict[str, Any], said) -> str | None:
    if v["outer"] == "diloco" and v["offload"] != "none":
        return (
            f"{said('offload')} cannot be combined with {said('outer')} yet: the outer step exchanges the main "
            "weights, which offload keeps in host memory; drop --offload."
        )
    return None


def _fraction_needs_offload(v: dict[str, Any], said) -> str | None:
    if said.explicit("offload_fraction") and v["offload"] != "optim":
        return (
            f"{said('offload_fraction')} says how much of the optimizer state goes to host memory, but "
            f"{said('offload')} keeps it all on the device; add --offload optim, or drop --offload-fraction."
        )
    return None


def _sgd_momentum_needs_sgd(v: dict[str, Any], said) -> str | None:
    if v["optimizer"] != "sgd" and said.explicit("sgd_momentum"):
        return f"{said('sgd_momentum')} applies to --optimizer sgd, but {said('optimizer')}; drop it or use sgd."
    return None


def _adam_kernel_of_adam(v: dict[str, Any], said) -> str | None:
    if v["adam_kernel"] == "auto":
        return None
    if v["optimizer"] != "adam":
        return f"{said('adam_kernel')} chooses the AdamW of --optimizer adam, but {said('optimizer')}; drop it."
    if v["adam_kernel"] == "fused" and v["outer"] == "diloco":
        return (
            f"{said('adam_kernel')} clips by the norm over every rank, but with {said('outer')} each instance "
            "clips its own gradients; use --adam-kernel torch (or auto)."
        )
    return None


def _overlap_step_needs_fused_adamw(v: dict[str, Any], said) -> str | None:
    if not v["overlap_step"]:
        return None
    if v["optimizer"] != "adam" or v["adam_kernel"] == "torch":
        used = said("optimizer") if v["optimizer"] != "adam" else said("adam_kernel")
        return (
            f"{said('overlap_step')} overlaps hfsdp's FusedAdamW step with the next forward, but {used}; drop it, or "
            "use --optimizer adam with --adam-kernel fused (or auto)."
        )
    if v["outer"] == "diloco" or v["offload"] != "none":
        used = said("outer") if v["outer"] == "diloco" else said("offload")
        return f"{said('overlap_step')} needs FusedAdamW on the GPU, which {used} does not use; drop it."
    if v["dtype"] != "bf16":
        return (
            f"{said('overlap_step')} overlaps the step that writes the next forward's bf16 weights, but "
            f"{said('dtype')} computes with the fp32 weights the step itself updates; drop it or use --dtype bf16."
        )
    return None


def _precision_needs_the_flag(name: str) -> Rule:
    """Megatron's rule: without use_precision_aware_optimizer every precision dtype is fp32 (main_params_dtype's only
    other value, fp16, is refused by a rule of its own, with or without it). One rule per dtype, each on its own."""

    def check(v: dict[str, Any], said) -> str | None:
        if v["use_precision_aware_optimizer"] or v[name] == "fp32":
            return None
        flag = said.name("use_precision_aware_optimizer")
        turn_on = f"{flag}: true" if "." in flag else flag
        return (
            f"{said(name)} needs the precision-aware optimizer, which is off ({said('use_precision_aware_optimizer')}"
            f"); as in Megatron, a dtype other than fp32 applies only with it: add {turn_on}, or set "
            f"{said.name(name)} to fp32."
        )

    return Rule((name, "use_precision_aware_optimizer"), check)


def _main_params_fp16(v: dict[str, Any], said) -> str | None:
    if v["main_params_dtype"] == "fp16":
        return (
            f"{said('main_params_dtype')} is not implemented: hfsdp keeps exact fp32 main weights (the optimizer "
            "steps them; with bf16 compute the forward reads a bf16 copy), and fp16 masters would need loss scaling, "
            f"which it does not do; set {said.name('main_params_dtype')} to fp32 (the default): fp32 masters are used."
        )
    return None


def _precision_aware_optimizer_is_fused_adamw(v: dict[str, Any], said) -> str | None:
    """The precision-aware optimizer is hfsdp's FusedAdamW: Adam (Megatron's rule), on the ranks' pieces, clipping
    by the norm over every rank."""
    if not v["use_precision_aware_optimizer"]:
        return None
    flag, kernel = said("use_precision_aware_optimizer"), said.name("adam_kernel")
    fused = f"{kernel}: fused" if "." in kernel else f"{kernel} fused"
    if v["optimizer"] != "adam":
        optimizer = said.name("optimizer")
        adam = f"{optimizer}: adam" if "." in optimizer else f"{optimizer} adam"
        return (
            f"{flag} keeps AdamW's state in lower precision, but {said('optimizer')} has no such state (Megatron "
            f"supports it only with adam); use {adam} (its AdamW is hfsdp's FusedAdamW, {fused} or auto), or drop it."
        )
    if v["adam_kernel"] == "torch":
        return (
            f"{flag} is hfsdp's FusedAdamW keeping its moments and reading its gradients in the dtypes asked, but "
            f"{said('adam_kernel')} is torch's AdamW, which keeps fp32 state; use {fused} (or auto), or drop it."
        )
    if v["outer"] == "diloco":
        return (
            f"{flag} needs hfsdp's FusedAdamW, which clips by the norm over every rank, but with {said('outer')} each "
            "instance clips its own gradients with torch's AdamW; drop it, or train without DiLoCo."
        )
    return None


def _turn(said, name: str, value: str) -> str:
    """How the user would set `name` to `value`: '--dtype bf16' as a flag, 'train.dtype: bf16' in a file (a switch's
    flag alone for true)."""
    spelled = said.name(name)
    if "." in spelled:
        return f"{spelled}: {value}"
    return spelled if value == "true" else f"{spelled} {value}"


def _remainders_need_the_precision_aware_optimizer(v: dict[str, Any], said) -> str | None:
    if v["use_precision_aware_optimizer"]:
        return None
    return (
        f"{said('store_param_remainders')} keeps the fp32 main weights as bf16 weights plus 16-bit remainders inside "
        f"the precision-aware optimizer's step, which is off ({said('use_precision_aware_optimizer')}); as in "
        f"Megatron, it applies only with it: add {_turn(said, 'use_precision_aware_optimizer', 'true')}, or drop "
        f"{said.name('store_param_remainders')}."
    )


def _remainders_need_bf16(v: dict[str, Any], said) -> str | None:
    if v["dtype"] == "bf16":
        return None
    return (
        f"{said('store_param_remainders')} keeps each fp32 main weight as the bf16 weight the forward computes with "
        f"plus the 16 bits bf16 drops, so it needs bf16 compute, but {said('dtype')} computes with the fp32 main "
        f"weights themselves; add {_turn(said, 'dtype', 'bf16')}, or drop {said.name('store_param_remainders')}."
    )


def _remainders_need_fp32_masters(v: dict[str, Any], said) -> str | None:
    if v["main_params_dtype"] == "fp32":
        return None
    return (
        f"{said('store_param_remainders')} splits fp32 main weights into a bf16 weight and a 16-bit remainder, but "
        f"{said('main_params_dtype')} asks for other masters; as in Megatron, it applies only to fp32 ones: set "
        f"{said.name('main_params_dtype')} to fp32 (the default), or drop {said.name('store_param_remainders')}."
    )


def _remainders_without_offload(v: dict[str, Any], said) -> str | None:
    if v["offload"] == "none":
        return None
    return (
        f"{said('store_param_remainders')} keeps the main weights' upper half as the bf16 weights on the device, but "
        f"{said('offload')} keeps the main weights in host memory (off the device already); drop "
        f"{said.name('offload')}, or drop {said.name('store_param_remainders')}."
    )


def _remainders_without_overlap_step(v: dict[str, Any], said) -> str | None:
    if not v["overlap_step"]:
        return None
    return (
        f"{said('store_param_remainders')} cannot be combined with {said('overlap_step')}: the overlapped step "
        "writes the next forward's bf16 weights into a buffer of their own, while with remainders the step writes "
        f"the bf16 weights the gathers read in place, so there is nothing to overlap; drop {said.name('overlap_step')}"
        f", or drop {said.name('store_param_remainders')}."
    )


#: What --store-param-remainders depends on; its problems are reported under it, the first that applies.
REMAINDER_SETTINGS = ("store_param_remainders", "use_precision_aware_optimizer", "dtype", "main_params_dtype",
                      "offload", "overlap_step")  # fmt: skip
_REMAINDER_CHECKS = (
    _remainders_need_the_precision_aware_optimizer,
    _remainders_need_bf16,
    _remainders_need_fp32_masters,
    _remainders_without_offload,
    _remainders_without_overlap_step,
)


def _store_param_remainders(v: dict[str, Any], said) -> str | None:
    """Megatron's store_param_remainders: with the precision-aware optimizer, bf16 compute and fp32 masters on the
    device, and (hfsdp's own limit, core's `kernels/remainder_groups.py`) without the overlapped step; with DiLoCo
    the precision-aware optimizer itself is refused.
    One paragraph, the first problem found, as the precision-aware optimizer's own rule reports."""
    if not v["store_param_remainders"]:
        return None
    return next((found for check in _REMAINDER_CHECKS if (found := check(v, said)) is not None), None)


def remainders_by_default(v: dict[str, Any], said) -> bool:
    """Whether a run that leaves store_param_remainders unset keeps its masters as bf16 weights plus remainders:
    as Megatron's default, wherever asking for it would be accepted (the rules above, from the precision-aware
    optimizer on)."""
    return _store_param_remainders({**v, "store_param_remainders": True}, said) is None


def _profile_steps_within_run(v: dict[str, Any], said) -> str | None:
    if v["profile_dir"] is None:
        if said.explicit("profile_steps"):
            return f"{said('profile_steps')} says which steps --profile-dir records, but there is none; add it."
        return None
    _, last = parse_step_range(str(v["profile_steps"]))
    if last > v["steps"]:
        return (
            f"{said('profile_steps')} ends after the run's last step ({said('steps')}), so the profile would never "
            f"be written; choose steps up to {v['steps']}."
        )
    return None


def _restarts_resume_from_save(v: dict[str, Any], said) -> str | None:
    if v["max_restarts"] and v["save"] is None:
        return (
            f"{said('max_restarts')} resumes every restart from the run's own checkpoints, but there is no --save; "
            "add --save DIR (and --save-every K), or drop --max-restarts."
        )
    return None


def _min_nproc_needs_restarts(v: dict[str, Any], said) -> str | None:
    if v["min_nproc"] is not None and not v["max_restarts"]:
        return (
            f"{said('min_nproc')} says how small a restart may shrink the run, but there are no restarts; add "
            "--max-restarts N."
        )
    return None


def _async_save_needs_save(v: dict[str, Any], said) -> str | None:
    if v["async_save"] and v["save"] is None:
        return "--async-save needs --save DIR to say where checkpoints go; add --save or drop --async-save."
    return None


RULES: tuple[Rule, ...] = (
    *(_only_with_diloco(name) for name in DILOCO_SETTINGS),
    Rule(("sync_every", "outer"), _diloco_needs_sync_every),
    Rule(("sync_fragments", "sync_every", "outer"), _fragments_within_cycle),
    Rule(("sync_fragments", "layers", "model_config", "outer"), _fragments_within_units),
    Rule(("offload", "outer"), _diloco_without_offload),
    Rule(("sgd_momentum", "optimizer"), _sgd_momentum_needs_sgd),
    Rule(("adam_kernel", "optimizer", "outer"), _adam_kernel_of_adam),
    Rule(("overlap_step", "optimizer", "adam_kernel", "outer", "offload", "dtype"), _overlap_step_needs_fused_adamw),
    *(_precision_needs_the_flag(name) for name in PRECISION_DTYPES if name != "main_params_dtype"),
    Rule(("main_params_dtype",), _main_params_fp16),
    Rule(
        ("use_precision_aware_optimizer", "optimizer", "adam_kernel", "outer"),
        _precision_aware_optimizer_is_fused_adamw,
    ),
    *(Rule(names, check) for names, check in FP8_CHECKS),
    Rule(REMAINDER_SETTINGS, _store_param_remainders),
    Rule(("offload_fraction", "offload"), _fraction_needs_offload),
    Rule(("profile_steps", "profile_dir", "steps"), _profile_steps_within_run),
    Rule(("model_config", *GPT_SETTINGS), _hf_model_excludes_gpt_flags),
    Rule(("num_query_groups", "heads"), _query_groups_divide_heads),
    Rule(("min_lr", "lr"), _min_lr_below_lr),
    Rule(("lr_warmup_iters", "lr_decay_style", "lr_decay_iters", "steps"), _warmup_before_decay_end),
    Rule(("hidden", "heads"), _heads_divide_hidden),
    Rule(("moe_topk", "num_moe_experts"), _topk_within_experts),
    Rule(("moe_topk", "num_moe_experts"), _router_needs_two_experts),
    Rule(("hidden", "heads", "model_config"), _rotary_head_dim_even),
    Rule(GPT_SIZES, _gpt_sizes),
    Rule(("seq_len",), _sequence_length),
    Rule(("seq_len", "micro_batch_size", "global_batch_size"), _batch_tokens),
    Rule(("seq_len", "micro_batch_size", "heads", "model_config"), _gpt_attention),
    Rule(("model_config", "seq_len"), _hf_config_file),
    _needs_save("save_every"),
    _needs_save("save_keep"),
    Rule(("max_restarts", "save"), _restarts_resume_from_save),
    Rule(("min_nproc", "max_restarts"), _min_nproc_needs_restarts),
    Rule(("async_save", "save"), _async_save_needs_save),
)
