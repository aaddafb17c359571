"""Write the two benchmark stores (run by ``benchmarks/throughput.py`` in a subprocess).

    python stores.py sparse --path P --n-obs N --n-genes G --nnz-per-cell K [--seed S]
    python stores.py cube   --path P --n N --chunk C [--seed S]

``sparse``: a single-cell-like AnnData store written by anndata with its defaults for zarr
v3 (zstd, sharded; anndata 0.13 writes that by default, 0.12 is told to with
``zarr_write_format=3`` and ``auto_shard_zarr_v3=True``). Counts are generated in blocks of
cells into memory-mapped scratch files, so memory stays bounded whatever ``N``: per cell a
library size (log-normal, mean ``K`` non-zeros), genes drawn uniformly without repetition,
values geometric (1, 2, 3, ...; mostly 1-3, like UMI counts), float32 ``data``, int32 ``indices``.
``obs`` has a categorical ``cell_type``.

``cube``: a plain ``(N, 8, 180, 360)`` float32 zarr v3 array with zarr's default codecs
(zstd), chunked ``(C, 8, 180, 360)``, not sharded (zarr-torch-dataset reads chunks, not
shards). Values are smooth fields plus noise, quantized to multiples of 2**-10 the way
reduced-precision climate fields are, so zstd compresses them somewhat.

Prints ``RESULT {json}`` (what was written, by which versions) on its last line.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
from importlib.metadata import version

import numpy as np
from _common import emit

CUBE_SHAPE = (8, 180, 360)


def sparse_blocks(n_obs: int, n_genes: int, nnz_per_cell: float, seed: int, block_nnz: int):
    """Yield ``(counts, data, indices)`` per block of cells: CSR pieces of synthetic counts."""
    rng = np.random.default_rng(seed)
    sigma = 0.35
    block = max(1, min(n_obs, int(block_nnz // max(1.0, nnz_per_cell))))
    for start in range(0, n_obs, block):
        b = min(block, n_obs - start)
        # target non-zeros per cell, then the number of uniform draws that leaves that many
        # distinct genes on average (draws with repetition, repeats dropped below)
        target = nnz_per_cell * rng.lognormal(-(sigma**2) / 2, sigma, b)
        target = np.clip(target, 1.0, 0.9 * n_genes)
        draws = np.maximum(1, np.rint(-n_genes * np.log1p(-target / n_genes))).astype(np.int64)
        rows = np.repeat(np.arange(b, dtype=np.int64), draws)
        keys = np.sort(rows * n_genes + rng.integers(0, n_genes, rows.size))
        keep = np.ones(keys.size, dtype=bool)
        np.not_equal(keys[1:], keys[:-1], out=keep[1:])
        keys = keys[keep]  # np.unique does this, but far slower in NumPy 2.5
        row_of = keys // n_genes
        counts = np.bincount(row_of, minlength=b)
        indices = (keys - row_of * n_genes).astype(np.int32)
        data = rng.geometric(0.45, keys.size).astype(np.float32)
        yield counts, data, indices


def write_sparse(args: argparse.Namespace) -> dict:
    import anndata as ad
    import pandas as pd
    import scipy.sparse as sp

    ad_version = version("anndata")
    if int(ad_version.split(".")[0]) == 0 and int(ad_version.split(".")[1]) < 13:
        # anndata 0.12 writes zarr v2 unless told otherwise; 0.13 has these as defaults
        ad.settings.zarr_write_format = 3
        ad.settings.auto_shard_zarr_v3 = True
    n, g = args.n_obs, args.n_genes
    scratch = tempfile.mkdtemp(prefix="scratch_", dir=os.path.dirname(os.path.abspath(args.path)))
    try:
        # first pass: generate in blocks, append to scratch files; bounded memory
        indptr = np.zeros(n + 1, dtype=np.int64)
        row = 0
        data_path, ind_path = os.path.join(scratch, "data"), os.path.join(scratch, "indices")
        with open(data_path, "wb") as fd, open(ind_path, "wb") as fi:
            for counts, data, indices in sparse_blocks(
                n, g, args.nnz_per_cell, args.seed, block_nnz=20_000_000
            ):
                indptr[row + 1 : row + 1 + len(counts)] = indptr[row] + np.cumsum(counts)
                row += len(counts)
                fd.write(data.tobytes())
                fi.write(indices.tobytes())
        nnz = int(indptr[-1])
        data = np.memmap(data_path, dtype=np.float32, mode="r", shape=(nnz,))
        indices = np.memmap(ind_path, dtype=np.int32, mode="r", shape=(nnz,))
        x = sp.csr_matrix((data, indices, indptr), shape=(n, g), copy=False)
        rng = np.random.default_rng(args.seed + 1)
        obs = pd.DataFrame(
            {
                "cell_type": pd.Categorical.from_codes(
                    rng.integers(0, 8, n), [f"t{i}" for i in range(8)]
                )
            },
            index=pd.Index([f"cell_{i}" for i in range(n)]),
        )
        var = pd.DataFrame(index=pd.Index([f"gene_{j}" for j in range(g)]))
        ad.AnnData(X=x, obs=obs, var=var).write_zarr(args.path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "kind": "sparse",
        "n_obs": n,
        "n_genes": g,
        "nnz": nnz,
        "writer": f"anndata {ad_version}, zarr {version('zarr')}",
    }


def write_cube(args: argparse.Namespace) -> dict:
    import zarr

    n, chunk = args.n, args.chunk
    array = zarr.create_array(
        args.path,
        shape=(n, *CUBE_SHAPE),
        chunks=(chunk, *CUBE_SHAPE),
        dtype="float32",
        zarr_format=3,
        overwrite=True,
    )
    rng = np.random.default_rng(args.seed)
    lat = np.linspace(-math.pi / 2, math.pi / 2, CUBE_SHAPE[1], dtype=np.float32)[:, None]
    lon = np.linspace(0, 2 * math.pi, CUBE_SHAPE[2], dtype=np.float32)[None, :]
    c = np.arange(CUBE_SHAPE[0], dtype=np.float32)[:, None, None]
    # field(t) = 10 cos(lat) sin(lon (1 + c) + 0.05 t) + 2 c, expanded so that each row is a
    # linear combination of two precomputed fields
    a = lon * (1 + c)
    sin_a, cos_a = 10 * np.cos(lat) * np.sin(a), 10 * np.cos(lat) * np.cos(a)
    step = max(chunk, (64 // chunk) * chunk)
    for start in range(0, n, step):
        stop = min(n, start + step)
        t = 0.05 * np.arange(start, stop, dtype=np.float32)[:, None, None, None]
        field = rng.standard_normal((stop - start, *CUBE_SHAPE), dtype=np.float32)
        field += sin_a * np.cos(t) + cos_a * np.sin(t) + 2 * c
        array[start:stop] = np.round(field * 1024) / 1024
    return {
        "kind": "cube",
        "n_obs": n,
        "shape": [n, *CUBE_SHAPE],
        "writer": f"zarr {version('zarr')}",
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="kind", required=True)
    s = sub.add_parser("sparse")
    s.add_argument("--path", required=True)
    s.add_argument("--n-obs", type=int, required=True)
    s.add_argument("--n-genes", type=int, required=True)
    s.add_argument("--nnz-per-cell", type=float, required=True)
    s.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("cube")
    c.add_argument("--path", required=True)
    c.add_argument("--n", type=int, required=True)
    c.add_argument("--chunk", type=int, required=True)
    c.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    emit(write_sparse(args) if args.kind == "sparse" else write_cube(args))


if __name__ == "__main__":
    main()
