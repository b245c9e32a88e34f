"""Hang detection inside a rank, as under torchrun (no hfsdp launcher to watch it): the rank's own watchdog thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_rank_without_progress_dumps_its_stacks_says_what_it_was_doing_and_exits_124(tmp_path):
    """A process whose heartbeat says "step 3" and then makes no progress for longer than --step-timeout (a sleep
    standing in for a collective that never returns): its watchdog thread writes every thread's stack to
    SAVE/hangs/attempt-0/rank-5.txt, prints one line naming the rank, the step and the file, and exits with 124,
    which torchrun takes for a failure to restart."""
    program = textwrap.dedent(
        f"""
        import time
        from hfsdp.cli.rank.heartbeat import Heartbeat
        beat = Heartbeat(1.0, 5, {str(tmp_path)!r}, None)
        beat.beat("step", 3)
        def stuck_in_a_collective():
            time.sleep(60)
        stuck_in_a_collective()
        """
    )
    env = {"PATH": "/usr/bin:/bin", "TORCHELASTIC_RESTART_COUNT": "0"}
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 124, result.stderr
    dump = tmp_path / "hangs" / "attempt-0" / "rank-5.txt"
    assert "stuck_in_a_collective" in dump.read_text()
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank 5 made no progress for ") and "in step 3" in line and str(dump) in line
