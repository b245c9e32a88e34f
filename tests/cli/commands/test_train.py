"""`hfsdp train` end to end, as the installed command in a subprocess (the real elastic launcher).

Spawning ranks is slow (megatron-core takes seconds to import in every rank), so each launch here
is a tiny model for a few steps, and one launch serves several assertions where it can. Checks that
must happen before any rank starts run in-process in test_cli_preflight.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.runs import HFSDP, LLAMA

SMALL = ["--layers", "1", "--hidden", "32", "--vocab", "64", "--seq-len", "16", "--device", "cpu"]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([HFSDP, "train", *args], capture_output=True, text=True, timeout=timeout)


def _tiny_hf_model(directory: Path) -> list[str]:
    """Flags that train a tiny transformers Llama: for tests about the launcher, not the model, it starts in a
    second where the megatron-core GPT needs every rank to import megatron-core."""
    config = directory / "llama.json"
    config.write_text(json.dumps(LLAMA))
    return ["--model-config", str(config), "--seq-len", "16", "--device", "cpu"]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _children(pid: int) -> list[int]:
    """PIDs of a live process's children, from /proc."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        found += [int(p) for p in children.read_text().split()]
    return found


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for init to reap it does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _importing_torch(pid: int) -> bool:
    """Whether process `pid` has started to load torch's libraries (it is importing torch, or past it)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _wait_gone(pids: list[int], seconds: float = 10) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(scope="module")
def hfsdp_run(tmp_path_factory):
    metrics = tmp_path_factory.mktemp("train") / "metrics.jsonl"
    args = ["--outer", "optim", "--instances", "2", "--steps", "8", "--lr", "1e-2", "--metrics", str(metrics)]
    result = _run(*args, "--log-every", "4", *SMALL)
    return result, _records(metrics)


def test_train_hfsdp_two_instances_runs_and_learns(hfsdp_run):
    """`hfsdp train --outer optim --instances 2` trains on 4 processes and the loss falls."""
    result, records = hfsdp_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HFSDP 2x2" in result.stdout
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"] - 0.1


def test_output_for_logs_is_plain_lines_and_stderr_stays_empty(hfsdp_run):
    """Piped, the run prints the model's size and memory, then "starting 4 ranks (layout)", then one plain line
    every --log-every steps, and nothing at all on stderr: megatron-core's warnings are silenced in every rank."""
    result, _ = hfsdp_run
    lines = result.stdout.splitlines()
    assert lines[0].startswith("model: ") and "HFSDP 2x2 needs about" in lines[0]
    assert lines[1] == "starting 4 ranks (HFSDP 2x2 (optim over optim_grads_params))"
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["4/8", "8/8"]
    assert "\r" not in result.stdout and "━" not in result.stdout
    assert result.stderr == ""


def test_metrics_records_have_the_documented_fields(hfsdp_run):
    """Each metrics line holds step, loss, grad_norm, lr, tokens_per_s and the model TFLOP/s per GPU; MFU only
    where the GPU's datasheet peak is known (not on the CPU). The summary says the median step's rate."""
    result, records = hfsdp_run
    for record in records:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_s", "model_tflops_per_gpu"} <= record.keys()
        assert record["tokens_per_s"] > 0 and record["grad_norm"] > 0 and record["lr"] == pytest.approx(1e-2)
        assert record["model_tflops_per_gpu"] > 0 and "mfu" not in record
    assert re.search(r"tokens/s \(median step\), [\d.,]+ model TFLOP/s per GPU, peak", result.stdout), result.stdout


def test_bad_flag_combination_is_rejected_before_any_process_starts():
    """An outer strategy stronger than the inner one exits 1 with a sentence naming --outer, and spawns nothing."""
    began = time.monotonic()
    result = _run("--outer", "optim_grads", "--inner", "optim", "--instances", "2", "--hidden", "30", "--heads", "4")
    assert result.returncode == 1
    assert "--outer" in result.stderr and "cross instances" in result.stderr
    assert "--hidden" in result.stderr
    assert "Traceback" not in result.stderr and "starting" not in result.stdout
    assert time.monotonic() - began < 30


