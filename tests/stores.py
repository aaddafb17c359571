"""Store writers and oracles shared by the tests (real stores on disk, no mocks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.sparse as sp


def csr_reference(path: str | Path) -> sp.csr_matrix:
    """The store's X as scipy CSR, read with plain zarr (the oracle for our loader)."""
    import zarr

    x = zarr.open_group(str(path), mode="r")["X"]
    return sp.csr_matrix(
        (x["data"][...], x["indices"][...], x["indptr"][...]), shape=tuple(x.attrs["shape"])
    )


def write_anndata(
    path: Path, *, n_obs: int, n_features: int, zarr_format: int, seed: int = 0, shard: bool = False
) -> sp.csr_matrix:
    """Write an AnnData store with anndata itself; returns X for comparison."""
    import anndata as ad
    import pandas as pd

    rng = np.random.default_rng(seed)
    x = sp.random(n_obs, n_features, density=0.1, format="csr", dtype=np.float32, random_state=rng)
    x.data[:] = rng.integers(1, 50, size=x.nnz)
    labels = pd.Categorical(rng.choice(["B", "T", "NK"], size=n_obs))
    obs = pd.DataFrame(
        {"cell_type": labels, "depth": rng.random(n_obs)}, index=[f"c{i}" for i in range(n_obs)]
    )
    adata = ad.AnnData(X=x, obs=obs)
    previous = (ad.settings.zarr_write_format, getattr(ad.settings, "auto_shard_zarr_v3", None))
    ad.settings.zarr_write_format = zarr_format
    if shard:
        ad.settings.auto_shard_zarr_v3 = True
    try:
        adata.write_zarr(path)
    finally:
        ad.settings.zarr_write_format = previous[0]
        if previous[1] is not None:
            ad.settings.auto_shard_zarr_v3 = previous[1]
    return x
