"""Benchmark: DirectReader.read_rows vs. zarr-python on a zstd-sharded 1-D float32 store.

Writes a ~200 MB (by default) 1-D float32 array, sharded with zstd inner chunks, into a
temp dir, then times windows of random ranges (like CSR ``data`` slices of 64 cells with
~1500 non-zeros each) read by:

* ``direct``: ``open_reader(...)`` → DirectReader (pread + numcodecs zstd on a thread pool);
* ``fallback``: ZarrReader (zarr-python, spans merged, spans in parallel);
* ``zarr``: plain zarr-python, ``array[start:stop]`` for each range in turn.

The store was just written, so it is mostly in the page cache: this measures decode and
overhead, not the disk.

    python benchmarks/io_read.py [--mb 200] [--windows 20] [--threads 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import tempfile
import time
import warnings

import numpy as np
import zarr
from zarr.codecs import ZstdCodec

from dali_zarr.io import open_reader
from dali_zarr.io.readers import ZarrReader


def make_store(path: str, n: int, chunk: int, shard_chunks: int, seed: int) -> zarr.Array:
    rng = np.random.default_rng(seed)
    arr = zarr.create_array(
        path,
        shape=(n,),
        chunks=(chunk,),
        shards=(chunk * shard_chunks,),
        dtype="float32",
        compressors=ZstdCodec(level=3),
        overwrite=True,
    )
    step = chunk * shard_chunks * 4
    for a in range(0, n, step):
        b = min(n, a + step)
        # count-like values (what CSR `data` of an expression matrix holds): compressible
        arr[a:b] = rng.poisson(1.5, b - a).astype(np.float32) + 1
    return zarr.open_array(path, mode="r")


def windows(n: int, n_windows: int, k: int, mean_len: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_windows):
        lens = rng.integers(mean_len // 2, mean_len * 3 // 2, k)
        starts = rng.integers(0, n - lens.max(), k)
        out.append(np.stack([starts, starts + lens], axis=1).astype(np.int64))
    return out


def time_it(fn, wins: list[np.ndarray]) -> float:
    """Seconds to read ``wins[1:]``, after ``wins[0]`` warmed up shard indexes and pools."""
    fn(wins[0])
    t = time.perf_counter()
    for w in wins[1:]:
        fn(w)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mb", type=float, default=200.0, help="array size in MB (float32)")
    p.add_argument("--chunk", type=int, default=65536, help="inner chunk length (elements)")
    p.add_argument("--shard-chunks", type=int, default=64, help="inner chunks per shard")
    p.add_argument("--windows", type=int, default=20, help="windows to time (at least 1)")
    p.add_argument("--ranges", type=int, default=32, help="ranges per window")
    p.add_argument("--range-len", type=int, default=64 * 1500, help="mean range length")
    p.add_argument("--threads", type=int, default=None, help="pool size (default: module pool)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    warnings.filterwarnings("ignore")

    n = int(args.mb * 1e6 / 4)
    if args.windows < 1 or args.ranges < 1 or args.range_len < 2:
        p.error("--windows and --ranges must be at least 1, --range-len at least 2")
    if n <= args.range_len * 3 // 2:  # ranges are up to 1.5x --range-len long
        p.error(
            f"--mb {args.mb:g} holds {n:,} elements, too few for ranges of up to "
            f"{args.range_len * 3 // 2:,} (--range-len {args.range_len:,}): raise --mb or "
            "lower --range-len"
        )
    with tempfile.TemporaryDirectory(prefix="dali_zarr_bench_") as tmp:
        t = time.perf_counter()
        arr = make_store(f"{tmp}/data.zarr", n, args.chunk, args.shard_chunks, args.seed)
        print(
            f"store: {n:,} float32 ({n * 4 / 1e6:.0f} MB), chunk {args.chunk}, "
            f"shard {args.chunk * args.shard_chunks}, zstd; "
            f"written in {time.perf_counter() - t:.1f} s"
        )
        wins = windows(n, args.windows + 1, args.ranges, args.range_len, args.seed + 1)
        elems = sum(int((w[:, 1] - w[:, 0]).sum()) for w in wins[1:])
        executor = concurrent.futures.ThreadPoolExecutor(args.threads) if args.threads else None
        direct = open_reader(arr, name="bench", executor=executor)
        fallback = ZarrReader(arr, name="bench", reason="benchmark", executor=executor)
        assert direct.path == "direct", direct.reason

        def plain_zarr(w: np.ndarray) -> np.ndarray:
            return np.concatenate([arr[s:e] for s, e in w.tolist()])

        w0 = wins[1]
        assert np.array_equal(direct.read_rows(w0), plain_zarr(w0))
        results = {}
        for label, fn in [
            ("direct", lambda w: direct.read_rows(w)),
            ("fallback", lambda w: fallback.read_rows(w)),
            ("zarr", plain_zarr),
        ]:
            dt = time_it(fn, wins)
            results[label] = dt
            print(
                f"{label:>8}: {elems / dt / 1e6:8.1f} M elements/s  "
                f"{elems * 4 / dt / 1e9:6.2f} GB/s  {dt / args.windows * 1e3:7.1f} ms/window"
            )
        print(
            f"direct vs zarr-python: {results['zarr'] / results['direct']:.1f}x; "
            f"direct vs fallback reader: {results['fallback'] / results['direct']:.1f}x"
        )


if __name__ == "__main__":
    main()
