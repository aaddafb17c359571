"""GPU throughput: dense float32 minibatches delivered on the GPU, against baselines and ceilings.

    python benchmarks/gpu_throughput.py                         # 200k cells x 62,710 genes
    python benchmarks/gpu_throughput.py --cells 20000 --batches 20   # quick look

Needs a CUDA GPU (exits with a message otherwise). Writes a Tahoe-like AnnData store once
(cached under ``--out``/stores/, keyed by its parameters): ``--cells`` cells x ``--genes``
genes (Tahoe-100M has 62,710), about ``--nnz-per-cell`` non-zeros per cell, anndata's zarr v3
defaults (zstd, sharded), through ``benchmarks/contenders/stores.py`` (falls back to
``dali_zarr.synthetic.make_single_cell`` when that script or anndata is absent). Then
measures, after ``--warmup`` batches, ``--batches`` batches of ``--batch-size`` rows
(torch.cuda.synchronize() before the clock stops), and reports rows/s and GB/s of dense
float32 ``[B, genes]`` on the GPU (``[B, panel]`` for the panel row):

* ``dali_zarr gpu``: ``Loader(device="gpu")`` (kvikio reads, nvCOMP decode, densify kernel
  in the DALI graph), batches as torch CUDA tensors (DLPack, no copy);
* with ``--stores N``: the same, the cells loaded as a collection of N stores; with
  ``--panel K``: the same, a panel of K genes selected on the GPU; with both: N stores
  whose panels keep different stored columns (each store's ids mapped per window);
* ``dali_zarr cpu + .cuda()``: the CPU path's dense batches copied to the GPU;
* ``baseline``: zarr-python reads of ``chunk_size``-row blocks → NumPy CSR → ``torch.cuda`` →
  ``torch.sparse_csr_tensor(...).to_dense()`` (what one writes without a loader);
* ``annbatch gpu``: ``annbatch.Loader(preload_to_gpu=True, to="torch")`` + ``.to_dense()``,
  run by ``--annbatch-python`` (default: this interpreter if it imports annbatch, else
  ``benchmarks/.venv-annbatch/bin/python`` if present, which needs torch and cupy added;
  skipped with the reason when it cannot run);
* ceilings: host→device copy bandwidth (pinned, 256 MiB), raw read bandwidth of the store's
  files (``os.preadv`` of 16 MiB pieces on 8 threads into reused buffers; page cache likely
  warm) and, with kvikio, raw reads into GPU memory (kvikio's pool sized as the GPU path
  sizes it).

Output: a table on stdout, ``<out>/gpu_throughput.json`` and ``<out>/gpu_throughput.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
from contenders._common import emit, epochs  # benchmarks/ is this script's directory
from throughput import (
    ANNBATCH_ENV,
    _at_least_one,
    ensure_sparse_store,
    gpu_windows_ahead,
    run_script,
    steady_warmup,
    warm_page_cache,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def add_store_and_sampler_arguments(p: argparse.ArgumentParser, cells: int, genes: int) -> None:
    """The store (written by :func:`make_store`), the sampler and the device: shared with
    ``gpu_profile.py``, which measures on the same stores."""
    p.add_argument("--cells", type=int, default=cells)
    p.add_argument("--genes", type=int, default=genes)
    p.add_argument("--nnz-per-cell", type=float, default=2_000)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--preload-nchunks", type=int, default=64)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device-id", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "out", "gpu"))
    p.add_argument("--store", help="use this AnnData store instead of writing one")
    p.add_argument(
        "--stores",
        type=int,
        default=1,
        help="also load the cells as a collection of this many stores (the store opened "
        "that many times, one block of cells each: a window then reads from several "
        "stores, as with Tahoe-100M's 14 plates)",
    )
    p.add_argument(
        "--panel",
        type=int,
        default=0,
        help="also load a panel of this many genes (open_dataset(features=...))",
    )


def parse_config(text: str) -> tuple[str, str, str, str]:
    """``READS/API[/SYNC[/PLANS]]`` (``--configs`` of this script and ``gpu_profile.py``) as
    a tuple; SYNC defaults to ``device``, PLANS to ``joint`` (the loader's defaults)."""
    parts = text.strip().split("/")
    defaults = ["device", "joint"]
    if 2 <= len(parts) <= 4:
        parts += defaults[len(parts) - 2 :]
    if (
        len(parts) != 4
        or parts[0] not in ("kvikio", "pinned")
        or parts[1] not in ("python", "c")
        or parts[2] not in ("device", "none")
        or parts[3] not in ("joint", "apart")
    ):
        sys.exit(
            f"--configs: {text!r} is not READS/API[/SYNC[/PLANS]] with READS kvikio|pinned, "
            "API python|c, SYNC device|none, PLANS joint|apart"
        )
    return parts[0], parts[1], parts[2], parts[3]


def config_label(reads: str, api: str, sync: str, plans: str) -> str:
    """A config in words, for the rows and headers that show it (the names of earlier
    runs' rows, where a window's plans run together)."""
    label = f"reads {reads}, nvCOMP {api} API, ring sync {sync}"
    return label if plans == "joint" else f"{label}, a window's plans one at a time"


def config_values(reads: str, api: str, sync: str, plans: str) -> dict[str, str]:
    """The switches the GPU path reads when it is built (executors, the CUDA backend) for
    one ``READS/API/SYNC/PLANS`` config, by environment variable."""
    from dali_zarr.graph.window_backends import JOINT_PLANS_ENV, RING_SYNC_ENV
    from dali_zarr.io import nvcomp_batched
    from dali_zarr.io.gpu import READS_ENV

    return {
        READS_ENV: reads,
        nvcomp_batched.ENV_SWITCH: "1" if api == "c" else "0",
        RING_SYNC_ENV: sync,
        JOINT_PLANS_ENV: "1" if plans == "joint" else "0",
    }


@contextlib.contextmanager
def config_env(reads: str, api: str, sync: str, plans: str) -> Iterator[None]:
    """The switches of one config for what is built inside (a contender, a profile), put
    back as they were after it, so what runs next has the user's own settings."""
    values = config_values(reads, api, sync, plans)
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_dali_config(args, store: str, config: tuple[str, str, str]) -> dict:
    """The GPU path under one ``--configs`` entry (how bytes reach the GPU, the nvCOMP call,
    the ring sync), read from the same store as the default row."""
    with config_env(*config):
        return run_dali(args, store, device="gpu")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_store_and_sampler_arguments(p, cells=200_000, genes=62_710)
    p.add_argument("--batches", type=_at_least_one, default=50)
    p.add_argument("--prefetch-windows", type=int, default=2, help="windows read ahead")
    p.add_argument(
        "--read-threads", type=int, default=None, help="windows read at once (default: loader's)"
    )
    p.add_argument("--annbatch-python", default=None, help="interpreter with annbatch (see above)")
    p.add_argument(
        "--configs",
        default="",
        help="comma-separated READS/API[/SYNC[/PLANS]] (gpu_profile.py's --configs): one more "
        "dali_zarr gpu row each, e.g. kvikio/c/device/apart,pinned/c (the first row runs as "
        "the environment says)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="check this script without a GPU: every contender runs on the CPU (the GPU path "
        "on dali_zarr's host backend), the GPU ceilings are left out; not GPU figures",
    )
    p.add_argument(
        "--inner-chunk",
        type=int,
        default=None,
        help="write dali_zarr's synthetic store with inner chunks of this many elements "
        "(gpu_profile.py --inner-chunks measures the decode against it) and measure every "
        "contender on it",
    )
    p.add_argument("--worker", choices=["annbatch"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner_chunk is not None and (args.inner_chunk <= 0 or args.store):
        p.error("--inner-chunk: a positive size, and no --store (it writes its own store)")
    args.configs = [parse_config(c) for c in args.configs.split(",") if c.strip()]
    args.target = "cpu" if args.smoke else f"cuda:{args.device_id}"
    return args


def synchronize(args: argparse.Namespace) -> None:
    """Wait for the GPU's queued work, so the clock measures delivered batches."""
    if not args.smoke:
        import torch

        torch.cuda.synchronize(args.device_id)


def require_gpu(script: str = "gpu_throughput.py") -> None:
    try:
        import torch

        ok = torch.cuda.is_available()
    except Exception as e:  # no torch / broken CUDA
        ok, why = False, str(e)
    else:
        why = "torch.cuda.is_available() is False"
    if not ok:
        sys.exit(
            f"{script} needs a CUDA GPU ({why}). Run it on a GPU machine (or with --smoke "
            f"here, on the host backend): python benchmarks/{script} [--cells N]"
        )


# ---------------------------------------------------------------------------- the store


#: inner chunks per shard of the synthetic stores (2M elements a shard at 65,536 a chunk);
#: with ``inner_chunk`` the shards keep that many elements, so only the chunk size changes
SHARD_ELEMENTS = 32 * 65_536


def make_store(args: argparse.Namespace, inner_chunk: int | None = None) -> str:
    """The store, written once and cached under ``<out>/stores`` (reused only once complete).

    ``inner_chunk``: write dali_zarr's synthetic store (the AnnData layout, zstd, sharded)
    with inner chunks of that many elements instead, for ``gpu_profile.py --inner-chunks``
    (the chunk size sets how many chunks each nvCOMP call decodes, and how large)."""
    if args.store:
        return args.store
    if inner_chunk is None and importlib.util.find_spec("anndata") is not None:
        # the CPU benchmark's writer
        sizes = {"n_obs": args.cells, "n_genes": args.genes, "nnz_per_cell": args.nnz_per_cell}
        store_args = argparse.Namespace(out=args.out, seed=0, **sizes)
        return str(ensure_sparse_store(store_args, sys.executable)[0])
    # no anndata (the GPU image), or a chunk size asked for: dali_zarr's own writer
    from dali_zarr.synthetic import make_single_cell

    chunk = inner_chunk or 65_536
    suffix = f"_c{inner_chunk}" if inner_chunk else ""
    name = f"synthetic_n{args.cells}_g{args.genes}_k{args.nnz_per_cell:g}{suffix}.zarr"
    path = os.path.join(args.out, "stores", name)
    done = path + ".done"
    if not os.path.exists(done):
        print(f"writing {path} ...", file=sys.stderr)
        shutil.rmtree(path, ignore_errors=True)
        make_single_cell(
            path,
            n_obs=args.cells,
            n_features=args.genes,
            density=args.nnz_per_cell / args.genes,
            chunk_elements=chunk,
            shard_chunks=max(1, SHARD_ELEMENTS // chunk),
        )
        open(done, "w").close()
    return path


# ---------------------------------------------------------------------------- measurements


def warmup_batches(args: argparse.Namespace) -> int:
    """Batches before the clock starts: ``--warmup`` or more, past what our loader reads
    ahead when it starts (the rule of ``throughput.py``), the same for every contender. The
    annbatch worker takes its parent's figure as given: the rule imports dali_zarr, which
    annbatch's own environment need not have (the worker then skipped annbatch with
    ``ModuleNotFoundError``)."""
    if args.worker:
        return args.warmup
    return steady_warmup(
        args.warmup,
        chunk_size=args.chunk_size,
        preload_nchunks=args.preload_nchunks,
        batch_size=args.batch_size,
        # the GPU rows read --prefetch-windows ahead, at least their read threads: past 2
        # windows only, 8 read threads started the clock with windows read already (6 of 30
        # timed windows on the host backend), which the timed interval did not pay for
        windows_ahead=gpu_windows_ahead(args.prefetch_windows, args.read_threads),
    )


def timed(args: argparse.Namespace, batches, consume) -> dict:
    """Time ``consume`` over ``args.batches`` batches after the warm-up
    (:func:`warmup_batches`): rows, seconds."""
    it = iter(batches)
    for _ in range(warmup_batches(args)):
        consume(next(it))
    synchronize(args)
    rows = 0
    start = time.perf_counter()
    for _ in range(args.batches):
        try:
            rows += consume(next(it))
        except StopIteration:
            break
    synchronize(args)
    return {"rows": rows, "seconds": time.perf_counter() - start}


def sampler(args, seed=0):
    import dali_zarr as dz

    return dz.ChunkSampler(
        chunk_size=args.chunk_size,
        preload_nchunks=args.preload_nchunks,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        seed=seed,
    )


def panel_of(n_genes: int, size: int) -> np.ndarray:
    """``size`` genes spread over the store, in descending order (a panel is rarely in the
    store's order)."""
    return np.linspace(0, n_genes - 1, min(size, n_genes)).astype(np.int64)[::-1].copy()


def open_benchmark_dataset(
    args, store: str, *, stores: int = 1, panel: int = 0, per_store_panels: bool = False
):
    """The store as one dataset, as a collection of ``stores`` stores (the store opened that
    many times, each giving one block of cells: every cell once), or with a ``panel``.

    ``per_store_panels``: each store keeps the panel's genes as its own stored columns (the
    panel rotated by one gene per store), as stores written with different gene orders
    do when selected by name; the GPU path then maps each store's ids per window."""
    import dali_zarr as dz

    dataset = dz.open_dataset(store)
    genes = panel_of(dataset.n_features, panel)
    if stores > 1:
        bounds = np.linspace(0, dataset.n_obs, stores + 1).astype(np.int64)
        blocks = [
            dz.Subset(dz.open_dataset(store), range(a, b))
            for a, b in itertools.pairwise(bounds.tolist())
        ]
        if per_store_panels:
            blocks = [dz.FeatureSubset(b, np.roll(genes, i)) for i, b in enumerate(blocks)]
        # one store stands for stores of other gene orders: its rolled panels are stacked by
        # position, as name-mapped panels of such stores would be
        dataset = dz.Collection(blocks, check_var_names=not per_store_panels)
    if panel and not per_store_panels:
        dataset = dz.FeatureSubset(dataset, genes)
    return dataset


def run_dali(args, store: str, device: str, **dataset_kw) -> dict:
    """dali_zarr's dense batches on the GPU: the GPU path, or the CPU path plus ``.cuda()``."""
    import dali_zarr as dz
    from dali_zarr.graph.window_backends import HostBackend

    dataset = open_benchmark_dataset(args, store, **dataset_kw)
    loader = dz.Loader(
        dataset,
        sampler(args),
        device=device,
        device_id=args.device_id,
        gpu_backend=HostBackend() if args.smoke and device == "gpu" else None,
        output="dense",
        prefetch_windows=args.prefetch_windows,
        read_threads=args.read_threads,
    )
    print(loader.device_reason, file=sys.stderr)

    def epoch(e):
        loader.set_epoch(e)
        return iter(loader)

    # a no-op for the GPU path's batches, which are on the device already
    result = timed(
        args, epochs(epoch), lambda b: b["X"].to(args.target, non_blocking=True).shape[0]
    )
    result["paths"] = loader.read_paths()
    result["width"] = dataset.n_features
    loader.close()
    return result


def baseline_blocks(batch_size: int, chunk_size: int, n_obs: int) -> list[int]:
    """The baseline's row blocks for one batch: ``chunk_size`` rows each, the last one
    shorter, ``batch_size`` rows in all (at most the store's), as the loaders' batches are.
    Whole blocks only made batches of 4,000 rows where the others had 4,096."""
    total = min(batch_size, n_obs)
    chunk = min(chunk_size, total)
    sizes = [chunk] * (total // chunk)
    return sizes + ([total % chunk] if total % chunk else [])


def run_baseline(args, store: str) -> dict:
    """zarr read → NumPy CSR → torch.cuda → densify, one batch of random row blocks at a time."""
    import torch
    import zarr

    x = zarr.open_group(store, mode="r")["X"]
    indptr = x["indptr"][...].astype(np.int64)
    n_obs, n_genes = (int(s) for s in x.attrs["shape"])
    data, indices = x["data"], x["indices"]
    rng = np.random.default_rng(0)
    sizes = baseline_blocks(args.batch_size, args.chunk_size, n_obs)

    def batches():
        while True:
            parts_d, parts_i, counts = [], [], []
            for size in sizes:
                s = int(rng.integers(0, n_obs - size + 1))
                e = s + size
                a, b = int(indptr[s]), int(indptr[e])
                parts_d.append(data[a:b])
                parts_i.append(indices[a:b])
                counts.append(np.diff(indptr[s : e + 1]))
            crow = np.concatenate([[0], np.cumsum(np.concatenate(counts))])
            yield crow, np.concatenate(parts_d), np.concatenate(parts_i)

    def consume(batch):
        crow, d, i = batch
        dev = args.target
        t = torch.sparse_csr_tensor(
            torch.from_numpy(crow).to(dev),
            torch.from_numpy(i.astype(np.int64)).to(dev),
            torch.from_numpy(d.astype(np.float32, copy=False)).to(dev),
            size=(len(crow) - 1, n_genes),
        )
        return t.to_dense().shape[0]

    return timed(args, batches(), consume)


def annbatch_python(args) -> str | None:
    """The interpreter that runs annbatch: as given, this one where it imports annbatch (it
    has torch and the GPU), else annbatch's own environment. That environment is the one
    ``throughput.py`` makes for the CPU benchmark, without torch or cupy: preferred over
    this interpreter, it skipped the annbatch row ("No module named 'torch'") on any machine
    where the CPU benchmark had run, annbatch installed here or not."""
    if args.annbatch_python:
        return args.annbatch_python
    if importlib.util.find_spec("annbatch") is not None:
        return sys.executable
    own = ANNBATCH_ENV / "bin" / "python"
    return str(own) if own.exists() else None


def run_annbatch(args, store: str) -> dict:
    py = annbatch_python(args)
    if py is None or not os.path.exists(py):
        where = py or f"{ANNBATCH_ENV}, nor importable here"
        return {"skipped": f"no annbatch environment ({where}; pass --annbatch-python)"}
    cmd = ["--worker", "annbatch", "--store", store]
    cmd += ["--batch-size", str(args.batch_size), "--chunk-size", str(args.chunk_size)]
    cmd += ["--preload-nchunks", str(args.preload_nchunks), "--batches", str(args.batches)]
    cmd += ["--warmup", str(warmup_batches(args)), "--device-id", str(args.device_id)]
    cmd += ["--smoke"] if args.smoke else []
    result = run_script(py, os.path.abspath(__file__), cmd, timeout=1800)
    if "error" in result:
        return {"skipped": f"annbatch worker failed: {result['error']}"}
    return result


def annbatch_worker(args) -> None:
    """Runs inside the annbatch environment: no dali_zarr import."""
    try:
        import anndata as ad
        import torch
        import zarr
        from annbatch import Loader

        # as annbatch's README asks for local stores, and as the CPU benchmark runs it:
        # without zarrs its reads decoded ~1.6-2.8x slower on the CPU (2026-11-28)
        try:
            import zarrs  # noqa: F401

            zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"})
        except ImportError:
            pass
        if not args.smoke:
            torch.cuda.set_device(args.device_id)  # the GPU the dali_zarr rows ran on
        loader = Loader(
            chunk_size=args.chunk_size,
            preload_nchunks=args.preload_nchunks,
            batch_size=args.batch_size,
            shuffle=True,
            drop_last=True,
            preload_to_gpu=not args.smoke,
            to="torch",
            rng=np.random.default_rng(0),
        )
        loader.add_dataset(ad.io.sparse_dataset(zarr.open_group(args.store, mode="r")["X"]))
        result = timed(args, epochs(lambda _e: loader), lambda b: b["X"].to_dense().shape[0])
        result["version"] = __import__("annbatch").__version__
        result["paths"] = {"codec pipeline": zarr.config.get("codec_pipeline.path")}
        del torch
    except Exception as e:
        result = {"skipped": f"{type(e).__name__}: {e}"}
    emit(result)


def ceiling_h2d(nbytes: int = 256 << 20) -> float:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return reps * nbytes / (time.perf_counter() - start) / 1e9


def store_files(store: str) -> list[str]:
    out = []
    for name in ("data", "indices"):
        for root, _, files in os.walk(os.path.join(store, "X", name)):
            out += [os.path.join(root, f) for f in files if not f.endswith(".json")]
    return out


def ceiling_read(store: str, threads: int = 8) -> float:
    """Bandwidth of reading the store's bytes into host memory: every file in pieces of the
    read plans' largest extent (``MAX_EXTENT``, 16 MiB), ``os.preadv`` on ``threads``
    threads, each into its own buffer, reused. (Until 2026-11-22 each whole shard file went
    into a fresh ``bytearray``, so the figure also held zero-filling and page faults of
    hundreds of MB per file, and a sharded store has too few files to keep 8 threads busy.)"""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from dali_zarr.io.gpu import MAX_EXTENT

    pieces = [
        (path, offset, min(MAX_EXTENT, size - offset))
        for path in store_files(store)
        for size in [os.path.getsize(path)]
        for offset in range(0, size, MAX_EXTENT)
    ]
    local = threading.local()

    def read(piece) -> int:
        path, offset, n = piece
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = np.empty(MAX_EXTENT, dtype=np.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.preadv(fd, [buf[:n]], offset)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, pieces[:threads]))  # buffers allocated and touched off the clock
        start = time.perf_counter()
        total = sum(pool.map(read, pieces))
    return total / (time.perf_counter() - start) / 1e9


def ceiling_kvikio(store: str) -> float | None:
    try:
        import cupy
        import kvikio
    except ImportError:
        return None
    from dali_zarr.io.gpu import kvikio_pool_size, kvikio_threads

    kvikio_threads(kvikio_pool_size())  # the pool size the GPU path asks for (kvikio's default: 1)
    files = store_files(store)
    sizes = [os.path.getsize(p) for p in files]
    buf = cupy.empty(max(sizes), dtype=cupy.uint8)
    start = time.perf_counter()
    for path, size in zip(files, sizes, strict=True):
        with kvikio.CuFile(path, "r") as f:
            f.pread(buf[:size], size, 0).get()
    cupy.cuda.runtime.deviceSynchronize()
    return sum(sizes) / (time.perf_counter() - start) / 1e9


# ---------------------------------------------------------------------------- report

DALI_GPU = "dali_zarr gpu"
BASELINE = "baseline zarr→numpy→torch.cuda→densify"
ANNBATCH = "annbatch gpu (preload_to_gpu=True)"
RATIO_TO = (BASELINE, ANNBATCH)  # issue #3 asks for >= 10x annbatch's GPU mode


def store_shape(store: str) -> tuple[int, int, int]:
    """(cells, genes, nnz) of the store's X."""
    import zarr

    x = zarr.open_group(store, mode="r")["X"]
    cells, genes = (int(v) for v in x.attrs["shape"])
    return cells, genes, int(x["indptr"][-1])


def rows_per_second(result: dict) -> float | None:
    if "skipped" in result or result["seconds"] <= 0:
        return None
    return result["rows"] / result["seconds"]


def report(args, store: str, results: dict, ceilings: dict) -> None:
    cells, genes, nnz = store_shape(store)
    bytes_per_row = genes * 4
    where = "SMOKE RUN on the CPU: checks the script, NOT GPU figures" if args.smoke else "GPU"
    lines = [
        f"{where}; store: {store} ({cells} cells x {genes} genes, {nnz / cells:.0f} nnz/cell)",
        f"batch {args.batch_size}, chunk {args.chunk_size}, preload {args.preload_nchunks}",
        "",
        "| loader | rows/s | GB/s dense float32 | "
        + " | ".join(f"x {name.split()[0]}" for name in RATIO_TO)
        + " | note |",
        "|---|---:|---:|" + "---:|" * len(RATIO_TO) + "---|",
    ]
    bars = {}
    for name, r in results.items():
        rps = rows_per_second(r)
        if rps is None:
            why = r.get("skipped", "no time measured")
            lines.append(f"| {name} | – | – |" + " – |" * len(RATIO_TO) + f" skipped: {why} |")
            continue
        width = r.get("width", genes)
        gbs = rps * 4 * width / 1e9
        bars[name] = gbs
        ratios = [rows_per_second(results.get(base, {"skipped": ""})) for base in RATIO_TO]
        # rows of a panel are narrower than the baseline's and annbatch's: no rows/s ratio
        cells_ratio = " | ".join(f"{rps / b:.2f}" if b and width == genes else "–" for b in ratios)
        note = "; ".join(f"{k}: {v}" for k, v in r.get("paths", {}).items())
        if width != genes:
            note = f"{width:,}-gene rows (others {genes:,}): ratios left out; {note}"
        lines.append(f"| {name} | {rps:,.0f} | {gbs:.2f} | {cells_ratio} | {note} |")
    # ceilings are in bytes moved; a loader delivers dense bytes, so also show what each
    # ceiling allows in dense float32 (x the dense/stored or dense/CSR size ratio)
    stored = sum(os.path.getsize(p) for p in store_files(store))
    dense_total = cells * bytes_per_row
    csr_row = 8 * nnz / cells + 8  # float32 data + int32 indices + int64 indptr
    expand = {"stored": dense_total / max(1, stored), "csr": bytes_per_row / csr_row}
    lines += ["", "| ceiling | GB/s moved | dense float32 GB/s it allows |", "|---|---:|---:|"]
    dense_ceilings = {}
    for name, (v, basis) in ceilings.items():
        if not isinstance(v, float):  # None (not measurable here) or why it was left out
            lines.append(f"| {name} | {v or 'n/a'} | – |")
            continue
        dense_ceilings[name] = v * expand[basis]
        lines.append(f"| {name} | {v:.2f} | {v * expand[basis]:.2f} (x{expand[basis]:.1f}) |")
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_throughput.json"), "w") as f:
        json.dump({"args": vars(args), "results": results, "ceilings": ceilings}, f, indent=2)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        ax.barh(list(bars), list(bars.values()), color="tab:green")
        for i, (name, v) in enumerate(dense_ceilings.items()):
            ax.axvline(v, ls="--", color=f"C{i}", label=f"{name} ({v:.1f} GB/s)")
        ax.set_xlabel("GB/s of dense float32 delivered on the GPU (ceilings: dense-equivalent)")
        ax.set_title(f"{where}\n{cells} x {genes}, batch {args.batch_size}", fontsize=9)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "gpu_throughput.png"), dpi=120)
    except ImportError:
        print("matplotlib missing: no chart written", file=sys.stderr)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker == "annbatch":
        annbatch_worker(args)
        return
    if not args.smoke:
        require_gpu()
    sys.path.insert(0, ROOT)
    store = make_store(args, args.inner_chunk)
    # every contender reads from the page cache: the first one would otherwise pay cold reads
    warm_page_cache(Path(store))
    results = {}
    contenders = [(DALI_GPU, partial(run_dali, device="gpu"))]
    for config in args.configs:
        name = f"{DALI_GPU}, {config_label(*config)}"
        contenders.append((name, partial(run_dali_config, config=config)))
    if args.stores > 1:
        contenders.append(
            (
                f"{DALI_GPU}, {args.stores} stores",
                partial(run_dali, device="gpu", stores=args.stores),
            )
        )
    if args.panel:
        contenders.append(
            (
                f"{DALI_GPU}, {args.panel}-gene panel",
                partial(run_dali, device="gpu", panel=args.panel),
            )
        )
    if args.panel and args.stores > 1:
        contenders.append(
            (
                f"{DALI_GPU}, {args.stores} stores, a {args.panel}-gene panel each",
                partial(run_dali, device="gpu", stores=args.stores, panel=args.panel,
                        per_store_panels=True),
            )
        )  # fmt: skip
    contenders += [
        ("dali_zarr cpu + .cuda()", partial(run_dali, device="cpu")),
        (BASELINE, run_baseline),
        (ANNBATCH, run_annbatch),
    ]
    for name, fn in contenders:
        print(f"measuring {name} ...", file=sys.stderr)
        try:
            results[name] = fn(args, store)
        except Exception as e:  # report and go on: one contender must not sink the table
            results[name] = {"skipped": f"{type(e).__name__}: {e}"}
    no_gpu = "smoke run" if args.smoke else None
    ceilings = {  # name: (GB/s, what the bytes are: stored chunk bytes or CSR arrays)
        "host→device copy of CSR (pinned)": (no_gpu or ceiling_h2d(), "csr"),
        "raw read of the store (os, 8 threads, 16 MiB reads)": (ceiling_read(store), "stored"),
        "raw read into GPU memory (kvikio, its pool as the GPU path sizes it)": (
            no_gpu or ceiling_kvikio(store),
            "stored",
        ),
    }
    report(args, store, results, ceilings)


if __name__ == "__main__":
    main()
