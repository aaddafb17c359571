#!/usr/bin/env bash
# Create .venv (once) and install dali_zarr with its test extras into it.
# torch is pinned to the CPU build these machines carry on disk; any torch >= 2.4 works.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.dali_zarr-installed
# A .venv whose python no longer runs (its interpreter was upgraded or removed) is made
# anew: the stamp alone would skip the install and leave an empty environment.
if [ -e .venv ] && ! .venv/bin/python -c "" > /dev/null 2>&1; then
  echo "bootstrap: .venv/bin/python does not run; re-creating .venv" >&2
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
  || ! (cd / && "$OLDPWD/.venv/bin/python" -c "import dali_zarr, torch, nvidia.dali") > /dev/null 2>&1; then
  # (imported from /: in the repository root ./dali_zarr imports even where the editable
  # install is missing, and torchrun's workers, which start in pipelines/, then fail)
  # The install takes ~3 GB in .venv (DALI with its nvCOMP/nvJPEG libraries ~1 GB, torch
  # ~0.75 GB, JAX, scipy, ...) plus pip's unpacking room. Say so up front: on a full disk pip
  # only reports "[Errno 28] No space left on device" part way through.
  need_mb=4096
  for dir in . "${TMPDIR:-/tmp}"; do
    free_mb=$(df -Pm "$dir" | awk 'NR == 2 {print $4}')
    if [ -n "$free_mb" ] && [ "$free_mb" -lt "$need_mb" ]; then
      echo "bootstrap: only ${free_mb} MB free on $(cd "$dir" && pwd) ($(df -P "$dir" | awk 'NR == 2 {print $1}')); installing .venv needs ~${need_mb} MB there. If pip fails with \"No space left on device\", free some space (or point TMPDIR elsewhere) and run again." >&2
    fi
  done
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==${DZ_TORCH:-2.13.0}"
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
