"""The `hfsdp` command.

A rank the launcher starts runs this module before anything else: multiprocessing's spawn
re-imports the parent's main module (the `hfsdp` script, which imports `hfsdp.cli.main`)
before it unpickles the rank's function, and unpickling it imports torch, megatron-core and
transformers, seconds of work. A Ctrl-C in those seconds (a terminal sends it to the whole
process group) would end every rank with a KeyboardInterrupt traceback from the middle of
an import. So a rank (`RUN_DIR_ENV` is set only in processes the launcher starts) leaves
quietly on SIGINT/SIGTERM until `worker.run_rank` installs the handlers of `stopping.py`:
there is nothing to finish yet, and the launcher prints the one line.
"""

import os as _os
import signal as _signal

from hfsdp.cli.rank.run_dir import RUN_DIR_ENV as _RUN_DIR_ENV


def _leave_quietly(signum: int, frame) -> None:
    _os._exit(128 + signum)  # before the rank has started anything: no state to save, no traceback to print


if _os.environ.get(_RUN_DIR_ENV):
    for _sig in (_signal.SIGINT, _signal.SIGTERM):
        _signal.signal(_sig, _leave_quietly)
