"""The engine stands alone: `hfsdp.core` needs torch and nothing else (CI also installs it into a fresh venv
with only torch and shards a plain module: scripts/core_alone.sh)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_engine_module_imports_without_models_checkpoints_or_the_cli():
    """Importing every module of hfsdp.core pulls in none of megatron-core, transformers, hfsdp.models,
    hfsdp.recipes, hfsdp.ckpt or hfsdp.cli."""
    code = (
        "import importlib, pkgutil, sys, hfsdp.core as core\n"
        "for m in pkgutil.walk_packages(core.__path__, 'hfsdp.core.'): importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('megatron', 'transformers') "
        "or n.startswith(('hfsdp.models', 'hfsdp.recipes', 'hfsdp.ckpt', 'hfsdp.cli')))\n"
        "print(bad)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_the_core_distribution_requires_torch_alone():
    """hfsdp-core's install requirements are torch; megatron-core and transformers are extras of the models."""
    project = tomllib.loads((REPO / "packages/core/pyproject.toml").read_text())["project"]
    assert [d.split(">")[0].split("=")[0].strip() for d in project["dependencies"]] == ["torch"]
    extras = project["optional-dependencies"]
    assert any(d.startswith("megatron-core") for d in extras["megatron"])
    assert any(d.startswith("transformers") for d in extras["hf"])
