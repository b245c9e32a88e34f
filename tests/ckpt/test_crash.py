"""A save killed at any moment leaves the previous checkpoint loadable and `latest` pointing at it.

Two processes save step 1, then are SIGKILLed inside the save of step 2: one
while writing its rank file, one after publishing step-2 but before moving
`latest` (the crash window that leaves an unpublished orphan step-2). A fresh
process group then resumes each root and must get step 1's state exactly, and
its save of step 2 must succeed, replace the orphan, and clean up.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hfsdp.ckpt import CheckpointError, resolve, verify

from tests.support import ckpt_phases
from tests.support.distributed import run_distributed

MODES = ("mid-write", "before-latest")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    base = tmp_path_factory.mktemp("crash")
    procs = {}
    for mode in MODES:
        args = [str(base / mode), str(base / f"{mode}.pt"), str(base / f"{mode}.init")]
        procs[mode] = subprocess.Popen([sys.executable, "-m", "tests.support.crash", mode, *args], cwd=REPO)
    for proc in procs.values():
        proc.wait(timeout=300)
    return base, {mode: proc.returncode for mode, proc in procs.items()}


@pytest.mark.parametrize("mode", MODES)
def test_killed_save_leaves_latest_on_the_previous_checkpoint(crashed, mode):
    """After the kill, `latest` names step-1, which verifies; a half-written step-2 is never a checkpoint."""
    base, codes = crashed
    root = base / mode
    assert codes[mode] == -signal.SIGKILL
    assert (root / "latest").read_text().strip() == "step-1"
    assert resolve(root) == root / "step-1"
    verify(root)
    if mode == "mid-write":
        assert not (root / "step-2").exists()
        (partial,) = root.glob(".tmp-step-2-*")
        with pytest.raises(CheckpointError, match="not a checkpoint"):
            verify(partial)
    else:
        verify(root / "step-2")  # complete, but not yet `latest`


def test_crashed_roots_resume_step_one_exactly_and_save_the_interrupted_step_again(crashed):
    """A fresh run loads step 1 bit for bit from each crashed root (`latest` wins over the orphan step-2), and
    its save of step 2 succeeds, replacing the orphan, moving latest and removing what the crash left."""
    base, _ = crashed
    orphan_marker = base / "before-latest" / "step-2" / "orphan-marker"
    orphan_marker.write_text("written into the orphan step-2 by the test")
    (results,) = run_distributed(ckpt_phases.crash_load_phase, 1, [str(base / m) for m in MODES])
    for mode, (step, state) in zip(MODES, results, strict=True):
        assert step == 1
        saved = torch.load(base / f"{mode}.pt")
        for a, b in zip(saved, state, strict=True):
            for key in a:
                assert torch.equal(a[key], b[key]), (mode, key)
        root = base / mode
        assert (root / "latest").read_text().strip() == "step-2"
        assert verify(root)["path"] == str(root / "step-2")
        assert not list(root.glob(".tmp-*")), "the next save removes what the crash left"
    assert not orphan_marker.exists(), "the orphan step-2 was replaced, not kept"
