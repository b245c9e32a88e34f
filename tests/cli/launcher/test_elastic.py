"""Elastic size: an instance lost from an HFSDP 3x2 run, which continues as HFSDP 2x2 from its last checkpoint.

On one machine `--min-nproc 4` makes a restart leave out the failed rank's instance, as
`torchrun --nnodes 2:3` leaves out a lost node: the run keeps its inner size (2) and its
global batch (24), resharded on load, with 3 microbatches per rank instead of 2. Compared with
the uninterrupted 3x2 run: every step's loss within 1e-6 (another layout sums in another order)
and every step's samples the same ones, neither replayed nor skipped.
"""

from __future__ import annotations

import os
import random
import re
import signal

import pytest

from tests.support.runs import Run, records, tiny_llama

STEPS = 20
HFSDP_3X2 = ["--nproc", "6", "--instances", "3", "--outer", "optim", "--global-batch-size", "24", "--steps", str(STEPS)]
HFSDP_3X2 += ["--save-every", "5", "--log-every", "5"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("elastic")
    whole = Run(base / "whole", *tiny_llama(base), *HFSDP_3X2, "--save", str(base / "whole" / "ck"))
    report = whole.finish()
    assert whole.proc.returncode == 0, report
    shrunk = Run(base / "shrunk", *tiny_llama(base), *HFSDP_3X2, "--save", str(base / "shrunk" / "ck"),
                 "--max-restarts", "1", "--min-nproc", "4")  # fmt: skip
    chosen = random.Random().randint(6, STEPS - 3)
    shrunk.wait_for(lambda: shrunk.steps()[-1:] >= [chosen], f"step {chosen}")
    os.kill(random.choice(shrunk.ranks()), signal.SIGKILL)
    return whole, shrunk, shrunk.finish()


def test_a_run_that_loses_an_instance_continues_on_fewer_instances_with_the_same_batch(runs):
    """The restart leaves out the failed rank's instance: 'resuming ... on 4 ranks (HFSDP 2x2', the resume line says
    HFSDP 3x2 -> HFSDP 2x2 with the global batch of 24 now in 3 microbatches per rank, and the run completes."""
    _, shrunk, report = runs
    assert shrunk.proc.returncode == 0, report
    restart = re.search(r"^restart 1 of 1: rank (\d) killed \(SIGKILL\) at step (\d+) \(pid \d+\); resuming from "
                        r"(\S+)/step-(\d+) on 4 ranks \(HFSDP 2x2 ", shrunk.err, re.M)  # fmt: skip
    assert restart, shrunk.err
    resumed = int(restart[4])
    assert f"(HFSDP 3x2 (optim over optim_grads_params) -> HFSDP 2x2 (optim over optim_grads_params)); global " \
           f"batch 24 (3 microbatches of 2 per rank), from sample {24 * resumed}" in shrunk.out  # fmt: skip
    assert shrunk.out.strip().splitlines()[-1] == f"1 restart: rank {restart[1]} killed (SIGKILL) at step {restart[2]}"
    assert "done: HFSDP 2x2" in shrunk.out


def test_the_loss_curve_continues_and_no_sample_is_replayed_or_skipped(runs):
    """Every step appears once, trains on samples 24(k-1) .. 24k-1 (consumed samples 24k after step k, on both
    layouts), and gives the uninterrupted 3x2 run's loss within 1e-6."""
    whole, shrunk, report = runs
    assert shrunk.proc.returncode == 0, report
    got, expected = records(shrunk.metrics), records(whole.metrics)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["consumed_samples"] for r in got] == [24 * k for k in range(1, STEPS + 1)]
    assert [r["consumed_samples"] for r in expected] == [24 * k for k in range(1, STEPS + 1)]
    for a, b in zip(got, expected, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a["step"], a["loss"], b["loss"])
