"""Store writers and oracles shared by the tests (real stores on disk, no mocks)."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import numcodecs
import numpy as np
import pytest
import scipy.sparse as sp
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, GzipCodec, ZstdCodec
from zarr.codecs import numcodecs as znc

from dali_zarr.data.dataset import CsrRows, DenseRows


def csr_reference(path: str | Path) -> sp.csr_matrix:
    """The store's X as scipy CSR, read with plain zarr (the oracle for our loader)."""
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


def write(path, data, *, fmt=3, chunks, shards=None, compressors=None, **kw) -> zarr.Array:
    """Write ``data`` as a zarr array with the given layout; returns it opened read-only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arr = zarr.create_array(
            str(path),
            shape=data.shape,
            dtype=data.dtype,
            chunks=chunks,
            shards=shards,
            compressors=compressors,
            zarr_format=fmt,
            **kw,
        )
        arr[...] = data
        return zarr.open_array(str(path), mode="r")


def same_size_shards(directory: Path) -> tuple[Path, np.ndarray, Path, np.ndarray]:
    """Two versions of a one-shard array (40 x 4 float32, uncompressed, chunks of 10 rows)
    whose shard files are the same size, 548 bytes, with chunks at other offsets: version 1
    leaves chunk 0 at the fill value (not stored), version 2 chunk 2, so chunk 1 sits where
    version 2 holds chunk 0, and chunk 2 where it holds chunk 1. A read planned on one
    version and made on the other gets those rows wrong without any error.
    Returns each version's array path and values (``v1.zarr``, ``v2.zarr`` in ``directory``).

    Each shard's modification time is set a minute back: a test that renames copies over
    version 1's shard twice can give the second copy its inode number back (ext4 reuses a
    freed one at once), and with timestamps of a clock tick (before Linux 6.13) a copy made
    within the tick of zarr's write would then look like the file planned."""
    out = []
    for version, fill_chunk in ((1, 0), (2, 2)):
        data = np.arange(40 * 4, dtype=np.float32).reshape(40, 4) + 1000 * version
        data[fill_chunk * 10 : fill_chunk * 10 + 10] = 0
        write(directory / f"v{version}.zarr", data, chunks=(10, 4), shards=(40, 4))
        out += [directory / f"v{version}.zarr", data]
    shard = [path / "c" / "0" / "0" for path in out[::2]]
    assert shard[0].stat().st_size == shard[1].stat().st_size  # the premise of its tests
    for file in shard:
        back = file.stat().st_mtime_ns - 60 * 10**9
        os.utime(file, ns=(back, back))
    return out[0], out[1], out[2], out[3]


def random_ranges(rng, n: int, chunk: int, k: int = 40) -> np.ndarray:
    """Unsorted, overlapping, empty and edge ``[start, stop)`` ranges over ``n`` rows."""
    starts = rng.integers(0, n + 1, k)
    stops = np.minimum(starts + rng.integers(0, 3 * chunk, k), n)
    extra = np.array(
        [[0, n], [n - 1, n], [min(chunk, n), min(2 * chunk, n)], [0, 0], [starts[0], stops[0]]]
    )
    r = np.concatenate([np.stack([starts, stops], 1), extra]).astype(np.int64)
    return r[rng.permutation(len(r))]


def has_cuda() -> bool:
    """Whether torch sees a CUDA device (GPU tests skip themselves otherwise)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


needs_cuda = pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")


def compressors(codec: str, fmt: int):
    """zarr v2 (numcodecs) or v3 compressor(s) by short name, for layout matrices."""
    if fmt == 2:
        return {
            "zstd": numcodecs.Zstd(level=1),
            "blosc-lz4": numcodecs.Blosc(cname="lz4"),
            "blosc": numcodecs.Blosc(cname="lz4"),
            "blosc-zstd": numcodecs.Blosc(cname="zstd", shuffle=numcodecs.Blosc.BITSHUFFLE),
            "lz4": numcodecs.LZ4(),
            "gzip": numcodecs.GZip(level=1),
            "zlib": numcodecs.Zlib(level=1),
            "bz2": numcodecs.BZ2(level=1),
            "lzma": numcodecs.LZMA(preset=1),
            "none": None,
        }[codec]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "zstd": ZstdCodec(level=1),
            "blosc-lz4": BloscCodec(cname="lz4"),
            "blosc": BloscCodec(cname="lz4"),
            "blosc-zstd": BloscCodec(cname="zstd", shuffle="bitshuffle"),
            "lz4": znc.LZ4(),
            "gzip": GzipCodec(level=1),
            "none": None,
            "zstd-crc32c": [ZstdCodec(level=1), Crc32cCodec()],
            "numcodecs-zstd": znc.Zstd(level=1),
            "numcodecs-zstd-crc32c": [znc.Zstd(level=1), znc.CRC32C()],
        }[codec]


def as_dense(rows, n_features: int) -> np.ndarray:
    """Rows a dataset's ``read_rows`` returned (CSR or dense) as a dense array."""
    if isinstance(rows, CsrRows):
        return sp.csr_matrix(
            (rows.data, rows.indices, rows.indptr), shape=(rows.n_rows, n_features)
        ).toarray()
    assert isinstance(rows, DenseRows), type(rows)
    return rows.values


def make_data(shape, dtype, chunk0: int, shard0: int | None, seed: int = 0) -> np.ndarray:
    """Random data with zero (= fill value) blocks so that zarr skips writing some chunks."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        data = rng.integers(-1000, 1000, size=shape).astype(dtype)
    else:
        data = (rng.standard_normal(shape) * 10).round(2).astype(dtype)
    data[chunk0 : 2 * chunk0] = 0  # one missing chunk (or empty inner chunk of a shard)
    if shard0 is not None and shape[0] > 2 * shard0:
        data[2 * shard0 : 3 * shard0] = 0  # a whole missing shard
    return data


def write_layout(
    path, spec, *, fmt: int = 3, codec: str, sharded: bool = False, dtype=None, **kw
) -> tuple[np.ndarray, zarr.Array]:
    """:func:`make_data` written with ``spec = (shape, dtype, chunks, shards)``; ``shards`` is
    used only when ``sharded``. Returns (data, the array opened read-only)."""
    shape, spec_dtype, chunks, shards = spec
    shards = shards if sharded else None
    data = make_data(shape, dtype or spec_dtype, chunks[0], shards[0] if shards else None)
    arr = write(
        path, data, fmt=fmt, chunks=chunks, shards=shards, compressors=compressors(codec, fmt), **kw
    )
    return data, arr


def batch_info(epoch_idx: int, iteration: int) -> SimpleNamespace:
    """What DALI passes an external source callback (``batch_info=True``)."""
    return SimpleNamespace(epoch_idx=epoch_idx, iteration=iteration)


def epoch_outputs(source, other, epoch: int):
    """``(iteration, outputs)`` of external-source callback ``source`` over DALI epoch
    ``epoch``, as DALI calls it, until it raises StopIteration; ``other``, a callback
    compared with it, must end at the same iteration."""
    it = 0
    while True:
        try:
            outputs = source(batch_info(epoch, it))
        except StopIteration:
            with pytest.raises(StopIteration):
                other(batch_info(epoch, it))
            return
        yield it, outputs
        it += 1


def raised_by_a_read_of(read, pipe: Path, seconds: float = 60) -> BaseException | None:
    """What ``read()`` raised (None if nothing), run on a thread; a read still waiting after
    ``seconds`` fails the test, once the named ``pipe`` it may wait on is opened for writing
    (which lets its open through)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            read()
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail("the read waited on a named pipe")
    return raised[0] if raised else None
