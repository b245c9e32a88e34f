"""`hfsdp train` end to end, as the installed command in a subprocess (the real elastic launcher)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

HFSDP = str(Path(sys.executable).parent / "hfsdp")
SMALL = ["--layers", "1", "--hidden", "32", "--vocab", "64", "--seq-len", "16", "--device", "cpu"]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([HFSDP, "train", *args], capture_output=True, text=True, timeout=timeout)


def _children_of_launcher() -> list[str]:
    """`hfsdp train` processes still alive, and spawned ranks orphaned by a launcher that exited."""
    out = subprocess.run(["ps", "-eo", "ppid=,args="], capture_output=True, text=True).stdout
    left = []
    for line in out.splitlines():
        ppid, _, args = line.strip().partition(" ")
        if args.startswith(f"{HFSDP} train") or (ppid == "1" and "spawn_main" in args):
            left.append(line)
    return left


@pytest.fixture(scope="module")
def hfsdp_run(tmp_path_factory):
    metrics = tmp_path_factory.mktemp("train") / "metrics.jsonl"
    args = ["--outer", "optim", "--instances", "2", "--steps", "8", "--lr", "1e-2", "--metrics", str(metrics), *SMALL]
    result = _run(*args)
    return result, [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def test_train_hfsdp_two_instances_runs_and_learns(hfsdp_run):
    """`hfsdp train --outer optim --instances 2` trains on 4 processes and the loss falls."""
    result, records = hfsdp_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HFSDP 2x2" in result.stdout
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"] - 0.1


def test_metrics_records_have_the_documented_fields(hfsdp_run):
    """Each metrics line holds step, loss, grad_norm, lr and tokens_per_s."""
    _, records = hfsdp_run
    for record in records:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_s"} <= record.keys()
        assert record["tokens_per_s"] > 0 and record["grad_norm"] > 0 and record["lr"] == pytest.approx(1e-2)


def test_bad_flag_combination_is_rejected_before_any_process_starts():
    """An outer strategy stronger than the inner one exits 1 with a sentence naming --outer, and spawns nothing."""
    began = time.monotonic()
    result = _run("--outer", "optim_grads", "--inner", "optim", "--instances", "2", "--hidden", "30", "--heads", "4")
    assert result.returncode == 1
    assert "--outer" in result.stderr and "cross instances" in result.stderr
    assert "--hidden" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - began < 30
    assert not _children_of_launcher()


def test_unknown_strategy_suggests_the_closest_name():
    """A misspelt --inner names the flag and suggests the right strategy name."""
    result = _run("--inner", "optim_grad_params")
    assert result.returncode == 1
    assert "--inner" in result.stderr and "optim_grads_params" in result.stderr


def test_a_failing_rank_stops_every_rank_with_its_error():
    """When rank 2 raises, the command exits non-zero naming rank 2 and its error, and no rank is left running."""
    result = _run("--steps", "4", "--debug-fail-rank", "2", *SMALL)
    assert result.returncode == 1
    assert "rank 2 failed" in result.stderr and "injected failure on rank 2" in result.stderr
    time.sleep(1)
    assert not _children_of_launcher()


def test_save_reshard_and_resume_through_the_cli(tmp_path):
    """Train 2 steps of HFSDP on 2 ranks with --save, `hfsdp ckpt reshard` to 1 rank, --load and train to step 4:
    steps 3-4 give the losses of an uninterrupted 4-step run."""
    model = ["--global-batch-size", "8", "--micro-batch-size", "2", *SMALL]
    hfsdp = ["--nproc", "2", "--instances", "2", "--outer", "optim", *model]
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    assert _run(*hfsdp, "--steps", "4", "--metrics", str(whole)).returncode == 0
    first = _run(*hfsdp, "--steps", "2", "--save", str(tmp_path / "ck"))
    assert first.returncode == 0, first.stderr[-2000:]
    target = ["--world-size", "1", "--instances", "1", "--outer", "no_shard"]
    reshard = subprocess.run(
        [HFSDP, "ckpt", "reshard", str(tmp_path / "ck"), str(tmp_path / "ck1"), *target],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert reshard.returncode == 0, reshard.stderr
    args = ["--nproc", "1", "--instances", "1", "--outer", "no_shard", *model, "--steps", "4"]
    second = _run(*args, "--load", str(tmp_path / "ck1"), "--metrics", str(resumed))
    assert second.returncode == 0, second.stderr[-2000:]
    expected = [json.loads(line) for line in whole.read_text().splitlines()][2:]
    got = [json.loads(line) for line in resumed.read_text().splitlines()]
    assert [r["step"] for r in got] == [3, 4]
    for a, b in zip(got, expected, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_train_moe_with_expert_parallelism_and_two_instances(tmp_path):
    """`hfsdp train --moe-experts 4 --ep 2 --outer optim --instances 2 --nproc 4` trains and reports HFSDP 2x2."""
    metrics = tmp_path / "moe.jsonl"
    moe = ["--moe-experts", "4", "--ep", "2", "--outer", "optim", "--instances", "2", "--nproc", "4"]
    result = _run(*moe, "--steps", "3", "--metrics", str(metrics), *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HFSDP 2x2" in result.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in records)  # finite, with gradients


def test_under_an_external_torchrun_it_joins_instead_of_spawning(tmp_path):
    """Started by torchrun (2 ranks), `hfsdp train` runs as the given ranks: world 2 from the launcher, not --nproc."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    args = ["--instances", "2", "--outer", "optim", "--steps", "2", "--global-batch-size", "8", *SMALL]
    result = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "-m", "hfsdp.cli", "train", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HFSDP 2x1" in result.stdout and "peak RSS MiB per rank: [" in result.stdout
