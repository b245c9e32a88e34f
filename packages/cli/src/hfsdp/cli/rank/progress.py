"""What rank 0 shows while training: a progress bar on a terminal, plain lines in a log.

A bar redraws one line with carriage returns, which a log file or a CI console turns
into noise; so when stdout is not a terminal, one plain line every `--log-every` steps
(and at the last step) says the same. The launcher has already said "starting N ranks".
"""

from __future__ import annotations

import sys

from hfsdp.cli.settings.report import say


def reporter(total: int, start: int, every: int, shown_up_to: int = 0):
    """A context manager with `update(record)`: a rich bar on a terminal, plain lines otherwise.

    `shown_up_to` is the last step an earlier attempt of the run printed: a restart trains the steps after its
    checkpoint again, and their lines are not printed twice.
    """
    if sys.stdout.isatty():
        return _Bar(total, start)
    return _Lines(total, every, shown_up_to)


def describe(r: dict) -> str:
    held_out = f"  eval loss {r['eval_loss']:.4f}" if "eval_loss" in r else ""
    rate = f"  {r['model_tflops_per_gpu']:,.0f} TFLOP/s/GPU" if "model_tflops_per_gpu" in r else ""
    mfu = f" ({r['mfu']:.1%} MFU)" if "mfu" in r else ""
    return (
        f"loss {r['loss']:.4f}{held_out}  lr {r['lr']:.3g}  grad norm {r['grad_norm']:.3g}  "
        f"{r['tokens_per_s']:,.0f} tok/s{rate}{mfu}  {r['peak_memory_mb']:,.0f} MiB"
    )


class _Lines:
    def __init__(self, total: int, every: int, shown_up_to: int):
        self.total, self.every, self.shown_up_to = total, every, shown_up_to

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, r: dict) -> None:
        if r["step"] <= self.shown_up_to:
            return
        if r["step"] % self.every == 0 or r["step"] == self.total or "eval_loss" in r:
            say(f"step {r['step']}/{self.total}  {describe(r)}")


class _Bar:
    """train, the step count, a short bar and the time left first, then the figures: on a narrow terminal the
    figures are cut (with an ellipsis), never the count or the time left."""

    def __init__(self, total: int, start: int, console=None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        from rich.table import Column

        self.progress = Progress(
            TextColumn("[bold]train"),
            MofNCompleteColumn(),
            BarColumn(bar_width=16),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
            console=console,
            expand=True,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, info="")

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def update(self, r: dict) -> None:
        self.progress.update(self.task, completed=r["step"], info=describe(r))
