"""From text to a trained model: `hfsdp train` on what `hfsdp data prepare` wrote.

The README's "Train on your own text" block runs as written in a temporary directory (model and corpus made by
`examples/model_and_corpus.py` from the standard library's own sources), and its loss on that real text ends below
the synthetic stream's starting loss from the same weights. Before launch, a dataset whose token ids do not fit the
model is refused with the tokenizer that made it named; the held-out set of `--validation-fraction` is what
`--eval-interval` evaluates on.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hfsdp.recipes.prepare.pipeline import Request, prepare

from tests.support.runs import records, tiny_llama
from tests.support.tiny_tokenizer import tiny_tokenizer

REPO = Path(__file__).resolve().parents[3]
HFSDP = str(Path(sys.executable).parent / "hfsdp")


def _readme_block() -> str:
    """The bash block under the README's "Train on your own text" heading."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("### Train on your own text") :]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def _last(pattern: str, out: str) -> float:
    return float(re.findall(pattern, out)[-1])


def test_the_readme_block_trains_on_real_text_below_the_synthetic_start(tmp_path):
    """The block runs end to end on CPU (prepare, import, train with evaluation, export, generate); the final
    training and eval losses on the stdlib's sources are below step 1's loss of the synthetic stream from the same
    imported weights (about ln 2048 = 7.6: what the model knows before it has learnt anything)."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", _readme_block()], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "wrote data/corpus.bin/.idx: " in out and "held out data/corpus_val" in out
    assert (tmp_path / "out/config.json").is_file() and (tmp_path / "out/tokenizer.json").is_file()
    assert "import json" in out.split("as a Hugging Face model directory")[-1]  # the exported model generates
    final, held_out = _last(r"final loss ([\d.]+)", out), _last(r"eval loss ([\d.]+)", out)

    synthetic = subprocess.run(
        [HFSDP, "train", "--model-config", "model/config.json", "--load", "ck0", "--nproc", "2", "--device", "cpu",
         "--seq-len", "128", "--global-batch-size", "16", "--steps", "1", "--metrics", "synthetic.jsonl"],
        cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300,
    )  # fmt: skip
    assert synthetic.returncode == 0, synthetic.stdout + synthetic.stderr
    start = records(tmp_path / "synthetic.jsonl")[0]["loss"]
    assert final < start - 0.5 and held_out < start - 0.5, (final, held_out, start)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A dataset of the 300-token tiny tokenizer, with a held-out set."""
    root = tmp_path_factory.mktemp("data")
    tok = tiny_tokenizer(root / "tok")
    corpus = root / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"sample text number {i} " * 8}) + "\n" for i in range(40)))
    prepare(Request([str(corpus)], str(tok), str(root / "c"), workers=1, validation_fraction=0.25))
    return root / "c", tok


def _train(tmp_path, *args):
    return subprocess.run([HFSDP, "train", "--nproc", "1", *map(str, args)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)  # fmt: skip


def test_ids_past_the_models_vocabulary_are_refused_naming_the_tokenizer(tmp_path, dataset):
    """A Hugging Face config of vocabulary 64, then the GPT's --vocab 128, for data of a 300-token tokenizer: exit 2
    before any rank starts, saying which tokenizer made the data and what vocabulary the model would need."""
    prefix, tok = dataset
    result = _train(tmp_path, *tiny_llama(tmp_path), "--data-path", prefix)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"--data-path {prefix} was tokenized by {tok} (TokenizersBackend, vocabulary 300)" in result.stderr
    assert f"but {tmp_path / 'llama.json'} has a vocabulary of 64" in result.stderr and "starting" not in result.stdout
    result = _train(tmp_path, "--data-path", prefix, "--device", "cpu")
    assert result.returncode == 2 and "but the GPT (--vocab 128) has a vocabulary of 128" in result.stderr


def test_the_held_out_set_is_what_eval_interval_evaluates(dataset):
    """With a sidecar naming PREFIX_val, the evaluation stream is that dataset's tokens, not a split of the
    training set; a dataset without one is split as before."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from hfsdp.cli.rank.train_loop import _data

    prefix, _ = dataset
    train, held = _data(SimpleNamespace(data_path=str(prefix), seq_len=8, eval_interval=5), 300)
    val = IndexedDataset(f"{prefix}_val")
    assert held.tokens[:16].tolist() == [int(t) for i in range(len(val)) for t in val[i]][:16]
    assert train.num_samples == (len(train.tokens) - 1) // 8 and train.first == 0  # the whole training set trains
    (prefix.parent / "c.meta.json").rename(prefix.parent / "moved.json")
    try:
        train, held = _data(SimpleNamespace(data_path=str(prefix), seq_len=8, eval_interval=5), 300)
        assert held.first == train.num_samples  # the last samples of the training set
    finally:
        (prefix.parent / "moved.json").rename(prefix.parent / "c.meta.json")
