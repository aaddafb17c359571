"""Where the GPU path spends its time, per window, and how it scales with read threads.

    python benchmarks/gpu_profile.py --cells 400000 --genes 20000 --nnz-per-cell 2000
    python benchmarks/gpu_profile.py --smoke --cells 3000 --genes 200 --nnz-per-cell 20

Same store as ``gpu_throughput.py`` (same arguments, same cache under ``--out``). Two parts:

1. **One window reader, no DALI.** ``GpuBatchSource.read_window`` over ``--windows``
   windows, the device synchronised after each stage so that each stage's time is its own:
   the byte plan (host), the reads into device memory, the nvCOMP decode and the row
   copies. Prints milliseconds per window for each stage and the reader's rows/s.
2. **The loader end to end** for each ``--read-threads`` value: rows/s of dense batches over
   ``--batches`` batches after ``--warmup`` (or more: past the windows read ahead with
   that many threads, as ``gpu_throughput.py`` warms up), and where the reader threads'
   time went, per window (:data:`THREAD_STAGES`, timed without added syncs: waiting in a
   sync is waiting for the device, in the reads for the files, the rest is host work), and
   the device memory in use. Keep ``--batches`` far above the batches of the windows read
   ahead: reads done during the warm-up are free for the clock. (On 2026-11-22
   an 18-batch measurement of a 6-window epoch gave 919k rows/s where the 50-batch
   benchmark gave 214k.)

Both parts run once per ``--configs`` entry, ``READS/API[/SYNC[/PLANS]]``: READS is how
chunk bytes reach the GPU (``kvikio``: ``CuFile.pread``; ``pinned``: ``os.preadv`` into
pinned memory and one copy; env ``DALI_ZARR_GPU_READS``), API the nvCOMP decode call
(``python``: nvCOMP's ``Codec.decode``; ``c``: its batched C API, env
``DALI_ZARR_NVCOMP_BATCHED=1``), SYNC what a recycled ring slot waits for (``device``, the
default, or ``none``; env ``DALI_ZARR_RING_SYNC``), PLANS how a window's byte plans run
(``joint``, the default: all reads in flight, one decode call per codec kind; ``apart``:
one plan after the other; env ``DALI_ZARR_JOINT_PLANS``). One call of this script on a GPU
machine compares them all on the same store.

Two sweeps measure the decode, ~80 % of a window on the H200 (2026-11-26), each value a
full profile: ``--inner-chunks`` (stores written with other inner chunk sizes) and
``--call-mb`` (the decoded bytes one nvCOMP call may cover, ``nvcomp_batched.CALL_NBYTES``:
fewer, larger calls per window against ~3x their size in scratch memory per reader thread).
Part 1 prints the decode calls per window and their chunks.

``--smoke`` runs both parts on the host backend (no GPU): a check that the script works, not
a measurement of anything the GPU does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from unittest import mock

from gpu_throughput import (
    ROOT,
    add_store_and_sampler_arguments,
    config_env,
    config_label,
    make_store,
    open_benchmark_dataset,
    parse_config,
    require_gpu,
    sampler,
    synchronize,
)
from throughput import _at_least_one, gpu_windows_ahead, steady_warmup


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_store_and_sampler_arguments(p, cells=400_000, genes=20_000)
    p.add_argument("--windows", type=_at_least_one, default=8, help="windows timed in part 1")
    p.add_argument("--batches", type=_at_least_one, default=200, help="batches timed per loader")
    p.add_argument("--read-threads", default="1,4,8", help="comma-separated")
    p.add_argument(
        "--configs",
        default="kvikio/c,kvikio/c/device/apart,pinned/c,kvikio/c/none,pinned/c/none",
        help="comma-separated READS/API[/SYNC[/PLANS]] (see above)",
    )
    p.add_argument(
        "--per-store-panels",
        action="store_true",
        help="with --stores and --panel: each store keeps the panel's genes as other stored "
        "columns (its ids mapped per window, as for stores with different gene orders)",
    )
    p.add_argument(
        "--inner-chunks",
        default="",
        help="comma-separated elements per inner chunk: profile a synthetic store (zstd, "
        "sharded, same shard size) written with each, instead of the default store",
    )
    p.add_argument(
        "--call-mb",
        default="",
        help="comma-separated MiB of decoded bytes one nvCOMP call may cover (default: "
        "dali_zarr's CALL_NBYTES): a full profile per value",
    )
    p.add_argument("--smoke", action="store_true", help="host backend, no GPU (a check)")
    args = p.parse_args(argv)
    args.configs = [parse_config(c) for c in args.configs.split(",")]
    args.inner_chunks = [int(c) for c in args.inner_chunks.split(",") if c.strip()]
    if args.inner_chunks and args.store:  # make_store returns --store whatever the size
        p.error("--inner-chunks writes its own stores: leave --store out")
    if any(c <= 0 for c in args.inner_chunks):
        p.error(f"--inner-chunks: sizes must be positive, not {args.inner_chunks}")
    args.call_mb = [int(c) for c in args.call_mb.split(",") if c.strip()]
    if any(c <= 0 for c in args.call_mb):
        p.error(f"--call-mb: sizes must be positive, not {args.call_mb}")
    args.target = "cpu" if args.smoke else f"cuda:{args.device_id}"
    return args


@contextlib.contextmanager
def stage_timers(args: argparse.Namespace, backend) -> Iterator[dict[str, float]]:
    """Wrap the reader's stages so that each adds its own time (device synchronised after
    it) to the yielded dict, keyed by stage name; every wrapper is removed on exit, so the
    loader runs after part 1 (and the next config) are timed without these syncs."""
    import dali_zarr.graph.device_window as device_window
    from dali_zarr.io import nvcomp_batched

    totals: dict[str, float] = defaultdict(float)
    patches = contextlib.ExitStack()  # every wrapper put back on exit (mock restores it)

    def patch(owner, name: str, value) -> None:
        patches.enter_context(mock.patch.object(owner, name, value))

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a, **kw):
            start = time.perf_counter()
            result = inner(*a, **kw)
            synchronize(args)
            totals[label] += time.perf_counter() - start
            return result

        patch(owner, name, wrapper)

    # the byte plans of a window's array: every store it touches, planned and placed
    timed(device_window, "window_plans", "byte plans (host)")
    planned = device_window.window_plans

    def counting(items, *, out_rows):
        plans, unplannable = planned(items, out_rows=out_rows)
        for plan, _ in plans:
            totals["decoded bytes"] += len(plan.chunks) * plan.chunk_nbytes
            totals["used bytes"] += int(plan.segments[:, 2].sum()) * plan.dtype.itemsize
        return plans, unplannable

    patch(device_window, "window_plans", counting)
    run_plans = backend.run_plans

    def counting_runs(jobs):
        totals["plans run"] += len(jobs)
        return run_plans(jobs)

    patch(backend, "run_plans", counting_runs)
    slices = nvcomp_batched.call_slices  # the decode calls the chunks of a kind are split into

    def counting_calls(chunk_nbytes, cap: int | None = None):
        calls = slices(chunk_nbytes, cap)
        totals["decode calls"] += len(calls)
        totals["decode call chunks"] += len(chunk_nbytes)
        return calls

    patch(nvcomp_batched, "call_slices", counting_calls)
    # a gene panel, one launch: a CSR store's ids mapped (and, for CSR output, rows cut),
    # a dense store's panel columns copied out of its stored rows
    timed(backend, "remap_columns", "panel ids mapped per store")
    timed(backend, "keep_panel_rows", "rows cut to the panel (CSR output)")
    timed(backend, "select_columns", "panel columns copied out (dense)")
    if args.smoke:
        timed(backend, "run_plan", "read + decode + copy (host backend)")
    else:
        executor = backend.executor  # the calling thread's: part 1 reads on this thread
        timed(executor, "_read_to_device", f"reads into device memory ({executor.reads})")
        timed(executor, "_nvcomp_decode", "nvCOMP decode")
        timed(executor, "copy_segments", "row copies")
    with patches:
        yield totals


def profile_reader(args: argparse.Namespace, dataset) -> None:
    from dali_zarr.graph.gpu_pipeline import GpuBatchSource
    from dali_zarr.graph.window_backends import HostBackend

    source = GpuBatchSource(
        dataset,
        sampler(args),
        output="dense",
        obs=[],
        return_index=False,
        read_threads=1,
        backend=HostBackend() if args.smoke else None,
        device_id=args.device_id,
    )
    n_windows = source.plan(0).n_windows
    if n_windows == 0:
        source.close()
        raise SystemExit(
            f"{dataset.n_obs:,} rows make no complete window of --chunk-size "
            f"{args.chunk_size} x --preload-nchunks {args.preload_nchunks}: lower those or "
            "raise --cells"
        )
    keys = [divmod(i, n_windows) for i in range(1 + args.windows)]  # (epoch, window)
    source.read_window((0, (0, ()), 0))  # warm: kernels compiled, buffers grown, files open
    source._reclaim()
    with stage_timers(args, source.backend) as totals:
        rows = 0
        start = time.perf_counter()
        for epoch, w in keys[1:]:
            window = source.read_window((epoch, (epoch, ()), w))
            rows += window.plan.n_rows
            source._reclaim()
        seconds = time.perf_counter() - start
    per = 1e3 / args.windows
    print(f"one reader: {per * seconds:.1f} ms per window, {rows / seconds:,.0f} rows/s")
    decoded, used = totals.pop("decoded bytes", 0.0), totals.pop("used bytes", 0.0)
    plans_run = totals.pop("plans run", 0.0)
    calls, call_chunks = totals.pop("decode calls", 0.0), totals.pop("decode call chunks", 0.0)
    for label, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {label:38s} {per * total:8.1f} ms per window")
    print(f"  byte plans run per window: {plans_run / args.windows:.1f}")
    if calls:
        print(
            f"  nvCOMP decode calls per window: {calls / args.windows:.1f}, "
            f"{call_chunks / calls:.0f} chunks each on average"
        )
    if used:  # CSR rows straddle store chunks: the chunks at both ends are decoded whole
        print(f"  store chunk bytes read and decoded per byte used: {decoded / used:.2f}")
    source.close()


#: what the reader threads' time per window is split into in part 2, without added syncs:
#: (module, class or None, attribute, label); the executor's parts are inside "plan runs"
THREAD_STAGES = (
    ("dali_zarr.graph.device_window", "DeviceWindowReader", "read", "window read, in all"),
    ("dali_zarr.graph.device_window", None, "window_plans", "byte plans (host)"),
    ("dali_zarr.io.gpu", "GpuPlanExecutor", "run_many", "plan runs, in all"),
    ("dali_zarr.io.gpu", "GpuPlanExecutor", "_read_to_device", "  reads (the thread waits)"),
    ("dali_zarr.io.gpu", "GpuPlanExecutor", "_frame_heads", "  frame checks (device to host)"),
    ("dali_zarr.io.gpu", "GpuPlanExecutor", "_nvcomp_decode", "  decode calls (enqueue)"),
    ("dali_zarr.io.gpu", "GpuPlanExecutor", "copy_segments", "  row copy launches"),
    ("dali_zarr.graph.window_backends", "HostBackend", "run_plan", "plan runs (host backend)"),
    ("dali_zarr.graph.window_backends", "CudaBackend", "minmax", "column-id check (a sync)"),
    ("dali_zarr.graph.window_backends", "CudaBackend", "finish", "window sync"),
    ("dali_zarr.graph.window_backends", "CudaBackend", "before_reuse", "ring slot wait"),
)


@contextlib.contextmanager
def thread_timers() -> Iterator[dict[str, float]]:
    """Seconds the reader threads spent in each of :data:`THREAD_STAGES` (summed over the
    threads; calls counted under ``"calls: <label>"``), while the loader runs as it always
    does: no syncs are added, so a stage's time is what its thread waited there. Where the
    threads wait tells what bounds the loader: the device (syncs), the reads, or the host."""
    import importlib
    import threading

    totals: dict[str, float] = defaultdict(float)
    lock = threading.Lock()
    patches = contextlib.ExitStack()
    for module, cls, name, label in THREAD_STAGES:
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        inner = getattr(owner, name)

        def wrapper(*a, _inner=inner, _label=label, **kw):
            start = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                took = time.perf_counter() - start
                with lock:
                    totals[_label] += took
                    totals[f"calls: {_label}"] += 1

        patches.enter_context(mock.patch.object(owner, name, wrapper))
    with patches:
        yield totals


#: the part of "plan runs, in all" outside the executor's timed parts
REST = "  stream syncs, fills and the rest"


def print_thread_times(totals: dict[str, float], threads: int, seconds: float) -> None:
    """Part 2's split of the reader threads' time, per window read."""
    windows = totals.get("calls: window read, in all", 0)
    if not windows:
        return
    busy = totals["window read, in all"] / (threads * seconds)
    print(
        f"  reader threads: {windows:.0f} windows read, busy {busy:.0%} of {threads} x "
        f"{seconds:.2f} s; ms per window (no added syncs: a sync's time is the device work "
        "it waited for)"
    )
    shown = {stage[3]: totals.get(stage[3], 0.0) for stage in THREAD_STAGES}
    inside = sum(v for label, v in shown.items() if label.startswith("  "))
    shown[REST] = shown["plan runs, in all"] - inside
    for label, spent in shown.items():
        if spent:
            print(f"    {label:40s} {1e3 * spent / windows:8.1f}")


def loader_warmup(args: argparse.Namespace, threads: int) -> int:
    """Batches before part 2's clock starts: ``--warmup`` or more, past the windows the
    loader reads ahead with ``threads`` read threads (the GPU path reads at least that many
    ahead), so that no ``read_threads`` value starts its clock with windows read for free
    (more threads read more ahead: a fixed warm-up favoured them)."""
    return steady_warmup(
        args.warmup,
        chunk_size=args.chunk_size,
        preload_nchunks=args.preload_nchunks,
        batch_size=args.batch_size,
        windows_ahead=gpu_windows_ahead(read_threads=threads),
    )


def profile_loader(args: argparse.Namespace, dataset) -> None:
    import dali_zarr as dz
    from dali_zarr.graph.window_backends import HostBackend

    for threads in [int(t) for t in args.read_threads.split(",")]:
        loader = dz.Loader(
            dataset,
            sampler(args),
            device="gpu",
            device_id=args.device_id,
            gpu_backend=HostBackend() if args.smoke else None,
            output="dense",
            read_threads=threads,
        )
        batches = _endless(loader)
        for _ in range(loader_warmup(args, threads)):
            next(batches)
        synchronize(args)
        with thread_timers() as thread_totals:
            rows, start = 0, time.perf_counter()
            for _ in range(args.batches):
                rows += next(batches)["X"].shape[0]
            synchronize(args)
            seconds = time.perf_counter() - start
        print(f"loader, read_threads={threads}: {rows / seconds:,.0f} rows/s ({rows:,} rows)")
        print_thread_times(thread_totals, threads, seconds)
        print(f"  device memory: {device_memory(args)}")
        loader.close()
        if not args.smoke:  # the next read_threads value starts from an empty pool
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()


def device_memory(args: argparse.Namespace) -> str:
    """What the loader holds on the device, for the read-threads trade-off (each reader
    thread has its own staging, chunk and decode-scratch buffers): cupy's pool (our ring and
    buffers) and all memory in use on the device (DALI's own pool and the contexts too)."""
    if args.smoke:
        return "n/a (smoke run)"
    import cupy
    import torch

    pool = cupy.get_default_memory_pool().total_bytes()
    free, total = torch.cuda.mem_get_info(args.device_id)
    return f"cupy pool {pool / 1e9:.2f} GB, in use on the device {(total - free) / 1e9:.2f} GB"


def _endless(loader):
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.smoke:
        require_gpu("gpu_profile.py")
    sys.path.insert(0, ROOT)

    from dali_zarr.io import nvcomp_batched

    failed = []
    for inner_chunk in args.inner_chunks or [None]:
        store = make_store(args, inner_chunk)
        for call_mb in args.call_mb or [None]:
            cap = nvcomp_batched.CALL_NBYTES if call_mb is None else call_mb << 20
            with mock.patch.object(nvcomp_batched, "CALL_NBYTES", cap):
                failed += [
                    f"{store}, calls of {cap >> 20} MiB: {c}" for c in profile_store(args, store)
                ]
    if failed:
        sys.exit(f"configurations that failed: {', '.join(failed)}")


def inner_chunks(store: str) -> str:
    """The header's note on the store's inner chunks: of ``X/data`` (CSR), of ``X`` (dense),
    none where the store has neither (a ``--store`` that is an array)."""
    import zarr

    try:
        x = zarr.open(os.path.join(store, "X"), mode="r")
        array = x["data"] if isinstance(x, zarr.Group) else x
    except (FileNotFoundError, KeyError):
        return ""
    return f", inner chunks of {' x '.join(f'{c:,}' for c in array.chunks)} elements"


def profile_store(args: argparse.Namespace, store: str) -> list[str]:
    """Both parts for every ``--configs`` entry on one store; the configs that failed."""
    from dali_zarr.io import nvcomp_batched
    from dali_zarr.io.gpu import kvikio_threads

    per_store = args.per_store_panels and args.stores > 1 and args.panel > 0
    dataset = open_benchmark_dataset(
        args, store, stores=args.stores, panel=args.panel, per_store_panels=per_store
    )
    kind = "SMOKE RUN on the host backend: not GPU figures" if args.smoke else "GPU"
    split = f" as {args.stores} stores" if args.stores > 1 else ""
    panel = f", a {args.panel}-gene panel" if args.panel else ""
    if per_store:
        panel += " each, over other stored columns"
    print(f"\n{kind}; store {store}{split}{panel}: {dataset.n_obs:,} rows{inner_chunks(store)}")
    print(f"nvCOMP calls of at most {nvcomp_batched.CALL_NBYTES >> 20} MiB of decoded bytes")
    failed = []
    for config in args.configs:
        print(f"\n== {config_label(*config)}")
        try:
            with config_env(*config):
                profile_reader(args, dataset)
                print(f"kvikio thread pool: {kvikio_threads() or 'n/a'}")
                profile_loader(args, dataset)
        except Exception as e:  # one configuration failing must not hide the others
            failed.append("/".join(config))
            print(f"FAILED: {type(e).__name__}: {e}")
    return failed


if __name__ == "__main__":
    main()
