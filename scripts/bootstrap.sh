#!/usr/bin/env bash
# Create .venv (once) and install dali_zarr with its test extras into it.
# torch is pinned to the CPU build these machines carry on disk; any torch >= 2.4 works.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.dali_zarr-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==${DZ_TORCH:-2.13.0}"
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
