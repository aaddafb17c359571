"""Synthetic stores for the demo, the tests and the benchmarks.

``make_single_cell`` writes an AnnData-layout Zarr store (CSR ``X``, categorical
``obs/cell_type``, ``var``) that anndata itself can read, with counts a model can learn
from: each cell type raises its own marker genes, so expression predicts the label.
``make_dense_cube`` writes a plain ``(n, *shape)`` float32 array chunked on axis 0.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
import zarr
from zarr.codecs import BloscCodec, BytesCodec, ZstdCodec

from dali_zarr.io.publish import written_whole

Codec = Literal["zstd", "blosc", "lz4", "none"]


def _compressors(codec: Codec, zarr_format: int) -> Any:
    """``codec``'s compressor for ``zarr_format``: ``blosc`` is Blosc with LZ4 inside (CPU
    decode on the GPU path), ``lz4`` bare LZ4 blocks (nvCOMP decodes them; zarr v2 only)."""
    if codec not in ("zstd", "blosc", "lz4", "none"):
        raise ValueError(f"codec={codec!r}: use 'zstd', 'blosc', 'lz4' or 'none'")
    if codec == "none":
        return None
    if zarr_format == 2:
        import numcodecs

        return {
            "zstd": numcodecs.Zstd(level=1),
            "blosc": numcodecs.Blosc(cname="lz4"),
            "lz4": numcodecs.LZ4(),
        }[codec]
    if codec == "lz4":  # numcodecs' v3 wrapper is not a codec of the zarr v3 spec
        raise ValueError("codec='lz4' needs zarr_format=2 (zarr v3's own codecs have no LZ4)")
    return ZstdCodec(level=1) if codec == "zstd" else BloscCodec(cname="lz4")


def _write_array(
    group: zarr.Group,
    name: str,
    values: np.ndarray,
    *,
    chunks: Sequence[int],
    shards: Sequence[int] | None,
    codec: Codec,
    zarr_format: int,
    attrs: dict | None = None,
) -> zarr.Array:
    kwargs: dict[str, Any] = {"compressors": _compressors(codec, zarr_format)}
    if zarr_format == 3:
        kwargs["serializer"] = BytesCodec()
        if shards is not None:
            kwargs["shards"] = tuple(shards)
    array = group.create_array(
        name, shape=values.shape, dtype=values.dtype, chunks=tuple(chunks), **kwargs
    )
    array[...] = values
    array.attrs.update(attrs or {"encoding-type": "array", "encoding-version": "0.2.0"})
    return array


def _write_strings(group: zarr.Group, name: str, values: list[str]) -> None:
    array = group.create_array(name, shape=(len(values),), dtype=str, chunks=(len(values),))
    array[...] = np.array(values, dtype=object)
    array.attrs.update({"encoding-type": "string-array", "encoding-version": "0.2.0"})


def _write_dataframe(group: zarr.Group, index: list[str], columns: dict[str, Any]) -> None:
    group.attrs.update(
        {
            "encoding-type": "dataframe",
            "encoding-version": "0.2.0",
            "_index": "_index",
            "column-order": list(columns),
        }
    )
    _write_strings(group, "_index", index)
    for name, (codes, categories) in columns.items():
        column = group.create_group(name)
        column.attrs.update(
            {"encoding-type": "categorical", "encoding-version": "0.2.0", "ordered": False}
        )
        _write_array(
            column,
            "codes",
            codes,
            chunks=(max(1, len(codes)),),
            shards=None,
            codec="none",
            zarr_format=group.metadata.zarr_format,
        )
        _write_strings(column, "categories", list(categories))


def single_cell_counts(
    n_obs: int, n_features: int, *, density: float, n_types: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(data, indices, indptr, labels): negative-binomial counts, marker genes per type."""
    rng = np.random.default_rng(seed)
    if n_obs < 1:  # else numpy's "need at least one array to concatenate", far from here
        raise ValueError(f"n_obs={n_obs}: need at least one cell")
    if not 1 <= n_types <= n_features:
        raise ValueError(f"n_types={n_types}: need 1 <= n_types <= n_features={n_features}")
    labels = rng.integers(0, n_types, size=n_obs).astype(np.min_scalar_type(-n_types))
    markers = rng.permutation(n_features)[: n_types * max(1, n_features // (4 * n_types))]
    markers = markers.reshape(n_types, -1)
    block = max(1, min(n_obs, 2_000_000 // max(1, n_features)))
    data_parts, index_parts, counts = [], [], np.zeros(n_obs, dtype=np.int64)
    for start in range(0, n_obs, block):
        stop = min(n_obs, start + block)
        prob = np.full((stop - start, n_features), density * 0.8, dtype=np.float32)
        mean = np.full_like(prob, 2.0)
        rows = np.arange(stop - start)[:, None]
        own = markers[labels[start:stop]]
        prob[rows, own] = min(0.95, density * 6)
        mean[rows, own] = 6.0
        hit = rng.random(prob.shape, dtype=np.float32) < prob
        # NB(r=2, p) has mean 2(1-p)/p; shift by one so every stored value is non-zero.
        values = rng.negative_binomial(2, 2.0 / (2.0 + mean[hit])).astype(np.float32) + 1
        r, c = np.nonzero(hit)
        counts[start:stop] = np.bincount(r, minlength=stop - start)
        data_parts.append(values)
        index_parts.append(c.astype(np.int32))
    indptr = np.zeros(n_obs + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return np.concatenate(data_parts), np.concatenate(index_parts), indptr, labels


@contextlib.contextmanager
def _store_at(path: str | os.PathLike) -> Iterator[str]:
    """A folder to write a store into that becomes ``path`` only once it is complete (never a
    half store at ``path``): an existing Zarr store there is replaced, a folder of other
    files is refused (zarr's own ``overwrite=True`` emptied it); the parent is created."""
    final = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(final)), exist_ok=True)
    with written_whole(final, overwrite=True) as partial:
        yield partial


def make_single_cell(
    path: str | os.PathLike,
    *,
    n_obs: int = 20_000,
    n_features: int = 2_000,
    density: float = 0.07,
    n_types: int = 8,
    zarr_format: Literal[2, 3] = 3,
    codec: Codec = "zstd",
    chunk_elements: int = 16_384,
    shard_chunks: int | None = 32,
    seed: int = 0,
) -> str:
    """Write an AnnData-layout store of synthetic counts; returns its path (written whole,
    see :func:`_store_at`)."""
    data, indices, indptr, labels = single_cell_counts(
        n_obs, n_features, density=density, n_types=n_types, seed=seed
    )
    with _store_at(path) as partial:
        _write_single_cell(partial, data, indices, indptr, labels, n_features=n_features,
                           n_types=n_types, zarr_format=zarr_format, codec=codec,
                           chunk_elements=chunk_elements, shard_chunks=shard_chunks)  # fmt: skip
    return os.fspath(path)


def _write_single_cell(
    path: str,
    data: np.ndarray,
    indices: np.ndarray,
    indptr: np.ndarray,
    labels: np.ndarray,
    *,
    n_features: int,
    n_types: int,
    zarr_format: Literal[2, 3],
    codec: Codec,
    chunk_elements: int,
    shard_chunks: int | None,
) -> None:
    n_obs = len(indptr) - 1
    root = zarr.open_group(path, mode="a", zarr_format=zarr_format)  # a fresh partial
    root.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
    x = root.create_group("X")
    x.attrs.update(
        {"encoding-type": "csr_matrix", "encoding-version": "0.1.0", "shape": [n_obs, n_features]}
    )
    chunk = (max(1, min(chunk_elements, len(data))),)
    shards = (chunk[0] * shard_chunks,) if shard_chunks and zarr_format == 3 else None
    for name, values in (("data", data), ("indices", indices)):
        _write_array(
            x, name, values, chunks=chunk, shards=shards, codec=codec, zarr_format=zarr_format
        )
    _write_array(
        x,
        "indptr",
        indptr,
        chunks=(len(indptr),),
        shards=None,
        codec=codec,
        zarr_format=zarr_format,
    )
    names = [f"type_{k}" for k in range(n_types)]
    _write_dataframe(
        root.create_group("obs"),
        [f"cell_{i}" for i in range(n_obs)],
        {"cell_type": (labels, names)},
    )
    _write_dataframe(root.create_group("var"), [f"gene_{j}" for j in range(n_features)], {})
    for empty in ("obsm", "varm", "obsp", "varp", "layers", "uns"):
        root.create_group(empty).attrs.update(
            {"encoding-type": "dict", "encoding-version": "0.1.0"}
        )


def make_dense_cube(
    path: str | os.PathLike,
    *,
    n_obs: int = 1_000,
    shape: Sequence[int] = (8, 18, 36),
    chunk_obs: int = 64,
    codec: Codec = "zstd",
    zarr_format: Literal[2, 3] = 3,
    shard_chunks: int | None = None,
    seed: int = 0,
) -> str:
    """Write a plain float32 array ``(n_obs, *shape)`` chunked on axis 0; returns its path
    (written whole, see :func:`_store_at`)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((n_obs, *shape), dtype=np.float32)
    kwargs: dict[str, Any] = {"compressors": _compressors(codec, zarr_format)}
    if zarr_format == 3 and shard_chunks:
        kwargs["shards"] = (chunk_obs * shard_chunks, *shape)
    with _store_at(path) as partial:
        array = zarr.create_array(
            partial,
            shape=values.shape,
            dtype=values.dtype,
            chunks=(chunk_obs, *shape),
            zarr_format=zarr_format,
            **kwargs,
        )
        array[...] = values
    return os.fspath(path)
