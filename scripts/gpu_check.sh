#!/usr/bin/env bash
# Issue #3's checks on a lent GPU machine: the `gpu` tests, then the GPU benchmark.
#
# Stage DALI and the wheels the GPU image lacks first (here, once):
#   echo /.gpu/ >> .git/info/exclude
#   DZ_GPU_EXTRA="$(bash scripts/gpu_check.sh extra)" ../shared/gpu/stage.sh pack
# then make the device calls it prints back to back; the last one's command is
#   ... && source .gpu/install.sh && bash scripts/gpu_check.sh tests
# and, on the same warm machine, carry=[".gpu/install.sh"]:
#   source .gpu/install.sh && bash scripts/gpu_check.sh bench
# Each step fits one 10-minute call. Results land in $OUT (they come back with the call):
# gpu_tests.txt, and gpu_throughput.txt/.json/.png.
set -uo pipefail
out=${OUT:-/tmp/dz-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step=${1:-tests}

case "$step" in
  extra)
    # Wheels beyond stage.sh's own list: zstandard (prefix decode) and annbatch with what
    # the image lacks of its dependencies (the image has pandas, h5py, scipy, pyyaml, ...;
    # KINDS.md lists it), so the benchmark measures annbatch's GPU mode in-process.
    echo zstandard annbatch anndata zarrs array-api-compat dask humanfriendly \
      importlib-metadata lazy-importer legacy-api-wrap locket natsort partd pydantic \
      pydantic-core pydantic-settings python-dotenv scverse-misc session-info2 \
      typing-inspection annotated-types tzdata
    ;;
  tests)
    {
      nvidia-smi -L
      python3 -c "from dali_zarr.graph.gpu_pipeline import gpu_status; print(gpu_status()[1])"
      # only the modules with gpu tests: the others import CPU-test extras (jax, lightning)
      python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
        tests/test_gpu_loader.py tests/test_gpu_pipeline.py tests/test_gpu_plan.py \
        tests/test_cuda_kernels.py
    } 2>&1 | tee "$out/gpu_tests.txt"
    ;;
  bench)
    # Tahoe-like: ~2,000 non-zeros per cell over 20,000 genes, zstd, sharded (issue #3)
    python3 benchmarks/gpu_throughput.py --cells "${DZ_CELLS:-100000}" --genes 20000 \
      --nnz-per-cell 2000 --batches "${DZ_BATCHES:-50}" --out "$out/bench" 2>&1 \
      | tee "$out/gpu_throughput.txt"
    cp "$out"/bench/gpu_throughput.json "$out"/bench/gpu_throughput.png "$out"/ 2>/dev/null
    rm -rf "$out/bench"  # the store must not travel back
    ;;
  *)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
