"""The launcher's use of torch's elastic API across the torch versions hfsdp supports."""

from __future__ import annotations

import dataclasses

import torch.distributed.launcher.api as launcher_api

from hfsdp.cli.launcher import launch


def test_the_shutdown_grace_is_passed_only_where_torch_takes_it(monkeypatch):
    """torch 2.12+ LaunchConfig takes `shutdown_timeout` and gets hfsdp's grace; an older one (2.11, the GPU image's)
    has no such field and gets nothing, instead of a TypeError that stops every launch."""
    takes = "shutdown_timeout" in {f.name for f in dataclasses.fields(launcher_api.LaunchConfig)}
    assert launch._grace() == ({"shutdown_timeout": launch.GRACE_S} if takes else {})

    @dataclasses.dataclass
    class OldLaunchConfig:
        min_nodes: int = 1

    monkeypatch.setattr(launcher_api, "LaunchConfig", OldLaunchConfig)
    assert launch._grace() == {}
