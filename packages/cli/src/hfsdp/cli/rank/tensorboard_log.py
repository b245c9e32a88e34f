"""`--tensorboard-dir DIR`: the per-step figures as TensorBoard curves, beside the JSONL of `--metrics`.

Megatron's flag name, and TensorBoard's own writer (`torch.utils.tensorboard.SummaryWriter`), so the
directory opens in `tensorboard --logdir DIR` like any PyTorch run's. The `tensorboard` package is an
optional dependency: without it the flag is refused before launch (`preflight.py`), never accepted
and then ignored. Rank 0 writes, one scalar per figure of the step's record, at the step's number;
a resumed run appends to the same directory from its first step on.
"""

from __future__ import annotations

import importlib.util

#: Record key -> TensorBoard tag.
TAGS = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "lr": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "peak_memory_mb": "train/peak_memory_mb",
    "step_time_s": "train/step_time_s",
    "model_tflops_per_gpu": "train/model_tflops_per_gpu",
    "mfu": "train/mfu",
}
INSTALL = "pip install tensorboard"


def available() -> bool:
    """Whether TensorBoard's writer can be imported (torch.utils.tensorboard needs the tensorboard package)."""
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardLog:
    """Writes each step's record as scalars under `TAGS`."""

    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=directory)

    def write(self, record: dict) -> None:
        for key, tag in TAGS.items():
            if key in record:
                self.writer.add_scalar(tag, record[key], global_step=record["step"])

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
