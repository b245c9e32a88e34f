#!/usr/bin/env bash
# Create .venv and install the three hfsdp packages (editable) with the dev tools.
# TORCH_SPEC picks the torch build: the default is the CPU wheel this project's machines carry;
# on a GPU machine set e.g. TORCH_SPEC="torch>=2.6" (or pre-install torch and set TORCH_SPEC="").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ -n "${TORCH_SPEC-torch==2.13.0}" ]; then
  .venv/bin/python -m pip install -q "${TORCH_SPEC-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e packages/core -e packages/ckpt -e "packages/cli[dev,plot]"
