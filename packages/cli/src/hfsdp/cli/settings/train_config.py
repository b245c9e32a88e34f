"""From flags, a config file and defaults to one validated `TrainConfig`: the same function for every command.

Precedence is flag > file > default, per setting (`gather`). `resolve` then applies every
rule: each setting's own check and the rules between settings (`settings.py`), and the
layout rules of core's `LayoutConfig`. `hfsdp train` calls it through `build_train_config`
and `hfsdp validate-config` through `build_file_config`, so a file that one accepts the
other accepts. Each problem names the setting as the user wrote it: the flag (`--outer`),
the file key (`ddp.outer_dp_sharding_strategy`) or, for a default, the key a file would use
(or the flag, when there is no file) with "(the default)". Nothing here starts a process,
touches the disk beyond the config file, or imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hfsdp.cli.settings.config_file import FileValues, read_config_file
from hfsdp.cli.settings.report import shown
from hfsdp.cli.settings.rules import RULES, remainders_by_default
from hfsdp.cli.settings.settings import BY_NAME, DILOCO_SETTINGS, SETTINGS
from hfsdp.core.rules.config import ConfigError, LayoutConfig, Problem

FLAG, FILE, DEFAULT, ENV = "flag", "file", "default", "env"
#: Microbatches per optimizer step when --global-batch-size is not given.
DEFAULT_MICROBATCHES = 2
#: Layout settings the rules between settings may name: they see the values the valid layout settled on.


@dataclass(frozen=True)
class Given:
    """A setting's value and where it came from: `spelled` is the flag, file key or variable that set it."""

    value: Any
    spelled: str
    source: str  # FLAG, FILE, DEFAULT or ENV

    def said(self) -> str:
        """'--hidden 30', 'model.moe_router_topk 2 (the default)': the setting as a message quotes it."""
        return f"{self.spelled} {shown(self.value)}" + (" (the default)" if self.source == DEFAULT else "")


@dataclass(frozen=True)
class TrainConfig:
    """A validated training run: the layout, the local process count, and every other setting by name.

    Settings read as attributes (`cfg.lr`, `cfg.steps`); `given` says where each came from, which
    matters on resume: a value the user set (flag or file) wins over the checkpoint's.
    """

    layout: LayoutConfig
    nproc: int
    values: Mapping[str, Any]
    given: Mapping[str, Given] = field(default_factory=dict, compare=False)
    config_path: str | None = None

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("values")
        if values is None or name not in values:
            raise AttributeError(name)
        return values[name]

    def explicit(self, name: str) -> bool:
        """Whether the user set `name` (by flag or config file) rather than leaving the default."""
        return name in self.given and self.given[name].source in (FLAG, FILE)

    @property
    def num_microbatches(self) -> int:
        return self.layout.num_microbatches

    @property
    def tokens_per_step(self) -> int:
        return self.layout.global_batch_size * self.values["seq_len"]

    @property
    def diloco(self):
        """The DiLoCo settings (`hfsdp.core.DiLoCoConfig`) of an `--outer diloco` run, else None."""
        if self.layout.outer.value != "diloco":
            return None
        from hfsdp.core.outer.outer_config import DiLoCoConfig

        return DiLoCoConfig(**{field: self.values[name] for name, field in DILOCO_SETTINGS.items()})


class _Quote:
    """What a rule gets to quote settings: `quote(name)` as the user wrote it, `quote.explicit(name)`."""

    def __init__(self, given: Mapping[str, Given]):
        self.given = given

    def __call__(self, name: str) -> str:
        return self.given[name].said()

    def explicit(self, name: str) -> bool:
        return self.given[name].source in (FLAG, FILE)

    def name(self, name: str) -> str:
        """How the user spells the setting, without its value: '--sync-every' or 'diloco.sync_every'."""
        return self.given[name].spelled


