"""`hfsdp plan`'s inputs, validated: the run (train's settings and rules), the model's shape, the cluster.

Every problem is collected and reported at once under the flag that caused it, as `train`
reports its own; train's rules apply unchanged, with the world being --nodes x --gpus-per-node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hfsdp.cli.checks.plan_inputs import default_mfu, layout_fields, model_shape, step_settings
from hfsdp.cli.settings.plan_settings import CLUSTER_FLAGS, PLAN_SETTINGS
from hfsdp.cli.settings.report import shown
from hfsdp.cli.settings.train_config import FLAG, Given, TrainConfig, gather, resolve
from hfsdp.core.rules.config import ConfigError, Problem
from hfsdp.planning.cluster import H200_PEAK_TFLOPS, Cluster
from hfsdp.planning.memory import Settings
from hfsdp.planning.model_shape import ModelShape

WORLD_SPELLED = "--nodes x --gpus-per-node"


class PlanInputError(ConfigError):
    """Invalid plan settings; carries every problem."""


@dataclass(frozen=True)
class PlanInputs:
    cfg: TrainConfig  # the run as train would resolve it; its layout is the one --inner/--outer/--instances name
    shape: ModelShape
    run: Settings
    cluster: Cluster
    mfu: float
    fields: dict[str, Any]

    @property
    def layout_given(self) -> bool:
        """Whether the user named a layout (it is then marked in the report)."""
        return any(self.cfg.explicit(n) for n in ("inner", "outer", "instances"))


def plan_inputs(flags: dict[str, Any]) -> PlanInputs:
    """Validate `hfsdp plan`'s flags; raise PlanInputError with every problem."""
    problems: list[Problem] = []
    cluster_values: dict[str, Any] = {}
    for flag, attr, _default, type_, _help in CLUSTER_FLAGS:
        value = flags.get(attr)
        if value is None:
            continue
        whole = type_ is int
        if (whole and (isinstance(value, bool) or not isinstance(value, int))) or not value > 0:
            what = "a positive whole number such as 1 or 8" if whole else "a positive number"
            problems.append(Problem(flag, f"{flag} must be {what}; got {shown(value)}."))
        elif attr == "mfu" and value > 1:
            problems.append(Problem(flag, f"{flag} is a fraction of the peak, at most 1; got {value}."))
        else:
            cluster_values[attr] = value
    if flags.get("format", "text") not in ("text", "json"):
        problems.append(Problem("--format", f"--format must be text or json; got {shown(flags['format'])}."))
    nodes, gpus = cluster_values.get("nodes", 1), cluster_values.get("gpus_per_node", 8)
    given = gather({n: flags.get(n) for n in PLAN_SETTINGS}, None, Given(nodes * gpus, WORLD_SPELLED, FLAG))
    try:
        cfg = resolve(given, problems, world_flag="--nodes")
    except ConfigError as err:
        raise PlanInputError(list(err.problems)) from None
    shape = model_shape(cfg)
    if shape.max_positions is not None and cfg.model_config is not None and cfg.seq_len > shape.max_positions:
        problems.append(
            Problem(
                "--seq-len",
                f"--seq-len {cfg.seq_len} is longer than the {shape.max_positions} positions {cfg.model_config} "
                "allows (max_position_embeddings); plan shorter sequences.",
            )
        )
    if problems:
        raise PlanInputError(problems)
    peak = cluster_values.pop("peak_tflops", None) or H200_PEAK_TFLOPS[cfg.dtype]
    mfu = cluster_values.pop("mfu", None) or default_mfu(shape)
    inter = cluster_values.pop("inter_gbits", 400.0)
    cluster = Cluster(**cluster_values, inter_gbps=inter / 8, peak_tflops=peak)
    return PlanInputs(cfg, shape, step_settings(cfg, shape), cluster, mfu, layout_fields(cfg))
