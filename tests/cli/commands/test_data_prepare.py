"""`hfsdp data prepare` as a user runs it: the summary, and for every bad input one paragraph, its exit code and
nothing written; Ctrl-C, SIGTERM and a killed run leave no half-written output and no worker behind.

What the dataset holds (ids, EOS, the split, the sidecar) is tests/recipes/test_prepare.py's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.support.tiny_tokenizer import stdlib_texts, tiny_tokenizer

HFSDP = str(Path(sys.executable).parent / "hfsdp")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} of the corpus"}) + "\n" for i in range(30)))
    return path


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """About 12 MB of JSON Lines (the json and email packages' sources, many times): seconds of tokenizing."""
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    lines = "".join(json.dumps({"text": t}) + "\n" for t in stdlib_texts("json", "email"))
    path.write_text(lines * max(1, 12_000_000 // len(lines)))
    return path


def run(*args, cwd=None):
    return subprocess.run([HFSDP, "data", "prepare", *map(str, args)], capture_output=True, text=True, cwd=cwd)


def written(directory: Path) -> list[str]:
    """Every entry of `directory` but the inputs: outputs and hidden staging alike."""
    return sorted(p.name for p in directory.iterdir() if p.suffix not in (".jsonl", ".txt") and p.name != "tok")


def fails(result, code: int, *phrases: str) -> str:
    """The run exited `code` with one paragraph on stderr containing `phrases`, and no traceback."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr
    return result.stderr


def test_a_corpus_becomes_a_dataset_with_a_summary_line(tmp_path, tok, corpus):
    """One line on stdout: documents, tokens, tokens/s, size, the tokenizer, the held-out set; no bar in a pipe."""
    result = run(corpus, "--tokenizer", tok, "--output", tmp_path / "data/c", "--validation-fraction", "0.1")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    [line] = result.stdout.splitlines()
    assert line.startswith(f"wrote {tmp_path / 'data/c'}.bin/.idx: 27 documents, ") and "tokens/s" in line
    assert f"tokenizer {tok} (vocabulary 300)" in line and "held out" in line and "3 documents" in line
    assert written(tmp_path / "data") == ["c.bin", "c.idx", "c.meta.json", "c_val.bin", "c_val.idx"]


def test_help_lists_every_flag_with_its_default():
    from hfsdp.cli.main import app

    out = CliRunner().invoke(app, ["data", "prepare", "-h"], env={"COLUMNS": "250", "TERM": "dumb"}).stdout
    assert "Usage: hfsdp data prepare [OPTIONS] INPUT..." in out
    for flag, default in [("--json-key", "text"), ("--workers", "one per usable CPU"), ("--validation-fraction", "0")]:
        line = next(line for line in out.splitlines() if f" {flag} " in line)
        assert f"[default: {default}" in line, line
    assert all(f in out for f in ("--tokenizer", "--output", "--split-lines", "--skip-bad-lines", "--overwrite"))


def test_a_missing_input_is_named(tmp_path, tok, corpus):
    fails(
        run(corpus, tmp_path / "nope.jsonl", "--tokenizer", tok, "-o", tmp_path / "c"), 2, "nope.jsonl does not exist"
    )
    assert written(tmp_path) == []


def test_an_unreadable_input_is_named(tmp_path, tok, corpus):
    """A path through a file cannot be read by anyone; a file without read rights (unless we are root) neither."""
    fails(run(corpus / "x", "--tokenizer", tok, "-o", tmp_path / "c"), 2, "corpus.jsonl/x cannot be read (Not a dir")
    if os.geteuid() != 0:
        locked = tmp_path / "locked.txt"
        locked.write_text("secret")
        locked.chmod(0)
        fails(run(locked, "--tokenizer", tok, "-o", tmp_path / "c"), 2, "locked.txt cannot be read (Permission")
    assert written(tmp_path) == []


def test_a_directory_or_a_fifo_as_input_is_refused_without_blocking(tmp_path, tok):
    fails(run(tmp_path, "--tokenizer", tok, "-o", tmp_path / "c"), 2, "is a directory; give the files in it")
    os.mkfifo(tmp_path / "pipe.txt")
    fails(run(tmp_path / "pipe.txt", "--tokenizer", tok, "-o", tmp_path / "c"), 2, "is not a regular file (a FIFO")
    assert written(tmp_path) == []  # the FIFO is an input (.txt)


def test_a_line_that_is_not_json_names_the_file_and_line(tmp_path, tok, corpus):
    """Exit 1, nothing written; with --skip-bad-lines it is counted, the first named, and the rest is written."""
    with corpus.open("a") as f:
        f.write('{"text": "fine"}\n{"text": broken\n')
    err = fails(run(corpus, "--tokenizer", tok, "-o", tmp_path / "c"), 1, f"{corpus} line 32: not JSON (Expecting")
    assert "pass --skip-bad-lines to count and skip such lines; nothing was written" in err
    assert written(tmp_path) == []
    assert run(corpus, "--tokenizer", tok, "-o", tmp_path / "new/dirs/c").returncode == 1
    assert written(tmp_path) == []  # not even the directories --output would have needed
    result = run(corpus, "--tokenizer", tok, "-o", tmp_path / "c", "--skip-bad-lines")
    assert result.returncode == 0 and "31 documents" in result.stdout
    assert f"skipped 1 bad lines (the first: {corpus} line 32: not JSON" in result.stdout


def test_a_json_line_without_the_key_names_the_keys_it_has(tmp_path, tok, corpus):
    with corpus.open("a") as f:
        f.write('{"body": "x"}\n')
    fails(run(corpus, "--tokenizer", tok, "-o", tmp_path / "c"), 1, "line 31: no key 'text' (its keys: 'body'")
    assert run(corpus, "--tokenizer", tok, "-o", tmp_path / "c", "--json-key", "body").returncode == 1  # 30 lack it


#: One line of every kind --skip-bad-lines skips, and the start of what the error says about it.
BAD_LINES = {
    "not JSON": (b'{"text": broken\n', "not JSON (Expecting value at column 10)"),
    "not an object": (b'["text"]\n', "not a JSON object"),
    "no key": (b'{"body": "x"}\n', "no key 'text' (its keys: 'body'"),
    "not text": (b'{"text": 7}\n', "'text' holds int, not text"),
    "not UTF-8": (b'{"text": "\xff"}\n', "not UTF-8 text (byte 0xff at byte 11 of the line)"),
    "surrogate bytes": (b'{"text": "a\xed\xa0\x80b"}\n', "not UTF-8 text (byte 0xed at byte 12"),
    "lone surrogate": (b'{"text": "a\\ud800b"}\n', "'text' holds \\ud800 at character 2, half of a UTF-16"),
    "too deep": (b"[" * 200_000 + b"]" * 200_000 + b"\n", "nested deeper than the JSON reader goes"),
    "huge number": (b'{"text": "x", "n": ' + b"7" * 5000 + b"}\n", "not JSON that can be read (Exceeds the limit"),
}


@pytest.mark.parametrize("kind", ["lone surrogate", "too deep"])
def test_a_hostile_line_is_one_paragraph_naming_it(tmp_path, tok, corpus, kind):
    """An escaped lone surrogate and a line nested 200,000 deep (both gave tracebacks) are bad lines named by file and
    number, and --skip-bad-lines skips them. Every kind's message: tests/recipes/test_prepare.py."""
    line, reason = BAD_LINES[kind]
    with corpus.open("ab") as f:
        f.write(line)
    fails(run(corpus, "--tokenizer", tok, "-o", tmp_path / "c"), 1, f"{corpus} line 31: {reason}", "nothing was")
    assert written(tmp_path) == []
    result = run(corpus, "--tokenizer", tok, "-o", tmp_path / "c", "--skip-bad-lines")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "30 documents" in result.stdout and f"skipped 1 bad lines (the first: {corpus} line 31: {reason}" in (
        result.stdout
    )


def test_skip_bad_lines_counts_every_kind_of_bad_line(tmp_path, tok, corpus):
    with corpus.open("ab") as f:
        for line, _ in BAD_LINES.values():
            f.write(line + b'{"text": "good"}\n')
    result = run(corpus, "--tokenizer", tok, "-o", tmp_path / "c", "--skip-bad-lines")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert f"{30 + len(BAD_LINES)} documents" in result.stdout
    assert f"skipped {len(BAD_LINES)} bad lines (the first: {corpus} line 31: not JSON" in result.stdout


def test_an_empty_corpus_is_refused(tmp_path, tok):
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "empty.txt").write_text("")
    fails(
        run(tmp_path / "blank.jsonl", tmp_path / "empty.txt", "--tokenizer", tok, "-o", tmp_path / "c"),
        1,
        "the corpus is empty: the 2 input files hold no document (3 without text); nothing was written",
    )
    assert written(tmp_path) == []


def test_a_tokenizer_directory_without_a_tokenizer_is_named(tmp_path, corpus):
    """A model directory holding only config.json: exit 2 before transformers is even imported."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text("{}")
    fails(run(corpus, "--tokenizer", tmp_path / "model", "-o", tmp_path / "c"), 2, "holds no tokenizer (none of")
    fails(run(corpus, "--tokenizer", tmp_path / "nowhere", "-o", tmp_path / "c"), 2, "nowhere does not exist")
    assert written(tmp_path) == ["model"]


def test_a_tokenizer_without_eos_is_refused(tmp_path, corpus):
    bare = tiny_tokenizer(tmp_path / "bare", eos=False)
    fails(run(corpus, "--tokenizer", bare, "-o", tmp_path / "c"), 1, "has no end-of-document token (eos_token)")


def test_a_vocabulary_larger_than_the_format_holds_is_refused(tmp_path, tok, corpus, monkeypatch):
    """The largest dtype shrunk to uint8 (256 ids) for the 300-token tokenizer: the refusal a 2**31 vocabulary gets."""
    import numpy as np

    from hfsdp.cli.main import app
    from hfsdp.recipes.prepare import indexed_writer

    monkeypatch.setattr(indexed_writer, "TOKEN_DTYPES", (np.dtype(np.uint8),))
    result = CliRunner().invoke(
        app, ["data", "prepare", str(corpus), "--tokenizer", str(tok), "-o", str(tmp_path / "c")]
    )
    assert result.exit_code == 1, result.output
    assert "has a vocabulary of 300 tokens, more than the 256 ids the indexed format's largest token dtype" in (
        result.output
    )
    assert written(tmp_path) == []


def test_an_output_that_exists_needs_overwrite(tmp_path, tok, corpus):
    """Refused with exit 2 and left as it was; --overwrite replaces it, and an older held-out set goes with it."""
    assert run(corpus, "--tokenizer", tok, "-o", tmp_path / "c", "--validation-fraction", "0.5").returncode == 0
    before = (tmp_path / "c.bin").read_bytes()
    fails(run(corpus, "--tokenizer", tok, "-o", tmp_path / "c"), 2, "c.bin", "already exist", "pass --overwrite")
    assert (tmp_path / "c.bin").read_bytes() == before
    assert run(corpus, "--tokenizer", tok, "-o", tmp_path / "c", "--overwrite").returncode == 0
    assert written(tmp_path) == ["c.bin", "c.idx", "c.meta.json"] and (tmp_path / "c.bin").read_bytes() != before


def test_an_output_that_is_a_fifo_or_a_directory_is_refused(tmp_path, tok, corpus):
    os.mkfifo(tmp_path / "c.idx")
    fails(run(corpus, "--tokenizer", tok, "-o", tmp_path / "c", "--overwrite"), 2, "c.idx exists and is not a regular")
    assert stat.S_ISFIFO((tmp_path / "c.idx").lstat().st_mode)
    fails(run(corpus, "--tokenizer", tok, "-o", f"{tmp_path}/"), 2, "is a directory; give a prefix in it")
    fails(run(corpus, "--tokenizer", tok, "-o", tmp_path / "d.bin"), 2, "ends in .bin; give the prefix alone")


def test_settings_out_of_range_are_refused(tmp_path, tok, corpus):
    fails(run(corpus, "--tokenizer", tok, "-o", tmp_path / "c", "--validation-fraction", "1"), 1, "is not in [0, 1)")
    fails(run(corpus, "--tokenizer", tok, "-o", tmp_path / "c", "--workers", "0"), 1, "--workers 0: at least one")


def _children(pid: int) -> list[int]:
    """The spawned workers among the processes whose parent is `pid` (not multiprocessing's resource tracker)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int(status.read_text().rsplit(")", 1)[1].split()[1])
            command = (status.parent / "cmdline").read_bytes()
            if parent == pid and b"spawn_main" in command and b"resource_tracker" not in command:
                found.append(int(status.parent.name))
    return found


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _start_big(tmp_path, tok, big, workers=2):
    proc = subprocess.Popen(
        [
            HFSDP,
            "data",
            "prepare",
            str(big),
            "--tokenizer",
            str(tok),
            "-o",
            str(tmp_path / "c"),
            "--workers",
            str(workers),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while len(_children(proc.pid)) < workers or not list(tmp_path.glob(".c.prepare-*")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.5)  # tokenizing
    return proc, _children(proc.pid)


def _gone(pids, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pids)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_with_one_line_and_nothing_written(tmp_path, tok, big, signum, code):
    """Ctrl-C (to the whole process group, as a terminal sends it) or SIGTERM (to the command): exit 128 + signal,
    one line, no traceback from the command or a worker, no staging, no output, no worker left."""
    proc, workers = _start_big(tmp_path, tok, big)
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, (out, err)
    assert err == f"interrupted ({signal.Signals(signum).name}); nothing was written to {tmp_path / 'c'}\n", err
    assert written(tmp_path) == [] and _gone(workers)


def test_a_killed_run_takes_its_workers_along_and_the_next_run_clears_its_staging(tmp_path, tok, big, corpus):
    """SIGKILL leaves a hidden staging directory (nothing can remove it then) and no worker: they get SIGKILL when
    their parent dies. The next run into the prefix removes the staging, whose lock died with its writer."""
    proc, workers = _start_big(tmp_path, tok, big)
    proc.kill()
    proc.communicate(timeout=60)
    assert _gone(workers), "a worker outlived its killed parent"
    [stale] = tmp_path.glob(".c.prepare-*")
    assert run(corpus, "--tokenizer", tok, "-o", tmp_path / "c").returncode == 0
    assert not stale.exists() and written(tmp_path) == ["c.bin", "c.idx", "c.meta.json"]


def test_a_worker_that_dies_fails_the_run_instead_of_hanging(tmp_path, tok, big):
    proc, workers = _start_big(tmp_path, tok, big)
    os.kill(workers[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "a tokenizing worker process died" in err and "Traceback" not in err, err
    assert written(tmp_path) == [] and _gone(workers)


#: Loaded by every process of the run through PYTHONPATH (the spawned workers too): a worker's first large message
#: is sent half, then the worker stalls; the marker file says the pipe now holds half a message.
SLOW_SEND = """
import os, sys, time
if "--multiprocessing-fork" in sys.argv:
    from multiprocessing import connection

    send = connection.Connection._send

    def _send(self, buf, *args, **kwargs):
        if len(buf) > 8192 and not getattr(connection, "stalled", False):
            connection.stalled = True
            send(self, memoryview(buf)[: len(buf) // 2], *args, **kwargs)
            open(os.environ["HFSDP_TEST_STALLED"], "w").close()
            time.sleep(600)
        return send(self, buf, *args, **kwargs)

    connection.Connection._send = _send
"""


@pytest.mark.parametrize(("signum", "group", "code"), [(signal.SIGINT, True, 130), (signal.SIGTERM, False, 143)])
def test_a_signal_while_a_worker_sends_its_result_stops_without_hanging(tmp_path, tok, signum, group, code):
    """The moment that hung: a worker has sent half of a result when the signal comes. The run exits at once with the
    one line and nothing written (it used to print the line, then wait forever for the rest of the message)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_SEND)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: " + "words " * 50}) + "\n" for i in range(400)))
    stalled = tmp_path / "stalled"
    env = {**os.environ, "PYTHONPATH": str(hook), "HFSDP_TEST_STALLED": str(stalled)}
    proc = subprocess.Popen(
        [HFSDP, "data", "prepare", str(corpus), "--tokenizer", str(tok), "-o", str(tmp_path / "c"), "--workers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not stalled.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        workers = _children(proc.pid)
        os.killpg(proc.pid, signum) if group else proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, (out, err)
    assert err == f"interrupted ({signal.Signals(signum).name}); nothing was written to {tmp_path / 'c'}\n", err
    assert written(tmp_path) == ["hook", "stalled"] and _gone(workers)
