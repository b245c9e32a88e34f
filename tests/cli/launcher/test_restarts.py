"""Runs that survive what kills runs, each compared with one uninterrupted run of the same 30 steps.

The reference is HFSDP 2x2 (a tiny transformers Llama, fp32, gloo) saving every 5 steps. The
hurt runs are the same command with `--max-restarts`: one has a rank SIGKILLed at a random
step; another has a rank SIGKILLed while the background write of an `--async-save` is in
flight, and then, in the restarted attempt, a rank SIGSTOPped under `--step-timeout`. Every
one must end with exit 0 and train exactly the reference's run: the same loss at every step,
bit for bit, and the same final checkpoint, tensor for tensor. A resume of the reference's
checkpoint on another world keeps its global batch and its data position.

Launches cost 10-60 s each on a shared 2-core machine, so the runs are module fixtures that
several tests read.
"""

from __future__ import annotations

import os
import random
import re
import signal
from pathlib import Path

import pytest

from hfsdp.ckpt import read_index

from tests.support.runs import Run, assert_same_tensors, records, tiny_llama

STEPS = 30
HFSDP_2X2 = ["--nproc", "4", "--instances", "2", "--outer", "optim", "--steps", str(STEPS), "--save-every", "5"]
HFSDP_2X2 += ["--log-every", "5"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("restarts")


def _run(base: Path, name: str, *args: str) -> Run:
    return Run(base / name, *tiny_llama(base), *HFSDP_2X2, "--save", str(base / name / "ck"), *args)


@pytest.fixture(scope="module")
def reference(base) -> Run:
    run = _run(base, "reference")
    report = run.finish()
    assert run.proc.returncode == 0, report
    return run


@pytest.fixture(scope="module")
def killed(base):
    """SIGKILL a random rank after a random step; return the run, the last step seen before the kill, the pid."""
    chosen = random.Random().randint(6, STEPS - 4)
    run = _run(base, "killed", "--max-restarts", "2")
    run.wait_for(lambda: run.steps()[-1:] >= [chosen], f"step {chosen}")
    seen = run.steps()[-1]
    victim = random.choice(run.ranks())
    os.kill(victim, signal.SIGKILL)
    return run, seen, victim, run.finish()


def _restart_lines(err: str) -> list[re.Match]:
    pattern = r"restart (\d) of (\d): rank (\d) (.*) \(pid (\d+)\); resuming from (\S+)/step-(\d+) on 4 ranks .*"
    return [m for line in err.splitlines() if (m := re.fullmatch(pattern, line))]


def test_a_killed_rank_is_restarted_and_the_run_equals_the_uninterrupted_one(reference, killed):
    """SIGKILL of one rank at a random step: every rank restarts from the last checkpoint, the run exits 0 and its
    losses and gradient norms are the uninterrupted run's at every step, bit for bit, and so is every tensor of its
    final checkpoint; the metrics file and the progress lines show each step once; the last line names the
    restart, the rank and the step."""
    run, seen, victim, report = killed
    assert run.proc.returncode == 0, report
    (line,) = _restart_lines(run.err)
    step = int(re.search(r"at step (\d+)", line[4])[1])
    assert line[4] == f"killed (SIGKILL) at step {step}" and seen + 1 <= step <= seen + 2, (line[0], seen)
    assert int(line[5]) == victim
    resumed = int(line[7])
    assert resumed % 5 == 0 and step - 6 <= resumed < step, line[0]
    assert f"resumed from {run.directory / 'ck' / f'step-{resumed}'} (HFSDP 2x2" in run.out
    assert run.out.strip().splitlines()[-1] == f"1 restart: rank {line[3]} killed (SIGKILL) at step {step}"
    got, expected = records(run.metrics), records(reference.metrics)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in expected]
    shown = [int(m[1]) for m in re.finditer(r"^step (\d+)/30 ", run.out, re.M)]
    assert shown == list(range(5, STEPS + 1, 5)), run.out
    assert_same_tensors(run.directory / "ck" / f"step-{STEPS}", reference.directory / "ck" / f"step-{STEPS}")


@pytest.fixture(scope="module")
def hurt(base):
    """--async-save run: SIGKILL a rank while step 10's background write is in flight (unpublished, `latest` at
    step 5); then, once the restarted attempt trains again, SIGSTOP a rank under --step-timeout 20."""
    run = _run(base, "hurt", "--max-restarts", "2", "--async-save", "--debug-slow-save", "10", "--step-timeout", "20")
    ck = run.directory / "ck"

    def in_flight() -> bool:
        staged = [p for p in ck.glob(".tmp-step-10-*") if len(list(p.glob("rank-*.safetensors"))) == 4]
        return bool(staged) and run.steps()[-1:] >= [11]

    run.wait_for(in_flight, "the background write of step 10")
    latest_then = (ck / "latest").read_text().strip()
    killed = random.choice(run.ranks())
    os.kill(killed, signal.SIGKILL)
    run.wait_for(lambda: run.attempts() >= 2 and run.steps()[-1:] >= [17], "the restarted attempt at step 17")
    stopped = random.choice(run.ranks())
    os.kill(stopped, signal.SIGSTOP)
    return run, latest_then, killed, stopped, run.finish()


