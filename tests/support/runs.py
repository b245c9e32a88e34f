"""`hfsdp train` as a user runs it, for the tests that break runs on purpose: start, watch, hurt, compare.

A run is the installed command in a subprocess with a tiny transformers Llama (it starts in a
second where the megatron-core GPT needs every rank to import megatron-core). The helpers find
the launcher's rank processes in /proc, read the metrics file and the hidden --timeline, and
compare the tensors of two checkpoints bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

HFSDP = str(Path(sys.executable).parent / "hfsdp")
LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}


def tiny_llama(directory: Path) -> list[str]:
    config = directory / "llama.json"
    config.write_text(json.dumps(LLAMA))
    return ["--model-config", str(config), "--seq-len", "16", "--device", "cpu"]


def records(path: Path) -> list[dict]:
    """The metrics file's records (a line being written is skipped)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class Run:
    """One `hfsdp train` in a subprocess, with its metrics file and timeline under `directory`."""

    def __init__(self, directory: Path, *args: str):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.metrics, self.timeline = directory, directory / "m.jsonl", directory / "timeline.jsonl"
        cmd = [HFSDP, "train", *args, "--metrics", str(self.metrics), "--timeline", str(self.timeline)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out = self.err = ""

    def steps(self) -> list[int]:
        return [r["step"] for r in records(self.metrics)]

    def attempts(self) -> int:
        """How many attempts the launcher has started."""
        return sum(1 for e in records(self.timeline) if e.get("event") == "attempt started")

    def wait_for(self, condition, what: str, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended while waiting for {what}: {self.finish()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"timed out waiting for {what}: {self.finish()}")
            time.sleep(0.05)

    def ranks(self) -> list[int]:
        """PIDs of the launcher's live rank processes (the current attempt's)."""
        from hfsdp.cli.launcher.launch import rank_processes

        return rank_processes(self.proc.pid)

    def finish(self, timeout: float = 600) -> str:
        self.out, self.err = self.proc.communicate(timeout=timeout)
        return f"exit {self.proc.returncode}\n--- stdout\n{self.out[-3000:]}\n--- stderr\n{self.err[-4000:]}"


def checkpoint_tensors(step_dir: Path) -> dict[tuple[str, str], torch.Tensor]:
    """Every tensor of every rank file of a checkpoint (weights, fp32 main weights, optimizer state, RNG)."""
    out = {}
    for path in sorted(step_dir.glob("rank-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({(path.name, key): f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    return out


def assert_same_tensors(a: Path, b: Path) -> None:
    left, right = checkpoint_tensors(a), checkpoint_tensors(b)
    assert left.keys() == right.keys() and left, (sorted(left)[:4], sorted(right)[:4])
    for key, tensor in left.items():
        assert torch.equal(tensor, right[key]), f"{key} differs between {a} and {b}"
