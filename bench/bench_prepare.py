"""`hfsdp data prepare` throughput and memory against the tokenizer called in a plain loop.

    .venv/bin/python bench/bench_prepare.py [--dir /tmp/hfsdp-bench-prepare] [--mb 40] [--repeat 3]

The corpus is real text every machine has: the standard library's `.py` files as JSON Lines (one file a line),
repeated to `--mb` MB; the tokenizer a byte-level BPE (at most 32,768 tokens: 20,440 are learnt) trained on part
of it, saved as transformers saves one. Each row runs in a fresh process, so its peak RSS is its own:

- `loop`: `AutoTokenizer`, then `tokenizer(json.loads(line)["text"])["input_ids"]` line by line, ids counted and
  dropped (no output at all): what a user writes by hand, single-threaded;
- `prepare, N workers`: the command, in-process in a small driver (`hfsdp.cli.main.app`), writing the dataset;
  its tokens/s are its own clock (tokenize + write, after the tokenizer is loaded), wall is the whole command;
- `prepare, 2 workers, 2x corpus`: the same on twice the text, to show memory does not grow with the corpus.

Peak RSS is the parent's (`ru_maxrss`) and the largest worker's (its VmHWM, polled; `ru_maxrss` of a spawned child
counts the parent's pages it held between fork and exec); "parent
CPU" is the parent's user + system seconds: reading and writing, which must stay well below the workers' time.
Rounds are interleaved; the table gives medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

VOCAB = 32_768

LOOP = r"""
import json, resource, sys, time
from hfsdp.models.hf_code import load_tokenizer  # AutoTokenizer.from_pretrained, never running a directory's code
tok = load_tokenizer(sys.argv[1])
eos, tokens, start = tok.eos_token_id, 0, time.perf_counter()
with open(sys.argv[2], encoding="utf-8") as f:
    for line in f:
        tokens += len(tok(json.loads(line)["text"])["input_ids"] + [eos])
seconds = time.perf_counter() - start
print(json.dumps({"tokens": tokens, "seconds": seconds,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

PREPARE = r"""
import json, resource, sys, threading, time
from pathlib import Path
from typer.testing import CliRunner
from hfsdp.cli.main import app

peak, done = {}, threading.Event()

def watch():  # the workers' own high-water marks (VmHWM: after their exec, so not the parent's pages at fork)
    while not done.wait(0.1):
        for children in Path("/proc/self/task").glob("*/children"):
            for pid in children.read_text().split():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                for line in status.splitlines():
                    if line.startswith("VmHWM:"):
                        peak[pid] = max(peak.get(pid, 0), int(line.split()[1]) / 1024)

threading.Thread(target=watch, daemon=True).start()
start = time.perf_counter()
result = CliRunner().invoke(app, ["data", "prepare", *sys.argv[1:]])
wall = time.perf_counter() - start
done.set()
assert result.exit_code == 0, result.output
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"line": result.output.strip().splitlines()[-1], "wall": wall, "rss_mib": me.ru_maxrss / 1024,
                  "worker_rss_mib": max(peak.values(), default=0), "parent_cpu": me.ru_utime + me.ru_stime,
                  "workers_cpu": kids.ru_utime + kids.ru_stime}))
"""


def corpus(directory: Path, mb: int) -> tuple[Path, Path]:
    """(the JSON Lines corpus of about `mb` MB, twice that), written once per size."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts):
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    lines = [(json.dumps({"text": t}) + "\n").encode() for t in texts]
    out = []
    for size in (mb, 2 * mb):
        path = directory / f"stdlib-{size}mb.jsonl"
        if not path.exists():
            with open(path, "wb") as f:
                written, i = 0, 0
                while written < size * 1_000_000:  # whole lines, cycling through the files
                    written += f.write(lines[i % len(lines)])
                    i += 1
        out.append(path)
    return out[0], out[1]


def tokenizer(directory: Path) -> Path:
    path = directory / "tokenizer"
    if (path / "tokenizer.json").exists():
        return path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.support.tiny_tokenizer import stdlib_texts, tiny_tokenizer

    texts = stdlib_texts("json", "email", "asyncio", "concurrent", "importlib", "unittest", "xml")
    return tiny_tokenizer(path, vocab_size=VOCAB, texts=texts)


def run(code: str, *args) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"a row failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_pressure() -> str:
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/hfsdp-bench-prepare")
    parser.add_argument("--mb", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    small, large = corpus(directory, args.mb)
    tok = tokenizer(directory)
    print(f"corpus {small.stat().st_size / 1e6:.1f} MB ({large.stat().st_size / 1e6:.1f} MB), {os.cpu_count()} CPUs")
    rows: dict[str, list[dict]] = {}
    for round_ in range(args.repeat):
        print(f"round {round_ + 1}: cpu pressure {cpu_pressure()}", flush=True)
        rows.setdefault("loop", []).append(run(LOOP, tok, small))
        for workers, path, label in ((1, small, "prepare, 1 worker"), (2, small, "prepare, 2 workers"),
                                     (2, large, "prepare, 2 workers, 2x corpus")):  # fmt: skip
            out = directory / "out"
            start = time.perf_counter()
            rows.setdefault(label, []).append(
                run(PREPARE, path, "--tokenizer", tok, "-o", out, "--workers", workers, "--overwrite")
            )
            rows[label][-1]["outer_wall"] = time.perf_counter() - start
    print()
    print("| run | tokens | tokens/s (median) | wall s | peak RSS MiB parent / worker | parent CPU s / workers CPU s |")
    print("|---|---:|---:|---:|---|---|")
    loop = rows["loop"]
    tokens = loop[0]["tokens"]
    rate = statistics.median(r["tokens"] / r["seconds"] for r in loop)
    print(f"| plain loop | {tokens:,} | {rate:,.0f} | {statistics.median(r['seconds'] for r in loop):.1f} "
          f"| {statistics.median(r['rss_mib'] for r in loop):,.0f} / - | - |")  # fmt: skip
    for label, runs in rows.items():
        if label == "loop":
            continue
        parsed = [_parse(r["line"]) for r in runs]
        print(
            f"| {label} | {parsed[0]['tokens']:,} | {statistics.median(p['rate'] for p in parsed):,.0f} "
            f"| {statistics.median(r['wall'] for r in runs):.1f} "
            f"| {statistics.median(r['rss_mib'] for r in runs):,.0f} / "
            f"{statistics.median(r['worker_rss_mib'] for r in runs):,.0f} "
            f"| {statistics.median(r['parent_cpu'] for r in runs):.1f} / "
            f"{statistics.median(r['workers_cpu'] for r in runs):.1f} |"
        )
    print(f"\nlast summary line: {rows['prepare, 2 workers'][-1]['line']}")


def _parse(line: str) -> dict:
    """Tokens (training + held out) and tokens/s from the command's summary line."""
    import re

    tokens = int(re.search(r"([\d,]+) tokens \(", line).group(1).replace(",", ""))
    rate = float(re.search(r"([\d,]+) tokens/s", line).group(1).replace(",", ""))
    return {"tokens": tokens, "rate": rate}


if __name__ == "__main__":
    main()
