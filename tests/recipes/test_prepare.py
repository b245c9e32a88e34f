"""`hfsdp.recipes.prepare`: what a corpus becomes (the tokenizer's own ids, EOS after each document), the held-out
split, the sidecar, and what each kind of line means. The command's errors and signals: tests/cli/test_data_prepare.py.
"""

from __future__ import annotations

import json
import sys

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
        # "about N": the interpreter's recursion limit, which torch.compile raises in a process that compiled before
        (b"[" * 200_000 + b"]" * 200_000 + b"\n", "nested deeper than the JSON reader goes (about {limit:,} arrays"),
        (b'{"text": "x", "n": ' + b"7" * 5000 + b"}\n", "not JSON that can be read (Exceeds the limit (4300 digits)"),
    ],
)
def test_a_bad_json_line_is_named_by_its_number_and_what_is_wrong(line, reason):
    """Every kind of bad line is one ValueError naming it (a lone surrogate and deep nesting gave tracebacks)."""
    texts, bad, empty = documents(Batch(0, 41, "json", [b'{"text": "ok"}\n', line, b"\n"], 0), "text")
    assert texts == [(41, "ok")] and len(bad) == 1 and empty == 1
    assert bad[0][0] == 42 and bad[0][1].startswith(reason.format(limit=sys.getrecursionlimit())), bad


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
    not_utf8 = pa.array([b"ok", b"\xffbad", None, b"fine"], pa.binary()).cast(pa.string(), safe=False)
    pq.write_table(pa.table({"text": not_utf8}), tmp_path / "bad.parquet")  # parquet holds it; pyarrow raised on it
    with pytest.raises(PrepareError, match=r"bad.parquet row 2: not UTF-8 text \(byte 0xff at byte 1 of the value\)"):
        prepare(Request([str(tmp_path / "bad.parquet")], str(tok), str(tmp_path / "e"), workers=1))
    summary = prepare(Request([str(tmp_path / "bad.parquet")], str(tok), str(tmp_path / "e"), workers=1, **_SKIP))
    assert summary.bad == 2 and _read(tmp_path / "e") == [expected("ok"), expected("fine")]  # the null too


_SKIP = {"skip_bad_lines": True}


def test_workers_return_tokens_in_the_datasets_dtype(tok, expected):
    """What travels back from a worker is already uint16 (a quarter of int64's bytes); a blank line is no document."""
    from hfsdp.recipes.prepare import encode, tokenizer

    info = tokenizer.load(str(tok))
    encode.start(encode.Job(info.backend, False, info.eos_id, info.vocab_size, "uint16", "text"))
    out = encode.encode(Batch(0, 1, "line", [b"abc\n", b"\n", b"de\r\n"], 9))
    assert out.tokens.dtype == np.uint16 and out.empty == 1
    assert out.tokens.tolist() == expected("abc") + expected("de")
    assert out.lengths.tolist() == [len(expected("abc")), len(expected("de"))]


def _worker(tok, monkeypatch, piece_chars: int, backend: str | None = None):
    """encode's worker state in this process, with pieces of `piece_chars` characters."""
    from hfsdp.recipes.prepare import encode, pieces, tokenizer

    info = tokenizer.load(str(tok))
    monkeypatch.setattr(pieces, "PIECE_CHARS", piece_chars)
    encode.start(encode.Job(backend or info.backend, False, info.eos_id, info.vocab_size, "uint16", "text"))
    return encode


def _with_bos(backend: str) -> str:
    """The tokenizer with a post-processor that puts EOS (id 0) before every text, as a BOS."""
    from tokenizers import Tokenizer, processors

    t = Tokenizer.from_str(backend)
    t.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    return t.to_str()


@pytest.mark.parametrize("bos", [False, True])
def test_a_long_document_is_tokenized_in_pieces_with_the_ids_of_the_whole(tok, monkeypatch, bos):
    """Python sources cut into pieces of at most 8,000 characters (after a line break between two non-spaces: never
    before an indented line) give the ids the whole text gives, special tokens and EOS included."""
    from tokenizers import Tokenizer

    from hfsdp.recipes.prepare import pieces, tokenizer

    backend = tokenizer.load(str(tok)).backend
    backend = _with_bos(backend) if bos else backend
    encode = _worker(tok, monkeypatch, 8000, backend)
    text = "".join(stdlib_texts("json"))
    where = pieces.Cuts.of(Tokenizer.from_str(backend))
    assert where == pieces.Cuts(after_lone=True, after_run=False, before_last=True)  # GPT-2's regex: "\n|\n"
    assert sum(1 for _ in pieces.cuts(text, where, 8000)) > len(text) // 8000 > 4
    whole = [*Tokenizer.from_str(backend).encode(text).ids, 0]
    out = encode.encode(Batch(0, 1, "file", [text.encode()], len(text)))
    assert out.tokens.tolist() == whole and out.lengths.tolist() == [len(whole)] and out.bad == []
    assert (whole[0] == 0) is bos