def test_a_kill_during_an_async_save_resumes_from_the_checkpoint_before_it(hurt):
    """While step 10's files were being written in the background, `latest` still named step 5; the kill left the
    unpublished write behind and the restart resumed from step 5, the previous checkpoint, whole."""
    run, latest_then, killed, _, report = hurt
    assert run.proc.returncode == 0, report
    assert latest_then == "step-5"
    first = _restart_lines(run.err)[0]
    assert first[1] == "1" and int(first[5]) == killed and first[4].startswith("killed (SIGKILL) at step 1")
    assert int(first[7]) == 5, first[0]
    assert not list((run.directory / "ck").glob(".tmp-*"))  # the next save cleared what the kill left


def test_a_stopped_rank_is_detected_its_stack_dumped_and_the_run_restarted(hurt):
    """A SIGSTOPped rank under --step-timeout 20: the watchdog names it (stopped) and what it was doing, every rank's
    Python stack is dumped to --save/hangs/attempt-1/rank-R.txt, the ranks are stopped and restarted; the run
    completes and its last line names both restarts."""
    run, _, _, stopped, report = hurt
    assert run.proc.returncode == 0, report
    second = _restart_lines(run.err)[1]
    assert second[1] == "2" and int(second[5]) == stopped, second[0]
    assert re.fullmatch(r"hung in .*step \d+ \(stopped, as by SIGSTOP\)", second[4]), second[0]
    stacks = run.directory / "ck" / "hangs" / "attempt-1"
    for rank in range(4):
        dump = (stacks / f"rank-{rank}.txt").read_text()
        assert "(most recent call first)" in dump and "train_loop.py" in dump, (rank, dump[:500])
    first = _restart_lines(run.err)[0]
    last = run.out.strip().splitlines()[-1]
    assert last == f"2 restarts: rank {first[3]} {first[4]}, rank {second[3]} {second[4]}", last


def test_a_hurt_async_run_equals_the_uninterrupted_one(reference, hurt):
    """After both restarts the async-saving run trained exactly the reference: every step once in the metrics file,
    the same losses bit for bit, and the same final checkpoint tensor for tensor (async saves hold what sync ones
    do)."""
    run, *_, report = hurt
    assert run.proc.returncode == 0, report
    got, expected = records(run.metrics), records(reference.metrics)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]
    assert_same_tensors(run.directory / "ck" / f"step-{STEPS}", reference.directory / "ck" / f"step-{STEPS}")


def test_a_resume_on_another_world_keeps_the_global_batch_and_the_data_position(reference, base):
    """The reference's step-10 checkpoint (batch 16 on 4 ranks) resumed on 2 ranks: the batch stays 16 (4
    microbatches per rank instead of 2) and the data continues at sample 160, so steps 11-14 see the same samples and
    give the reference's losses (rtol 1e-5: another layout sums in another order); consumed samples only grow and
    the new checkpoint records 224 and batch 16. With --global-batch-size 8 the resume line says so and the run
    consumes 8 samples a step from 160; its step-11 checkpoint (168 samples: not 11 x 8, nor 11 x 16) resumed on 4
    ranks keeps batch 8 and continues at sample 168, giving that run's steps 12-13."""
    source = reference.directory / "ck" / "step-10"
    run = Run(base / "two", *tiny_llama(base), "--nproc", "2", "--load", str(source), "--steps", "14",
              "--save", str(base / "two" / "ck"))  # fmt: skip
    report = run.finish()
    assert run.proc.returncode == 0, report
    assert f"resumed from {source} (HFSDP 2x2 (optim over optim_grads_params) -> ZeRO-3 1x2 (optim_grads_params)); " \
           "global batch 16 (4 microbatches of 2 per rank), from sample 160" in run.out  # fmt: skip
    got, expected = records(run.metrics), records(reference.metrics)[10:14]
    assert [r["consumed_samples"] for r in got] == [176, 192, 208, 224]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
    index = read_index(base / "two" / "ck" / "step-14")
    assert index.extra["consumed_samples"] == 224 and index.layout["global_batch_size"] == 16

    told = Run(base / "told", *tiny_llama(base), "--nproc", "2", "--load", str(source), "--steps", "13",
               "--global-batch-size", "8", "--save", str(base / "told" / "ck"), "--save-every", "1")  # fmt: skip
    report = told.finish()
    assert told.proc.returncode == 0, report
    assert "--global-batch-size 8 instead of the checkpoint's global batch 16 (2 microbatches of 2 per rank" in told.out
    assert [r["consumed_samples"] for r in records(told.metrics)] == [168, 176, 184]

    # Step 11 of the batch-8 run: the data position (168) is no step x batch, so only consumed_samples gives it.
    changed = base / "told" / "ck" / "step-11"
    four = Run(base / "four", *tiny_llama(base), "--nproc", "4", "--load", str(changed), "--steps", "13")
    report = four.finish()
    assert four.proc.returncode == 0, report
    assert f"resumed from {changed} (ZeRO-3 1x2 (optim_grads_params) -> ZeRO-3 1x4 (optim_grads_params)); " \
           "global batch 8 (1 microbatch of 2 per rank), from sample 168" in four.out  # fmt: skip
    got, expected = records(four.metrics), records(told.metrics)[1:]
    assert [r["consumed_samples"] for r in got] == [176, 184]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
