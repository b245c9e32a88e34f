"""A Hugging Face directory's own code (`auto_map`), which hfsdp never runs: the one loader of tokenizers and the
one check of configs.

A `config.json` or `tokenizer_config.json` may name Python classes that live in the directory itself (`auto_map`).
Where transformers has no class of its own for what it loads, it asks "run the custom code? [y/N]" on stdin (on a
terminal for 15 s, drawn over hfsdp's progress bar), and a `y` imports the directory's `.py` files: preparing a
dataset or importing a checkpoint would run whatever the directory's author wrote. So every tokenizer hfsdp loads
goes through `load_tokenizer`, which refuses such a directory before transformers is imported and passes
`trust_remote_code=False` (transformers then never asks, for a hub name either), and every model config through
`model_code_problem` (`hfsdp.models.hf.config_from_dict`: `train --model-config` and `ckpt import`). A refusal is
one paragraph naming the file and the classes: what transformers would build in their place is not what the
author made, so the user decides, not a default.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hfsdp.models.hf_config import CONFIG_NAME, HFConfigUnreadable, HFModelError, read_json_file

TOKENIZER_CONFIG = "tokenizer_config.json"


class OwnCodeError(HFModelError):
    """A tokenizer or model that only the directory's own Python code can build."""


def auto_map(data: object) -> dict[str, str]:
    """The classes `data` (a config's contents) names in its `auto_map`, as {"AutoTokenizer": "module.Class"}; the
    legacy list form of tokenizer_config.json is its AutoTokenizer (slow, fast) pair."""
    found = data.get("auto_map") if isinstance(data, dict) else None
    if found is None or found == {} or found == []:
        return {}
    if isinstance(found, list | tuple):
        found = {"AutoTokenizer": found}
    if not isinstance(found, dict):
        return {"auto_map": _short(found)}
    out = {}
    for key, value in found.items():
        names = [v for v in value if v] if isinstance(value, list | tuple) else [value]
        out[str(key)] = ", ".join(_short(v) for v in names) or "null"
    return out


def known_model_type(model_type: object) -> bool:
    """Whether transformers builds `model_type` with its own classes (no directory code needed)."""
    from transformers import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def model_code_problem(data: dict, source: str) -> str | None:
    """The refusal for a model config whose architecture only its `auto_map` code builds (a model_type transformers
    does not know), else None. A known model_type is built by transformers' own class, as transformers itself does
    with trust_remote_code=False."""
    named = auto_map(data)
    if not named or known_model_type(data.get("model_type")):
        return None
    return refusal(
        source,
        named,
        "this model",
        "use a model whose model_type transformers knows (llama, qwen2, "
        "mistral, ...), or convert it to one where you trust its code",
    )


def tokenizer_code_problem(directory: Path, flag: str = "--tokenizer") -> str | None:
    """The refusal for a tokenizer directory whose tokenizer (AutoTokenizer in either file) or config (AutoConfig of
    a model_type transformers does not know) is the directory's own code, else None."""
    for name, keys in ((TOKENIZER_CONFIG, None), (CONFIG_NAME, ("AutoTokenizer", "AutoConfig"))):
        file = directory / name
        if not file.is_file():
            continue
        try:
            data = read_json_file(file, name)
        except HFConfigUnreadable:
            continue  # transformers says what is wrong with the file itself
        named = {k: v for k, v in auto_map(data).items() if keys is None or k in keys}
        if name == CONFIG_NAME and "AutoTokenizer" not in named and known_model_type(data.get("model_type")):
            named = {}  # transformers' own config class for a model_type it knows: no directory code runs
        if named:
            what = f"{flag} {directory}" if flag else str(directory)
            return refusal(
                what,
                named,
                "its tokenizer",
                f"remove the auto_map from {file} if the directory's "
                "tokenizer.json is the tokenizer you mean, or give a tokenizer directory without one",
            )
    return None


def refusal(source: str, named: dict[str, str], what: str, fix: str) -> str:
    classes = ", ".join(f"{k}: {v}" for k, v in named.items())
    return (
        f"{source} names its own Python code in auto_map ({classes}), which transformers would import and run to "
        f"build {what}; hfsdp never runs a directory's own code. To go on, {fix}."
    )


def load_tokenizer(name: str, flag: str = "--tokenizer"):
    """`AutoTokenizer.from_pretrained(name)` without ever running a directory's own code: refused before transformers
    is imported for a local directory, and by transformers itself (`trust_remote_code=False`) for a hub name.
    Raises OwnCodeError, ImportError (transformers missing) or whatever transformers raises."""
    path = Path(name)
    if path.is_dir() and (problem := tokenizer_code_problem(path, flag)):
        raise OwnCodeError(problem)
    for logger in ("transformers", "huggingface_hub"):
        logging.getLogger(logger).setLevel(logging.ERROR)  # no warnings about unused keys: a problem is an error
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise OwnCodeError(
            refusal(
                f"{flag} {name}",
                {"auto_map": "the repository's own classes"},
                "its tokenizer",
                "give a tokenizer transformers builds with its own classes (a directory with a tokenizer.json)",
            )
        ) from None


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."