def gather(flags: Mapping[str, Any], file: FileValues | None, world: Given | None) -> dict[str, Given]:
    """Every setting's Given: flag > file > default; `world` is the world size its caller settled on."""
    given: dict[str, Given] = {}
    for s in SETTINGS:
        if s.name == "world_size":
            continue
        if s.flag and flags.get(s.name) is not None:
            given[s.name] = Given(flags[s.name], s.flag, FLAG)
        elif file is not None and s.name in file.values:
            value, key = file.values[s.name]
            given[s.name] = Given(value, key, FILE)
        else:
            spelled = (s.key if file is not None else s.flag) or s.key or s.flag or s.name
            given[s.name] = Given(s.default, spelled, DEFAULT)
    if world is not None:
        given["world_size"] = world
    return given


def resolve(
    given: Mapping[str, Given],
    problems: list[Problem] | None = None,
    nproc: int | None = None,
    world_flag: str = "--nproc",
) -> TrainConfig:
    """Check every value and rule; return the TrainConfig or raise ConfigError with every problem at once.

    `world_flag` is the option that supplies a world size a file lacks, for the message saying so.
    """
    problems = list(problems or [])
    values: dict[str, Any] = {}
    good: set[str] = set()
    for s in SETTINGS:
        if s.name not in given or s.layout or s.name == "nproc":
            continue
        g = given[s.name]
        optional_and_unset = g.value is None and s.default is None
        wrong = s.check(g.value) if s.check and not optional_and_unset else None
        if wrong:
            problems.append(Problem(g.spelled, f"{g.spelled} {wrong}; got {shown(g.value)}."))
            continue
        values[s.name] = float(g.value) if s.type is float and g.value is not None else g.value
        good.add(s.name)

    layout = _layout(given, problems, good, values, world_flag)
    # Rules may name layout settings too (DiLoCo's need `outer`, the batch rules the batch sizes): with the layout
    # valid, as LayoutConfig made them.
    known = dict(values)
    if layout is not None:
        known.update({s.name: _plain(getattr(layout, s.name)) for s in SETTINGS if s.layout})
    for rule in RULES:
        if all(name in good or (layout is not None and BY_NAME[name].layout) for name in rule.names):
            found = rule.check({n: known[n] for n in rule.names}, _Quote(given))
            for name, message in [(rule.names[0], found)] if isinstance(found, str) else found or ():
                problems.append(Problem(given[name].spelled, message))
    if problems or layout is None:
        raise ConfigError(problems)
    if "store_param_remainders" in values and values["store_param_remainders"] is None:  # unset: Megatron's default
        values["store_param_remainders"] = remainders_by_default(values, _Quote(given))
    return TrainConfig(
        layout=layout,
        nproc=nproc if nproc is not None else layout.world_size,
        values=values,
        given=dict(given),
    )


def _layout(
    given: Mapping[str, Given], problems: list[Problem], good: set[str], values: dict[str, Any], world_flag: str
) -> LayoutConfig | None:
    """Build the LayoutConfig (core's rules), renaming its problems' fields to what the user wrote."""
    kwargs = {s.name: given[s.name].value for s in SETTINGS if s.layout and s.name in given}
    experts = kwargs.get("num_moe_experts")
    if experts == 0 and _is_int(experts):
        kwargs["num_moe_experts"] = experts = None  # 0 experts: a dense model, as --help says
    if experts is None or (_is_int(experts) and experts >= 1):
        values["num_moe_experts"] = experts  # for the rules between settings, even if the layout fails
        good.add("num_moe_experts")
    if given["global_batch_size"].source == DEFAULT:
        kwargs["global_batch_size"] = _default_global_batch(kwargs)
    world = given.get("world_size")
    missing = world is None or world.value is None
    if missing:
        kwargs["world_size"] = None  # still let core check everything it can without it
    try:
        layout = LayoutConfig(**kwargs)
    except ConfigError as err:
        for p in err.problems:
            g = given.get(p.field)
            if p.field == "world_size" and missing:
                problems.append(_missing_world(given.get("world_size"), world_flag))
            elif g is None:
                problems.append(p)
            else:  # core names the field by its short name: say it as the user wrote it
                message = g.spelled + p.message[len(p.field) :] if p.message.startswith(p.field + " ") else p.message
                problems.append(Problem(g.spelled, message))
        return None
    return layout


def _missing_world(world: Given | None, world_flag: str) -> Problem:
    spelled = world.spelled if world else "parallel.world_size"
    return Problem(
        spelled,
        f"{spelled} is missing: the file does not say how many ranks the layout is for; set it in the file's "
        f"'parallel' section, or pass {world_flag} N.",
    )


