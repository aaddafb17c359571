#!/usr/bin/env bash
# The main job: generate a synthetic single-cell store and train an MLP on it with DDP.
# Usage: bash scripts/demo.sh [NPROC] [extra ddp_train.py args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
nproc_per_node=2
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then  # NPROC is optional: flags may come first
  nproc_per_node=$1
  shift
fi
mkdir -p runs
# torchrun forwards only the signals it handles: SIGUSR1 (sbatch --signal=USR1@120) killed it
# by default and left its ranks training, unsaved
exec .venv/bin/torchrun --standalone --nproc_per_node="$nproc_per_node" \
  --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
  pipelines/ddp_train.py --data runs/demo.zarr --generate "$@"
