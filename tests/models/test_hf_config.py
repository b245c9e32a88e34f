"""The one reader of Hugging Face config.json files (`hfsdp.models.hf_config`), and that `train --model-config`
and `ckpt import` both go through it: the same refusal, in the same words, before transformers or any rank
sees the file. Each bad file here once hung a command, ate its memory, trained to NaN or failed inside every
rank with a traceback."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hfsdp.cli.main import app
from hfsdp.models.hf_config import MAX_JSON_BYTES, HFConfigUnreadable, HFModelError, read_hf_config

from tests.support.runs import LLAMA

runner = CliRunner()


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _huge(path: Path) -> None:
    with open(path, "wb") as f:  # sparse: 100 MB that cost no disk
        f.truncate(100 << 20)


def _text(text: str):
    return lambda path: path.write_text(text)


def _config(**changes):
    return _text(json.dumps({**LLAMA, **changes}))


#: case -> (how to write config.json, words of the refusal)
BAD = {
    "a FIFO": (_fifo, "is not a regular file"),
    "/dev/zero": (_dev_zero, "is not a regular file"),
    "100 MB": (_huge, f"is larger than {MAX_JSON_BYTES} bytes"),
    "a million layers": (_config(num_hidden_layers=1_000_000), "num_hidden_layers 1000000 is above 1,024"),
    "no heads": (_config(num_attention_heads=0), "num_attention_heads 0 must be at least 1"),
    "100,000-deep nesting": (_text("[" * 100_000 + "]" * 100_000), "nested too deeply"),
    "NaN": (_text(json.dumps({**LLAMA, "rms_norm_eps": float("nan")})), "non-finite number NaN"),
    "a vocabulary of 1e12": (_config(vocab_size=10**12), "vocab_size 1000000000000 is above 4,194,304"),
    "an MLP of 1e12": (_config(intermediate_size=10**12), "intermediate_size 1000000000000 is above 262,144"),
    "an odd rotary head dim": (_config(hidden_size=12, num_key_value_heads=4, rope_theta=1e4), "4 heads of 3 channels"),
    "kv heads that do not divide": (_config(num_key_value_heads=3), "does not divide num_attention_heads 4"),
    "top-k above the experts": (
        _config(model_type="mixtral", num_local_experts=2, num_experts_per_tok=3),
        "routes each token to more experts than the 2 there are",
    ),
    "a negative epsilon": (_config(rms_norm_eps=-1e-6), "rms_norm_eps -1e-06 must be a positive number"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_configs_are_refused_at_once_by_the_reader_train_and_import(tmp_path, case):
    """The reader refuses each bad config.json in milliseconds; `hfsdp train --model-config` refuses it with exit 2
    when the file itself cannot be used (a FIFO, too large, not plain JSON: a path problem) and exit 1 when a value
    in it is wrong, and `hfsdp ckpt import` with exit 2, in one line each holding the reader's own message, before
    any rank or any weight; nothing is written."""
    write, words = BAD[case]
    model = tmp_path / "model"
    model.mkdir()
    write(model / "config.json")
    began = time.monotonic()
    with pytest.raises(HFModelError) as err:
        read_hf_config(model)
    assert time.monotonic() - began < 10  # at once: nothing read past the bound, no FIFO waited on
    message = str(err.value)
    assert words in message and str(model / "config.json") in message and "\n" not in message

    train = runner.invoke(app, ["train", "--model-config", str(model / "config.json"), "--device", "cpu"])
    assert train.exit_code == (2 if isinstance(err.value, HFConfigUnreadable) else 1), train.output
    assert train.output == f"error: --model-config: {message}\n"

    imported = runner.invoke(app, ["ckpt", "import", str(model), str(tmp_path / "ck"), "--world-size", "2"])
    assert imported.exit_code == 2, imported.output
    assert message in " ".join(imported.output.split()) and len(imported.output.strip().splitlines()) == 1
    assert not (tmp_path / "ck").exists() and [p.name for p in tmp_path.iterdir()] == ["model"]


def test_validate_config_reads_the_model_config_too(tmp_path):
    """A config file naming a Hugging Face config (`model.hf_config`) is refused by validate-config for what is
    wrong inside that file, in the reader's words, without torch."""
    (tmp_path / "llama.json").write_text(json.dumps({**LLAMA, "num_attention_heads": 0}))
    run = tmp_path / "run.yaml"
    run.write_text(f"parallel: {{world_size: 2}}\nmodel: {{hf_config: {tmp_path / 'llama.json'}}}\n")
    result = runner.invoke(app, ["validate-config", str(run)])
    assert result.exit_code == 1
    assert "model.hf_config: " in result.output and "num_attention_heads 0 must be at least 1" in result.output


def test_defaults_transformers_fills_in_are_checked_as_well(tmp_path):
    """A config.json that leaves head_dim out gets the architecture's own (hidden / heads) from transformers: an
    odd one is refused just the same, naming the defaults."""
    from hfsdp.models import hf

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "hidden_size": 12, "num_key_value_heads": 4}))
    with pytest.raises(HFModelError, match=r"with LlamaConfig's defaults\): hidden_size 12 gives 4 heads of 3"):
        hf.load_config(path)


def test_a_good_config_reads_as_it_is(tmp_path):
    """A valid config.json comes back as its dict; a directory means its config.json."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert read_hf_config(tmp_path) == read_hf_config(tmp_path / "config.json") == LLAMA
