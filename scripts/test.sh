#!/usr/bin/env bash
# The test suite: lint, then pytest (GPU tests skip themselves where no GPU is present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/anndata013_env.sh
.venv/bin/ruff check dali_zarr pipelines tests benchmarks
.venv/bin/python -m pytest -q "$@"
