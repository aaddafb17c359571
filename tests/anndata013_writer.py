"""Write AnnData stores with anndata 0.13 (Python 3.12), for ``tests/test_anndata013.py``.

Run by that test in the ``.venv-anndata013`` interpreter, which has anndata 0.13 and the
zarr it pulls in, not dali_zarr: ``python tests/anndata013_writer.py OUT_DIR``. Writes
the stores under OUT_DIR and ``reference.npz`` (the matrices and obs columns as written),
then prints one JSON line with the versions that wrote them.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp
import zarr

N_OBS, N_VARS = 300, 120


def make_adata(dense: bool) -> ad.AnnData:
    rng = np.random.default_rng(13)
    counts = sp.random(N_OBS, N_VARS, density=0.08, format="csr", random_state=rng)
    counts.data[:] = rng.integers(1, 40, size=counts.nnz)
    x = counts.astype(np.float32)
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(rng.choice(["T", "B", "NK", "Mono"], size=N_OBS)),
            "n_genes": rng.integers(0, 5_000, size=N_OBS).astype(np.int64),
            "score": rng.random(N_OBS).astype(np.float32),
            "is_doublet": rng.random(N_OBS) > 0.9,
            "plate": pd.array(rng.integers(0, 14, size=N_OBS), dtype="Int32"),  # no missing
            "barcode": [f"AACG{i:06d}" for i in range(N_OBS)],  # unique text: stays text
            # unique text with missing values (a nullable-string-array with a mask)
            "note": pd.array([None if i % 7 == 0 else f"n{i}" for i in range(N_OBS)], "string"),
        },
        index=[f"cell{i}" for i in range(N_OBS)],
    )
    var = pd.DataFrame(index=[f"gene{j}" for j in range(N_VARS)])
    adata = ad.AnnData(X=x.toarray() if dense else x, obs=obs, var=var)
    adata.layers["counts"] = counts.astype(np.int32)
    adata.obsm["X_pca"] = rng.random((N_OBS, 8)).astype(np.float32)
    adata.raw = adata.copy()
    return adata


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    # name: (dense X, zarr format, settings changed from anndata 0.13's defaults, X chunks)
    stores = {
        "default_csr": (False, 3, {}, None),  # v3, sharded, zstd: what users get
        "default_dense": (True, 3, {}, None),
        "csr_v2": (False, 2, {}, None),  # zarr's v2 default compressor (blosc)
        # several chunks and shards, column ids in the narrowest dtype that holds them
        "csr_small_chunks": (
            False,
            3,
            {"write_csr_csc_indices_with_min_possible_dtype": True},
            {"chunks": (256,), "shards": (1024,)},
        ),
        "dense_small_chunks": (True, 3, {}, (32, N_VARS)),
    }
    for name, (dense, fmt, changes, chunks) in stores.items():
        with ad.settings.override(zarr_write_format=fmt, **changes):
            adata = make_adata(dense)
            path = out / f"{name}.zarr"
            rewrite_x = bool(chunks) and not dense
            adata.write_zarr(
                path, chunks=chunks if dense else None, consolidate_metadata=not rewrite_x
            )
            if rewrite_x:  # X again, chunked and sharded as asked
                group = zarr.open_group(path, mode="r+")
                del group["X"]
                ad.io.write_elem(group, "X", adata.X, dataset_kwargs=chunks)
                zarr.consolidate_metadata(path)
        written[name] = adata
    adata = written["default_csr"]
    np.savez(
        out / "reference.npz",
        X=adata.X.toarray(),
        counts=adata.layers["counts"].toarray(),
        X_pca=adata.obsm["X_pca"],
        cell_type_codes=adata.obs["cell_type"].cat.codes.to_numpy(),
        cell_type_categories=np.array(adata.obs["cell_type"].cat.categories, dtype=str),
        n_genes=adata.obs["n_genes"].to_numpy(),
        score=adata.obs["score"].to_numpy(),
        is_doublet=adata.obs["is_doublet"].to_numpy(),
        plate=adata.obs["plate"].to_numpy(dtype=np.int32),
    )
    versions = {name: version(name) for name in ("anndata", "zarr")}
    print(json.dumps(versions))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
