#!/usr/bin/env bash
# The engine installs and shards a plain module with only torch beside it: a fresh venv, torch, packages/core.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q "${TORCH_SPEC-torch==2.13.0}"
"$venv/bin/python" -m pip install -q -e packages/core
"$venv/bin/python" -W ignore::UserWarning scripts/core_alone.py
rm -rf "$(dirname "$venv")"
