"""`hfsdp data prepare`: text files to the Megatron indexed dataset `hfsdp train --data-path` reads.

The work is `hfsdp.recipes.prepare` (library code, usable without the CLI); this module turns flags into its
`Request`, draws the progress bar on a terminal, and turns every outcome into one line: the summary, or one
paragraph naming the file, line or flag and saying what to do. Exit codes: 0 written; 1 the corpus, the tokenizer
or a setting is refused (a bad line, an empty corpus, a vocabulary too large); 2 a path cannot be used (an input
missing, unreadable or not a regular file, a tokenizer directory without a tokenizer, an output that exists);
130 / 143 stopped by SIGINT / SIGTERM. In every case but 0 nothing was written. Neither this module nor the
worker processes import torch; transformers, which loads the tokenizer in this process, does.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Annotated

import typer

from hfsdp.cli.rank import stopping
from hfsdp.cli.settings.report import say

EXIT_REFUSED, EXIT_UNUSABLE = 1, 2

HELP = "Prepare training data: text to a Megatron indexed dataset (PREFIX.bin, PREFIX.idx)."
app = typer.Typer(name="data", help=HELP, no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)


def prepare(
    inputs: Annotated[
        list[str],
        typer.Argument(
            metavar="INPUT",
            help="Files to read, each by its name: .jsonl/.ndjson/.json JSON Lines, .parquet (needs pyarrow), "
            "anything else UTF-8 text.",
            show_default=False,
        ),
    ],
    tokenizer: Annotated[
        str,
        typer.Option(
            "--tokenizer",
            help="A directory holding a tokenizer (as save_pretrained writes it, often the model's own) or a "
            "Hugging Face hub name.",
            show_default=False,
        ),
    ],
    output: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            help="Prefix to write: PREFIX.bin, PREFIX.idx and PREFIX.meta.json (which tokenizer made them).",
            show_default=False,
        ),
    ],
    json_key: Annotated[
        str, typer.Option("--json-key", help="The key of each JSON line (the column of a parquet file) holding text.")
    ] = "text",
    split_lines: Annotated[
        bool,
        typer.Option("--split-lines", help="Text files: one document per non-blank line (default: one per file)."),
    ] = False,
    workers: Annotated[
        int | None,
        typer.Option("--workers", help="Tokenizing processes.", show_default="one per usable CPU"),
    ] = None,
    validation_fraction: Annotated[
        float,
        typer.Option(
            "--validation-fraction",
            help="Share of documents held out in PREFIX_val.bin/.idx, which train's --eval-interval then evaluates "
            "on (one document in every 1/F).",
            show_default="0: none",
        ),
    ] = 0.0,
    skip_bad_lines: Annotated[
        bool,
        typer.Option(
            "--skip-bad-lines",
            help="Count and skip bad lines (not UTF-8, not JSON or nested too deep, no --json-key, not text, a lone "
            "surrogate) instead of stopping at the first.",
        ),
    ] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a dataset that exists at --output.")] = False,
) -> None:
    """Tokenize JSON Lines, text or parquet files into a Megatron indexed dataset for hfsdp train --data-path.

    Every document is tokenized as the transformers tokenizer does it and ends with its EOS token; the dataset's
    token dtype is uint16 where the vocabulary fits, else int32. Everything is checked before tokenizing starts, and
    the files are written aside and renamed into place at the end: a bad line, an empty corpus or Ctrl-C leaves
    nothing half-written. Exit codes: 0 written, 1 the corpus, the tokenizer or a setting is refused, 2 a path
    cannot be used, 130 / 143 stopped by SIGINT / SIGTERM.
    """
    from hfsdp.recipes.prepare.errors import PathError, PrepareError
    from hfsdp.recipes.prepare.pipeline import Request
    from hfsdp.recipes.prepare.pipeline import prepare as run

    stopping.install()
    request = Request(
        inputs, tokenizer, output, json_key, split_lines, workers, validation_fraction, skip_bad_lines, overwrite
    )
    try:
        with _bar() as progress:
            summary = run(request, progress)
    except stopping.Interrupted as stop:
        stopping.ignore()
        say(f"interrupted ({signal.Signals(stop.signum).name}); nothing was written to {output}", err=True)
        raise typer.Exit(stop.exit_code) from None
    except PathError as err:
        say(f"error: {err}", err=True)
        raise typer.Exit(EXIT_UNUSABLE) from None
    except PrepareError as err:
        say(f"error: {err}", err=True)
        raise typer.Exit(EXIT_REFUSED) from None
    say(summary_line(summary))


# typer keeps a docstring's single line breaks: each paragraph on one line, as `hfsdp train --help` shows its own.
app.command("prepare", help="\n\n".join(" ".join(p.split()) for p in prepare.__doc__.split("\n\n")))(prepare)


def summary_line(s) -> str:
    """The one line a finished run prints: what was written, how fast, how large."""
    line = (
        f"wrote {s.prefix}.bin/.idx: {s.documents:,} documents, {s.tokens:,} tokens ({s.dtype}) in {s.seconds:.1f} s, "
        f"{s.tokens_per_s:,.0f} tokens/s, {_size(s.output_bytes)}; tokenizer {s.tokenizer.name} "
        f"(vocabulary {s.tokenizer.vocab_size:,})"
    )
    if s.validation_documents:
        line += f"; held out {s.prefix}_val: {s.validation_documents:,} documents, {s.validation_tokens:,} tokens"
    if s.bad:
        line += f"; skipped {s.bad:,} bad lines (the first: {s.first_bad})"
    return line


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


@contextlib.contextmanager
def _bar():
    """A progress bar on a terminal (stderr), driven by (bytes done, bytes in all, tokens); elsewhere nothing."""
    from rich.console import Console

    console = Console(stderr=True, highlight=False)
    if not console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("[bold]prepare"),
        BarColumn(),
        DownloadColumn(),
        TextColumn("{task.fields[tokens]:,} tokens"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("prepare", total=None, tokens=0)
        yield lambda done, total, tokens: bar.update(task, completed=done, total=total, tokens=tokens)
