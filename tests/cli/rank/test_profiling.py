"""`--profile-dir` / `--profile-steps`: torch.profiler traces of exactly the steps asked for, one per rank, written
whole or not at all, and every bad value refused before any rank starts."""

from __future__ import annotations

import gzip
import json
import subprocess

import pytest
import torch

from hfsdp.cli.rank.profiling import StepProfiler
from hfsdp.cli.settings.train_config import build_train_config
from hfsdp.core.rules.config import ConfigError

from tests.cli.checks.test_preflight import assert_refused_before_start, fake_checkpoint, train
from tests.support.runs import HFSDP, LLAMA


@pytest.mark.parametrize("steps", ["4-3", "0", "0-2", "a", "3-", "-3", "2-x", "1.5"])
def test_a_step_range_that_is_none_is_refused_naming_the_flag(steps):
    with pytest.raises(ConfigError) as err:
        build_train_config({"profile_dir": "p", "profile_steps": steps, "steps": 10})
    problems = {p.field: p.message for p in err.value.problems}
    assert set(problems) == {"--profile-steps"} and "such as 5 or 3-4" in problems["--profile-steps"], problems


def test_a_window_past_the_last_step_or_without_a_directory_is_refused():
    with pytest.raises(ConfigError) as err:
        build_train_config({"profile_dir": "p", "profile_steps": "4-6", "steps": 5})
    assert "ends after the run's last step" in err.value.problems[0].message
    with pytest.raises(ConfigError) as err:
        build_train_config({"profile_steps": "2", "steps": 5})
    assert "but there is none; add it" in err.value.problems[0].message
    cfg = build_train_config({"profile_dir": "p", "profile_steps": "5", "steps": 5})
    assert (cfg.profile_dir, cfg.profile_steps) == ("p", "5")


def test_a_profile_dir_on_a_file_or_a_window_before_the_resumed_step_is_refused_before_launch(tmp_path):
    (tmp_path / "f").write_text("")
    code, output, seconds = train("--profile-dir", str(tmp_path / "f"), "--steps", "5")
    assert_refused_before_start(code, output, seconds, "--profile-dir", "is a file")
    fake_checkpoint(tmp_path / "ck", 4)
    code, output, seconds = train("--load", str(tmp_path / "ck"), "--steps", "8", "--profile-dir",
                                  str(tmp_path / "prof"), "--profile-steps", "3-5")  # fmt: skip
    assert_refused_before_start(code, output, seconds, "--profile-steps", "where the run resumes from --load")
    assert not (tmp_path / "prof").exists()


def test_a_run_stopped_inside_the_window_writes_nothing(tmp_path):
    profiler = StepProfiler(str(tmp_path / "prof"), "1-2", 0, torch.device("cpu"))
    with pytest.raises(KeyboardInterrupt), profiler:
        profiler.before_step(1)
        torch.ones(4) @ torch.ones(4)
        profiler.after_step(1)
        raise KeyboardInterrupt
    assert not (tmp_path / "prof").exists() and profiler.written == []


def test_each_rank_writes_a_trace_of_exactly_the_steps_asked_for(tmp_path):
    """Two ranks, 4 steps, --profile-steps 2-3: a gzipped Chrome trace per rank holding the optimizer steps of
    steps 2 and 3 only, rank 0's operator table beside them, and the summary naming the files."""
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(LLAMA))
    prof = tmp_path / "prof"
    args = [HFSDP, "train", "--model-config", str(config), "--seq-len", "16", "--device", "cpu", "--nproc", "2",
            "--steps", "4", "--adam-kernel", "torch", "--profile-dir", str(prof), "--profile-steps", "2-3"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert sorted(p.name for p in prof.iterdir()) == ["rank0-steps2-3.json.gz", "rank0-steps2-3.txt",
                                                      "rank1-steps2-3.json.gz"]  # fmt: skip
    for rank in (0, 1):
        events = json.loads(gzip.decompress((prof / f"rank{rank}-steps2-3.json.gz").read_bytes()))["traceEvents"]
        steps = [e for e in events if e.get("name", "").startswith("Optimizer.step#") and e.get("ph") == "X"]
        assert len(steps) == 2, sorted({e.get("name") for e in events})[:50]
    assert "Self CPU" in (prof / "rank0-steps2-3.txt").read_text()
    assert f"profile of steps 2-3: {prof / 'rank0-steps2-3.json.gz'}" in done.stdout, done.stdout
