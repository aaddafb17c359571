"""Feature selection: a gene panel selected as windows are read (``features=``) against the
same loader delivering every gene and the panel sliced out of each batch in torch.

Both contenders read the same store with the same sampler on the CPU path; they run
interleaved (``--reps`` times each) and the table gives medians and their ratio, since these
machines are shared and noisy. Prints a Markdown table; ``--json`` writes the figures.

    python benchmarks/feature_selection.py --cells 40000 --genes 20000 --panel 2000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # throughput.py's warm-up rule

import dali_zarr as dz  # noqa: E402
from dali_zarr import synthetic  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", type=int, default=40_000)
    p.add_argument("--genes", type=int, default=20_000)
    p.add_argument("--density", type=float, default=0.075, help="non-zeros per gene per cell")
    p.add_argument("--panel", type=int, default=2_000, help="genes selected (random, shuffled)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--preload-nchunks", type=int, default=16)
    p.add_argument("--batches", type=int, default=60, help="timed batches per repetition")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--store", default=None, help="default: runs/bench/feature_selection-CxG-D.zarr")
    p.add_argument("--json", default="", help="write the figures here")
    return p.parse_args(argv)


def warmup_batches(args: argparse.Namespace) -> int:
    """Untimed batches (pipeline build, JIT), past the windows the loader reads ahead when it
    starts, as ``throughput.py`` warms up: after one batch the clock started with the next
    window read already (1 of the 15 timed windows of 4 batches each), free for the clock."""
    from throughput import steady_warmup

    return steady_warmup(
        1,
        chunk_size=args.chunk_size,
        preload_nchunks=args.preload_nchunks,
        batch_size=args.batch_size,
    )


def rows_per_s(
    loader: dz.Loader, panel: torch.Tensor | None, batches: int, warmup: int = 1
) -> float:
    """Rows/s over ``batches`` batches after ``warmup`` untimed ones."""
    it = iter(_forever(loader))
    for _ in range(warmup):
        next(it)
    rows, t0 = 0, time.perf_counter()
    for _ in range(batches):
        x = next(it)["X"]
        if panel is not None:
            x = x.index_select(1, panel)  # what users do without features=
        rows += x.shape[0]
    return rows / (time.perf_counter() - t0)


def _forever(loader: dz.Loader):
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the store's shape in its name: a cached store of other sizes is never reused
    default = f"runs/bench/feature_selection-{args.cells}x{args.genes}-{args.density}.zarr"
    store = Path(args.store or default)
    if not store.exists():
        print(f"writing {args.cells} x {args.genes} store {store} ...", file=sys.stderr)
        synthetic.make_single_cell(
            store, n_obs=args.cells, n_features=args.genes, density=args.density,
            chunk_elements=65_536,
        )  # fmt: skip
    panel = np.random.default_rng(0).choice(args.genes, size=args.panel, replace=False)
    sampler = dz.ChunkSampler(
        chunk_size=args.chunk_size, preload_nchunks=args.preload_nchunks,
        batch_size=args.batch_size, seed=0,
    )  # fmt: skip
    contenders = {
        "every gene, then x[:, panel] in torch": (dz.open_dataset(store), torch.from_numpy(panel)),
        "features=panel": (dz.open_dataset(store, features=panel), None),
    }
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    warmup = warmup_batches(args)
    for rep in range(args.reps):
        for name, (dataset, select) in contenders.items():
            with dz.Loader(dataset, sampler) as loader:
                rates[name].append(rows_per_s(loader, select, args.batches, warmup))
            print(f"rep {rep}: {name}: {rates[name][-1]:,.0f} rows/s", file=sys.stderr)
    base = statistics.median(rates["every gene, then x[:, panel] in torch"])
    print(
        f"\n{args.cells:,} cells x {args.genes:,} genes, panel of {args.panel:,}; batch "
        f"{args.batch_size}, chunk {args.chunk_size}, preload {args.preload_nchunks}; CPU path; "
        f"median of {args.reps} interleaved runs of {args.batches} batches after {warmup}\n"
    )
    print("| loader | rows/s | x every-gene |")
    print("|---|---:|---:|")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"| {name} | {median:,.0f} | {median / base:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows_per_s": rates}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
