"""`hfsdp.recipes.prepare`: what a corpus becomes (the tokenizer's own ids, EOS after each document), the held-out
split, the sidecar, and what each kind of line means. The command's errors and signals: tests/cli/test_data_prepare.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hfsdp.recipes.prepare import sidecar
from hfsdp.recipes.prepare.errors import PrepareError
from hfsdp.recipes.prepare.pipeline import Request, prepare
from hfsdp.recipes.prepare.sources import Batch, documents

from tests.support.tiny_tokenizer import stdlib_texts, tiny_tokenizer

TEXTS = ["first document, with words", "second: ünïcödé and <|endoftext|> inside", "third\nhas\nlines", "4"] * 5


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


@pytest.fixture(scope="module")
def expected(tok):
    """What transformers makes of each text, with EOS after it."""
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    return lambda text: [*t(text)["input_ids"], t.eos_token_id]


def _jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(str(prefix))
    return [data[i].tolist() for i in range(len(data))]


def test_jsonl_documents_are_the_tokenizers_ids_then_eos(tmp_path, tok, expected):
    """Every JSON line's text, tokenized as transformers does it (an EOS in the text stays a token), then EOS."""
    summary = prepare(Request([str(_jsonl(tmp_path / "c.jsonl", TEXTS))], str(tok), str(tmp_path / "out/c"), workers=1))
    assert _read(tmp_path / "out/c") == [expected(t) for t in TEXTS]
    assert summary.documents == len(TEXTS) and summary.tokens == sum(len(expected(t)) for t in TEXTS)
    assert summary.dtype == "uint16" and sorted(p.name for p in summary.files) == ["c.bin", "c.idx", "c.meta.json"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["c.bin", "c.idx", "c.meta.json"]  # no staging


def test_the_dataset_is_the_same_for_any_number_of_workers(tmp_path, tok, monkeypatch):
    """Batches come back in order: one worker and two write byte-identical files (many small batches here)."""
    from hfsdp.recipes.prepare import sources

    monkeypatch.setattr(sources, "BATCH_BYTES", 200)
    corpus = str(_jsonl(tmp_path / "c.jsonl", stdlib_texts("json")))
    for n in (1, 2):
        prepare(Request([corpus], str(tok), str(tmp_path / f"w{n}"), workers=n, validation_fraction=0.2))
    for name in ("w{}.bin", "w{}.idx", "w{}_val.bin", "w{}_val.idx"):
        assert (tmp_path / name.format(1)).read_bytes() == (tmp_path / name.format(2)).read_bytes()


def test_text_files_are_one_document_each_or_one_per_line(tmp_path, tok, expected):
    """Without --split-lines a text file is one document (lines and all); with it, each non-blank line is one."""
    a, b = tmp_path / "a.txt", tmp_path / "b.md"
    a.write_text("line one\nline two\n\n")
    b.write_text("  \nonly line")
    prepare(Request([str(a), str(b)], str(tok), str(tmp_path / "files"), workers=1))
    assert _read(tmp_path / "files") == [expected("line one\nline two\n\n"), expected("  \nonly line")]
    prepare(Request([str(a), str(b)], str(tok), str(tmp_path / "lines"), split_lines=True, workers=1))
    assert _read(tmp_path / "lines") == [expected("line one"), expected("line two"), expected("only line")]


def test_validation_holds_out_one_document_in_every_1_over_f(tmp_path, tok, expected):
    """F = 0.25: documents 3, 7, 11, ... are held out in PREFIX_val, the rest train; the sidecar names the set."""
    texts = [f"document number {i}" for i in range(20)]
    corpus = str(_jsonl(tmp_path / "c.jsonl", texts))
    summary = prepare(Request([corpus], str(tok), str(tmp_path / "c"), workers=2, validation_fraction=0.25))
    held = [i for i in range(20) if i % 4 == 3]
    assert _read(tmp_path / "c_val") == [expected(texts[i]) for i in held]
    assert _read(tmp_path / "c") == [expected(t) for i, t in enumerate(texts) if i not in held]
    assert (summary.documents, summary.validation_documents) == (15, 5)
    assert sidecar.validation_prefix(tmp_path / "c") == str(tmp_path / "c_val")
    with pytest.raises(PrepareError, match="holds out one document in every 4, so none of the 2 documents"):
        prepare(Request([str(_jsonl(tmp_path / "two.jsonl", texts[:2]))], str(tok), str(tmp_path / "t"), **_F25))
    assert not list(tmp_path.glob("t.*")) and not list(tmp_path.glob("t_val.*")) and not list(tmp_path.glob(".t.*"))


_F25 = {"workers": 1, "validation_fraction": 0.25}


def test_the_sidecar_names_the_tokenizer_and_what_was_written(tmp_path, tok):
    """Which tokenizer (name, class, vocabulary, EOS, sha256), the dtype, the counts and the largest id."""
    summary = prepare(Request([str(_jsonl(tmp_path / "c.jsonl", TEXTS))], str(tok), str(tmp_path / "c"), workers=1))
    record = sidecar.read(tmp_path / "c")
    assert record["tokenizer"]["name"] == str(tok) and record["tokenizer"]["vocab_size"] == 300
    assert record["tokenizer"]["eos_token"] == "<|endoftext|>" and len(record["tokenizer"]["sha256"]) == 64
    assert record["documents"] == summary.documents and record["tokens"] == summary.tokens
    assert 0 < record["max_token_id"] < 300 and record["dtype"] == "uint16" and record["validation"] is None
    assert sidecar.read(tmp_path / "absent") is None and sidecar.validation_prefix(tmp_path / "c") is None


def test_what_prepare_writes_passes_trains_pre_launch_check_to_the_last_id(tmp_path, tok):
    """`hfsdp train`'s check of the pair (tests/cli/checks/test_dataset_check.py) on real output: a model whose
    vocabulary holds the largest id written passes, one id fewer is refused naming the tokenizer from the sidecar."""
    from hfsdp.cli.checks.dataset_check import problems

    corpus = str(_jsonl(tmp_path / "c.jsonl", TEXTS))
    prepare(Request([corpus], str(tok), str(tmp_path / "c"), workers=1, validation_fraction=0.1))
    top = sidecar.read(tmp_path / "c")["max_token_id"]
    assert problems(str(tmp_path / "c"), top + 1, "m", 8, evaluates=True) == []
    [vocab] = problems(str(tmp_path / "c"), top, "model/config.json", 8, evaluates=False)
    assert f"was tokenized by {tok} (TokenizersBackend, vocabulary 300)" in vocab
    assert f"token ids up to {top} " in vocab and "model/config.json has a vocabulary of" in vocab


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"{not json}\n", "not JSON (Expecting property name enclosed in double quotes at column 2)"),
        (b'["text"]\n', "not a JSON object (JSON Lines: one object per line)"),
        (b'{"body": "x", "id": 1}\n', "no key 'text' (its keys: 'body', 'id'; choose the text's with --json-key)"),
        (b'{"text": 7}\n', "'text' holds int, not text"),
        (b'{"text": "\xff"}\n', "not UTF-8 text (byte 0xff at byte 11 of the line)"),
        (b'{"text": "a\xed\xa0\x80b"}\n', "not UTF-8 text (byte 0xed at byte 12 of the line)"),  # a surrogate's bytes
        (b'{"text": "a\\ud800b"}\n', "'text' holds \\ud800 at character 2, half of a UTF-16 surrogate pair without"),
        (b"[" * 200_000 + b"]" * 200_000 + b"\n", "nested deeper than the JSON reader goes (about 1,000 arrays"),
        (b'{"text": "x", "n": ' + b"7" * 5000 + b"}\n", "not JSON that can be read (Exceeds the limit (4300 digits)"),
    ],
)
def test_a_bad_json_line_is_named_by_its_number_and_what_is_wrong(line, reason):
    """Every kind of bad line is one ValueError naming it (a lone surrogate and deep nesting gave tracebacks)."""
    texts, bad, empty = documents(Batch(0, 41, "json", [b'{"text": "ok"}\n', line, b"\n"], 0), "text")
    assert texts == ["ok"] and len(bad) == 1 and empty == 1
    assert bad[0][0] == 42 and bad[0][1].startswith(reason), bad


