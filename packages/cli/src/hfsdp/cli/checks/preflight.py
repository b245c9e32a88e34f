"""What `hfsdp train` checks on this machine before any rank starts: paths, the checkpoint, the device.

The config rules (`train_config.resolve`) judge values; these checks judge the world the
run will meet: that `--load` is a sound checkpoint of this model, that `--save`, `--metrics`,
`--tensorboard-dir` and `--profile-dir` can be written (TensorBoard's package there), that no save would
collide with a published step, that the dataset and the device exist (for fp8, GPUs with fp8 tensor cores:
`fp8_device.py`). Each takes seconds at most, so a mistake costs a message instead of a minute of spawning ranks
and two torch tracebacks. Every problem is reported at once, under the flag that caused it.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfsdp.cli.settings.report import shown
from hfsdp.cli.settings.setting import parse_step_range
from hfsdp.cli.settings.settings import BY_NAME, SETTINGS
from hfsdp.cli.settings.train_config import TrainConfig
from hfsdp.core.rules.config import ConfigError, Problem

#: Where the trainer records the model's settings in a checkpoint's `extra`, to compare on resume.
MODEL_KEY = "model"


class PreflightError(ConfigError):
    """A path, checkpoint or device this run needs is unusable; carries every problem (exit code 2)."""


@dataclass(frozen=True)
class Plan:
    """What the checks found out: where the run starts and from which checkpoint."""

    start_step: int = 0
    checkpoint: Path | None = None
    checkpoint_layout: str | None = None
    saved_layout: dict | None = None  # the checkpoint's layout record (its global batch, inner size, ...)

    def nothing_to_do(self, cfg: TrainConfig) -> str | None:
        """The message when the checkpoint is already at (or past) --steps, else None."""
        if self.checkpoint is None or self.start_step < cfg.steps:
            return None
        return (
            f"checkpoint {self.checkpoint} is at step {self.start_step} and --steps is {cfg.steps}: nothing to do "
            "(--steps counts every step of the run, not more steps; raise it to train further)."
        )


#: The fields of a Hugging Face config that fix its parameters' shapes, compared on resume.
HF_ARCH_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


def model_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The architecture settings a checkpoint records and a resume must match: the GPT's flags, or the
    shape-fixing fields of --model-config's config.json."""
    if cfg.model_config is not None:
        from hfsdp.models import hf

        config = hf.load_config(cfg.model_config).to_dict()
        return {"model_config": {k: config.get(k) for k in HF_ARCH_KEYS}}
    out = {s.name: cfg.values[s.name] for s in SETTINGS if s.arch}
    out["num_moe_experts"] = cfg.layout.num_moe_experts
    return out


