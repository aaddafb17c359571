#!/usr/bin/env bash
# A second interpreter with anndata 0.13 (which needs Python 3.12), made once: the tests in
# tests/test_anndata013.py write their stores with it, and skip themselves without it.
# Called by scripts/test.sh; the demo does not need it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv-anndata013/.ok ] && exit 0
py312=""
for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python; do
  if "$candidate" -c "" >/dev/null 2>&1; then py312=$candidate; break; fi
done
if [ -z "$py312" ]; then
  echo "anndata013_env: no Python 3.12 found: tests/test_anndata013.py will skip" >&2
  exit 0
fi
rm -rf .venv-anndata013
"$py312" -m venv .venv-anndata013
.venv-anndata013/bin/python -m pip install -q "anndata==0.13.*"
touch .venv-anndata013/.ok
