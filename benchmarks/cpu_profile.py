"""Where the CPU path's time goes: reading windows against handing out batches.

    python benchmarks/cpu_profile.py benchmarks/out/stores/sparse_n20000_g2000_k150_s0.zarr \
        --chunk-size 64 --preload-nchunks 8 --batch-size 512

Three numbers per store and setting, each in CPU time of this process (all its threads,
``time.process_time``) as well as wall time: CPU time is what a change of the code saves,
and it varies far less than wall time on a shared machine (2026-11-27, load average 2-7:
wall rates moved 2x between runs, CPU time per window by up to ~20 %).

1. **Reading a window** (``BatchSource.read_window`` over ``--windows`` windows, no DALI):
   reads, decode, row copies, the column id check.
2. **Handing out a batch** with nothing to read: the ``Loader`` over the same sampler, its
   windows read once and then served again from memory, so what is timed is the callback,
   the DALI graph (gather or densify), DLPack and the torch batch.
3. **Decoded bytes against the bytes used** (CSR stores): what the reads decode, from the
   chunk geometry alone. A range's chunks are decoded up to the last row any range of the
   window needs (zstd's prefix decode; other codecs decode whole chunks: more than this
   says). Inner chunks much longer than ``chunk_size`` make each range decode most of a
   chunk for a few of its rows.

The full loader costs about (1) / (batches per window) + (2) per batch; ``throughput.py``
measures it.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import numpy as np

import dali_zarr as dz
from dali_zarr.graph.source import BatchSource
from dali_zarr.planning.partition import split_at_chunks


def sampler(args: argparse.Namespace) -> dz.ChunkSampler:
    return dz.ChunkSampler(
        chunk_size=args.chunk_size,
        preload_nchunks=args.preload_nchunks,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=False,
        seed=0,
    )


def timed(fn, n: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call of ``fn(i)`` over ``n`` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n


def window_reads(dataset, args: argparse.Namespace) -> None:
    source = BatchSource(
        dataset,
        sampler(args),
        output="csr" if dataset.layout == "csr" else "dense",
        obs=[],
        return_index=False,
    )
    plan = source.plan(0)
    keys = [(0, (0, ()), w % plan.n_windows) for w in range(args.windows)]
    source.read_window(keys[0])  # first opens, shard indexes
    wall, cpu = timed(lambda i: source.read_window(keys[i]), len(keys))
    # the rows the timed windows hold (a window is whole batches; the epoch's last is short):
    # chunk_size x preload_nchunks overstated them up to 2.7x
    rows = sum(plan.window(w).n_rows for _, _, w in keys) / len(keys)
    print(
        f"read a window ({rows:,.0f} rows): {wall * 1e3:.2f} ms wall, {cpu * 1e3:.2f} ms CPU "
        f"({rows / cpu:,.0f} rows per CPU second)"
    )
    source.close()


def batches(dataset, args: argparse.Namespace, output: str) -> None:
    loader = dz.Loader(dataset, sampler(args), device="cpu", output=output)
    source = loader._source
    read, held = source.read_window, {}

    def read_once(wkey):  # DALI's epoch is part of the key; the plan and window are not
        key = wkey[1:]
        if key not in held:
            held[key] = read(wkey)
        return held[key]

    source.read_window = read_once
    served = iter(())

    def next_batch(_: int) -> None:
        nonlocal served
        batch = next(served, None)
        if batch is None:
            loader.set_epoch(0)  # the same plan again: its windows come from memory
            served = iter(loader)
            batch = next(served)
        assert batch["X"].shape[0] > 0

    timed(next_batch, len(loader) + 2)  # every window read once, the graph built
    wall, cpu = timed(next_batch, args.batches)
    print(
        f"hand out a batch ({output}, windows in memory): {wall * 1e3:.3f} ms wall, "
        f"{cpu * 1e3:.3f} ms CPU"
    )
    loader.close()


def decoded_bytes(dataset, args: argparse.Namespace) -> tuple[int, int]:
    """(bytes the reads of an epoch decode, bytes they deliver) of a CSR dataset's data and
    indices: each window's chunks up to the last row any of its ranges needs."""
    plan = sampler(args).plan_epoch(dataset.n_obs, 0)
    used = decoded = 0
    for w in range(plan.n_windows):
        elements = dataset.indptr[plan.window(w).row_ranges]
        nz = elements[:, 1] > elements[:, 0]
        starts, stops = elements[nz, 0], elements[nz, 1]
        for reader in dataset.readers():
            size, chunk_rows = reader.dtype.itemsize, reader.rows_per_chunk
            used += int((stops - starts).sum()) * size
            _, chunk, _, hi = split_at_chunks(starts, stops, chunk_rows)
            needed, which = np.unique(chunk, return_inverse=True)
            upto = np.zeros(len(needed), dtype=np.int64)
            np.maximum.at(upto, which, hi - chunk * chunk_rows)
            decoded += int(upto.sum()) * size
    return decoded, used


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("store")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--preload-nchunks", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--windows", type=int, default=20, help="windows read in part 1")
    p.add_argument("--batches", type=int, default=200, help="batches timed in part 2")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    dataset = dz.open_dataset(args.store)
    print(
        f"{dataset}; chunk_size {args.chunk_size}, preload_nchunks {args.preload_nchunks}, "
        f"batch_size {args.batch_size}; load average {os.getloadavg()[0]:.2f}"
    )
    window_reads(dataset, args)
    for output in ("csr", "dense") if dataset.layout == "csr" else ("dense",):
        batches(dataset, args, output)
    if dataset.layout == "csr":
        decoded, used = decoded_bytes(dataset, args)
        print(
            f"decoded per epoch: {decoded / 1e6:,.1f} MB for {used / 1e6:,.1f} MB delivered "
            f"({decoded / used:.2f}x; chunks of {dataset.readers()[0].rows_per_chunk:,} "
            "elements)"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
