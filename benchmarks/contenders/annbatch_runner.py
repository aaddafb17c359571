"""annbatch: ``annbatch.Loader`` with our chunk_size, preload_nchunks and batch_size.

Runs in its own Python 3.12 environment (``benchmarks/.venv-annbatch``). Configured as
annbatch's README says for local stores: the zarrs codec pipeline on
(``zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"})``), ``shuffle=True``,
no ``to=`` (batches stay SciPy CSR / NumPy on the CPU), no cupy (``preload_to_gpu=False``).

Sparse store: ``X`` is opened with ``anndata.io.sparse_dataset`` and added alone
(``add_dataset``, no obs columns, like the other contenders). ``output="csr"`` takes the
SciPy ``csr_matrix`` batch as it comes; ``output="dense"`` densifies it with ``.toarray()``,
what its users do on a CPU (float32 ``[B, n_genes]``). Dense cube: the zarr array itself is
added (``add_dataset(zarr.open_array(...))``) and batches are NumPy arrays already.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
from _common import emit, epochs, measure, parse


def main() -> None:
    store, s = parse()
    warnings.filterwarnings("ignore")
    import anndata as ad
    import zarr

    if s.get("zarrs", True):
        zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"})
    from annbatch import Loader

    loader = Loader(
        chunk_size=s["chunk_size"],
        preload_nchunks=s["preload_nchunks"],
        batch_size=s["batch_size"],
        shuffle=True,
        drop_last=False,
        preload_to_gpu=False,
        rng=np.random.default_rng(0),
    )
    if os.path.isdir(os.path.join(store, "X")):
        loader.add_dataset(ad.io.sparse_dataset(zarr.open_group(store, mode="r")["X"]))
    else:
        loader.add_dataset(zarr.open_array(store, mode="r"))
    dense = s["output"] == "dense"

    def consume(batch) -> tuple[int, int]:
        x = batch["X"]
        if isinstance(x, np.ndarray):
            return x.shape[0], x.nbytes
        if dense:
            x = x.toarray()
            return x.shape[0], x.nbytes
        return x.shape[0], x.data.nbytes + x.indices.nbytes + x.indptr.nbytes

    result = measure(
        epochs(lambda _epoch: loader),
        consume,
        warmup=s.get("warmup", 2),
        max_batches=s["max_batches"],
        max_seconds=s["max_seconds"],
    )
    result["codec_pipeline"] = zarr.config.get("codec_pipeline.path")
    emit(result)


if __name__ == "__main__":
    main()
