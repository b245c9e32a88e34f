"""Ctrl-C or SIGTERM in the first moments of `hfsdp`, while it still imports, is one line and exit 128 + signal
(issue 37, item 7): `hfsdp/cli/__init__.py` handles both before anything else is imported, and every command's
class (`main.py`) hands over to `stopping.py` when the command starts."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from typer.testing import CliRunner

from hfsdp.cli.main import app

from tests.support.runs import HFSDP

#: Seconds after the start at which the signal is sent: inside hfsdp.cli's own import, main.py's (typer, rich, the
#: commands), the command's parsing, and train's checks (importing torch).
DELAYS = (0.02, 0.05, 0.1, 0.2, 0.4)
#: Python's own start (the interpreter, site) comes before any module of ours and keeps Python's defaults, so the
#: signal waits until hfsdp's handler is in place: at most this long, far more than it takes (20 to 70 ms on a loaded
#: 2-core box), and far less than main.py's imports, after which a handler of the command's would answer instead.
HANDLER_WITHIN_S = 0.15


def _default_dispositions() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (SigCgt in /proc; SIGTERM has none until hfsdp installs one)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            caught = next(line for line in status if line.startswith("SigCgt:"))
    except (FileNotFoundError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (sig - 1) & 1)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_hfsdp_starts_is_one_line_and_128_plus_signal(tmp_path, sig):
    for delay in DELAYS:
        start = time.monotonic()
        proc = subprocess.Popen(
            [HFSDP, "train", "--nproc", "1", "--steps", "1", "--save", str(tmp_path / "ck")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a group of its own, as a terminal's Ctrl-C signals the whole foreground group
            preexec_fn=_default_dispositions,  # as a shell starts a foreground command, whatever this process ignores
        )
        while not _catches(proc.pid, signal.SIGTERM) and time.monotonic() - start < HANDLER_WITHIN_S:
            time.sleep(0.001)
        time.sleep(max(0.0, start + delay - time.monotonic()))
        os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=60)
        said = f"signal at {time.monotonic() - start:.3f} s (asked {delay}): exit {proc.returncode}, stderr {err!r}"
        assert proc.returncode == 128 + sig, said
        assert "Traceback" not in out + err and "KeyboardInterrupt" not in err, said
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("interrupted") and signal.Signals(sig).name in lines[0], said
        assert not (tmp_path / "ck").exists()


def test_a_signal_inside_a_command_without_its_own_line_is_one_line(monkeypatch):
    """A command that does not report a stop itself (plan, validate-config, ckpt) unwinds on the signal and the
    command class says the one line: exit 130, no KeyboardInterrupt traceback."""
    from hfsdp.cli.commands import plan

    def interrupted(flags):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # never reached: the handler raises at once

    monkeypatch.setattr(plan, "_plan", interrupted)
    result = CliRunner().invoke(app, ["plan"])
    assert result.exit_code == 130, (result.output, result.exception)
    assert result.output.strip().splitlines() == ["interrupted (SIGINT); hfsdp plan did not finish"]


def test_a_command_run_in_process_leaves_the_callers_handlers_as_they_were():
    """Called from Python (a test's CliRunner, a notebook), a command restores the SIGINT/SIGTERM handlers it found:
    ignoring them after the command is for the `hfsdp` program's own exit, and left in a caller it made every process
    the caller started later ignore Ctrl-C and SIGTERM."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    result = CliRunner().invoke(app, ["validate-config", "examples/hfsdp_2x4.yaml"])
    assert result.exit_code == 0, result.output
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_signal_inside_an_import_is_raised_when_the_import_is_over(tmp_path, monkeypatch):
    """A signal that lands while a module is being imported (torch's, numpy's: lazily, inside commands and ranks)
    waits until the import is over, then raises `Interrupted`: raised inside it, it left numpy half-imported (a
    later import failed with "cannot load module more than once per process", a traceback) or was swallowed by a C
    extension's init (a SIGTERM the run ignored). Here a module signals its own process halfway through its body."""
    import importlib
    import sys

    from hfsdp.cli.rank import stopping

    (tmp_path / "slow_module.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(0.2)  # the signal's handler runs here, inside the import\n"
        "FINISHED = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    monkeypatch.setattr(stopping, "_requested", None)
    try:
        stopping.install()
        with pytest.raises(stopping.Interrupted) as stopped:
            importlib.import_module("slow_module")
            time.sleep(1)  # the recheck raises within RECHECK_S of the import's end
        assert stopped.value.signum == signal.SIGTERM
        assert sys.modules["slow_module"].FINISHED  # the module's import ran to its end
        assert not any("importlib" in str(entry.path) for entry in stopped.traceback)  # raised outside it
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in before.items():
            signal.signal(sig, handler)
        sys.modules.pop("slow_module", None)
