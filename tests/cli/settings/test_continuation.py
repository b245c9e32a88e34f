"""What a resumed or restarted run keeps, decided before any rank starts: its global batch, its inner size, its own
checkpoint. In-process: each check answers in a fraction of a second, with no rank started."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hfsdp.ckpt import GroupSpec, write_from_tensors
from hfsdp.cli.commands import train as train_command
from hfsdp.cli.main import app
from hfsdp.cli.rank.progress import reporter
from hfsdp.cli.rank.resume import open_metrics
from hfsdp.cli.settings.autoresume import RUN_ID_KEY, own_checkpoint
from hfsdp.cli.settings.continuation import on_world
from hfsdp.cli.settings.train_config import build_train_config
from hfsdp.core.rules.config import ConfigError, LayoutConfig

SMALL = ["--layers", "1", "--hidden", "32", "--vocab", "64", "--seq-len", "16", "--device", "cpu"]
HFSDP_3X2 = {"nproc": 6, "instances": 3, "outer": "optim", "global_batch_size": 24, "max_restarts": 1}
runner = CliRunner()


def _flags(**values) -> dict:
    flags = dict.fromkeys(inspect.signature(train_command.train).parameters)
    flags.update(layers=1, hidden=32, vocab=64, seq_len=16, device="cpu", **values)
    return flags


def _checkpoint(root: Path, step: int, layout: dict, extra: dict | None = None) -> Path:
    """A small valid checkpoint ROOT/step-K of the GPT SMALL builds (with ROOT/latest), written in-process."""
    shapes = {"embedding.word_embeddings.weight": (64, 32), "decoder.layers.0.mlp.linear_fc1.weight": (8, 32)}
    group = GroupSpec(0, False, "float32", None, tuple(shapes.items()))
    tensors = {kind: {n: torch.ones(s) for n, s in shapes.items()} for kind in ("model", "main")}
    path = write_from_tensors(
        root / f"step-{step}",
        LayoutConfig(**layout),
        [group],
        tensors,
        step=step,
        extra={"step": step, **(extra or {})},
    )
    (root / "latest").write_text(f"step-{step}\n")
    return path


def test_a_restart_on_fewer_ranks_keeps_the_inner_size_and_the_global_batch(tmp_path):
    """HFSDP 3x2 with global batch 24 continues on 4 ranks as HFSDP 2x2, batch 24, 3 microbatches per rank instead of
    2; on 5 ranks (not whole instances) or 2 (one instance: no outer axis to shard over) it is refused, naming the
    world sizes that work."""
    cfg = build_train_config(_flags(**HFSDP_3X2, save=str(tmp_path)))
    assert cfg.layout.layout_name.startswith("HFSDP 3x2") and cfg.num_microbatches == 2
    smaller = on_world(cfg.given, 4, 2, 24)
    assert smaller.layout.layout_name.startswith("HFSDP 2x2") and smaller.nproc == 4
    assert smaller.layout.global_batch_size == 24 and smaller.num_microbatches == 3
    with pytest.raises(ConfigError, match=r"5 is not a multiple of the 2 ranks of one instance.*work: 4, 6, 12"):
        on_world(cfg.given, 5, 2, 24)
    with pytest.raises(ConfigError, match=r"continue on 2 ranks: .*no outer axis.*world sizes that work: 4, 6, 12"):
        on_world(cfg.given, 2, 2, 24)


def test_a_resume_whose_checkpoint_batch_does_not_split_is_refused_before_any_rank_starts(tmp_path):
    """--load of a checkpoint trained with global batch 16 on 3 ranks (16 is no multiple of 2 x 3): exit 1, one
    paragraph naming --load, the batch and the sizes that work, and no rank started."""
    _checkpoint(tmp_path / "ck", 10, {"world_size": 4, "global_batch_size": 16, "micro_batch_size": 2})
    result = runner.invoke(app, ["train", *SMALL, "--nproc", "3", "--steps", "12", "--load", str(tmp_path / "ck")])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: --load: the checkpoint ") and "starting" not in result.output
    assert "global batch of 16 sequences per step, which does not split over 3 ranks" in result.output
    assert "Numbers of ranks that split it with --micro-batch-size 2: 1, 2, 4, 8" in result.output
    assert "set --global-batch-size" in result.output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--max-restarts", "2"],
            "--max-restarts 2 resumes every restart from the run's own checkpoints, but there is no --save",
        ),
        (["--async-save"], "--async-save needs --save DIR"),
        (
            ["--min-nproc", "2", "--save", "CK"],
            "--min-nproc 2 says how small a restart may shrink the run, but there are no restarts",
        ),
        (
            [
                "--nproc",
                "6",
                "--instances",
                "3",
                "--outer",
                "optim",
                "--global-batch-size",
                "24",
                "--max-restarts",
                "1",
                "--save",
                "CK",
                "--min-nproc",
                "2",
            ],
            "--min-nproc 2 lets a restart go down to 2 ranks, but the run cannot continue on 2 ranks",
        ),
        (
            ["--nproc", "4", "--max-restarts", "1", "--save", "CK", "--min-nproc", "6"],
            "--min-nproc 6 is more than the 4 ranks the run starts on",
        ),
    ],
)
def test_restart_settings_that_cannot_work_are_refused_before_any_rank_starts(tmp_path, args, expected):
    """Restarts without --save, an async save without --save, --min-nproc without restarts, above --nproc, or down to
    a world the layout cannot use: exit 1 with one sentence naming the flag, and no rank started."""
    args = [str(tmp_path / "ck") if a == "CK" else a for a in args]
    result = runner.invoke(app, ["train", *SMALL, *args])
    assert result.exit_code == 1, result.output
    assert expected in result.output and "starting" not in result.output and "Traceback" not in result.output


def test_only_a_checkpoint_of_this_run_is_resumed_by_a_restart(tmp_path):
    """The latest checkpoint of --save is this run's when its extra records this run's id; an older run's checkpoint
    in the same root is not."""
    _checkpoint(tmp_path / "ck", 5, {"world_size": 2}, {RUN_ID_KEY: "run-a"})
    found = own_checkpoint(str(tmp_path / "ck"), "run-a")
    assert found is not None and found[0] == tmp_path / "ck" / "step-5"
    assert own_checkpoint(str(tmp_path / "ck"), "run-b") is None
    assert own_checkpoint(str(tmp_path / "nothing"), "run-a") is None


def test_under_torchrun_a_restart_on_fewer_nodes_resumes_its_own_checkpoint_as_fewer_instances(tmp_path, monkeypatch):
    """torchrun restarts `hfsdp train --instances 3` (HFSDP 3x2) on 4 ranks after losing a node: the run finds its own
    checkpoint (same --rdzv-id) and continues as HFSDP 2x2 from it with the batch of 24; an hfsdp --max-restarts that
    disagrees with torchrun's is refused; with another job's id the checkpoint is not resumed, and --instances 3 on
    4 ranks is then the invalid layout it is."""
    layout = {"world_size": 6, "instances": 3, "outer": "optim", "global_batch_size": 24, "micro_batch_size": 2}
    _checkpoint(tmp_path / "ck", 5, layout, {RUN_ID_KEY: "job-7"})
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.delenv("HFSDP_RUN_ID", raising=False)
    flags = _flags(instances=3, outer="optim", save=str(tmp_path / "ck"))
    cfg, own = train_command._settings(flags, 4)
    assert own and cfg.load == str(tmp_path / "ck" / "step-5")
    assert cfg.layout.layout_name.startswith("HFSDP 2x2") and cfg.layout.global_batch_size == 24
    with pytest.raises(ConfigError, match="disagrees with torchrun's --max-restarts 2"):
        train_command._settings({**flags, "max_restarts": 1}, 4)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")
    with pytest.raises(ConfigError, match="instances 3 does not divide"):
        train_command._settings(flags, 4)


def test_a_resumed_metrics_file_keeps_the_steps_up_to_the_checkpoint(tmp_path):
    """Resuming at step 10 keeps records 1-10 of the metrics file and drops 11-12 (trained again) and the half line a
    kill left, so every step appears once; a fresh start truncates it."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in range(1, 13)) + '{"step": 13, "lo')
    with open_metrics(str(path), 10) as f:
        f.write('{"step": 11, "loss": 2.0}\n')
    lines = path.read_text().splitlines()
    assert [int(line.split(",")[0].split(":")[1]) for line in lines] == [*range(1, 11), 11]
    assert lines[-1] == '{"step": 11, "loss": 2.0}'
    with open_metrics(str(path), 0):
        pass
    assert path.read_text() == ""


def test_progress_lines_of_replayed_steps_are_not_printed_again(capsys):
    """After a restart at step 10 whose last attempt printed up to step 14, steps 11-14 train again silently; 15 on
    print as usual."""
    with reporter(20, 10, 5, shown_up_to=14) as shown:
        for step in range(11, 21):
            shown.update({"step": step, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0,
                          "peak_memory_mb": 1.0})  # fmt: skip
    printed = [line.split()[1] for line in capsys.readouterr().out.splitlines()]
    assert printed == ["15/20", "20/20"]
