"""A Hugging Face `config.json`, read as untrusted input: the one reader for `train --model-config`,
`ckpt import`, `validate-config` and the planner.

A config.json comes from anywhere, and each way it can be wrong used to fail in its
own place: a FIFO hung the reader, `/dev/zero` ate memory, NaN trained to a NaN loss,
`num_attention_heads: 0` raised ZeroDivisionError inside transformers, a million layers
took minutes to build on the `meta` device, a vocabulary of 1e12 failed in every rank's
allocator. So, before transformers sees it:

- the file is a regular file (or a link to one: the hub cache is links), at most
  `MAX_JSON_BYTES`, parsed by `safe_json` (finite numbers, unique keys, bounded
  nesting);
- it is an object naming its `model_type`;
- every size is a whole number within the documented bounds (`sizes.py`), and so
  is the whole model; heads divide evenly, rotary embeddings get an even number of
  channels, top-k routing has that many experts; norms' epsilons and the rotary
  base are positive.

`config_problems` checks a dict, so the same checks run on the file's raw contents
(cheap: no torch, no transformers) and again on the transformers config built from
it (`config.to_dict()`), which fills in the architecture's defaults for the keys the
file left out. Every message starts with where the value came from.
"""

from __future__ import annotations

import os
import reprlib
import stat
from pathlib import Path
from typing import Any

from hfsdp.models.safe_json import JsonError, loads
from hfsdp.models.sizes import ModelSizes, check_sizes

CONFIG_NAME = "config.json"
#: Far above any real config.json (a few KiB; some MiB with a huge id2label) or weight map (~100 KiB for 1000 tensors).
MAX_JSON_BYTES = 64 << 20
MAX_DEPTH = 64

#: config.json key -> the kind of size it is (`sizes.LIMITS`); None values mean "derived" and are allowed.
SIZE_KEYS = {
    "vocab_size": "vocab",
    "hidden_size": "hidden",
    "intermediate_size": "ffn",
    "moe_intermediate_size": "ffn",
    "num_hidden_layers": "layers",
    "num_attention_heads": "heads",
    "num_key_value_heads": "kv_heads",
    "head_dim": "head_dim",
    "num_local_experts": "experts",  # Mixtral
    "num_experts": "experts",  # Qwen2/3-MoE, OLMoE
    "num_experts_per_tok": "experts",
}
#: Keys that are derived when absent or null (transformers computes them from the others).
OPTIONAL = {"num_key_value_heads", "head_dim", "moe_intermediate_size", "num_local_experts", "num_experts"}
POSITIVE_KEYS = ("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon", "rope_theta")
ROPE_KEYS = ("rope_theta", "rope_parameters", "rope_scaling")

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60
_repr.maxlevel, _repr.maxlist, _repr.maxdict = 2, 4, 4


class HFModelError(ValueError):
    """A config.json that cannot be turned into a causal language model hfsdp can shard."""


class HFConfigUnreadable(HFModelError):
    """The file itself cannot be used (missing, not a regular file, too large, unreadable, not JSON): a path problem,
    which the commands report as such (exit 2), apart from a config whose values are wrong (exit 1)."""


