"""The rules of FP8 training (`--fp8-format`, `--fp8-recipe`, `--fp8-min-size`, `--fp8-param-gather`), between its
settings and others.

Kept apart from `rules.py` so the fp8 choices read in one place; `rules.py` makes each `(names, check)` pair of
`FP8_CHECKS` a `Rule`, so they are checked by `train`, `validate-config` and `plan` alike, before any rank starts.
Each check names the flag or key as the user wrote it and says what to do. What only the machine can tell (a GPU
without fp8 tensor cores) is `checks/fp8_device.py`'s, in the pre-launch checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _set(said, name: str, value: str) -> str:
    """How the user would set `name` to `value`: '--fp8-format e4m3' as a flag, 'model.fp8: e4m3' in a file."""
    spelled = said.name(name)
    return f"{spelled}: {value}" if "." in spelled else f"{spelled} {value}"


def _needs_a_format(v: dict[str, Any], said) -> list[tuple[str, str]] | None:
    """--fp8-recipe, --fp8-min-size or --fp8-param-gather without --fp8-format: it would be silently ignored."""
    if v["fp8"] is not None:
        return None
    problems = []
    about = (
        ("fp8_recipe", "chooses how fp8 scales are taken"),
        ("fp8_min_size", "chooses which Linear layers are large enough for fp8"),
        ("fp8_param_gather", "gathers fp8 weights"),
    )
    for name, what in about:
        if said.explicit(name) and (name != "fp8_param_gather" or v[name]):
            problems.append(
                (
                    name,
                    f"{said(name)} {what}, but fp8 is off ({said.name('fp8')} is not set); turn it on with "
                    f"{_set(said, 'fp8', 'hybrid')} (or e4m3), or drop {said.name(name)}.",
                )
            )
    return problems or None


def _rowwise_has_no_hybrid(v: dict[str, Any], said) -> str | None:
    if v["fp8"] == "hybrid" and v["fp8_recipe"] == "rowwise":
        return (
            f"{said('fp8')} keeps gradients in e5m2, but {said('fp8_recipe')} scales gradients per row in e4m3 too, "
            "as torchao's rowwise recipe does (e5m2's extra range is what one scale per tensor needs, not one per "
            f"row), so rowwise has no hybrid form; use {_set(said, 'fp8', 'e4m3')} with rowwise, or "
            f"{_set(said, 'fp8_recipe', 'tensorwise')} with hybrid."
        )
    return None


def _param_gather_needs_tensorwise(v: dict[str, Any], said) -> str | None:
    if v["fp8"] is not None and v["fp8_param_gather"] and v["fp8_recipe"] != "tensorwise":
        return (
            f"{said('fp8_param_gather')} gathers each weight already quantized on its shard, which needs one scale "
            f"for the whole weight (the max of the shards' amaxes gives it exactly), but {said('fp8_recipe')} takes "
            f"one per row; use {_set(said, 'fp8_recipe', 'tensorwise')}, or drop {said.name('fp8_param_gather')}."
        )
    return None


def _needs_bf16(v: dict[str, Any], said) -> str | None:
    if v["fp8"] is not None and v["dtype"] != "bf16":
        return (
            f"{said('fp8')} needs bf16 compute, but {said('dtype')}: the fp8 matmuls take bf16 inputs and return bf16, "
            "and the layers fp8 leaves alone (embeddings, norms, attention, the output layer) run in bf16, as in "
            f"Megatron and torchao; add {_set(said, 'dtype', 'bf16')}, or drop {said.name('fp8')}."
        )
    return None


def _needs_a_hugging_face_model(v: dict[str, Any], said) -> str | None:
    if v["fp8"] is not None and v["model_config"] is None:
        return (
            f"{said('fp8')} converts the nn.Linear layers of a Hugging Face model, but without "
            f"{said.name('model_config')} the run builds the megatron-core GPT, whose layers are megatron's own "
            "parallel linears, which need TransformerEngine for fp8; train a Hugging Face model instead "
            f"({_set(said, 'model_config', 'PATH/config.json')}), or drop {said.name('fp8')}."
        )
    return None


#: (the settings a rule reads, the first being where its problem is reported; the check).
FP8_CHECKS: tuple[tuple[tuple[str, ...], Callable], ...] = (
    (("fp8", "fp8_recipe", "fp8_min_size", "fp8_param_gather"), _needs_a_format),
    (("fp8", "fp8_recipe"), _rowwise_has_no_hybrid),
    (("fp8_param_gather", "fp8", "fp8_recipe"), _param_gather_needs_tensorwise),
    (("fp8", "dtype"), _needs_bf16),
    (("fp8", "model_config"), _needs_a_hugging_face_model),
)
