"""`hfsdp train --data-path` checks the .bin/.idx pair itself before any rank starts, whoever made it: a pair with no
sidecar (Megatron-LM's), a .bin changed after `data prepare` wrote its sidecar, float tokens, negative ids, too few
tokens for the run's --seq-len, and a damaged sidecar are each one paragraph naming the file, exit 2."""

from __future__ import annotations

import numpy as np
import pytest

from hfsdp.cli.checks import dataset_check
from hfsdp.recipes.prepare import sidecar
from hfsdp.recipes.prepare.indexed_writer import IndexedWriter

from tests.cli.checks.test_preflight import assert_refused_before_start, train

#: test_preflight's SMALL: a GPT of --vocab 64, --seq-len 16.
VOCAB, SEQ = 64, 16


def _pair(prefix, tokens, dtype=np.uint16, lengths=None):
    """A Megatron indexed pair and no sidecar, as Megatron-LM's preprocess_data.py leaves one."""
    tokens = np.asarray(tokens).astype(dtype)
    writer = IndexedWriter(prefix, dtype)
    writer.add(tokens, np.asarray(lengths if lengths is not None else [len(tokens)], dtype=np.int64))
    writer.finish()
    return str(prefix)


def _record(tokens: int, max_id: int, validation=None) -> dict:
    tokenizer = {"name": "tok", "class": "TokenizersBackend", "vocab_size": 60, "eos_token": "</s>", "sha256": "0"}
    return {"tokenizer": tokenizer, "documents": 1, "tokens": tokens, "max_token_id": max_id, "validation": validation}


def test_a_pair_made_elsewhere_with_ids_past_the_vocabulary(tmp_path):
    """No sidecar: the ids are read from the .bin itself (id 64 = --vocab 64 at the very end of the file)."""
    prefix = _pair(tmp_path / "d", [*range(VOCAB), VOCAB])
    assert_refused_before_start(*train("--data-path", prefix), "--data-path", f"holds token ids up to {VOCAB} ")
    _, out, _ = train("--data-path", prefix)
    assert f"({prefix}.bin), but the GPT (--vocab 64) has a vocabulary of 64" in out and "at least 65" in out


def test_a_bin_changed_after_prepare_names_the_tokenizer(tmp_path):
    """The sidecar says ids up to 40, but the .bin was rewritten since: the scan finds 63 of --vocab 32."""
    prefix = _pair(tmp_path / "d", [*range(VOCAB)] * 2)
    sidecar.write(sidecar.path(prefix), _record(2 * VOCAB, 40))
    code, out, seconds = train("--data-path", prefix, "--vocab", "32")
    assert_refused_before_start(code, out, seconds, "--data-path", "was tokenized by tok (TokenizersBackend, vocabul")
    assert "holds token ids up to 63" in out and "has a vocabulary of 32" in out


@pytest.mark.parametrize(
    ("tokens", "dtype", "says"),
    [
        ([0.5] * 40, np.float32, "says its tokens are float32, which are not token ids"),
        ([1, 2, -7, 3] * 10, np.int32, "holds the negative token id -7"),
        ([1] * SEQ, np.uint16, "holds 16 tokens, fewer than the 17 one sequence of --seq-len 16 needs"),
    ],
)
def test_tokens_no_rank_could_train_on(tmp_path, tokens, dtype, says):
    prefix = _pair(tmp_path / "d", tokens, dtype)
    assert_refused_before_start(*train("--data-path", prefix), "--data-path", says)


def test_evaluating_without_a_held_out_set_needs_two_sequences(tmp_path):
    """--eval-interval splits a dataset without a held-out set: 20 tokens train at --seq-len 16 but cannot split."""
    prefix = _pair(tmp_path / "d", [1] * 20)
    assert dataset_check.problems(prefix, VOCAB, "m", SEQ, evaluates=False) == []
    [short] = dataset_check.problems(prefix, VOCAB, "m", SEQ, evaluates=True)
    assert f"{prefix}.bin holds 20 tokens, fewer than the 33 two sequences" in short


def test_the_held_out_set_is_checked_too(tmp_path):
    """The sidecar's held-out set: missing, or with ids past the vocabulary, named as the held-out set."""
    prefix = _pair(tmp_path / "d", [1] * 40)
    sidecar.write(sidecar.path(prefix), _record(40, 1, {"prefix": "d_val", "tokens": 40}))
    [missing] = dataset_check.problems(prefix, VOCAB, "m", SEQ, evaluates=True)
    assert "names the held-out data" in missing and "d_val.bin and" in missing
    _pair(tmp_path / "d_val", [99] * 40)
    [past] = dataset_check.problems(prefix, VOCAB, "m", SEQ, evaluates=True)
    assert past.startswith(f"the held-out set {tmp_path / 'd_val'} (named by ") and "ids up to 99" in past
    assert dataset_check.problems(prefix, 100, "m", SEQ, evaluates=True) == []


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("{not json", "it is not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"tokenizer": "tok"}', "'tokenizer' is not an object"),
        ('{"max_token_id": true}', "'max_token_id' is not a whole number"),
        ('{"validation": {"prefix": "../../elsewhere", "tokens": 40}}', "'validation' names no file beside"),
        ('{"validation": {"prefix": "%s", "tokens": 40}}' % ("v" * 300), "longer than a file name can be"),
    ],
)
def test_a_damaged_sidecar_is_one_paragraph(tmp_path, body, says):
    """Every field a check or a rank reads is checked (a traceback before: a tokenizer that is a string, JSON nested
    deeper than Python's recursion, a held-out name the OS refuses)."""
    import json

    prefix = _pair(tmp_path / "d", [1] * 40)
    if body.startswith("{") and not body.startswith("{not"):
        body = json.dumps({"format": sidecar.FORMAT, "version": 1, **_record(40, 1), **json.loads(body)})
    sidecar.path(prefix).write_text(body)
    code, out, seconds = train("--data-path", prefix, "--eval-interval", "1")
    assert_refused_before_start(code, out, seconds, "--data-path", says)
    assert f"{prefix}.meta.json is not the sidecar hfsdp data prepare writes" in out


def test_the_pass_over_the_tokens_runs_chunk_by_chunk(tmp_path, monkeypatch):
    """With a chunk of 7 tokens the extremes are found in any chunk, the last one partial; unsigned skips the
    minimum; a rank other than 0 (scan=False) does not read the tokens."""
    from hfsdp.recipes.indexed_format import token_stream

    values = np.random.default_rng(0).integers(-50, 50, 1000)
    values[500], values[999] = -77, 88
    prefix = _pair(tmp_path / "s", values, np.int32, lengths=[400, 600])
    monkeypatch.setattr(dataset_check, "CHUNK", 7)
    assert dataset_check.id_range(token_stream(prefix)) == (-77, 88)
    assert dataset_check.id_range(token_stream(_pair(tmp_path / "u", [5, 300, 2]))) == (0, 300)
    assert dataset_check.problems(prefix, 10, "m", SEQ, evaluates=False, scan=False) == []
