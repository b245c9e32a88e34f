"""The model record: which model a checkpoint's weights belong to, so export can write what loads it.

An index may carry `"model": {"format": ..., "config": {...}}`:

- `"transformers"`: the config of a transformers causal LM (`config.to_dict()`);
  its parameter names are the names a `save_pretrained` directory uses;
- `"megatron-gpt"`: a megatron-core GPT's `GPTShape.record()`; a Llama-style one
  maps to transformers' Llama (`hfsdp.models.megatron.hf_adapter`).

The training loop passes it to `save_checkpoint`, `import_hf` writes it, reshard
carries it over; `export --format hf` needs it. The field is optional and the
format version stays 3: older indexes simply lack it.

Writers hand the record in as Python data, so `checked_record` makes sure it is
what a reader will accept (plain, bounded JSON with a known format) before a
byte is written, and keeps a copy of it, not the caller's object. Torch-free, so
`inspect` can describe the record (`describe`) in a fraction of a second.
"""

from __future__ import annotations

import json
from typing import Any

from hfsdp.ckpt.format.errors import CheckpointError
from hfsdp.ckpt.format.index import MEGATRON_GPT, MODEL_FORMATS, TRANSFORMERS
from hfsdp.ckpt.format.schema import SchemaError, parse_model_record
from hfsdp.models.safe_json import JsonError, loads

#: Nesting allowed inside the record: the index nests it 2 levels deep and allows 64 in all.
MAX_RECORD_DEPTH = 60


def checked_record(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """A copy of `record` as a reader will see it, or CheckpointError saying why it cannot be saved."""
    if record is None:
        return None
    usage = (
        f'pass {{"format": one of {", ".join(MODEL_FORMATS)}, "config": a dict}}, the config being '
        "config.to_dict() of a transformers config or GPTShape.record()"
    )
    try:
        raw = json.dumps(record, allow_nan=False).encode()
        return parse_model_record(loads(raw, MAX_RECORD_DEPTH))
    except (TypeError, ValueError, RecursionError) as err:  # JsonError and SchemaError are ValueErrors
        reason = str(err) if isinstance(err, JsonError | SchemaError) else f"it is not plain JSON data: {err}"
        raise CheckpointError(f"The model record cannot be saved ({reason}); {usage}. Nothing was written.") from None


def describe(record: dict[str, Any] | None) -> str:
    """One short line about the recorded model, for `inspect`."""
    if record is None:
        return "not recorded (export writes the consolidated state dict only)"
    config = record["config"]

    def number(*keys: str) -> Any:
        return next((config[k] for k in keys if isinstance(config.get(k), int | float)), "?")

    if record["format"] == TRANSFORMERS:
        head = f"transformers {config['model_type']}"
        layers, hidden = number("num_hidden_layers", "n_layer"), number("hidden_size", "n_embd")
    elif record["format"] == MEGATRON_GPT:
        head = f"megatron GPT ({config.get('normalization', '?')}, {'SwiGLU' if config.get('swiglu') else 'GELU'})"
        layers, hidden = number("num_layers"), number("hidden_size")
    else:  # the schema admits only the formats above
        head, layers, hidden = str(record["format"]), "?", "?"
    return f"{head}, {layers} layers, hidden {hidden}, vocab {number('vocab_size')}"
