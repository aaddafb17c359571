#!/usr/bin/env bash
# Issue #3's checks on a lent GPU machine: the `gpu` tests, the GPU benchmark, the profile.
#
# Stage DALI and the wheels the GPU image lacks first (here, once):
#   echo /.gpu/ >> .git/info/exclude
#   DZ_GPU_EXTRA="$(bash scripts/gpu_check.sh extra)" bash scripts/stage_gpu.sh
# then make the device calls it prints back to back; the last one's command is
#   ... && source .gpu/install.sh && bash scripts/gpu_check.sh tests
# and, on the same warm machine, carry=[".gpu/install.sh"]:
#   source .gpu/install.sh && bash scripts/gpu_check.sh bench     # writes the store once
#   source .gpu/install.sh && bash scripts/gpu_check.sh profile   # reuses it
#   source .gpu/install.sh && bash scripts/gpu_check.sh demo      # the DDP demo, GPU path
# `profile` times the C API with each read method (kvikio|pinned), with a window's plans
# one at a time (DALI_ZARR_JOINT_PLANS=0, the way before 2026-11-27's session q) and with
# DALI_ZARR_RING_SYNC=none; `bench` measures such configs as rows of one run (DZ_CONFIGS,
# below).
# What fitted 15 minutes of device time on an H200 (2026-11-26, 780 s in all): the five
# staging calls (seconds each), then in the last one `tests` (6 pytest-xdist workers, which
# the image has: ~70 s instead of minutes) and `bench` (~150 s with the store at 100,000
# cells), then `profile` (~40 s) and a second `bench` on the warm machine. The defaults
# below are those sizes since then; benchmarks/results/h200-2026-11-26/README.md has the
# exact commands of that session.
# The decode sweep of 2026-11-27 (benchmarks/results/h200-2026-11-27/: 125 s), which made
# the calls 512 MiB and found 16,384-element inner chunks 4-5x faster to decode than 262,144:
#   DZ_CELLS=50000 DZ_BENCH_ARGS="--inner-chunks 16384,65536,262144 --call-mb 128,1024
#   --configs kvikio/c --read-threads 4,8" ... profile
# Next: `bench` with its defaults (its second row is the same loader with a window's plans
# one at a time: the same-run A/B of session q's joint plans, never run on a GPU), then
# every contender on a store of small inner chunks:
#   DZ_BENCH_ARGS="--inner-chunk 16384" ... bench
# That session's device time (766 s): 5 staging calls and tests + demo (121 s), bench
# (132 s), the sweep (125 s); a second machine (start ~60 s, staging) for tests + bench
# without extra rows + a call-size profile (228 s).
# `profile` also prints the store chunk bytes read and decoded per byte used: CSR rows straddle
# store chunks, so it is ~1 + (store rows per chunk) / --chunk-size (the GPU path decodes whole
# chunks; `dali-zarr inspect STORE` prints rows per chunk): ~1.3 at 256 rows on ~75-row
# chunks. DZ_BENCH_ARGS="--chunk-size 1024 --preload-nchunks 16" keeps the 16k-row window
# and reads ~1.07 (every contender gets the same settings).
# Each step fits one 10-minute call (bench: ~2.5 min the first time, about half of it writing
# the store; DZ_CELLS=400000 for the larger store of earlier runs, ~5 min). Results land in
# $OUT (they come back with the call): gpu_tests.txt, gpu_throughput.txt/.json/.png,
# gpu_demo.txt/.jsonl, gpu_profile.txt. Stores stay in $DZ_BENCH_DIR.
set -uo pipefail
out=${OUT:-/tmp/dz-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step=${1:-tests}

case "$step" in
  extra)
    # Wheels beyond stage_gpu.sh's own list: zstandard (prefix decode) and annbatch with what
    # the image lacks of its dependencies (the image has pandas, h5py, scipy, pyyaml, ...;
    # KINDS.md lists it), so the benchmark measures annbatch's GPU mode in-process.
    echo zstandard annbatch==0.3.1 anndata==0.13.* zarrs array-api-compat dask humanfriendly \
      importlib-metadata lazy-importer legacy-api-wrap locket natsort partd pydantic \
      pydantic-core pydantic-settings python-dotenv scverse-misc session-info2 \
      typing-inspection annotated-types tzdata
    ;;
  tests)
    {
      nvidia-smi -L
      python3 -m pip list 2>/dev/null | grep -iE '^(numpy|numba|numba-cuda|cupy|cupy-cuda13x|torch|zarr|numcodecs) '
      python3 -c "import nvidia.dali as d, kvikio, nvidia.nvcomp as n; print('DALI', d.__version__, 'kvikio', kvikio.__version__, 'nvcomp', getattr(n, '__version__', '?'))"
      python3 -c "from dali_zarr.graph.gpu_pipeline import gpu_status; print(gpu_status()[1])"
      # only the modules with gpu tests: the others import CPU-test extras (jax, lightning);
      # the gene-panel and element ones write their stores with anndata (staged by `extra`)
      panels=$(python3 -c "import anndata" 2>/dev/null && echo tests/test_features.py tests/test_elements.py)
      [ -n "$panels" ] || echo "anndata missing: the gpu tests of test_features.py and test_elements.py do not run"
      # 6 workers where pytest-xdist is installed (the image has it): device time is short
      workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 6")
      case " ${DZ_PYTEST_ARGS:-} " in *" -n "*) workers="" ;; esac
      # test_bad_input.py: stores rewritten under the GPU path's reads (kvikio handles)
      python3 -m pytest -m gpu -q -rs -p no:cacheprovider $workers \
        tests/test_gpu_loader.py tests/test_gpu_pipeline.py tests/test_gpu_plan.py \
        tests/test_cuda_kernels.py tests/test_bad_input.py $panels ${DZ_PYTEST_ARGS:-}
    } 2>&1 | tee "$out/gpu_tests.txt"
    ;;
  bench)
    # Tahoe-like: ~2,000 non-zeros per cell over 20,000 genes, zstd, sharded (issue #3).
    # The store is kept outside $OUT (in $DZ_BENCH_DIR) so that later calls on the same warm
    # machine reuse it; only the table, JSON and chart travel back.
    bench=${DZ_BENCH_DIR:-$HOME/dz/bench}
    # 150 timed batches (~37 windows, 6 epochs of 100,000 cells) so that windows read during
    # the warm-up are a small part of the clock (they are free for it), and epoch boundaries
    # are in it. DZ_CONFIGS: more dali_zarr gpu rows, one per READS/API[/SYNC[/PLANS]] (a
    # window's plans one at a time, pinned reads and no ring sync by default; DZ_CONFIGS=
    # drops them).
    # Three more dali_zarr rows: the cells as a collection of 14 stores (Tahoe-100M's plates),
    # a 1,000-gene panel, and the 14 stores each under its own panel map (stores written
    # with other gene orders), all read by byte plans (DZ_STORES=1 DZ_PANEL=0 drop them).
    # an earlier run's results must not travel back as this one's
    rm -f "$bench"/gpu_throughput.json "$bench"/gpu_throughput.png
    python3 benchmarks/gpu_throughput.py --cells "${DZ_CELLS:-100000}" --genes 20000 \
      --nnz-per-cell 2000 --batches "${DZ_BATCHES:-150}" --out "$bench" \
      --configs "${DZ_CONFIGS-kvikio/c/device/apart,pinned/c,kvikio/c/none}" \
      --stores "${DZ_STORES:-14}" --panel "${DZ_PANEL:-1000}" ${DZ_BENCH_ARGS:-} 2>&1 \
      | tee "$out/gpu_throughput.txt"
    status=$?  # the benchmark's (pipefail), not the copies'
    for f in gpu_throughput.json gpu_throughput.png; do  # no PNG without matplotlib
      [ -f "$bench/$f" ] && cp "$bench/$f" "$out"/
    done
    exit "$status"
    ;;
  demo)
    # README's main job on the GPU path: pipelines/ddp_train.py under torchrun (nccl), one
    # rank per GPU here (DZ_NPROC), on a 50,000-cell store it writes once beside the bench
    # stores; each rank prints its read paths and rows/s per epoch (gpu_demo.txt, .jsonl).
    # DZ_DEMO_ARGS goes last (e.g. "--epochs 5"; a later --device wins).
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
    rm -f "$out/gpu_demo.jsonl"
    python3 -m torch.distributed.run --standalone --nproc_per_node="${DZ_NPROC:-$gpus}" \
      pipelines/ddp_train.py --data "${DZ_BENCH_DIR:-$HOME/dz/bench}/demo.zarr" --generate \
      --device gpu --log-json "$out/gpu_demo.jsonl" ${DZ_DEMO_ARGS:-} 2>&1 \
      | tee "$out/gpu_demo.txt"
    ;;
  profile)
    python3 benchmarks/gpu_profile.py --cells "${DZ_CELLS:-100000}" --genes 20000 \
      --nnz-per-cell 2000 --out "${DZ_BENCH_DIR:-$HOME/dz/bench}" ${DZ_BENCH_ARGS:-} 2>&1 \
      | tee "$out/gpu_profile.txt"
    ;;
  *)
    awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"  # the header above
    exit 2
    ;;
esac