LLAMA3 = (  # Llama 3's pre-tokenizer regex, as its tokenizer.json has it
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


def test_where_each_kind_of_tokenizer_is_cut(tok):
    """GPT-2's regex splits a run of line breaks before its last one, Llama 3's after it, BERT's anywhere; a tokenizer
    that marks every text's start (a prefix space, SentencePiece's metaspace) or has no pre-tokenizer is never cut."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    from hfsdp.recipes.prepare import tokenizer
    from hfsdp.recipes.prepare.pieces import Cuts

    def variant(**parts):
        t = Tokenizer.from_str(tokenizer.load(str(tok)).backend)
        for name, value in parts.items():
            setattr(t, name, value)
        return Cuts.of(t)

    assert variant() == Cuts(after_lone=True, after_run=False, before_last=True)
    llama3 = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(LLAMA3), "isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
    )
    assert variant(pre_tokenizer=llama3) == Cuts(after_lone=True, after_run=True, before_last=False)
    assert not variant(pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=True)).any
    assert not variant(pre_tokenizer=pre_tokenizers.Metaspace()).any
    assert not variant(normalizer=normalizers.Prepend("▁")).any
    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz.:)#-'7")}}
    bert = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    bert.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    assert Cuts.of(bert) == Cuts(True, True, True)
    bert.pre_tokenizer = None
    assert not Cuts.of(bert).any


def test_cuts_fall_after_a_line_break_between_two_non_spaces():
    from hfsdp.recipes.prepare.pieces import Cuts, cuts

    gpt2, llama3 = Cuts(True, False, True), Cuts(True, True, False)
    text = "one\ntwo\n\nthree\n  four\r\nfive"  # no cut before "  four": a line break between non-spaces only
    assert [text[a:b] for a, b in cuts(text, gpt2, 15)] == ["one\ntwo\n", "\nthree\n  four\r", "\nfive"]
    assert [text[a:b] for a, b in cuts(text, llama3, 15)] == ["one\ntwo\n\n", "three\n  four\r\n", "five"]
    assert gpt2.last(text, 0, 9) == 8 and llama3.last(text, 0, 8) == 4 and llama3.last(text, 4, 9) == 9
    with pytest.raises(
        ValueError, match="no line break between two non-space characters in the 8 characters from character 9"
    ):
        list(cuts(text, gpt2, 8))
    assert Cuts(False, False, False).last(text, 0, 30) is None


def test_a_long_document_that_cannot_be_cut_is_a_bad_line(tok, monkeypatch):
    """No line break between two non-spaces in a piece's length, or a tokenizer that is never cut: the document is
    a bad line saying how to split it, not a run that takes all memory; the batch's other documents are kept."""
    from tokenizers import Tokenizer, pre_tokenizers

    from hfsdp.recipes.prepare import tokenizer

    encode = _worker(tok, monkeypatch, 100)
    lines = [b'{"text": "short"}\n', json.dumps({"text": "word " * 30 + "\n  indented " * 20}).encode() + b"\n"]
    out = encode.encode(Batch(0, 7, "json", lines, 0))
    assert out.lengths.size == 1 and len(out.bad) == 1 and out.bad[0][0] == 8
    assert out.bad[0][1].startswith("a document of 390 characters has no line break between two non-space")
    assert out.bad[0][1].endswith("split it: --split-lines makes every line of a text file a document, and a JSON "
                                  "or parquet text can be cut into several")  # fmt: skip
    t = Tokenizer.from_str(tokenizer.load(str(tok)).backend)
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    encode = _worker(tok, monkeypatch, 100, t.to_str())
    out = encode.encode(Batch(0, 1, "line", [b"x\n" * 20, ("x\ny" * 40).encode()], 0))
    assert out.lengths.size == 1 and out.bad[0][0] == 2
    assert (
        "a document of 120 characters, longer than the 100 prepare tokenizes in one piece, and this tokenizer"
        in (out.bad[0][1])
    )


MEMORY = r"""
import resource, sys
from hfsdp.recipes.prepare import encode
from hfsdp.recipes.prepare.sources import Batch
encode.start(encode.Job(open(sys.argv[1]).read(), False, 0, 300, "uint16", "text"))
data = open(sys.argv[2], "rb").read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = encode.encode(Batch(0, 1, "file", [data], len(data)))
print(out.lengths[0], (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_long_document_is_tokenized_in_bounded_memory(tmp_path, tok):
    """A 4 MB text, one document: the worker's peak grows by a piece's cost (about 240 MiB with this tokenizer of
    0.85 tokens per character), not by the whole document's (780 MiB before, 130-200x its size)."""
    import subprocess
    import sys

    from hfsdp.recipes.prepare import tokenizer

    (tmp_path / "backend.json").write_text(tokenizer.load(str(tok)).backend)
    text = "".join(stdlib_texts("json", "email"))
    (tmp_path / "big.txt").write_text((text * (4_000_000 // len(text) + 1))[:4_000_000])
    result = subprocess.run(
        [sys.executable, "-c", MEMORY, str(tmp_path / "backend.json"), str(tmp_path / "big.txt")],
        capture_output=True,
        text=True,
        check=True,
    )
    tokens, grown_mib = map(int, result.stdout.split())
    assert tokens > 3_000_000 and grown_mib < 400, (tokens, grown_mib)


def test_a_document_over_the_limit_is_a_bad_line_never_read(tmp_path, tok, monkeypatch, expected):
    """A text file or a JSON line over MAX_DOCUMENT_BYTES (lowered here to 1,000) is not read: a bad line naming its
    size and how to split it; the lines after it keep their numbers, and --skip-bad-lines skips it."""
    from hfsdp.recipes.prepare import sources

    monkeypatch.setattr(sources, "MAX_DOCUMENT_BYTES", 1000)
    (tmp_path / "big.txt").write_text("word " * 300)
    with pytest.raises(PrepareError, match=r"big.txt line 1: a text file of 1,500 bytes, more than the"):
        prepare(Request([str(tmp_path / "big.txt")], str(tok), str(tmp_path / "t"), workers=1))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "x " * 2000}) + "\n" + json.dumps({"text": "after"}) + "\n")
    with pytest.raises(PrepareError, match=r"c.jsonl line 1: a line of 4,013 bytes, more than the .* split it"):
        prepare(Request([str(corpus)], str(tok), str(tmp_path / "c"), workers=1))
    summary = prepare(Request([str(corpus)], str(tok), str(tmp_path / "c"), workers=1, skip_bad_lines=True))
    assert summary.bad == 1 and _read(tmp_path / "c") == [expected("after")]
    assert not list(tmp_path.glob("t.*"))


def test_a_tokenizer_file_over_the_limit_is_refused_before_it_is_read(tmp_path, tok, monkeypatch):
    from hfsdp.recipes.prepare import tokenizer

    monkeypatch.setattr(tokenizer, "MAX_TOKENIZER_BYTES", 1000)
    monkeypatch.setattr(tokenizer, "_from_pretrained", lambda name: pytest.fail("the tokenizer was read"))
    corpus = str(_jsonl(tmp_path / "c.jsonl", TEXTS))
    with pytest.raises(
        PrepareError, match=r"--tokenizer .*tok: .*tokenizer.json is [0-9,]+ bytes, more than the 0 MiB"
    ):
        prepare(Request([corpus], str(tok), str(tmp_path / "c"), workers=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_a_text_file_longer_than_a_piece_is_one_document_with_the_ids_of_the_whole(tmp_path, tok, expected):
    """End to end, at the real piece length (1 Mi characters): a 1.3 MB text file is one document, ids as
    transformers gives them for the whole text."""
    text = "".join(stdlib_texts("json", "email"))
    text = text * (1_300_000 // len(text) + 1)
    (tmp_path / "big.txt").write_text(text)
    summary = prepare(Request([str(tmp_path / "big.txt")], str(tok), str(tmp_path / "c"), workers=1))
    assert summary.documents == 1 and _read(tmp_path / "c") == [expected(text)]