def read_json_file(file: Path, what: str, listed_by: Path | None = None) -> Any:
    """The JSON in `file` (a regular file, at most MAX_JSON_BYTES, plain finite JSON), or HFModelError."""
    check_regular(file, what, listed_by)
    if os.stat(file).st_size > MAX_JSON_BYTES:  # refused without reading it; the capped read below is the guard
        raise HFConfigUnreadable(f"{file} is larger than {MAX_JSON_BYTES} bytes, far beyond any {what}.")
    try:
        with open(file, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except OSError as err:
        raise HFConfigUnreadable(f"Cannot read {file} ({err.strerror or err}); check the path and rights.") from None
    if len(raw) > MAX_JSON_BYTES:
        raise HFConfigUnreadable(f"{file} is larger than {MAX_JSON_BYTES} bytes, far beyond any {what}.")
    try:
        return loads(raw, MAX_DEPTH)
    except JsonError as err:
        raise HFConfigUnreadable(f"{file} cannot be read as the {what}: {err}.") from None


def check_regular(file: Path, what: str, listed_by: Path | None = None) -> None:
    """`file` exists and is (or links to) a regular file: never open a FIFO (it blocks) or a device (endless)."""
    try:
        mode = os.stat(file).st_mode
    except FileNotFoundError:
        by = f", which {listed_by} lists," if listed_by is not None else ""
        raise HFConfigUnreadable(f"The {what} {file}{by} is missing (or a dangling link).") from None
    except OSError as err:
        raise HFConfigUnreadable(f"Cannot look at {file} ({err.strerror or err}); check the path and rights.") from None
    if not stat.S_ISREG(mode):
        raise HFConfigUnreadable(f"The {what} {file} is not a regular file (a directory, FIFO or device).")


def config_file(path: str | Path) -> Path:
    """The config.json `path` means: the file itself, or the one inside a model directory."""
    path = Path(path)
    return path / CONFIG_NAME if path.is_dir() else path


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The checked contents of the config.json at `path` (a file, or a directory holding one), or HFModelError
    naming the file and the first problem."""
    file = config_file(path)
    data = read_json_file(file, "model config")
    check_hf_config(data, str(file))
    return data


def check_hf_config(data: object, source: str) -> None:
    """Raise HFModelError with every problem of `data` (a config.json's contents) in one paragraph, if any."""
    problems = config_problems(data, source)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise HFModelError(f"{problems[0]}{more}; correct the config.json, or give another.")


def config_problems(data: object, source: str) -> list[str]:
    """Every problem of `data` as a config.json hfsdp can train, each a sentence starting with `source`."""
    if not isinstance(data, dict):
        return [f"{source} holds no JSON object, so it is not a model config"]
    if not isinstance(data.get("model_type"), str):
        return [
            f"{source} has no 'model_type'; a Hugging Face config.json names its architecture there "
            '(e.g. "model_type": "llama")'
        ]
    said = lambda key: f"{source}: {key} {_shown(data[key])}"  # noqa: E731
    sizes = {
        key: (kind, data[key])
        for key, kind in SIZE_KEYS.items()
        if key in data and not (key in OPTIONAL and data[key] is None)
    }
    problems = check_sizes(sizes, model_sizes(data))
    bad = {key for key, _ in problems}
    problems += _relations(data, {key: value for key, (_, value) in sizes.items() if key not in bad})
    for key in POSITIVE_KEYS:
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
            problems.append((key, "must be a positive number"))
    return [f"{said(key)} {wrong}" for key, wrong in problems]


def _relations(data: dict[str, Any], good: dict[str, int]) -> list[tuple[str, str]]:
    """The sizes against each other (each already within its bounds)."""
    problems = []
    hidden, heads = good.get("hidden_size"), good.get("num_attention_heads")
    kv, head_dim = good.get("num_key_value_heads"), good.get("head_dim")
    if head_dim is None and "head_dim" not in good and hidden is not None and heads is not None and hidden % heads:
        problems.append(
            ("hidden_size", f"is not divisible by num_attention_heads {heads}: every head gets hidden/heads channels")
        )
    if heads is not None and kv is not None and heads % kv:
        problems.append(
            (
                "num_key_value_heads",
                f"does not divide num_attention_heads {heads}: each key/value head serves whole heads",
            )
        )
    derived = hidden // heads if hidden is not None and heads is not None and not hidden % heads else None
    dim = head_dim if head_dim is not None else derived
    factor = data.get("partial_rotary_factor", 1.0)
    if dim is not None and any(k in data for k in ROPE_KEYS) and isinstance(factor, int | float):
        rotary = int(dim * factor)
        if rotary % 2:
            # A head_dim transformers derived from the other two is the user's hidden_size and heads.
            own = head_dim is not None and head_dim != derived
            what = "is odd" if own else f"gives {heads} heads of {dim} channels, an odd number"
            part = f" (its rotary part, partial_rotary_factor {factor}, is {rotary})" if factor != 1 else ""
            problems.append(
                (
                    "head_dim" if own else "hidden_size",
                    f"{what}{part}: rotary position embeddings rotate pairs of channels, so a head needs an even "
                    "number of them",
                )
            )
    experts = good.get("num_local_experts", good.get("num_experts"))
    topk = good.get("num_experts_per_tok")
    if topk is not None and experts is not None and topk > experts:
        problems.append(("num_experts_per_tok", f"routes each token to more experts than the {experts} there are"))
    return problems


def model_sizes(data: dict[str, Any]) -> ModelSizes | None:
    """The parameter-shaping sizes of a config, or None when some is missing or not a whole number."""

    def whole(key: str, default: object = None) -> int | None:
        value = data.get(key, default)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    hidden, heads = whole("hidden_size"), whole("num_attention_heads")
    vocab, layers, ffn = whole("vocab_size"), whole("num_hidden_layers"), whole("intermediate_size")
    if None in (hidden, heads, vocab, layers, ffn):
        return None
    experts = whole("num_local_experts") or whole("num_experts") or 0
    return ModelSizes(
        vocab=vocab,
        hidden=hidden,
        ffn=(whole("moe_intermediate_size") or ffn) if experts else ffn,
        layers=layers,
        heads=heads,
        kv_heads=whole("num_key_value_heads") or heads,
        head_dim=whole("head_dim") or max(1, hidden // heads),
        experts=experts,
        tied=data.get("tie_word_embeddings") is True,
    )


def _shown(value: object) -> str:
    return _repr.repr(value).encode("ascii", "backslashreplace").decode("ascii")
