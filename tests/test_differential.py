"""Seeded random stores x random loader settings, checked against scipy and zarr.

Each case draws a store layout (zarr v2/v3, codec, chunk and shard lengths, CSR or dense X,
value dtype, index dtypes), a selection (collection, gene panel, row subset), sampler
settings and a world of 1-4 ranks (simulated in this process), then checks every batch of
two epochs: X against the store's own values, obs columns against anndata's, each row at
most once across the ranks, equal batch counts where they are enforced, and the rows each
epoch leaves out (``plan.rows_skipped``) accounting for the rest. Refusals with a
:class:`~dali_zarr.DaliZarrError` (a world larger than the data allows) are accepted; any
other error fails.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import zarr

import dali_zarr as dz
from tests.stores import compressors

CASES = 16


@dataclass
class Store:
    path: str
    x: np.ndarray  # dense float64 values, columns in the case's var order
    cell_type: np.ndarray  # labels as text
    depth: np.ndarray


def _rewrite_x(rng, path: Path, x: sp.csr_matrix | np.ndarray, fmt: int) -> None:
    """Replace the X anndata wrote with one of a random layout (chunks, shards, codec)."""
    codec = str(rng.choice(["zstd", "blosc", "lz4", "gzip", "none"]))
    group = zarr.open_group(path, mode="a")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if isinstance(x, np.ndarray):
            attrs = dict(group["X"].attrs)
            del group["X"]
            chunks = (int(rng.integers(1, x.shape[0] + 5)), int(rng.integers(1, x.shape[1] + 3)))
            shards = None
            if fmt == 3 and rng.random() < 0.5:
                shards = (chunks[0] * int(rng.integers(1, 4)), chunks[1])
            array = group.create_array(
                "X", shape=x.shape, dtype=x.dtype, chunks=chunks, shards=shards,
                compressors=compressors(codec, fmt),
            )  # fmt: skip
            array[...] = x
            array.attrs.update(attrs)
        else:
            index = ["int32", "int64"]
            for name, values in (
                ("data", x.data),
                ("indices", x.indices.astype(rng.choice(index))),
                ("indptr", x.indptr.astype(rng.choice(index))),
            ):
                chunk = int(rng.integers(1, 300))
                shards = (
                    (chunk * int(rng.integers(1, 5)),) if fmt == 3 and rng.random() < 0.5 else None
                )
                del group["X"][name]
                array = group["X"].create_array(
                    name, shape=values.shape, dtype=values.dtype, chunks=(chunk,), shards=shards,
                    compressors=compressors(codec, fmt),
                )  # fmt: skip
                if values.size:
                    array[...] = values
    zarr.consolidate_metadata(path)


def _write_store(
    rng, path: Path, var_names: list[str], *, dense: bool, dtype: str, first: bool
) -> Store:
    """An AnnData store written by anndata (its var in a random order half of the time,
    except for a collection's first store, whose order the loader keeps), then given a
    random X layout."""
    import anndata as ad
    import pandas as pd

    n_obs = int(rng.integers(1, 400))
    names = var_names if first or rng.random() < 0.5 else list(rng.permutation(var_names))
    density = float(rng.choice([0.0, 0.05, 0.3, 0.8]))
    x = sp.random(n_obs, len(names), density=density, format="csr", random_state=rng)
    x.data = rng.integers(1, 60, x.nnz).astype(dtype)
    x = x.astype(dtype)
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(rng.choice(["B", "T", "NK", "DC"], n_obs)),
            "depth": rng.random(n_obs).astype(np.float32),
        },
        index=[f"{path.name}-{i}" for i in range(n_obs)],
    )
    fmt = int(rng.choice([2, 3]))
    ad.settings.zarr_write_format = fmt
    ad.AnnData(X=x.toarray() if dense else x, obs=obs, var=pd.DataFrame(index=names)).write_zarr(
        path
    )
    _rewrite_x(rng, path, x.toarray() if dense else x, fmt)
    order = [names.index(v) for v in var_names]
    return Store(
        str(path),
        x.toarray().astype(np.float64)[:, order],
        obs["cell_type"].astype(str).to_numpy(),
        obs["depth"].to_numpy(),
    )


@pytest.mark.parametrize("seed", range(CASES))
def test_random_stores_and_settings_deliver_the_stored_rows(tmp_path: Path, seed: int) -> None:
    import anndata as ad

    rng = np.random.default_rng(seed)
    var_names = [f"g{i}" for i in range(int(rng.integers(1, 30)))]
    dense = rng.random() < 0.3
    dtype = str(rng.choice(["float32", "float64", "int32", "uint16", "int64"]))
    written = ad.settings.zarr_write_format
    try:
        stores = [
            _write_store(
                rng, tmp_path / f"s{k}.zarr", var_names, dense=dense, dtype=dtype, first=k == 0
            )
            for k in range(1 if rng.random() < 0.7 else 2)
        ]
    finally:
        ad.settings.zarr_write_format = written
    x = np.concatenate([s.x for s in stores])
    cell_type = np.concatenate([s.cell_type for s in stores])
    depth = np.concatenate([s.depth for s in stores])
    features = list(var_names) if len(stores) > 1 else None  # gene orders may differ
    if rng.random() < 0.4:
        features = [var_names[i] for i in rng.permutation(len(var_names))[: rng.integers(1, 9)]]
    paths = [s.path for s in stores]
    ds = dz.open_dataset(paths if len(paths) > 1 else paths[0], features=features)
    columns = [var_names.index(f) for f in features] if features else slice(None)
    rows = np.arange(len(x))
    if rng.random() < 0.3 and len(x) > 1:
        rows = np.sort(rng.choice(len(x), int(rng.integers(1, len(x) + 1)), replace=False))
        ds = dz.Subset(ds, rows)
    expected = x[:, columns]
    batch_size, chunk_size = int(rng.integers(1, 80)), int(rng.integers(1, 150))
    sampler = dz.ChunkSampler(
        chunk_size=chunk_size,
        preload_nchunks=max(int(rng.integers(1, 6)), -(-batch_size // chunk_size)),
        batch_size=batch_size,
        shuffle=bool(rng.random() < 0.7),
        drop_last=bool(rng.random() < 0.4),
        seed=int(rng.integers(0, 100)),
    )
    world = int(rng.choice([1, 2, 3, 4]))
    shard = str(rng.choice(["chunks", "contiguous"]))
    enforce = bool(rng.random() < 0.6)
    output = "dense" if dense else str(rng.choice(["dense", "csr"]))
    out_dtype = str(rng.choice(["float32", "float64"]))
    case = f"{sampler!r}, world={world}, shard={shard}, enforce={enforce}, output={output}"
    try:
        for epoch in range(2):
            delivered, counts, skipped = [], [], []
            for rank in range(world):
                planner = sampler
                if world > 1:
                    planner = dz.DistributedSampler(
                        sampler,
                        dist_info=lambda r=rank: (r, world),
                        shard=shard,
                        enforce_equal_batches=enforce,
                    )
                with dz.Loader(
                    ds, planner, output=output, dtype=out_dtype, obs=["cell_type", "depth"],
                    return_index=True, num_threads=1, device="cpu",
                ) as loader:  # fmt: skip
                    loader.set_epoch(epoch)
                    skipped.append(loader.plan().rows_skipped)
                    names = np.array(loader.categories("cell_type"))
                    n_batches = 0
                    for batch in loader:
                        n_batches += 1
                        ids = batch["index"].numpy()
                        got = batch["X"].to_dense() if output == "csr" else batch["X"]
                        assert 0 < len(ids) <= batch_size, case
                        np.testing.assert_allclose(
                            got.numpy().astype(np.float64), expected[ids], rtol=1e-6, err_msg=case
                        )
                        assert (names[batch["cell_type"].numpy()] == cell_type[ids]).all(), case
                        np.testing.assert_array_equal(batch["depth"].numpy(), depth[ids], case)
                        delivered.append(ids)
                    assert n_batches == len(loader), case
                    counts.append(n_batches)
            ids = np.concatenate([np.zeros(0, np.int64), *delivered])
            assert np.isin(ids, rows).all(), case
            assert len(np.unique(ids)) == len(ids), f"a row delivered twice: {case}"
            assert len(set(skipped)) == 1, case
            assert len(ids) + skipped[0] == len(rows), case
            if world == 1 and not sampler.drop_last:
                assert len(ids) == len(rows), case
            if world > 1 and enforce:
                assert counts == [len(rows) // world // batch_size] * world, case
    except dz.ConfigError as exc:  # a world or batch the data cannot fill: refused by name
        n, per_rank = len(rows), -(-len(rows) // world)
        warranted = {  # each refusal a case may meet, and when it is right
            "more ranks than chunks": -(-n // chunk_size) < world,
            "dataset too small": world > 1 and enforce and n // world < batch_size,
            "nothing to deliver": sampler.drop_last and per_rank < batch_size,
        }
        assert any(words in str(exc) and due for words, due in warranted.items()), (case, exc)