def test_unknown_strategy_suggests_the_closest_name():
    """A misspelt --inner names the flag and suggests the right strategy name."""
    result = _run("--inner", "optim_grad_params")
    assert result.returncode == 1
    assert "--inner" in result.stderr and "optim_grads_params" in result.stderr


def test_a_failing_rank_stops_every_rank_with_its_error(tmp_path):
    """When rank 2 raises, the command prints that rank's traceback once and one line naming rank 2 and its error,
    exits 1, and no rank is left running."""
    proc = subprocess.Popen(
        [HFSDP, "train", "--steps", "4", "--debug-fail-rank", "2", *_tiny_hf_model(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ranks = []
    while proc.poll() is None and len(ranks) < 4:
        ranks = [p for p in _children(proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        time.sleep(0.2)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert err.count("Traceback") == 1 and "injected failure on rank 2" in err
    assert err.strip().splitlines()[-1].startswith("error: rank 2 failed (RuntimeError: injected failure on rank 2")
    assert "Its traceback is above" in err
    assert not _wait_gone(ranks)


def test_save_reshard_and_resume_through_the_cli(tmp_path):
    """Train 4 steps of HFSDP on 2 ranks saving every 2, `hfsdp ckpt reshard` step 2 to 1 rank, --load it and train
    to step 4: steps 3-4 give the losses and the learning rates of the uninterrupted run (a warmup + cosine schedule
    continued at the checkpoint's step, not restarted at step 0); the resume says where from and which layouts; a
    resume with nothing left to do says so without starting ranks; an explicit --lr wins over the checkpoint's."""
    from hfsdp.recipes.lr_schedule import Schedule

    schedule = ["--lr-warmup-iters", "3", "--lr-decay-style", "cosine", "--min-lr", "1e-4"]
    model = ["--global-batch-size", "8", "--micro-batch-size", "2", *schedule, *SMALL]
    hfsdp = ["--nproc", "2", "--instances", "2", "--outer", "optim", *model]
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    # One run is both the uninterrupted one (its metrics) and the one that saved step 2 (and step 4).
    first = _run(*hfsdp, "--steps", "4", "--save-every", "2", "--save", str(tmp_path / "ck"), "--metrics", str(whole))
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"checkpoints: {tmp_path / 'ck'} (latest: step-4" in first.stdout

    nothing = _run(*hfsdp, "--steps", "4", "--load", str(tmp_path / "ck"))
    assert nothing.returncode == 0, nothing.stderr
    assert f"checkpoint {tmp_path / 'ck' / 'step-4'} is at step 4 and --steps is 4: nothing to do" in nothing.stdout
    assert "starting" not in nothing.stdout and "nan" not in nothing.stdout

    target = ["--world-size", "1", "--instances", "1", "--outer", "no_shard"]
    reshard = subprocess.run(
        [HFSDP, "ckpt", "reshard", str(tmp_path / "ck" / "step-2"), str(tmp_path / "ck1"), *target],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert reshard.returncode == 0, reshard.stderr
    args = ["--nproc", "1", "--instances", "1", "--outer", "no_shard", *model, "--steps", "4"]
    second = _run(*args, "--load", str(tmp_path / "ck1"), "--metrics", str(resumed))
    assert second.returncode == 0, second.stderr[-2000:]
    layouts = "(ZeRO-3 1x1 (optim_grads_params) -> ZeRO-3 1x1 (optim_grads_params))"  # ck1 was resharded to 1 rank
    assert f"resumed from {tmp_path / 'ck1'} {layouts}" in second.stdout
    expected = _records(whole)[2:]
    got = _records(resumed)
    assert [r["step"] for r in got] == [3, 4]
    lr_at = Schedule(3e-3, 1e-4, warmup_iters=3, decay_iters=4, style="cosine").lr_at
    assert [r["lr"] for r in got] == pytest.approx([lr_at(3), lr_at(4)], rel=1e-9)  # restarted: lr_at(1), lr_at(2)
    for a, b in zip(got, expected, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["lr"] == pytest.approx(b["lr"], rel=1e-12)

    override = tmp_path / "override.jsonl"
    end = ["--lr-decay-iters", "4"]  # --steps 3 would end the decay inside the warmup
    third = _run(*args[:-1], "3", *end, "--load", str(tmp_path / "ck1"), "--lr", "1e-4", "--metrics", str(override))
    assert third.returncode == 0, third.stderr[-2000:]
    assert "--lr 0.0001 instead of the checkpoint's 0.003" in third.stdout
    assert [r["lr"] for r in _records(override)] == [pytest.approx(1e-4)]


def test_train_moe_with_expert_parallelism_and_two_instances(tmp_path):
    """`hfsdp train --moe-experts 4 --ep 2 --outer optim --instances 2 --nproc 4` trains as HFSDP 2x2 with experts on
    their own mesh, and computes what two ranks without expert parallelism compute (ZeRO-3 1x2, ep 1, the same
    global batch): the same losses and gradient norms, step by step (rtol 1e-5)."""
    runs = {}
    for name, layout in {
        "ep2 HFSDP": ["--ep", "2", "--outer", "optim", "--instances", "2", "--nproc", "4"],
        "ep1 ZeRO-3": ["--ep", "1", "--nproc", "2"],
    }.items():
        metrics = tmp_path / f"{name}.jsonl"
        batch = ["--global-batch-size", "16"]
        result = _run("--moe-experts", "4", *layout, *batch, "--steps", "3", "--metrics", str(metrics), *SMALL)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = (result.stdout, _records(metrics))
    assert "HFSDP 2x2" in runs["ep2 HFSDP"][0]
    sharded, single = runs["ep2 HFSDP"][1], runs["ep1 ZeRO-3"][1]
    assert [r["step"] for r in sharded] == [1, 2, 3]
    for a, b in zip(sharded, single, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(
            b["grad_norm"], rel=1e-5
        )


def test_under_an_external_torchrun_it_joins_instead_of_spawning(tmp_path):
    """Started by torchrun (2 ranks), `hfsdp train` runs as the given ranks: world 2 from the launcher, not --nproc;
    a configuration error is printed once, not once per rank."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    args = ["--instances", "2", "--outer", "optim", "--steps", "2", "--global-batch-size", "8", *SMALL]
    cmd = [torchrun, "--nproc-per-node", "2", "-m", "hfsdp.cli", "train"]
    result = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HFSDP 2x1" in result.stdout and "peak RSS MiB per rank: [" in result.stdout
    bad = subprocess.run([*cmd, "--hidden", "30", *SMALL[:2]], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert bad.stderr.count("is not divisible by --heads 4") == 1


# Signals ------------------------------------------------------------------------------------------


def _interrupt(tmp_path: Path, send, *extra: str) -> tuple[subprocess.Popen, str, str, list[int]]:
    """Start a long 2-rank run saving every step, wait until it trains, `send(pid)` a signal, return the outcome."""
    metrics = tmp_path / "m.jsonl"
    args = ["--nproc", "2", "--steps", "100000", "--save", str(tmp_path / "ck"), "--save-every", "1", *extra]
    proc = subprocess.Popen(
        [HFSDP, "train", *args, "--save-keep", "2", "--metrics", str(metrics), *_tiny_hf_model(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    deadline = time.monotonic() + 240
    while len(_records(metrics)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    ranks = _children(proc.pid)
    send(proc.pid)
    out, err = proc.communicate(timeout=120)
    return proc, out, err, ranks


def _assert_stopped_cleanly(tmp_path: Path, proc, out: str, err: str, ranks: list[int], code: int, name: str) -> None:
    assert proc.returncode == code, err
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted at step ") and f"({name})" in lines[0], err
    assert f"last checkpoint {tmp_path / 'ck'}/step-" in lines[0]
    assert not _wait_gone(ranks)
    verify = subprocess.run([HFSDP, "ckpt", "verify", str(tmp_path / "ck")], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    step = int(lines[0].rsplit("step-", 1)[1])
    assert (tmp_path / "ck" / "latest").read_text().strip() == f"step-{step}"
    assert len(list((tmp_path / "ck").glob("step-*"))) <= 2  # --save-keep 2


def test_sigterm_to_the_launcher_stops_with_one_line_and_exit_143(tmp_path):
    """SIGTERM (what a scheduler sends) to `hfsdp train`: exit 143, one line "interrupted at step N; last checkpoint
    DIR/step-K", no traceback, every rank gone, the latest checkpoint intact."""
    proc, out, err, ranks = _interrupt(tmp_path, lambda pid: os.kill(pid, signal.SIGTERM))
    _assert_stopped_cleanly(tmp_path, proc, out, err, ranks, 143, "SIGTERM")


def test_ctrl_c_stops_with_one_line_and_exit_130(tmp_path):
    """Ctrl-C (SIGINT to the whole foreground process group, launcher and ranks alike): exit 130, one line, no
    traceback, every rank gone, the latest checkpoint intact."""
    proc, out, err, ranks = _interrupt(tmp_path, lambda pid: os.killpg(pid, signal.SIGINT))
    _assert_stopped_cleanly(tmp_path, proc, out, err, ranks, 130, "SIGINT")


def test_ctrl_c_while_the_ranks_still_import_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C a moment after the ranks are spawned, while they still import torch and transformers: exit 130 and
    the one line, no KeyboardInterrupt traceback from any rank, every rank gone."""
    proc = subprocess.Popen(
        [HFSDP, "train", "--nproc", "2", "--steps", "100000", *_tiny_hf_model(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ranks: list[int] = []
    while len(ranks) < 2 and proc.poll() is None:
        ranks = [p for p in _children(proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        time.sleep(0.05)
    while proc.poll() is None and not all(_importing_torch(p) for p in ranks):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # the ranks are inside their imports (seconds of them): torch is loading
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines() == ["interrupted before the first step (SIGINT); no checkpoint saved (no --save)"]
    assert not _wait_gone(ranks)


def test_sigterm_with_restarts_and_async_saves_still_stops_with_one_line(tmp_path):
    """With --max-restarts and --async-save a SIGTERM is a stop, not a failure to restart: exit 143, the one line,
    the save in flight finished and published (the latest checkpoint verifies), every rank gone."""
    proc, out, err, ranks = _interrupt(
        tmp_path, lambda pid: os.kill(pid, signal.SIGTERM), "--max-restarts", "2", "--async-save"
    )
    _assert_stopped_cleanly(tmp_path, proc, out, err, ranks, 143, "SIGTERM")
    assert not list((tmp_path / "ck").glob(".tmp-*"))


def test_a_killed_rank_is_reported_as_killed(tmp_path):
    """A rank killed with SIGKILL is reported as such, without pointing at a traceback that does not exist."""
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [HFSDP, "train", "--nproc", "2", "--steps", "100000", "--metrics", str(metrics), *_tiny_hf_model(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not _records(metrics) and proc.poll() is None:
        time.sleep(0.2)
    ranks = [p for p in _children(proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    ranks = [p for p in ranks if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]
    os.kill(ranks[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r"error: rank [01] was killed by signal 9 \(SIGKILL\) at step \d+, by the system \(out of memory\?\) or by "
        r"someone; "
        r"every other rank was stopped\. It left no traceback\.",
        lines[0],
    ), err
    assert not _wait_gone(ranks)


def test_train_a_hugging_face_model_with_a_schedule_evaluation_and_recompute(tmp_path):
    """`hfsdp train --model-config config.json` trains the transformers Llama it describes (HFSDP 2x1, recompute)
    with Megatron's warmup + cosine schedule: every step's lr is the schedule's, held-out loss is reported every
    --eval-interval steps and at the end, the loss falls, and a checkpoint is saved; --tensorboard-dir holds the
    same figures as --metrics, step by step, read back with TensorBoard's own event reader."""
    from hfsdp.recipes.lr_schedule import Schedule

    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    metrics = tmp_path / "metrics.jsonl"
    args = ["--model-config", str(config), "--nproc", "2", "--instances", "2", "--outer", "optim", "--steps", "7"]
    args += ["--lr", "1e-2", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-3"]
    args += ["--eval-interval", "3", "--recompute", "--seq-len", "16", "--device", "cpu"]
    board = tmp_path / "tb"
    result = _run(*args, "--metrics", str(metrics), "--save", str(tmp_path / "ckpt"), "--tensorboard-dir", str(board))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HFSDP 2x1" in result.stdout and result.stderr == ""
    records = _records(metrics)
    _assert_tensorboard_holds(board, records)
    schedule = Schedule(1e-2, 1e-3, warmup_iters=2, decay_iters=7, style="cosine")
    assert [r["lr"] for r in records] == pytest.approx([schedule.lr_at(n) for n in range(1, 8)], rel=1e-9)
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6, 7]
    assert records[-1]["eval_loss"] < records[2]["eval_loss"] and records[-1]["loss"] < records[0]["loss"]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-7"


def _assert_tensorboard_holds(board: Path, records: list[dict]) -> None:
    """The TensorBoard event files under `board` hold every figure of every record, at its step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hfsdp.cli.rank.tensorboard_log import TAGS

    events = EventAccumulator(str(board))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {tag for key, tag in TAGS.items() if any(key in r for r in records)}
    assert "train/model_tflops_per_gpu" in events.Tags()["scalars"]  # MFU only on a GPU with a known peak
    for key, tag in TAGS.items():
        if not any(key in r for r in records):
            continue
        written = {e.step: e.value for e in events.Scalars(tag)}
        expected = {r["step"]: r[key] for r in records if key in r}
        assert written.keys() == expected.keys(), tag
        assert [written[s] for s in expected] == pytest.approx(list(expected.values()), rel=1e-6), tag


def test_hugging_face_in_train_and_out(tmp_path):
    """The README's flow: a model saved with transformers is imported into a 2x2 HFSDP checkpoint, trained by
    `hfsdp train --model-config --load` (fresh optimizer at step 0, warmup + cosine, fused AdamW), exported with
    --format hf and loaded back by transformers with nothing missing: its first loss is the original model's, and
    the exported model's held-out loss is the run's last eval loss (fp32, rtol 1e-5)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hfsdp.models import hf
    from hfsdp.recipes.data import SyntheticTokens

    original = hf.build_causal_lm(hf.config_from_dict(LLAMA), seed=7)
    original.save_pretrained(tmp_path / "hf")
    hfsdp = [HFSDP, "ckpt"]
    imported = subprocess.run(
        [*hfsdp, "import", str(tmp_path / "hf"), str(tmp_path / "imported"), "--world-size", "4", "--instances", "2",
         "--outer", "optim"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    metrics = tmp_path / "metrics.jsonl"
    args = ["--model-config", str(tmp_path / "hf" / "config.json"), "--load", str(tmp_path / "imported")]
    args += ["--nproc", "4", "--instances", "2", "--outer", "optim", "--steps", "4", "--seq-len", "16"]
    args += ["--lr", "1e-2", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--eval-interval", "4"]
    result = _run(*args, "--device", "cpu", "--metrics", str(metrics), "--save", str(tmp_path / "trained"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "weights only: the optimizer starts fresh at step 0" in result.stdout
    records = _records(metrics)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    exported = subprocess.run(
        [*hfsdp, "export", str(tmp_path / "trained"), str(tmp_path / "out"), "--format", "hf", "--dtype", "fp32"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    data = SyntheticTokens(LLAMA["vocab_size"], 16)
    train, held_out = data.split()
    with torch.no_grad():
        first = hf.causal_lm_loss(original, *train.global_batch(0, 16)).item()
        evaluated = sum(hf.causal_lm_loss(model, *held_out.global_batch(k, 16)).item() for k in range(2)) / 2
    assert records[0]["loss"] == pytest.approx(first, rel=1e-5)
    assert records[-1]["eval_loss"] == pytest.approx(evaluated, rel=1e-5)
