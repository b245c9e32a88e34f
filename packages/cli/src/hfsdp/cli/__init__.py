"""The `hfsdp` command; this module's one job is to make a signal during start-up quiet.

It is the first module of ours any `hfsdp` process runs: the console script and `python -m hfsdp.cli` import it
before `main.py`, whose imports (typer, rich, the commands) take a few hundred milliseconds, and a rank the launcher
starts imports it too (multiprocessing's spawn re-imports the parent's main module, the `hfsdp` script, before it
unpickles the rank's function, which imports torch, megatron-core and transformers: seconds). A Ctrl-C or SIGTERM in
that time used to end in a KeyboardInterrupt traceback from the middle of an import, or, for SIGTERM, in no line at
all. So, before anything else is imported:

- the `hfsdp` program leaves on SIGINT/SIGTERM with one line and exit 128 + signal until its command starts
  (`main.py`'s command class then installs `stopping.py`'s handlers, which unwind the command instead): nothing
  has been done yet, so there is nothing to finish;
- a rank the launcher started (`RUN_DIR_ENV` is set only there) leaves as quietly, without the line, until
  `worker.run_rank` installs its handlers: the launcher prints the one line for the run.

A signal ignored by whoever started the program (nohup, a script's `&`) stays ignored. Only Python's own start, before
it reaches this module (some 20 ms), keeps Python's defaults. Importing this module from another program (a test, a
notebook) changes no handler.
"""

import _signal  # signal's C core: `signal` would import enum first, milliseconds in which Python's default holds
import os as _os
import sys as _sys

_NAMES = {_signal.SIGINT: "SIGINT", _signal.SIGTERM: "SIGTERM"}
STARTING_LINE = "interrupted while hfsdp was starting ({}); nothing was done\n"


def _leave_with_a_line(signum: int, frame) -> None:
    """Before the command starts: say so in one line and leave, no state to save and no traceback to print."""
    _os.write(2, STARTING_LINE.format(_NAMES[signum]).encode())
    _os._exit(128 + signum)


def _leave_quietly(signum: int, frame) -> None:
    _os._exit(128 + signum)  # a rank before it has started anything: the launcher says what happened


def _is_the_program() -> bool:
    """This process runs `hfsdp` (the console script, or `python -m hfsdp.cli`, when argv[0] is still "-m"), and is
    not a process it spawned (a rank, a tokenizing worker), which re-imports the script under the parent's argv."""
    if "--multiprocessing-fork" in getattr(_sys, "orig_argv", ()):
        return False
    return _os.path.basename(_sys.argv[0]) in ("hfsdp", "hfsdp.exe") or _sys.argv[0] == "-m"


#: Whether this process is the `hfsdp` program (decided at its start: `-m` later becomes `__main__.py`'s path).
IS_THE_PROGRAM = _is_the_program()

if IS_THE_PROGRAM:
    for _sig in _NAMES:
        if _signal.getsignal(_sig) is not _signal.SIG_IGN:  # ignored by whoever started us (nohup, a script's &)
            _signal.signal(_sig, _leave_with_a_line)

from hfsdp.cli.rank.run_dir import RUN_DIR_ENV as _RUN_DIR_ENV  # noqa: E402 (after the handlers: it takes time)

if _os.environ.get(_RUN_DIR_ENV):
    for _sig in _NAMES:
        _signal.signal(_sig, _leave_quietly)
