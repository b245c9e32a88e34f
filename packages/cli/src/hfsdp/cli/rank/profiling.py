"""`--profile-dir DIR --profile-steps FIRST-LAST`: torch.profiler over a few steps of a real run.

Where the time of a step goes (a kernel, a collective, the host between two steps) is what a
step time cannot say. Each rank records its own CPU and CUDA activity from the start of step FIRST
to the end of step LAST (counted from 1, as the progress line counts) and writes it as a
Chrome/Perfetto trace, `rank{R}-steps{FIRST}-{LAST}.json.gz`; rank 0 also writes the table of its
costliest operators beside it (`.txt`). Files appear whole or not at all: a run stopped inside the
window writes nothing. The recorded steps run slower than the others (the profiler's own cost), so
their step times are not the run's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hfsdp.cli.settings.setting import parse_step_range


class StepProfiler:
    """Starts torch.profiler before step `first` and writes its trace after step `last`; idle otherwise.

    Used as a context manager around the loop: leaving it inside the window (a signal, an error) stops the
    profiler and writes nothing.
    """

    def __init__(self, directory: str | None, steps: str, rank: int, device: torch.device):
        self.directory = Path(directory) if directory is not None else None
        self.first, self.last = parse_step_range(steps) if directory is not None else (0, 0)
        self.rank, self.device = rank, device
        self._profile: torch.profiler.profile | None = None
        self.written: list[Path] = []

    def before_step(self, step: int) -> None:
        """Called as step `step` (from 1) begins."""
        if self.directory is None or step != self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.__enter__()

    def after_step(self, step: int) -> None:
        """Called once step `step` is complete (its loss read): the window's last step writes the files."""
        if self._profile is None or step != self.last:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        self.directory.mkdir(parents=True, exist_ok=True)
        stem = f"rank{self.rank}-steps{self.first}-{self.last}"
        trace = self.directory / f"{stem}.json.gz"
        tmp = self.directory / f".{os.getpid()}-{trace.name}"  # ends in .gz: torch compresses what it exports
        profile.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)
        self.written.append(trace)
        if self.rank == 0:
            key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = self.directory / f"{stem}.txt"
            _write_whole(table, profile.key_averages().table(sort_by=key, row_limit=40) + "\n")
            self.written.append(table)

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc) -> None:
        if self._profile is not None:
            profile, self._profile = self._profile, None
            profile.__exit__(None, None, None)


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(f".{os.getpid()}-{path.name}")
    tmp.write_text(text)
    os.replace(tmp, path)
