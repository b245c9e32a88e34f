"""The rules between settings: what must hold of several settings together, each a full-sentence problem.

`train_config.resolve` checks a rule once every setting it names passed its own check (`settings.py`),
for `hfsdp train` and `hfsdp validate-config` alike. Adding a rule is one function and one `Rule` entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hfsdp.cli.settings import DILOCO_SETTINGS, GPT_SETTINGS


@dataclass(frozen=True)
class Rule:
    """A rule between settings, checked once each of `names` passed its own check.

    `check(values, said)` returns what is wrong or None; `said(name)` is how the user set a
    setting ("--hidden 30", "model.moe_router_topk 2 (the default)"), `said.name(name)` its
    spelling alone, and `said.explicit(name)` whether the user set it at all. The problem is
    reported under the first name. A rule may name layout settings (`outer`), checked once the
    layout is valid.
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


def _sgd_momentum_needs_sgd(v: dict[str, Any], said) -> str | None:
    if v["optimizer"] != "sgd" and said.explicit("sgd_momentum"):
        return f"{said('sgd_momentum')} applies to --optimizer sgd, but {said('optimizer')}; drop it or use sgd."
    return None


RULES: tuple[Rule, ...] = (
    *(_only_with_diloco(name) for name in DILOCO_SETTINGS),
    Rule(("sync_every", "outer"), _diloco_needs_sync_every),
    Rule(("sync_fragments", "sync_every", "outer"), _fragments_within_cycle),
    Rule(("sync_fragments", "layers", "model_config", "outer"), _fragments_within_units),
    Rule(("offload", "outer"), _diloco_without_offload),
    Rule(("sgd_momentum", "optimizer"), _sgd_momentum_needs_sgd),
    Rule(("model_config", *GPT_SETTINGS), _hf_model_excludes_gpt_flags),
    Rule(("num_query_groups", "heads"), _query_groups_divide_heads),
    Rule(("min_lr", "lr"), _min_lr_below_lr),
    Rule(("lr_warmup_iters", "lr_decay_style", "lr_decay_iters", "steps"), _warmup_before_decay_end),
    Rule(("hidden", "heads"), _heads_divide_hidden),
    Rule(("moe_topk", "num_moe_experts"), _topk_within_experts),
    _needs_save("save_every"),
    _needs_save("save_keep"),
)