def save_steps(start: int, steps: int, every: int | None) -> list[int]:
    """The steps a run from `start` to `steps` saves at: every `every` steps, and at the end."""
    due = set(range(every * (start // every + 1), steps + 1, every)) if every else set()
    return sorted(due | {steps}) if steps > start else []


def preflight(cfg: TrainConfig, verify_checkpoint: bool = True, local_ranks: int | None = None) -> Plan:
    """Check everything outside the config; return the Plan or raise PreflightError with every problem.

    `verify_checkpoint` reads every byte of `--load` against its checksums and every token of `--data-path`
    against the model's vocabulary (rank 0 of a torchrun job does it, the others trust it; a restart's checks
    trust what the run's start read); `local_ranks` is how many ranks this machine starts (for the GPU count).
    """
    problems: list[Problem] = []
    _device(cfg, local_ranks if local_ranks is not None else cfg.nproc, problems)
    if cfg.data_path is not None:
        problems += [Problem("--data-path", message) for message in _dataset(cfg, verify_checkpoint)]
    if cfg.model_config is not None:
        _hf_model(cfg, problems)
    plan = Plan()
    if cfg.load is not None:
        plan = _checkpoint(cfg, verify_checkpoint, problems)
    if cfg.metrics is not None:
        _writable_file(Path(cfg.metrics), "--metrics", problems)
    if cfg.tensorboard_dir is not None:
        _tensorboard_dir(Path(cfg.tensorboard_dir), problems)
    if cfg.profile_dir is not None:
        _output_dir(Path(cfg.profile_dir), "--profile-dir", problems)
        _profile_after_resume(cfg, plan.start_step, problems)
    if cfg.save is not None and plan.nothing_to_do(cfg) is None:
        _save_root(cfg, plan.start_step, problems)
    if problems:
        raise PreflightError(problems)
    return plan


def _dataset(cfg: TrainConfig, scan: bool) -> list[str]:
    """--data-path against the model this run builds (its vocabulary: the GPT's --vocab or --model-config's) and
    --seq-len: `dataset_check`, which reads every token where `scan`."""
    from hfsdp.cli.checks import dataset_check

    if cfg.model_config is None:
        vocab, model = cfg.vocab, f"the GPT (--vocab {cfg.vocab})"
    else:
        from hfsdp.models import hf

        try:
            vocab, model = hf.load_config(cfg.model_config).vocab_size, cfg.model_config
        except hf.HFModelError:
            vocab, model = None, ""  # the config's own problem is reported by _hf_model; the pair is still read
    return dataset_check.problems(cfg.data_path, vocab, model, cfg.seq_len, cfg.eval_interval is not None, scan)


def _device(cfg: TrainConfig, local_ranks: int, problems: list[Problem]) -> None:
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        problems.append(
            Problem("--device", "--device cuda was asked for but no CUDA device is visible; use --device cpu or auto.")
        )
        return
    gpus = torch.cuda.device_count() if cfg.device != "cpu" and torch.cuda.is_available() else 0
    if cfg.overlap_step and not gpus:
        problems.append(
            Problem(
                "--overlap-step",
                "--overlap-step overlaps FusedAdamW's step with the next forward on a GPU's side stream, but this "
                "run trains on the CPU, which has none (every step runs in order); drop --overlap-step.",
            )
        )
    if cfg.fp8 is not None and gpus:
        from hfsdp.cli.checks import fp8_device

        given = cfg.given.get("fp8")
        said, name = (given.said(), given.spelled) if given else (f"--fp8-format {shown(cfg.fp8)}", "--fp8-format")
        problems += [Problem(name, message) for message in fp8_device.problems(said, name, local_ranks)]
    if gpus and local_ranks > gpus:
        problems.append(
            Problem(
                "--nproc",
                f"this machine would start {local_ranks} ranks but has {gpus} GPU(s), one per rank; start at most "
                f"{gpus} ranks here (--nproc, or the config's world size), or train with --device cpu.",
            )
        )


def _checkpoint(cfg: TrainConfig, verify: bool, problems: list[Problem]) -> Plan:
    """--load: a sound checkpoint (checksums, index) of this model; its step is where the run starts."""
    from hfsdp.ckpt import CheckpointError, read_index, resolve
    from hfsdp.ckpt import verify as verify_checkpoint

    try:
        if verify:
            verify_checkpoint(cfg.load)
        ckpt_dir = resolve(cfg.load)
        index = read_index(ckpt_dir)
        layout = index.config()
    except CheckpointError as err:
        problems.append(Problem("--load", str(err)))
        return Plan()
    except OSError as err:
        problems.append(Problem("--load", f"--load {cfg.load} cannot be read ({err.strerror or err}); check the path."))
        return Plan()
    except Exception as err:  # a reader's bug on a strange file must still read as a message about --load
        problems.append(
            Problem("--load", f"--load {cfg.load} cannot be read as a checkpoint ({type(err).__name__}: {err}).")
        )
        return Plan()
    step = int(index.extra.get("step", index.step))
    _same_optimizer(cfg, index, ckpt_dir, problems)
    recorded = index.extra.get(MODEL_KEY)
    saved = dict(recorded) if isinstance(recorded, dict) else _shapes_from_index(index)
    if index.model is not None and index.model["format"] == "transformers":  # an import, or a save of an HF model
        saved = {"model_config": {k: index.model["config"].get(k) for k in HF_ARCH_KEYS}}
    saved["num_moe_experts"] = layout.num_moe_experts
    try:
        run = model_settings(cfg)
    except ValueError:
        return Plan(step, ckpt_dir, layout.layout_name, dict(index.layout))  # reported above
    if ("model_config" in run) != ("model_config" in saved) and ("layers" in saved or "model_config" in saved):
        then = "a Hugging Face model" if "model_config" in saved else "the megatron-core GPT"
        now = "--model-config's model" if "model_config" in run else "the megatron-core GPT"
        problems.append(
            Problem(
                "--load",
                f"the checkpoint {ckpt_dir} holds {then}, but this run builds {now}; resume it with the model "
                "that saved it, or start without --load.",
            )
        )
    if "model_config" in run:
        if saved.get("model_config", run["model_config"]) != run["model_config"]:
            differ = [k for k in HF_ARCH_KEYS if saved["model_config"].get(k) != run["model_config"][k]]
            problems.append(
                Problem(
                    "--model-config",
                    f"the checkpoint {ckpt_dir} was saved from a model whose {differ[0]} is "
                    f"{shown(saved['model_config'].get(differ[0]))}, but {cfg.model_config} says "
                    f"{shown(run['model_config'][differ[0]])}; resume with the config that saved it.",
                )
            )
        return Plan(step, ckpt_dir, layout.layout_name, dict(index.layout))
    for name, value in saved.items():
        if name in run and run[name] != value:
            flag = BY_NAME[name].flag
            then, now = _as_flag(value), _as_flag(run[name])
            problems.append(
                Problem(
                    flag,
                    f"the checkpoint {ckpt_dir} was saved from a model with {flag} {then}, but this run builds "
                    f"{flag} {now}; pass {flag} {then} to resume it, or start without --load.",
                )
            )
    return Plan(step, ckpt_dir, layout.layout_name, dict(index.layout))


#: --optimizer -> the torch class a checkpoint records.
OPTIMIZER_CLASSES = {"adam": "AdamW", "sgd": "SGD"}


def _same_optimizer(cfg: TrainConfig, index, ckpt_dir: Path, problems: list[Problem]) -> None:
    """A resumed optimizer state belongs to the class that saved it (a weights-only checkpoint has none)."""
    saved = index.optimizer["type"] if index.optimizer else None
    wanted = OPTIMIZER_CLASSES[cfg.optimizer]
    if saved is not None and saved != wanted:
        theirs = next((k for k, v in OPTIMIZER_CLASSES.items() if v == saved), None)
        fix = f"pass --optimizer {theirs} to resume it" if theirs else "resume it with the optimizer that saved it"
        problems.append(
            Problem(
                "--optimizer",
                f"the checkpoint {ckpt_dir} holds {saved} state, but --optimizer {cfg.optimizer} builds {wanted}; "
                f"{fix}, or start without --load.",
            )
        )


def _hf_model(cfg: TrainConfig, problems: list[Problem]) -> None:
    """--model-config: a config transformers builds (on `meta`) into a causal LM with decoder layers, long enough for
    --seq-len with the architecture's defaults filled in. The file's own contents passed the rules already."""
    from hfsdp.cli.settings.rules import seq_len_beyond_positions
    from hfsdp.models import hf

    flag = cfg.given["model_config"].spelled if "model_config" in cfg.given else "--model-config"
    try:
        config = hf.load_config(cfg.model_config)
        hf.build_causal_lm(config, device="meta")
    except hf.HFModelError as err:
        problems.append(Problem(flag, str(err)))
        return
    layers = getattr(config, "num_hidden_layers", None)
    diloco = cfg.diloco
    if diloco is not None and isinstance(layers, int) and diloco.fragments > layers + 1:
        problems.append(
            Problem(
                "--sync-fragments",
                f"--sync-fragments {diloco.fragments} is more than the {layers + 1} units of {cfg.model_config} (its "
                f"{layers} decoder layers and the root): each fragment is a run of whole units; use at most "
                f"{layers + 1}.",
            )
        )
    longest = getattr(config, "max_position_embeddings", None)
    if isinstance(longest, int) and cfg.seq_len > longest:
        seq_len = cfg.given["seq_len"].said() if "seq_len" in cfg.given else f"--seq-len {cfg.seq_len}"
        problems.append(Problem("--seq-len", seq_len_beyond_positions(seq_len, longest, cfg.model_config)))


def _as_flag(value: Any) -> str:
    """A model setting as its flag takes it: no experts is `--moe-experts 0`."""
    return "0" if value is None else shown(value)


def _shapes_from_index(index) -> dict[str, int]:
    """Model settings read off the tensor shapes, for checkpoints that do not record them."""
    shapes = {name: shape for g in index.groups for name, shape in g.members}
    out: dict[str, int] = {}
    embedding = shapes.get("embedding.word_embeddings.weight")
    if embedding is not None and len(embedding) == 2:
        out["vocab"], out["hidden"] = embedding
    layers = {int(n.split(".")[2]) for n in shapes if n.startswith("decoder.layers.") and n.split(".")[2].isdigit()}
    if layers:
        out["layers"] = max(layers) + 1
    return out


def _save_root(cfg: TrainConfig, start: int, problems: list[Problem]) -> None:
    """--save: a directory (or one that can be created) that we can write, where no step this run saves is published.

    A step above the one `latest` names (or any step, without `latest`) is the orphan of a save that crashed
    between its rename and moving `latest`: the save of that step replaces it (docs/checkpoints.md), so it is no
    obstacle; a published step is, since a save never overwrites one.
    """
    from hfsdp.ckpt import CheckpointError
    from hfsdp.ckpt.format.store import latest_step

    root = Path(cfg.save)
    if root.exists() and not root.is_dir():
        problems.append(Problem("--save", f"--save {root} is a file, not a directory; give a checkpoint directory."))
        return
    if not _writable_dir(root, "--save", problems):
        return
    try:
        published = latest_step(root) if root.is_dir() else None
    except CheckpointError as err:
        problems.append(Problem("--save", str(err)))
        return
    for step in save_steps(start, cfg.steps, cfg.save_every):
        taken = root / f"step-{step}"
        if taken.exists() and published is not None and step <= published:
            problems.append(
                Problem(
                    "--save",
                    f"--save {root} already holds step-{step}, which `latest` has published and this run would save "
                    f"again; a save never overwrites a published step. Choose another --save, remove {taken}, or "
                    f"resume from it with --load {root}.",
                )
            )
            return


def _tensorboard_dir(directory: Path, problems: list[Problem]) -> None:
    """--tensorboard-dir: the tensorboard package is there to write with, and the directory can be written."""
    from hfsdp.cli.rank import tensorboard_log

    if not tensorboard_log.available():
        problems.append(
            Problem(
                "--tensorboard-dir",
                f"--tensorboard-dir needs the tensorboard package, which is not installed; {tensorboard_log.INSTALL} "
                "(or drop the flag: --metrics writes the same figures as JSON lines).",
            )
        )
        return
    _output_dir(directory, "--tensorboard-dir", problems)


def _profile_after_resume(cfg, start_step: int, problems: list[Problem]) -> None:
    """A resumed run begins after its checkpoint's step: a window that opens at or before it would never record."""
    first, _ = parse_step_range(cfg.profile_steps)
    if start_step >= first:
        problems.append(
            Problem(
                "--profile-steps",
                f"--profile-steps {cfg.profile_steps} begins at or before step {start_step}, where the run resumes "
                f"from --load, so nothing would be recorded; choose steps after {start_step}.",
            )
        )


def _output_dir(directory: Path, flag: str, problems: list[Problem]) -> None:
    """A directory the run writes files into: not a file, and it exists writable or can be created."""
    if directory.exists() and not directory.is_dir():
        problems.append(Problem(flag, f"{flag} {directory} is a file; give a directory for what it writes."))
        return
    _writable_dir(directory, flag, problems)


def _writable_file(path: Path, flag: str, problems: list[Problem]) -> None:
    if path.is_dir():
        problems.append(Problem(flag, f"{flag} {path} is a directory; give the path of a file to write."))
        return
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        problems.append(
            Problem(flag, f"{flag} {path}: the directory {parent} {what}; create it first or choose another path.")
        )
        return
    _probe(parent, flag, path, problems)


def _writable_dir(root: Path, flag: str, problems: list[Problem]) -> bool:
    """`root` exists and is writable, or its nearest existing ancestor is a writable directory."""
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        problems.append(Problem(flag, f"{flag} {root}: {existing} is a file, so the directory cannot be created."))
        return False
    return _probe(existing, flag, root, problems)


def _probe(directory: Path, flag: str, target: Path, problems: list[Problem]) -> bool:
    """Create and remove a file in `directory`: the one test of writability that root, ACLs and
    read-only mounts all answer truthfully."""
    try:
        with tempfile.TemporaryFile(dir=directory, prefix=".hfsdp-probe-"):
            pass
    except OSError as err:
        problems.append(
            Problem(
                flag,
                f"{flag} {target}: cannot write in {directory} ({err.strerror or err}); check its permissions "
                "and free space, or choose another path.",
            )
        )
        return False
    return True