def test_a_whole_file_not_utf8_is_named_by_the_line_of_its_first_bad_byte():
    _, bad, _ = documents(Batch(0, 1, "file", [b"fine\nfine\nbad \xfe here\n"], 0), "text")
    assert bad == [(3, "not UTF-8 text (byte 0xfe at byte 15 of the file)")]


def test_parquet_reads_the_key_column(tmp_path, tok, expected):
    """A parquet file's --json-key column, row by row (only where pyarrow is installed: it is optional)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": TEXTS[:4], "n": [1, 2, 3, 4]}), tmp_path / "c.parquet")
    prepare(Request([str(tmp_path / "c.parquet")], str(tok), str(tmp_path / "c"), workers=1))
    assert _read(tmp_path / "c") == [expected(t) for t in TEXTS[:4]]
    with pytest.raises(PrepareError, match=r"has no column 'body' \(its columns: text, n\)"):
        prepare(Request([str(tmp_path / "c.parquet")], str(tok), str(tmp_path / "d"), json_key="body", workers=1))


def test_workers_return_tokens_in_the_datasets_dtype(tok, expected):
    """What travels back from a worker is already uint16 (a quarter of int64's bytes); a blank line is no document."""
    from hfsdp.recipes.prepare import encode, tokenizer

    info = tokenizer.load(str(tok))
    encode.start(encode.Job(info.backend, False, info.eos_id, info.vocab_size, "uint16", "text"))
    out = encode.encode(Batch(0, 1, "line", [b"abc\n", b"\n", b"de\r\n"], 9))
    assert out.tokens.dtype == np.uint16 and out.empty == 1
    assert out.tokens.tolist() == expected("abc") + expected("de")
    assert out.lengths.tolist() == [len(expected("abc")), len(expected("de"))]
