"""Everything `hfsdp train` needs, merged from defaults, the config file and the flags, and validated.

Precedence is flag > file > default. Layout fields go through `LayoutConfig`, so the
trainer enforces exactly the rules `validate-config` does; problems are reported
under the name the user wrote: the flag (`--outer`) or the file key
(`ddp.outer_dp_sharding_strategy`). Nothing here starts a process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfsdp.cli.config_file import file_problems, load_config_file
from hfsdp.core.config import ConfigError, LayoutConfig, Problem

#: LayoutConfig field -> the flag that sets it.
LAYOUT_FLAGS = {
    "world_size": "--nproc",
    "inner": "--inner",
    "outer": "--outer",
    "instances": "--instances",
    "ep": "--ep",
    "expert_strategy": "--expert-strategy",
    "expert_instances": "--expert-instances",
    "expert_outer": "--expert-outer",
    "num_moe_experts": "--moe-experts",
    "global_batch_size": "--global-batch-size",
    "micro_batch_size": "--micro-batch-size",
}

#: Trainer setting -> (file key, default).
SETTINGS: dict[str, tuple[str | None, Any]] = {
    "steps": ("train.train_iters", 20),
    "lr": ("train.lr", 3e-3),
    "clip_grad": ("train.clip_grad", 1.0),
    "seed": ("train.seed", 0),
    "dtype": ("train.dtype", "fp32"),
    "layers": ("model.num_layers", 2),
    "hidden": ("model.hidden_size", 64),
    "heads": ("model.num_attention_heads", 4),
    "vocab": ("model.vocab_size", 128),
    "seq_len": ("model.seq_length", 32),
    "moe_topk": ("model.moe_router_topk", 2),
    "weight_decay": (None, 0.01),
    "device": (None, "auto"),
    "metrics": (None, None),
    "data_path": (None, None),
    "save": (None, None),
    "save_every": (None, None),
    "load": (None, None),
    "debug_fail_rank": (None, None),
}
LAYOUT_DEFAULTS = {"global_batch_size": 16, "micro_batch_size": 2}


@dataclass(frozen=True)
class TrainConfig:
    """A validated training run: the layout, the model's size and the loop's settings."""

    layout: LayoutConfig
    nproc: int
    steps: int = 20
    lr: float = 3e-3
    clip_grad: float = 1.0
    seed: int = 0
    dtype: str = "fp32"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 128
    seq_len: int = 32
    moe_topk: int = 2
    weight_decay: float = 0.01
    device: str = "auto"
    metrics: str | None = None
    data_path: str | None = None
    save: str | None = None
    save_every: int | None = None
    load: str | None = None
    debug_fail_rank: int | None = None
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def num_microbatches(self) -> int:
        return self.layout.num_microbatches

    @property
    def tokens_per_step(self) -> int:
        return self.layout.global_batch_size * self.seq_len


def build_train_config(flags: dict[str, Any], world_size: int, nproc: int, cuda_available: bool) -> TrainConfig:
    """Merge defaults < config file < flags and validate; raise ConfigError naming flags or file keys."""
    file_layout: dict[str, Any] = {}
    file_extras: dict[str, Any] = {}
    if flags.get("config"):
        loaded = load_config_file(flags["config"], world_size_override=world_size)
        file_layout = {k: v for k, v in loaded.layout.to_dict().items() if v is not None}
        file_extras = {f"model.{k}": v for k, v in loaded.model.items()} | {
            f"train.{k}": v for k, v in loaded.train.items()
        }
    names: dict[str, str] = {}
    layout: dict[str, Any] = {"world_size": world_size}
    for name, flag in LAYOUT_FLAGS.items():
        if name == "world_size":
            continue
        if flags.get(name) is not None:
            layout[name], names[name] = flags[name], flag
        elif name in file_layout:
            layout[name] = file_layout[name]
        elif name in LAYOUT_DEFAULTS:
            layout[name], names[name] = LAYOUT_DEFAULTS[name], flag
    settings: dict[str, Any] = {}
    for name, (key, default) in SETTINGS.items():
        settings[name] = flags[name] if flags.get(name) is not None else file_extras.get(key, default)
    problems = _setting_problems(settings, cuda_available)
    try:
        cfg = LayoutConfig(**layout)
    except ConfigError as err:
        raise ConfigError(problems + file_problems(err.problems, names)) from None
    experts = cfg.num_moe_experts
    if experts and isinstance(settings["moe_topk"], int) and settings["moe_topk"] > experts:
        problems.append(
            Problem(
                "--moe-topk",
                f"--moe-topk {settings['moe_topk']} exceeds --moe-experts {experts}; "
                "route each token to at most as many experts as exist.",
            )
        )
    if problems:
        raise ConfigError(problems)
    return TrainConfig(layout=cfg, nproc=nproc, **settings)


def _setting_problems(s: dict[str, Any], cuda_available: bool) -> list[Problem]:
    problems = []

    def bad(flag: str, message: str) -> None:
        problems.append(Problem(flag, message))

    for name in ("steps", "layers", "hidden", "heads", "vocab", "seq_len", "moe_topk"):
        value = s[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            bad(_flag(name), f"{_flag(name)} must be a positive integer, got {value!r}.")
    if isinstance(s["hidden"], int) and isinstance(s["heads"], int) and s["heads"] > 0 and s["hidden"] % s["heads"]:
        bad("--hidden", f"--hidden {s['hidden']} is not divisible by --heads {s['heads']}; pick a multiple of it.")
    if not (isinstance(s["lr"], int | float) and s["lr"] > 0):
        bad("--lr", f"--lr must be a positive number, got {s['lr']!r}.")
    if not (isinstance(s["clip_grad"], int | float) and s["clip_grad"] >= 0):
        bad("--clip-grad", f"--clip-grad must be >= 0 (0 turns clipping off), got {s['clip_grad']!r}.")
    if s["dtype"] not in ("fp32", "bf16"):
        bad("--dtype", f"--dtype is {s['dtype']!r}; hfsdp trains in 'fp32' or 'bf16'.")
    if s["device"] not in ("auto", "cpu", "cuda"):
        bad("--device", f"--device is {s['device']!r}; use 'auto', 'cpu' or 'cuda'.")
    if s["device"] == "cuda" and not cuda_available:
        bad("--device", "--device cuda was asked for but no CUDA device is visible; use --device cpu or auto.")
    if s["data_path"] is not None:
        prefix = Path(s["data_path"])
        missing = [str(prefix) + ext for ext in (".bin", ".idx") if not Path(str(prefix) + ext).is_file()]
        if missing:
            bad(
                "--data-path",
                f"--data-path {prefix} needs {' and '.join(missing)}, which do not exist; "
                "give the prefix of a Megatron indexed dataset (PREFIX.bin and PREFIX.idx).",
            )
    if s["load"] is not None and not Path(s["load"]).is_dir():
        bad(
            "--load",
            f"--load {s['load']} is not a directory; give a checkpoint root (with 'latest') or a step directory.",
        )
    if s["save_every"] is not None and (not isinstance(s["save_every"], int) or s["save_every"] < 1):
        bad("--save-every", f"--save-every must be a positive integer, got {s['save_every']!r}.")
    if s["save_every"] is not None and s["save"] is None:
        bad("--save-every", "--save-every needs --save DIR to say where checkpoints go.")
    return problems


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
