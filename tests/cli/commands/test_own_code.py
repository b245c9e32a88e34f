"""A Hugging Face directory that names its own Python code (`auto_map`) is refused by every command that loads one,
even with a `y` waiting on stdin for transformers' "run the custom code? [y/N]": the code never runs, no prompt is
printed, and the refusal is one paragraph naming the directory and the classes (`hfsdp.models.hf_code`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hfsdp.models.hf_code import tokenizer_code_problem

from tests.support.tiny_tokenizer import tiny_tokenizer

HFSDP = str(Path(sys.executable).parent / "hfsdp")
PROMPT = "Do you wish to run the custom code"


def _planted(directory: Path, marker: Path) -> None:
    """evil.py: writes `marker` the moment it is imported, then defines what auto_map names."""
    (directory / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig, PreTrainedTokenizerFast\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )


def _edit(file: Path, **keys) -> None:
    data = json.loads(file.read_text()) if file.is_file() else {}
    file.write_text(json.dumps({**data, **keys}))


def _hfsdp(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([HFSDP, *map(str, args)], input="y\n", capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_data_prepare_refuses_a_tokenizer_that_runs_its_own_code(tmp_path, where):
    """config.json's AutoConfig (a model_type transformers does not know), or tokenizer_config.json's AutoTokenizer
    (a class it does not have): transformers would ask and, on the `y`, run evil.py. Refused, exit 1, nothing run or
    written, no prompt."""
    tok, marker = tiny_tokenizer(tmp_path / "tok"), tmp_path / "MARKER"
    _planted(tok, marker)
    if where == "config.json":
        _edit(tok / "config.json", model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"})
        named = "AutoConfig: evil.EvilConfig"
    else:
        _edit(tok / where, tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "evil.EvilTokenizer"]})
        named = "AutoTokenizer: evil.EvilTokenizer"
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "some text"}) + "\n")
    done = _hfsdp("data", "prepare", "c.jsonl", "--tokenizer", tok, "--output", "out/c", cwd=tmp_path)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert not marker.exists(), "the directory's own code ran"
    said = done.stdout + done.stderr
    assert PROMPT not in said and "Traceback" not in said and not (tmp_path / "out").exists()
    assert f"--tokenizer {tok} names its own Python code in auto_map ({named})" in done.stderr
    assert "hfsdp never runs a directory's own code" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_ckpt_import_refuses_a_model_only_its_own_code_builds(tmp_path):
    """A model_type transformers does not know, with the auto_map that would build it: the same paragraph."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model, marker = tmp_path / "m", tmp_path / "MARKER"
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(model)
    _planted(model, marker)
    auto = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    _edit(model / "config.json", model_type="evil", auto_map=auto)
    done = _hfsdp("ckpt", "import", model, tmp_path / "ck", "--world-size", "1", cwd=tmp_path)
    assert done.returncode == 2 and not marker.exists(), (done.stdout, done.stderr)  # as any model it cannot import
    assert PROMPT not in done.stdout + done.stderr and "Traceback" not in done.stderr
    assert "names its own Python code in auto_map (AutoConfig: evil.EvilConfig, AutoModelForCausalLM" in done.stderr
    assert not (tmp_path / "ck").exists()


def test_an_auto_map_transformers_does_not_need_is_not_refused(tmp_path):
    """A model directory whose config.json keeps an auto_map for a model_type transformers has its own classes for
    (many hub models do) is a tokenizer directory like any other: nothing of its own would run."""
    tok = tiny_tokenizer(tmp_path / "tok")
    _edit(tok / "config.json", model_type="llama", auto_map={"AutoConfig": "x.Y", "AutoModelForCausalLM": "x.Z"})
    assert tokenizer_code_problem(tok) is None
    _edit(tok / "config.json", auto_map={"AutoConfig": "x.Y", "AutoTokenizer": [None, "x.T"]})
    assert "AutoTokenizer: x.T" in tokenizer_code_problem(tok)
