"""The rules between settings: what must hold of several settings together, each a full-sentence problem.

`train_config.resolve` checks a rule once every setting it names passed its own check (`settings.py`),
for `hfsdp train` and `hfsdp validate-config` alike. Adding a rule is one function and one `Rule` entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hfsdp.cli.settings import GPT_SETTINGS


@dataclass(frozen=True)
class Rule:
    """A rule between settings, checked once each of `names` passed its own check.

    `check(values, said)` returns what is wrong or None; `said(name)` is how the user set a
    setting ("--hidden 30", "model.moe_router_topk 2 (the default)") and `said.explicit(name)`
    whether the user set it at all. The problem is reported under the first name.
    """

    names: tuple[str, ...]
    check: Callable[[dict[str, Any], Callable[[str], str]], str | None]


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
    Rule(("model_config", *GPT_SETTINGS), _hf_model_excludes_gpt_flags),
    Rule(("num_query_groups", "heads"), _query_groups_divide_heads),
    Rule(("min_lr", "lr"), _min_lr_below_lr),
    Rule(("lr_warmup_iters", "lr_decay_style", "lr_decay_iters", "steps"), _warmup_before_decay_end),
    Rule(("hidden", "heads"), _heads_divide_hidden),
    Rule(("moe_topk", "num_moe_experts"), _topk_within_experts),
    _needs_save("save_every"),
    _needs_save("save_keep"),
    Rule(("max_restarts", "save"), _restarts_resume_from_save),
    Rule(("min_nproc", "max_restarts"), _min_nproc_needs_restarts),
    Rule(("async_save", "save"), _async_save_needs_save),
)