def _default_global_batch(kwargs: Mapping[str, Any]) -> int | None:
    """DEFAULT_MICROBATCHES microbatches on every data-parallel rank, when the sizes it needs are valid."""
    sizes = [kwargs.get(n) for n in ("micro_batch_size", "world_size", "tp", "pp", "cp")]
    if not all(_is_int(v) and v >= 1 for v in sizes):
        return None
    mbs, world, tp, pp, cp = sizes
    return DEFAULT_MICROBATCHES * mbs * max(1, world // (tp * pp * cp))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plain(value: Any) -> Any:
    """A layout field as rules read it: a strategy by its name."""
    return value.value if hasattr(value, "value") else value


# The two entry points ----------------------------------------------------------------------------


def build_file_config(path: str, world_size: int | None = None) -> TrainConfig:
    """`hfsdp validate-config PATH [--world-size N]`: the run `hfsdp train --config PATH` would make.

    --world-size replaces the file's world size. Raises ConfigFileError or ConfigError.
    """
    file = read_config_file(path)
    if world_size is not None:
        world = Given(world_size, "--world-size", FLAG)
    elif "world_size" in file.values:
        value, key = file.values["world_size"]
        world = Given(value, key, FILE)
    else:
        world = Given(None, "parallel.world_size", FILE)
    return resolve(gather({}, file, world), file.problems, world_flag="--world-size")


def build_train_config(flags: Mapping[str, Any], torchrun_world: int | None = None) -> TrainConfig:
    """`hfsdp train`: flags over `--config FILE` over defaults. Raises ConfigFileError or ConfigError.

    The world size: under an external torchrun its WORLD_SIZE (`torchrun_world`), which the file
    must agree with; else --nproc, which the file must agree with; else the file's; else 4 without
    a file. A file without a world size needs --nproc (or torchrun), as validate-config needs
    --world-size, so the two commands accept the same files.
    """
    given, problems, nproc = gather_train(flags, torchrun_world)
    return resolve(given, problems, nproc=nproc)


def gather_train(
    flags: Mapping[str, Any], torchrun_world: int | None = None
) -> tuple[dict[str, Given], list[Problem], int | None]:
    """`build_train_config` before its rules: every setting's Given, the file's problems, the local rank count.

    A restart that resumes its own checkpoint changes some of them (the instances, the global batch) first.
    """
    file = read_config_file(flags["config"]) if flags.get("config") else None
    problems = list(file.problems) if file else []
    world, nproc = _world(flags, file, torchrun_world, problems)
    return gather(flags, file, world), problems, nproc


def _world(
    flags: Mapping[str, Any], file: FileValues | None, torchrun_world: int | None, problems: list[Problem]
) -> tuple[Given, int | None]:
    in_file = file.values.get("world_size") if file else None
    setting = BY_NAME["nproc"]
    if torchrun_world is not None:
        world = Given(torchrun_world, "WORLD_SIZE", ENV)
        if in_file is not None and in_file[0] != torchrun_world:
            problems.append(
                Problem(
                    in_file[1],
                    f"{in_file[1]} is {shown(in_file[0])} but torchrun started {torchrun_world} ranks "
                    f"(WORLD_SIZE={torchrun_world}); start as many ranks as the file says, or change the file.",
                )
            )
        return world, flags.get("nproc")
    if flags.get("nproc") is not None:
        world = Given(flags["nproc"], "--nproc", FLAG)
        if in_file is not None and in_file[0] != flags["nproc"]:
            problems.append(
                Problem(
                    "--nproc",
                    f"--nproc {shown(flags['nproc'])} disagrees with {in_file[1]} {shown(in_file[0])} in "
                    f"{file.path}; drop --nproc to train on the file's ranks, or change the file.",
                )
            )
        return world, flags["nproc"]
    if in_file is not None:
        return Given(in_file[0], in_file[1], FILE), in_file[0] if _is_int(in_file[0]) else None
    if file is not None:
        return Given(None, "parallel.world_size", FILE), None
    return Given(setting.default, "--nproc", DEFAULT), setting.default
