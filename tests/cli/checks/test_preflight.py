"""Everything `hfsdp train` checks before any rank starts: paths, the checkpoint to resume, what a save would
overwrite. Run in-process (the command returns before launching), so each check is shown to fail in a fraction of
a second, with one message naming the flag and no "starting N ranks" line."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hfsdp.ckpt import GroupSpec, write_from_tensors
from hfsdp.cli.checks.preflight import MODEL_KEY, save_steps
from hfsdp.cli.main import app
from hfsdp.core.rules.config import LayoutConfig

SMALL = ["--layers", "1", "--hidden", "32", "--vocab", "64", "--seq-len", "16", "--device", "cpu", "--nproc", "2"]
runner = CliRunner()


def fake_checkpoint(root: Path, step: int, hidden: int = 32, vocab: int = 64, model: dict | None = None) -> Path:
    """A small valid checkpoint ROOT/step-K (with ROOT/latest) written in-process, no ranks started."""
    shapes = {
        "embedding.word_embeddings.weight": (vocab, hidden),
        "decoder.layers.0.mlp.linear_fc1.weight": (8, hidden),
    }
    group = GroupSpec(0, False, "float32", None, tuple(shapes.items()))
    tensors = {kind: {n: torch.ones(s) for n, s in shapes.items()} for kind in ("model", "main")}
    extra = {"step": step, **({MODEL_KEY: model} if model is not None else {})}
    path = write_from_tensors(
        root / f"step-{step}", LayoutConfig(world_size=2), [group], tensors, step=step, extra=extra
    )
    (root / "latest").write_text(f"step-{step}\n")
    return path


def train(*args: str) -> tuple[int, str, float]:
    began = time.monotonic()
    result = runner.invoke(app, ["train", *SMALL, *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output, time.monotonic() - began


def assert_refused_before_start(code: int, output: str, seconds: float, flag: str, text: str, exit_code=2) -> None:
    assert code == exit_code, output
    assert output.startswith((f"error: {flag}: ", f"error: {flag} ")) and text in output, output
    assert len(output.strip().splitlines()) == 1
    assert "starting" not in output and "Traceback" not in output
    assert seconds < 60  # refused before launch: no rank started, nothing hung (a bound for a loaded box, not a speed)


def test_load_of_a_directory_that_is_no_checkpoint(tmp_path):
    """--load of a plain directory is refused before any rank starts."""
    (tmp_path / "empty").mkdir()
    assert_refused_before_start(*train("--load", str(tmp_path / "empty")), "--load", "is not a checkpoint")


def test_load_of_a_damaged_checkpoint(tmp_path):
    """--load of a checkpoint whose file was changed after saving is refused by its checksums."""
    ckpt = fake_checkpoint(tmp_path / "ck", 3)
    shard = next(ckpt.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert_refused_before_start(*train("--load", str(tmp_path / "ck")), "--load", "does not match its checksum")


def test_load_of_another_models_checkpoint(tmp_path):
    """--load of a checkpoint with another hidden size (read off its shapes) names the flag that differs."""
    fake_checkpoint(tmp_path / "ck", 3, hidden=48)
    code, output, seconds = train("--load", str(tmp_path / "ck"))
    assert_refused_before_start(code, output, seconds, "--hidden", "saved from a model with --hidden 48")
    assert "pass --hidden 48 to resume it" in output


def test_load_compares_the_recorded_model_settings(tmp_path):
    """A checkpoint that records its model settings is compared on all of them, heads included."""
    fake_checkpoint(tmp_path / "ck", 3, model={"layers": 1, "hidden": 32, "heads": 8, "vocab": 64})
    assert_refused_before_start(*train("--load", str(tmp_path / "ck")), "--heads", "--heads 8")


def test_save_that_is_a_file(tmp_path):
    """--save naming a file is refused."""
    (tmp_path / "f").write_text("")
    assert_refused_before_start(*train("--save", str(tmp_path / "f")), "--save", "is a file, not a directory")


def test_save_whose_next_step_exists(tmp_path):
    """--save into a root that already holds a step this run would write is refused: a save never overwrites."""
    fake_checkpoint(tmp_path / "ck", 10)
    code, output, seconds = train("--save", str(tmp_path / "ck"), "--steps", "20", "--save-every", "5")
    assert_refused_before_start(code, output, seconds, "--save", "already holds step-10, which `latest` has published")


def test_save_over_an_orphan_step_follows_the_documented_rule(tmp_path):
    """A crash after step-20 was renamed into place but before `latest` moved leaves an orphan step-20 above
    `latest` (step-10). docs/checkpoints.md: resume loads `latest` and saving step 20 again replaces the orphan;
    so `--load ROOT --save ROOT` passes the pre-launch checks, as does a fresh run into a root without `latest`.
    A published step stays refused."""
    from hfsdp.cli.checks.preflight import preflight
    from hfsdp.cli.settings.train_config import build_train_config

    root = tmp_path / "ck"
    fake_checkpoint(root, 20)
    fake_checkpoint(root, 10)  # `latest` back at step-10: step-20 is the orphan
    flags = dict(layers=1, hidden=32, vocab=64, seq_len=16, device="cpu", nproc=2, steps=20, save_every=10)
    plan = preflight(build_train_config({**flags, "load": str(root), "save": str(root)}))
    assert plan.start_step == 10 and plan.checkpoint == root / "step-10"
    (root / "latest").unlink()  # no `latest`: every step is unpublished, and a fresh run's save replaces it
    assert preflight(build_train_config({**flags, "save": str(root)})).start_step == 0
    (root / "latest").write_text("step-20\n")  # now published: refused
    code, output, seconds = train("--save", str(root), "--steps", "20", "--save-every", "10")
    assert_refused_before_start(code, output, seconds, "--save", "already holds step-10, which `latest` has published")


def test_save_under_a_file(tmp_path):
    """--save whose parent is a file cannot be created, and says so."""
    (tmp_path / "f").write_text("")
    assert_refused_before_start(*train("--save", str(tmp_path / "f" / "ck")), "--save", "cannot be created")


@pytest.mark.skipif(not Path("/proc/version").is_file(), reason="needs a read-only file system (/proc)")
def test_save_where_nothing_can_be_written():
    """--save on a file system that refuses writes is refused before any rank starts."""
    assert_refused_before_start(*train("--save", "/proc/hfsdp-ck"), "--save", "cannot write in /proc")


def test_metrics_in_a_missing_directory(tmp_path):
    """--metrics in a directory that does not exist is refused (it is not created silently)."""
    code, output, seconds = train("--metrics", str(tmp_path / "no" / "m.jsonl"))
    assert_refused_before_start(code, output, seconds, "--metrics", "does not exist")


def test_tensorboard_dir_without_tensorboard_or_on_a_file(tmp_path, monkeypatch):
    """--tensorboard-dir without the tensorboard package is refused before launch, saying how to install it (never
    accepted and then ignored); one naming a file is refused too."""
    from hfsdp.cli.rank import tensorboard_log

    (tmp_path / "f").write_text("")
    code, output, seconds = train("--tensorboard-dir", str(tmp_path / "f"))
    assert_refused_before_start(code, output, seconds, "--tensorboard-dir", "is a file")
    monkeypatch.setattr(tensorboard_log, "available", lambda: False)
    code, output, seconds = train("--tensorboard-dir", str(tmp_path / "tb"))
    assert_refused_before_start(code, output, seconds, "--tensorboard-dir", "pip install tensorboard")
    assert not (tmp_path / "tb").exists()


def test_metrics_that_is_a_directory(tmp_path):
    """--metrics naming a directory is refused."""
    assert_refused_before_start(*train("--metrics", str(tmp_path)), "--metrics", "is a directory")


def test_resume_with_nothing_left_to_do(tmp_path):
    """A checkpoint already at --steps: one line saying so, exit 0, no rank started."""
    fake_checkpoint(tmp_path / "ck", 20)
    code, output, _ = train("--load", str(tmp_path / "ck"), "--steps", "20")
    assert code == 0, output
    assert output.strip() == (
        f"checkpoint {tmp_path / 'ck' / 'step-20'} is at step 20 and --steps is 20: nothing to do (--steps counts "
        "every step of the run, not more steps; raise it to train further)."
    )


def test_every_problem_at_once_from_the_installed_command(tmp_path):
    """The real command reports all path problems together, exit 2, in seconds, with no rank started."""
    (tmp_path / "f").write_text("")
    args = ["--load", str(tmp_path), "--save", str(tmp_path / "f"), "--metrics", str(tmp_path / "no" / "m")]
    began = time.monotonic()
    hfsdp = str(Path(sys.executable).parent / "hfsdp")
    proc = subprocess.run([hfsdp, "train", *SMALL, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert time.monotonic() - began < 20
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: the run cannot start (3 problems):")
    assert {line.split()[1].rstrip(":") for line in proc.stderr.splitlines()[1:]} == {"--load", "--save", "--metrics"}


@pytest.mark.parametrize(
    ("start", "steps", "every", "expected"),
    [(0, 20, None, [20]), (0, 20, 5, [5, 10, 15, 20]), (7, 20, 5, [10, 15, 20]), (0, 7, 5, [5, 7]), (20, 20, 5, [])],
)
def test_save_steps(start, steps, every, expected):
    """The steps a run saves at: every K steps after where it starts, and at the end."""
    assert save_steps(start, steps, every) == expected


def test_model_config_that_is_no_causal_lm(tmp_path):
    """A --model-config that is not JSON or is missing is a file that cannot be used (exit 2); one that names an
    architecture without decoder layers is refused by the pre-launch build (exit 2); all before any rank starts,
    naming --model-config."""
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    encoder = tmp_path / "bert.json"
    encoder.write_text('{"model_type": "bert", "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 2}')
    cases = ((broken, "cannot be read", 2), (tmp_path / "none.json", "is missing", 2), (encoder, "decoder", 2))
    for path, text, exit_code in cases:
        code, output, seconds = train_hf(str(path))
        assert_refused_before_start(code, output, seconds + 0, "--model-config", text, exit_code)


def test_model_config_shorter_than_the_sequence(tmp_path):
    """--seq-len beyond the model's max_position_embeddings is refused before any rank starts."""
    config = tmp_path / "config.json"
    config.write_text(
        '{"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, '
        '"num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 8}'
    )
    code, output, seconds = train_hf(str(config))
    assert_refused_before_start(code, output, seconds, "--seq-len", "max_position_embeddings", exit_code=1)


def train_hf(config: str) -> tuple[int, str, float]:
    """`hfsdp train --model-config CONFIG` in-process (no GPT shape flags, which it excludes)."""
    began = time.monotonic()
    args = ["train", "--model-config", config, "--seq-len", "16", "--device", "cpu", "--nproc", "2"]
    result = runner.invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output, time.monotonic() - began - 3  # transformers' import: ~3 s of it


def test_a_model_config_without_a_causal_lm_is_one_short_line(tmp_path):
    """An encoder-decoder --model-config (t5) is refused in one line of a few hundred characters, not transformers'
    4 KB list of every causal LM class it knows."""
    config = tmp_path / "t5.json"
    config.write_text('{"model_type": "t5", "vocab_size": 64, "d_model": 32, "num_heads": 4, "num_layers": 1}')
    code, output, _ = train_hf(str(config))
    assert code == 2 and len(output.strip().splitlines()) == 1 and "Traceback" not in output, output
    assert output.startswith("error: --model-config: transformers has no causal language model for model_type 't5'")
    assert len(output) < 400, output
