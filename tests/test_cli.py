"""The dali-zarr command line (convert, inspect, bench) on real stores on disk."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import tracemalloc
import warnings
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import zarr

import dali_zarr as dz
from dali_zarr import synthetic
from dali_zarr.cli import bench_summary, main, parse_size
from dali_zarr.convert import _Appender, convert, output_permutation
from tests.processes import ROOT, child_env
from tests.stores import as_dense, csr_reference, write_anndata

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---------------------------------------------------------------------------- helpers


def run(*argv: object) -> int:
    return main([str(a) for a in argv])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "error:" in err
    return err


def write_h5ad(path: Path, *, n_obs: int, n_features: int, dense: bool = False, seed: int = 0):
    """An .h5ad written by anndata itself: categorical, float, int and string obs columns."""
    rng = np.random.default_rng(seed)
    x = sp.random(n_obs, n_features, density=0.2, format="csr", dtype=np.float32, random_state=rng)
    x.data[:] = rng.integers(1, 50, size=x.nnz)
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(rng.choice(["B", "T", "NK"], size=n_obs)),
            "depth": rng.random(n_obs),
            "batch": rng.integers(0, 4, size=n_obs),
            "donor": [f"d{i % 7}" for i in range(n_obs)],
        },
        index=[f"c{i}" for i in range(n_obs)],
    )
    var = pd.DataFrame(index=[f"g{j}" for j in range(n_features)])
    adata = ad.AnnData(X=x.toarray() if dense else x, obs=obs, var=var)
    adata.write_h5ad(path)
    return adata


def assert_same_obs(got: pd.DataFrame, want: pd.DataFrame) -> None:
    for column in want.columns:
        np.testing.assert_array_equal(np.asarray(got[column]), np.asarray(want[column]))
    np.testing.assert_array_equal(np.asarray(got.index), np.asarray(want.index))


def loader_rows(path: Path) -> np.ndarray:
    """Every row of the store as our own dataset reads it (the direct path), dense."""
    ds = dz.open_dataset(path)
    return as_dense(ds.read_rows(np.array([[0, ds.n_obs]])), ds.n_features)


def x_codecs(array: zarr.Array) -> list[str]:
    codecs = array.metadata.to_dict()["codecs"]
    if codecs[0]["name"] == "sharding_indexed":
        codecs = codecs[0]["configuration"]["codecs"]
    return [c["name"] for c in codecs]


@pytest.fixture(scope="module")
def h5ad_file(tmp_path_factory) -> tuple[Path, ad.AnnData]:
    path = tmp_path_factory.mktemp("h5ad") / "cells.h5ad"
    return path, write_h5ad(path, n_obs=700, n_features=40)


# ---------------------------------------------------------------------------- convert


def test_convert_h5ad_keeps_every_row_and_obs_value(tmp_path, h5ad_file):
    src, adata = h5ad_file
    dst = tmp_path / "out.zarr"
    assert run("convert", src, dst, "--chunk-rows", 50, "--shard-size", "4KB", "-q") == 0
    back = ad.read_zarr(dst)
    np.testing.assert_array_equal(back.X.toarray(), adata.X.toarray())
    assert_same_obs(back.obs, adata.obs)
    np.testing.assert_array_equal(back.obs["original_index"], np.arange(700))
    np.testing.assert_array_equal(back.var_names, adata.var_names)
    np.testing.assert_array_equal(loader_rows(dst), adata.X.toarray())
    ds = dz.open_dataset(dst)
    assert ds.layout == "csr"
    assert ds.categories("cell_type") == tuple(adata.obs["cell_type"].cat.categories)
    np.testing.assert_array_equal(ds.obs_column("batch").values, adata.obs["batch"])
    # chunks of ~50 rows: round(nnz / n_obs * 50) elements; shards of whole chunks <= 4 KB
    x = zarr.open_group(dst, mode="r")["X"]
    elements = round(adata.X.nnz / 700 * 50)
    assert x["data"].chunks == (elements,)
    assert x["data"].shards == (elements * (4000 // (elements * 4)),)
    assert x_codecs(x["data"]) == ["bytes", "zstd"]
    info = zarr.open_group(dst, mode="r").attrs["dali_zarr"]
    assert info["chunk_rows"] == 50 and info["chunk_elements"] == elements
    assert info["shuffle"] is None
    assert not os.path.exists(f"{dst}.partial")


@pytest.mark.parametrize(("nnz_per_row", "rows"), [(4096, 16), (2000, 32), (100, 256)])
def test_convert_csr_default_chunks_hold_at_most_65536_elements(tmp_path, nnz_per_row, rows):
    """Without --chunk-rows a CSR chunk held 256 rows on average: 512,000 elements at 2,000
    non-zeros a row, which nvCOMP decoded 2-4x slower per window on the H200 than chunks
    of 65,536 (benchmarks/results/h200-2026-11-27). Long rows now get fewer rows a chunk;
    short rows keep 256."""
    from dali_zarr.convert import DEFAULT_CSR_CHUNK_ELEMENTS, convert

    n_obs, n_vars = 600, 5000
    rng = np.random.default_rng(0)
    cols = np.stack([rng.choice(n_vars, nnz_per_row, replace=False) for _ in range(n_obs)])
    x = sp.csr_matrix(
        (np.ones(n_obs * nnz_per_row, np.float32), np.sort(cols, axis=1).ravel(),
         np.arange(0, n_obs * nnz_per_row + 1, nnz_per_row)), shape=(n_obs, n_vars),
    )  # fmt: skip
    ad.AnnData(X=x).write_zarr(tmp_path / "in.zarr")
    result = convert(tmp_path / "in.zarr", tmp_path / "out.zarr")
    assert result.chunk_rows == rows
    chunk = zarr.open_group(tmp_path / "out.zarr", mode="r")["X"]["data"].chunks[0]
    assert chunk == rows * nnz_per_row
    assert chunk <= DEFAULT_CSR_CHUNK_ELEMENTS  # short rows too: 256 of them are fewer
    np.testing.assert_array_equal(loader_rows(tmp_path / "out.zarr"), x.toarray())
    # shuffled pieces (one random read of the input each) keep 256 rows
    convert(tmp_path / "in.zarr", tmp_path / "shuffled.zarr", shuffle=True)
    shuffled = zarr.open_group(tmp_path / "shuffled.zarr", mode="r").attrs["dali_zarr"]
    assert shuffled["shuffle"]["piece_rows"] == 256 and shuffled["chunk_rows"] == rows


def test_convert_dense_h5ad(tmp_path):
    src = tmp_path / "dense.h5ad"
    adata = write_h5ad(src, n_obs=300, n_features=24, dense=True)
    dst = tmp_path / "dense.zarr"
    assert run("convert", src, dst, "--chunk-rows", 32, "--shard-size", "10KB", "-q") == 0
    x = zarr.open_group(dst, mode="r")["X"]
    assert x.chunks == (32, 24)
    assert x.shards == (96, 24)  # 3 chunks of 32 × 24 × 4 bytes fit in 10 KB
    np.testing.assert_array_equal(loader_rows(dst), adata.X)
    assert_same_obs(ad.read_zarr(dst).obs, adata.obs)
    assert isinstance(dz.open_dataset(dst), dz.DenseDataset)


@pytest.mark.parametrize(("zarr_format", "codec"), [(2, "lz4"), (3, "none"), (3, "zstd")])
def test_convert_anndata_zarr(tmp_path, zarr_format, codec):
    src = tmp_path / "in.zarr"
    x = write_anndata(src, n_obs=500, n_features=30, zarr_format=zarr_format)
    dst = tmp_path / "out.zarr"
    assert run("convert", src, dst, "--codec", codec, "--chunk-rows", 64, "-q") == 0
    np.testing.assert_array_equal(csr_reference(dst).toarray(), x.toarray())
    np.testing.assert_array_equal(loader_rows(dst), x.toarray())
    back, orig = ad.read_zarr(dst), ad.read_zarr(src)
    assert_same_obs(back.obs, orig.obs)
    data = zarr.open_group(dst, mode="r")["X"]["data"]
    assert data.metadata.zarr_format == 3
    want = {"lz4": ["bytes", "numcodecs.lz4"], "none": ["bytes"], "zstd": ["bytes", "zstd"]}
    assert x_codecs(data) == want[codec]
    assert dz.open_dataset(dst).read_paths() == {
        "out.zarr/X/data": "direct",
        "out.zarr/X/indices": "direct",
    }


def test_convert_plain_array(tmp_path):
    src = synthetic.make_dense_cube(tmp_path / "cube.zarr", n_obs=333, shape=(3, 5), chunk_obs=16)
    dst = tmp_path / "out.zarr"
    assert run("convert", src, dst, "--chunk-rows", 40, "--shard-size", "5KB", "-q") == 0
    out = zarr.open_array(dst, mode="r")
    assert out.chunks == (40, 3, 5) and out.shards == (80, 3, 5)
    np.testing.assert_array_equal(out[...], zarr.open_array(src, mode="r")[...])
    assert dz.open_dataset(dst).feature_shape == (3, 5)
    # zero-width rows: nothing to shard (zarr divided by the chunks' zero length)
    empty = zarr.create_array(tmp_path / "w0.zarr", shape=(20, 0), dtype="f4", chunks=(8, 1))
    assert (
        run(
            "convert",
            empty.store.root,
            tmp_path / "w0_out.zarr",
            "--chunk-rows",
            7,
            "--shard-size",
            200,
        )
        == 0
    )
    assert zarr.open_array(tmp_path / "w0_out.zarr", mode="r").shape == (20, 0)
    # ... and our own reader opens it (chunks of (7, 0) made it divide by zero)
    ds = dz.open_dataset(tmp_path / "w0_out.zarr")
    assert ds.n_obs == 20 and ds.read_rows(np.array([[3, 17]])).values.shape == (14, 0)


def test_convert_refuses_a_zarr_node_by_name(tmp_path):
    """convert reads paths: a zarr.Array given to the library call was iterated row by row
    as if it were a list of paths (TypeError: ... not ndarray), a store object raised
    "'LocalStore' object is not iterable"."""
    src = synthetic.make_dense_cube(tmp_path / "cube.zarr", n_obs=20, shape=(3,), chunk_obs=8)
    array = zarr.open_array(src, mode="r")
    for source in (array, array.store, [src, array]):
        with pytest.raises(dz.ConfigError, match=r"convert reads files and folders.*is not a path"):
            convert(source, tmp_path / "out.zarr")
    assert not (tmp_path / "out.zarr").exists()
    convert((src,), tmp_path / "out.zarr")  # a tuple of paths is paths
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "out.zarr")[...], array[...])


def test_convert_refuses_a_shard_size_that_is_not_a_number_of_bytes(tmp_path):
    """shard_bytes="1GB" (as --shard-size takes it) raised a bare TypeError ('<' not
    supported between 'str' and 'int'), NaN a ValueError from int() after the checks."""
    src = synthetic.make_dense_cube(tmp_path / "cube.zarr", n_obs=20, shape=(3,), chunk_obs=8)
    for value in ("1GB", -1, float("nan"), float("inf")):
        with pytest.raises(dz.ConfigError, match=r"shard_bytes=.*must be a number of bytes"):
            convert(src, tmp_path / "out.zarr", shard_bytes=value)
    assert not (tmp_path / "out.zarr").exists()
    convert(src, tmp_path / "out.zarr", shard_bytes=1e6)  # a float is a number of bytes
    assert zarr.open_array(tmp_path / "out.zarr").shape == (20, 3)


def test_an_h5ad_compressed_with_a_filter_h5py_lacks_is_named_with_the_fix(tmp_path, capsys):
    """anndata writes .h5ad arrays with hdf5plugin's zstd/blosc filters; without the plugin
    loaded, convert said "reading chunk 0 ... failed (OSError: Can't synchronously read
    data (can't open directory (/usr/local/lib/plugin)...)). It is corrupted or truncated:
    restore it from an intact copy": a sound file called broken, and no word of the fix."""
    import h5py

    write_h5ad(tmp_path / "a.h5ad", n_obs=30, n_features=8)
    with h5py.File(tmp_path / "a.h5ad", "r+") as f:  # X/data under filter 32015 (zstd)
        data = f["X/data"][...]
        del f["X/data"]
        kept = f["X"].create_dataset(
            "data", shape=data.shape, dtype=data.dtype, chunks=data.shape,
            compression=32015, allow_unknown_filter=True,
        )  # fmt: skip
        kept.id.write_direct_chunk((0,), data.tobytes())  # as stored: no filter runs
    assert not h5py.h5z.filter_avail(32015)  # this environment has no hdf5plugin
    assert run("convert", tmp_path / "a.h5ad", tmp_path / "o.zarr") == 2
    err = one_line_error(capsys)
    assert "a.h5ad/X/data: is compressed with HDF5 filter 32015" in err, err
    assert "pip install hdf5plugin" in err and "corrupted" not in err, err
    assert not (tmp_path / "o.zarr").exists()


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_store_with_a_codec_not_installed_is_not_called_no_store(tmp_path, capsys, zarr_format):
    """A Zarr array compressed with zfpy (lossy climate data) where zfpy is not installed
    was "not a Zarr store ... pass the directory that holds zarr.json" (v2), or "corrupted
    or truncated: restore it from an intact copy" (v3, whose codec loads at the first
    decode): a sound store called broken, and no word of the fix."""
    src = tmp_path / "a.zarr"
    zarr.create_array(src, data=np.ones((10, 3), np.float32), zarr_format=zarr_format)
    meta = src / (".zarray" if zarr_format == 2 else "zarr.json")
    doc = json.loads(meta.read_text())
    if zarr_format == 2:
        doc["compressor"] = {"id": "zfpy", "mode": 4}
    else:
        doc["codecs"] = [{"name": "numcodecs.zfpy", "configuration": {"mode": 4}}]
    meta.write_text(json.dumps(doc))
    assert run("convert", src, tmp_path / "o.zarr") == 2
    err = one_line_error(capsys)
    assert re.search(r"a.zarr: codec '(numcodecs\.)?zfpy' is not available in this", err), err
    assert "zfpy" in err and "not a Zarr store" not in err and "corrupted" not in err, err


def test_lz4_chunks_larger_than_lz4_encodes_are_refused_before_reading(tmp_path, capsys):
    """Wide rows (a (time, 1024, 2048) float32 field: 8 MiB a row) make the default 256-row
    chunk 2 GiB, more than lz4 encodes: --codec lz4 read a chunk of rows, then failed with
    numcodecs' traceback "ValueError: Codec does not support buffers of > 2113929216
    bytes". Refused up front, with the chunk_rows that fits (before reading a row)."""
    src = tmp_path / "wide.zarr"
    wide = zarr.create_array(src, shape=(300, 1024, 2048), chunks=(1, 1024, 2048), dtype="f4")
    wide[0] = 1.0  # one chunk on disk (a chunk of zeros alone is never encoded)
    assert run("convert", src, tmp_path / "o.zarr", "--codec", "lz4", "--chunk-rows", 256) == 2
    err = one_line_error(capsys)
    assert "a chunk of 256 rows is 2,147,483,648 bytes" in err, err
    assert "chunk_rows=252 or fewer (--chunk-rows)" in err, err
    assert not (tmp_path / "o.zarr").exists() and not Path(f"{tmp_path}/o.zarr.partial").exists()


def test_convert_sizes_default_chunks_of_wide_rows_by_bytes(tmp_path):
    """The default 256 rows per chunk took no account of a row's size: a (time, 37, 721,
    1440) float32 field made 39 GB chunks, read and compressed whole (the OOM killer, with
    no message). Rows over 64 KiB now get chunks of at most 16 MiB decoded (at least one
    row); narrow rows keep 256, and --chunk-rows still decides where given."""
    src = tmp_path / "wide.zarr"
    rng = np.random.default_rng(0)
    values = rng.integers(0, 4, (12, 1024, 1024)).astype("f4")  # 4 MiB a row
    zarr.create_array(src, data=values, chunks=(3, 1024, 1024))
    assert run("convert", src, tmp_path / "o.zarr", "-q") == 0
    out = zarr.open_array(tmp_path / "o.zarr", mode="r")
    assert out.chunks == (4, 1024, 1024), out.chunks
    np.testing.assert_array_equal(out[...], values)
    assert run("convert", src, tmp_path / "o6.zarr", "--chunk-rows", 6, "-q") == 0
    assert zarr.open_array(tmp_path / "o6.zarr", mode="r").chunks == (6, 1024, 1024)
    narrow = tmp_path / "narrow.zarr"
    zarr.create_array(narrow, data=np.ones((600, 30), "f4"), chunks=(100, 30))
    assert run("convert", narrow, tmp_path / "n.zarr", "-q") == 0
    assert zarr.open_array(tmp_path / "n.zarr", mode="r").chunks == (256, 30)


def test_convert_concatenates_inputs(tmp_path):
    a = synthetic.make_single_cell(tmp_path / "a.zarr", n_obs=300, n_features=50, seed=1)
    b = synthetic.make_single_cell(
        tmp_path / "b.zarr", n_obs=200, n_features=50, n_types=5, zarr_format=2, seed=2
    )
    dst = tmp_path / "ab.zarr"
    assert run("convert", a, b, dst, "--chunk-rows", 64, "-q") == 0
    want = sp.vstack([csr_reference(a), csr_reference(b)]).toarray()
    np.testing.assert_array_equal(loader_rows(dst), want)
    back = ad.read_zarr(dst)
    labels = np.concatenate([ad.read_zarr(p).obs["cell_type"].astype(str) for p in (a, b)])
    np.testing.assert_array_equal(back.obs["cell_type"].astype(str), labels)
    np.testing.assert_array_equal(back.obs["original_index"], np.arange(500))
    assert list(back.obs["original_source"].value_counts(sort=False)) == [300, 200]
    # categories merged: codes from the two stores mean the same label in dz
    ds = dz.open_dataset(dst)
    names = np.array(ds.categories("cell_type"))
    np.testing.assert_array_equal(names[ds.obs_column("cell_type").values], labels)

    c1 = synthetic.make_dense_cube(tmp_path / "c1.zarr", n_obs=50, shape=(4,), seed=1)
    c2 = synthetic.make_dense_cube(tmp_path / "c2.zarr", n_obs=70, shape=(4,), seed=2)
    assert run("convert", c1, c2, tmp_path / "c.zarr", "-q") == 0
    want = np.concatenate([zarr.open_array(p)[...] for p in (c1, c2)])
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "c.zarr")[...], want)


def test_shuffle_is_a_recorded_permutation(tmp_path, h5ad_file):
    src, adata = h5ad_file
    dst = tmp_path / "shuffled.zarr"
    argv = ["convert", src, dst, "--shuffle", "--seed", 7, "--chunk-rows", 25]
    assert run(*argv, "--block-rows", 100, "-q") == 0
    back = ad.read_zarr(dst)
    perm = back.obs["original_index"].to_numpy()
    assert sorted(perm) == list(range(700)) and not np.array_equal(perm, np.arange(700))
    info = zarr.open_group(dst, mode="r").attrs["dali_zarr"]
    settings = {k: info["shuffle"][k] for k in ("seed", "piece_rows", "window_pieces")}
    assert settings == {"seed": 7, "piece_rows": 25, "window_pieces": 4}
    assert info["shuffle"]["numpy"] == np.__version__ and len(info["shuffle"]["digest"]) == 16
    np.testing.assert_array_equal(perm, output_permutation(700, **info["shuffle"]))
    np.testing.assert_array_equal(perm, output_permutation(700, **settings))
    # an order recomputed otherwise (a NumPy whose permutation stream changed) is refused
    other = {**info["shuffle"], "digest": "0" * 16, "numpy": "1.0"}
    with pytest.raises(dz.DatasetError, match=r"NumPy 1\.0 then, .* now: its permutation"):
        output_permutation(700, **other)
    # ... and under the same NumPy, keywords that are not the store's (another seed) are
    # named as such: the advice to use the NumPy that wrote the store could not help
    with pytest.raises(dz.DatasetError, match=r"the same NumPy: the keywords differ"):
        output_permutation(700, **{**info["shuffle"], "seed": 8})
    np.testing.assert_array_equal(back.X.toarray(), adata.X.toarray()[perm])
    np.testing.assert_array_equal(loader_rows(dst), adata.X.toarray()[perm])
    assert_same_obs(back.obs, adata.obs.iloc[perm])
    # the two levels: rows of one 25-row input piece land in one 100-row output block
    pieces = perm // 25
    for block in range(7):
        assert len(set(pieces[block * 100 : (block + 1) * 100])) <= 4
    # another seed, another order; a plain array records its permutation in its attributes
    src2 = synthetic.make_dense_cube(tmp_path / "cube.zarr", n_obs=210, shape=(3,), chunk_obs=8)
    result = convert(src2, tmp_path / "s.zarr", shuffle=True, seed=1, chunk_rows=10, block_rows=30)
    out = zarr.open_array(tmp_path / "s.zarr", mode="r")
    perm2 = output_permutation(210, **out.attrs["dali_zarr"]["shuffle"])
    assert result.shuffle == out.attrs["dali_zarr"]["shuffle"]
    np.testing.assert_array_equal(out[...], zarr.open_array(src2)[...][perm2])


def test_convert_streams_in_bounded_blocks(tmp_path):
    # 16 MB of float32 in, 64-row blocks (256 KB) and 512 KB shards: the converter never
    # holds more than a few blocks + one shard, far from the input's size.
    src = synthetic.make_dense_cube(
        tmp_path / "big.zarr", n_obs=4096, shape=(1024,), chunk_obs=64, codec="none"
    )
    tracemalloc.start()
    try:
        result = convert(
            src, tmp_path / "out.zarr", chunk_rows=64, shard_bytes=2**19, block_rows=64
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.n_blocks == 4096 // 64
    assert result.shard_chunks == 2
    assert peak < 4 * 2**20, f"peak {peak / 2**20:.1f} MiB for a 16 MiB input"
    out = zarr.open_array(tmp_path / "out.zarr", mode="r")
    np.testing.assert_array_equal(out[...], zarr.open_array(src)[...])


def test_interrupted_convert_leaves_no_store_and_reruns(tmp_path, sc_store, monkeypatch, capsys):
    dst = tmp_path / "out.zarr"
    calls = []

    def stop(done: int, total: int) -> None:
        calls.append(done)
        if len(calls) == 3:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        convert(sc_store, dst, block_rows=500, progress=stop)
    assert not dst.exists() and not Path(f"{dst}.partial").exists()

    # Ctrl-C in the middle of the CLI: exit 130, nothing at DST
    original = _Appender.append
    count = {"n": 0}

    def interrupt(self, values):
        count["n"] += 1
        if count["n"] == 3:
            raise KeyboardInterrupt
        return original(self, values)

    monkeypatch.setattr(_Appender, "append", interrupt)
    assert run("convert", sc_store, dst, "--block-rows", 300, "-q") == 130
    assert "interrupted" in capsys.readouterr().err
    assert not dst.exists() and not Path(f"{dst}.partial").exists()
    monkeypatch.undo()
    assert run("convert", sc_store, dst, "-q") == 0
    np.testing.assert_array_equal(csr_reference(dst).toarray(), csr_reference(sc_store).toarray())


def test_a_full_disk_names_the_destination_and_what_was_written(
    tmp_path, sc_store, monkeypatch, capsys
):
    """The OS says only "No space left on device"; the user hears which destination, how far
    the output got, and that nothing half-written is left."""
    dst = tmp_path / "out.zarr"
    original = _Appender.append
    count = {"n": 0}

    def fill_the_disk(self, values):
        count["n"] += 1
        if count["n"] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(self, values)

    monkeypatch.setattr(_Appender, "append", fill_the_disk)
    assert run("convert", sc_store, dst, "--block-rows", 300, "-q") == 2
    err = capsys.readouterr().err
    assert f"{dst}: the file system (or your quota) under {tmp_path} ran out of space" in err
    assert "MB of the output were written (the inputs take" in err
    assert "The partial output was removed" in err
    assert not dst.exists() and not Path(f"{dst}.partial").exists()


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A 128 KiB tmpfs (less than a convert of sc_store writes), where this machine lets us
    mount one (root in the CI container)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_convert_onto_a_really_full_file_system_says_so(tiny_filesystem, sc_store, capsys):
    dst = tiny_filesystem / "out.zarr"
    assert run("convert", sc_store, dst, "-q") == 2
    err = capsys.readouterr().err
    assert f"{dst}: the file system (or your quota) under {tiny_filesystem} ran out" in err
    assert "MB are free there now" in err
    assert os.listdir(tiny_filesystem) == []


def test_ctrl_c_while_zarr_writes_leaves_a_partial_the_rerun_removes(tmp_path):
    """Ctrl-C while zarr's event loop still had chunk writes in flight: the partial was
    removed under them, the late writes made a ``DST.partial`` without our marker, and the
    rerun refused it ("not left by an interrupted dali-zarr writer"). The writes are now
    waited for, so nothing is left (or, where they cannot be, the marker stays)."""
    src = tmp_path / "in.zarr"
    arr = zarr.create_array(src, shape=(6000, 50), chunks=(500, 50), dtype="float32")
    arr[...] = np.arange(6000 * 50, dtype=np.float32).reshape(6000, 50)
    dst = tmp_path / "out.zarr"
    code = textwrap.dedent(
        f"""
        import os, signal, sys, threading, time
        from dali_zarr.cli import main

        def interrupt_once_writing():  # 1-row chunks: a block is 100 writes at once
            chunks = {str(dst)!r} + ".partial/c"
            while not (os.path.isdir(chunks) and len(os.listdir(chunks)) > 300):
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt_once_writing, daemon=True).start()
        sys.exit(main(["convert", {str(src)!r}, {str(dst)!r}, "--chunk-rows", "1",
                       "--block-rows", "100", "--shard-size", "0", "-q"]))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                          capture_output=True, timeout=300)  # fmt: skip
    assert proc.returncode == 130, proc.stderr.decode()[-2000:]
    assert "Task was destroyed" not in proc.stderr.decode()  # no writes cut off
    partial = Path(f"{dst}.partial")
    assert not partial.exists() or (partial / ".dali-zarr-partial").exists()
    assert not dst.exists()
    assert run("convert", src, dst, "-q") == 0
    assert not partial.exists()
    np.testing.assert_array_equal(zarr.open_array(dst)[...], arr[...])


def test_killed_convert_is_cleaned_up_by_a_rerun(tmp_path, sc_store):
    dst = tmp_path / "out.zarr"
    code = textwrap.dedent(
        f"""
        import os, signal
        from dali_zarr.convert import convert

        def die(done, total):
            if done > 0:
                os.kill(os.getpid(), signal.SIGKILL)

        convert({str(sc_store)!r}, {str(dst)!r}, block_rows=1000, progress=die)
        """
    )
    cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    partial = Path(f"{dst}.partial")
    assert partial.is_dir() and not dst.exists()  # half-written, and not at DST
    with pytest.raises(dz.DatasetError):  # the partial store is not a valid dataset
        dz.open_dataset(partial)
    assert run("convert", sc_store, dst, "-q") == 0
    assert not partial.exists()
    np.testing.assert_array_equal(csr_reference(dst).toarray(), csr_reference(sc_store).toarray())


def test_overwrite_and_foreign_partial(tmp_path, sc_store, capsys):
    dst = tmp_path / "out.zarr"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    assert run("convert", sc_store, dst, "-q") == 2  # says at once --overwrite won't do
    assert "already exists and is a folder that is not a Zarr store" in one_line_error(capsys)
    assert (dst / "keep.txt").exists()
    # --overwrite replaces stores (and empty folders), not a folder of the user's files
    assert run("convert", sc_store, dst, "--overwrite", "-q") == 2
    assert "not a Zarr store" in one_line_error(capsys) and (dst / "keep.txt").exists()
    (tmp_path / "cells.h5ad").write_text("not ours to delete")
    assert run("convert", sc_store, tmp_path / "cells.h5ad", "--overwrite", "-q") == 2
    assert "a file, not a Zarr store" in one_line_error(capsys)
    (tmp_path / "gone.zarr").symlink_to(tmp_path / "unmounted")
    assert run("convert", sc_store, tmp_path / "gone.zarr", "--overwrite", "-q") == 2
    assert "a symbolic link to" in one_line_error(capsys)
    (dst / "keep.txt").unlink()
    assert run("convert", sc_store, dst, "--overwrite", "-q") == 0  # an empty folder
    synthetic.make_dense_cube(dst, n_obs=20)
    assert run("convert", sc_store, dst, "--overwrite", "-q") == 0  # a store
    assert dz.open_dataset(dst).n_obs == 3_001
    (tmp_path / "file").write_text("")
    assert run("convert", sc_store, tmp_path / "file" / "o.zarr", "-q") == 2
    assert "is not a directory" in one_line_error(capsys)
    other = tmp_path / "other.zarr"
    Path(f"{other}.partial").mkdir()
    (Path(f"{other}.partial") / "theirs.txt").write_text("keep me")
    assert run("convert", sc_store, other, "-q") == 2
    assert "not left by an interrupted" in one_line_error(capsys)
    assert (Path(f"{other}.partial") / "theirs.txt").read_text() == "keep me"


def test_convert_summary_and_json(tmp_path, sc_store, capsys):
    assert run("convert", sc_store, tmp_path / "a.zarr", "--shuffle") == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "shuffled: seed 0" in out and "dali-zarr inspect" in out
    assert run("convert", sc_store, tmp_path / "b.zarr", "--json", "--codec", "lz4") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n_obs"] == 3_001 and result["codec"] == "lz4" and result["layout"] == "csr"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--codec", "foo"], "invalid choice: 'foo'"),
        (["--chunk-rows", "0"], "must be at least 1"),
        (["--shard-size", "12XB"], "invalid size '12XB'"),
        (["--seed", "-1"], "must be 0 or more"),
        (["--piece-rows", "10"], "piece_rows=10: pieces are what shuffle puts in random order"),
    ],
)
def test_convert_bad_options(tmp_path, sc_store, capsys, argv, message):
    assert run("convert", sc_store, tmp_path / "out.zarr", *argv) == 2
    assert message in one_line_error(capsys)
    assert not (tmp_path / "out.zarr").exists()


def test_convert_bad_inputs(tmp_path, sc_store, capsys):
    assert run("convert", tmp_path / "missing.zarr", tmp_path / "o.zarr") == 2
    assert "no such file or directory" in one_line_error(capsys)
    (tmp_path / "notes.txt").write_text("hello")
    assert run("convert", tmp_path / "notes.txt", tmp_path / "o.zarr") == 2
    assert "not an HDF5" in one_line_error(capsys)
    assert run("convert", sc_store) == 2
    assert "SRC and a DST" in one_line_error(capsys)
    assert run("convert", sc_store, sc_store / "X" / "inside.zarr") == 2
    assert "inside the input" in one_line_error(capsys)
    wide = synthetic.make_single_cell(tmp_path / "wide.zarr", n_obs=20, n_features=301)
    assert run("convert", sc_store, wide, tmp_path / "o.zarr") == 2
    assert "share the feature axis" in one_line_error(capsys)
    cube = synthetic.make_dense_cube(tmp_path / "cube.zarr", n_obs=20, shape=(300,))
    assert run("convert", sc_store, cube, tmp_path / "o.zarr") == 2
    assert "separately" in one_line_error(capsys)
    csc = tmp_path / "csc.h5ad"
    ad.AnnData(X=sp.random(20, 10, density=0.3, format="csc", dtype=np.float32)).write_h5ad(csc)
    assert run("convert", csc, tmp_path / "o.zarr") == 2
    assert "CSC" in (err := one_line_error(capsys)) and "write_h5ad" in err  # not only write_zarr
    renamed = tmp_path / "renamed.zarr"
    shutil.copytree(sc_store, renamed)
    var = zarr.open_group(renamed)["var"]["_index"]
    var[0] = "not_a_gene"
    assert run("convert", sc_store, renamed, tmp_path / "o.zarr") == 2
    assert "var_names differ" in one_line_error(capsys)
    # a corrupted chunk (zarr's traceback before) and a truncated .h5ad (h5py's words only)
    broken = tmp_path / "broken.zarr"
    shutil.copytree(sc_store, broken)
    (broken / "X" / "data" / "c" / "0").write_bytes(b"\x00not a shard" * 10)
    assert run("convert", broken, tmp_path / "o.zarr") == 2
    err = one_line_error(capsys)
    assert "broken.zarr/X/data: reading chunk " in err and "corrupted or truncated" in err
    whole = tmp_path / "whole.h5ad"
    ad.AnnData(X=np.ones((50, 40), dtype=np.float32)).write_h5ad(whole)
    (tmp_path / "cut.h5ad").write_bytes(whole.read_bytes()[:3000])
    assert run("convert", tmp_path / "cut.h5ad", tmp_path / "o.zarr") == 2
    assert "cut.h5ad: the HDF5 file cannot be opened" in one_line_error(capsys)
    # an N-D obsm entry is valid AnnData, but not as the X of the AnnData store convert writes
    with_cube = ad.AnnData(X=np.zeros((20, 3), dtype=np.float32))
    with_cube.obsm["patches"] = np.zeros((20, 4, 5), dtype=np.float32)
    with_cube.write_zarr(tmp_path / "patches.zarr")
    args = (tmp_path / "patches.zarr", tmp_path / "o.zarr", "--element", "obsm/patches")
    assert run("convert", *args) == 2
    assert "must be 2-D" in (err := one_line_error(capsys)) and "open_dataset" in err
    assert not (tmp_path / "o.zarr").exists()


def test_parse_size():
    assert parse_size("1GB") == 10**9
    assert parse_size("256MiB") == 2**28
    assert parse_size("1.5kb") == 1500
    assert parse_size("4096") == 4096
    assert parse_size("none") == parse_size("0") == parse_size("0MB") == 0
    with pytest.raises(ValueError, match="invalid size"):
        parse_size("lots")
    with pytest.raises(ValueError, match="under 1 byte"):  # was read as 0: not sharded
        parse_size("0.5")
    for huge in ("1e400", "1e308GB", "1e19"):  # 1e400 raised OverflowError (a traceback)
        with pytest.raises(ValueError, match="more than 2"):
            parse_size(huge)


# ---------------------------------------------------------------------------- inspect


def inspect_json(path: Path, capsys, *options: str) -> dict:
    assert run("inspect", *options, path, "--json") == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_v3_sharded_zstd(sc_store, capsys):
    report = inspect_json(sc_store, capsys)
    assert (report["kind"], report["layout"], report["n_obs"]) == ("anndata", "csr", 3_001)
    data = {a["name"]: a for a in report["arrays"]}
    assert data["X/data"]["path"] == "gpu-decode" and data["X/data"]["shards"] == [65_536]
    assert data["X/data"]["chunks"] == [2_048] and data["X/data"]["zarr_format"] == 3
    assert data["X/indptr"]["path"] == "read whole at open"
    rows_per_chunk = data["X/data"]["rows_per_chunk"]
    assert rows_per_chunk == pytest.approx(2_048 * 3_001 / report["nnz"])
    s = report["suggestion"]
    # CSR rows straddle store chunks: a loader chunk spans >= 4 of them (reads <= ~1.25x)
    assert s["chunk_size"] % round(rows_per_chunk) == 0 and s["chunk_size"] >= 32
    assert s["chunk_size"] >= 4 * round(rows_per_chunk)
    assert s["read_amplification"] == pytest.approx(1 + round(rows_per_chunk) / s["chunk_size"])
    assert s["preload_nchunks"] * s["chunk_size"] >= 4 * 256
    assert [o["name"] for o in report["obs"]] == ["cell_type"]
    assert run("inspect", sc_store) == 0
    text = capsys.readouterr().out
    assert "gpu-decode" in text and "suggested: chunk_size=" in text and "rule:" in text


@pytest.mark.parametrize(
    ("chunk_elements", "codec"),
    [(262_144, "zstd"), (262_144, "blosc"), (262_144, "none"), (65_536, "zstd")],
)
def test_inspect_advises_smaller_csr_chunks_for_the_gpu(tmp_path, capsys, chunk_elements, codec):
    """A CSR store whose data the GPU path decodes in chunks over twice convert's default
    gets the measured reason and the command that rewrites it; others get nothing."""
    from dali_zarr import synthetic

    path = synthetic.make_single_cell(
        tmp_path / "c.zarr", n_obs=2_000, n_features=2_000, density=0.1, codec=codec,
        chunk_elements=chunk_elements, shard_chunks=None,
    )  # fmt: skip
    report = inspect_json(path, capsys)
    assert run("inspect", path) == 0
    text = capsys.readouterr().out
    if chunk_elements > 131_072 and codec == "zstd":
        assert report["gpu_note"].startswith("X/data is stored in chunks of 262,144 elements")
        assert "note: X/data is stored in chunks of 262,144" in text
        command = f"dali-zarr convert {path} {tmp_path / 'c_rechunked.zarr'}"
        assert report["gpu_rewrite"] == command and f"\n    {command}\n" in text
    elif codec == "blosc":  # decoded on the CPU whatever the device: that note instead
        assert report["gpu_note"].startswith('with device="gpu", X/data and X/indices are')
        assert report["gpu_rewrite"] == f"dali-zarr convert {path} {tmp_path / 'c_zstd.zarr'}"
    else:  # small chunks, or not decoded at all
        assert report["gpu_note"] == report["gpu_rewrite"] == "" and "note: X/data" not in text


@pytest.mark.parametrize("store", ["anndata default", "gzip array of a group"])
def test_inspect_names_what_the_gpu_path_decodes_on_the_cpu_and_its_rewrite_works(
    tmp_path, capsys, store
):
    """anndata writes X with blosc by default, which nvCOMP cannot decode: on the GPU path
    every window of such a store is decoded on the host and copied, and inspect only said
    "decoded on the CPU". It now says so for the GPU and prints the convert command
    (with the element the user chose); the store that command writes draws no note."""
    if store == "anndata default":
        x = sp.random(600, 300, density=0.1, format="csr", dtype=np.float32, random_state=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # anndata's note on zarr v2 as its default
            ad.AnnData(X=x).write_zarr(tmp_path / "cells.zarr")
        path, element = tmp_path / "cells.zarr", None
        names, why = "X/data and X/indices are", "codecs blosc"
    else:
        root = zarr.open_group(tmp_path / "cube.zarr", mode="w")
        root.create_array(
            "t2m", shape=(50, 8, 8), chunks=(5, 8, 8), dtype="float32",
            compressors=zarr.codecs.GzipCodec(),
        )[...] = np.arange(50 * 64, dtype=np.float32).reshape(50, 8, 8)  # fmt: skip
        path, element = tmp_path / "cube.zarr", "t2m"
        names, why = "t2m is", "codecs gzip"
    chosen = ["--element", element] if element else []
    report = inspect_json(path, capsys, *chosen)
    note = report["gpu_note"]
    assert note.startswith(f'with device="gpu", {names} decoded on the CPU ({why})'), note
    out = tmp_path / f"{path.stem}_zstd.zarr"
    assert report["gpu_rewrite"] == shlex.join(
        ["dali-zarr", "convert", *chosen, str(path), str(out)]
    )
    assert run(*shlex.split(report["gpu_rewrite"])[1:]) == 0
    capsys.readouterr()
    again = inspect_json(out, capsys)
    assert {a["path"] for a in again["arrays"]} <= {"gpu-decode", "read whole at open"}
    assert again["gpu_note"] == again["gpu_rewrite"] == ""


def test_inspect_of_rows_too_wide_for_a_window_of_a_batch_says_so_once(tmp_path, capsys):
    """Rows so wide that 1 GiB holds no batch: the suggested line said "a window is 0 rows,
    ~0.0 MiB decoded" beside the warning that the window of 256 rows holds no batch."""
    path = tmp_path / "frames.zarr"
    zarr.create_array(path, shape=(400, 1024, 1024), dtype="float32", chunks=(1, 1024, 1024))
    assert run("inspect", path, "--batch-size", 5000) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "suggested:" in x]
    assert line.endswith("(batch_size=5000: a window of 256 rows holds no batch: see the warning)")


def test_inspect_v2_blosc_and_fallback(tmp_path, capsys):
    v2 = synthetic.make_single_cell(tmp_path / "v2.zarr", n_obs=400, n_features=60, zarr_format=2)
    report = inspect_json(v2, capsys)
    assert {a["name"]: a["path"] for a in report["arrays"]}["X/data"] == "gpu-decode"
    assert report["arrays"][0]["zarr_format"] == 2 and report["arrays"][0]["shards"] is None

    blosc = synthetic.make_single_cell(tmp_path / "b.zarr", n_obs=400, n_features=60, codec="blosc")
    report = inspect_json(blosc, capsys)
    data = report["arrays"][0]
    assert data["path"] == "cpu-decode" and "blosc" in data["why"]
    assert any(c.startswith("blosc") for c in data["codecs"])

    from zarr.codecs import Crc32cCodec, TransposeCodec, ZstdCodec

    # zstd with a per-chunk crc32c: decoded on the CPU (README's cpu-decode list says so)
    crc = zarr.create_array(
        tmp_path / "c.zarr", shape=(100, 8), chunks=(10, 8), dtype="f4",
        compressors=[ZstdCodec(), Crc32cCodec()],
    )  # fmt: skip
    crc[...] = 1
    data = inspect_json(tmp_path / "c.zarr", capsys)["arrays"][0]
    assert data["path"] == "cpu-decode" and "crc32c" in data["why"]

    arr = zarr.create_array(
        tmp_path / "t.zarr", shape=(100, 8), chunks=(10, 8), dtype="f4",
        filters=[TransposeCodec(order=(1, 0))],
    )  # fmt: skip
    arr[...] = np.arange(800, dtype="f4").reshape(100, 8)
    report = inspect_json(tmp_path / "t.zarr", capsys)
    assert report["kind"] == "array" and report["arrays"][0]["path"] == "zarr-fallback"
    assert "transpose" in report["arrays"][0]["why"]
    assert report["suggestion"]["chunk_size"] == 40  # smallest multiple of 10 rows >= 32
    assert report["suggestion"]["read_amplification"] == 1.0  # dense: whole store chunks
    assert run("inspect", tmp_path / "t.zarr") == 0  # 100 rows: a window of 256 holds them
    assert "a window is 256 rows, ~0.0 MiB decoded; the store's 100 fit in one)" in (
        capsys.readouterr().out
    )


def test_inspect_converted_store(tmp_path, sc_store, capsys):
    dst = tmp_path / "c.zarr"
    assert run("convert", sc_store, dst, "--chunk-rows", 128, "--codec", "lz4", "-q") == 0
    report = inspect_json(dst, capsys)
    assert report["converted"]["chunk_rows"] == 128
    data = report["arrays"][0]
    assert data["path"] == "gpu-decode" and data["rows_per_chunk"] == pytest.approx(128, rel=0.01)
    assert report["suggestion"]["chunk_size"] == 4 * 128  # CSR: >= 4 store chunks
    assert [o["name"] for o in report["obs"]] == ["cell_type", "original_index"]


def test_inspect_errors(tmp_path, h5ad_file, capsys):
    assert run("inspect", tmp_path / "nothing") == 2
    assert "no such file" in one_line_error(capsys)
    assert run("inspect", h5ad_file[0]) == 2
    assert "dali-zarr convert" in one_line_error(capsys)
    group = zarr.open_group(tmp_path / "g.zarr", mode="w")
    group.create_array("a", shape=(4,), dtype="f4")
    assert run("inspect", tmp_path / "g.zarr") == 2
    assert "neither an AnnData store" in one_line_error(capsys)


def test_printed_commands_run_as_printed_for_paths_with_spaces(tmp_path, capsys):
    """convert's "next: dali-zarr inspect DST" and inspect's advice to convert a file printed
    paths unquoted: pasted into a shell, a path with a space became two arguments."""
    folder = tmp_path / "my data"
    folder.mkdir()
    cube = synthetic.make_dense_cube(folder / "a cube.zarr", n_obs=40, shape=(2,))
    assert run("convert", cube, folder / "out put.zarr") == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "next:" in x]
    command = line.split("next: ", 1)[1].replace("dali-zarr", f"{sys.executable} -m dali_zarr.cli")
    done = subprocess.run(
        ["bash", "-c", command], env=child_env(), cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0 and "40 observations" in done.stdout, done.stderr
    h5ad = folder / "my cells.h5ad"
    h5ad.write_bytes(b"")
    assert run("inspect", h5ad) == 2
    advice = one_line_error(capsys).split("convert it first: ", 1)[1]
    assert shlex.split(advice) == ["dali-zarr", "convert", str(h5ad), str(folder / "my cells.zarr")]


def test_inspect_reports_broken_obs_columns_instead_of_failing(tmp_path, capsys):
    """A categorical column without categories failed inspect with zarr's bare KeyError, and
    one whose metadata zarr cannot parse with a JSONDecodeError (exit 1), though the loader
    opens such stores and refuses only those columns; inspect's "batchable" now agrees with
    the loader column by column."""
    path = synthetic.make_single_cell(tmp_path / "s.zarr", n_obs=40, n_features=8, n_types=2)
    obs = zarr.open_group(path, mode="r+")["obs"]
    for name in ("no_categories", "float_codes", "broken_codes", "broken_column"):
        column = obs.create_group(name)
        column.attrs.update({"encoding-type": "categorical", "encoding-version": "0.2.0"})
        codes = np.zeros(40, dtype=np.float32 if name == "float_codes" else np.int8)
        column.create_array("codes", data=codes)
        if name != "no_categories":
            column.create_array("categories", data=np.array(["a"]))
    obs.create_array("two_d", data=np.zeros((40, 2), dtype=np.float32)).attrs.update(
        {"encoding-type": "array", "encoding-version": "0.2.0"}
    )
    (Path(path) / "obs" / "broken_codes" / "codes" / "zarr.json").write_text("{")
    (Path(path) / "obs" / "broken_column" / "zarr.json").write_text("{")
    obs.attrs["column-order"] = [*obs.attrs["column-order"], "no_categories", "float_codes",
                                 "broken_codes", "broken_column"]  # fmt: skip
    report = inspect_json(Path(path), capsys)
    batchable = {o["name"]: o["batchable"] for o in report["obs"]}
    assert batchable == {"cell_type": True, "no_categories": False, "float_codes": False,
                         "broken_codes": False, "broken_column": False,
                         "two_d": False}  # fmt: skip
    ds = dz.open_dataset(path)
    for name, ok in batchable.items():
        if ok:
            assert len(ds.obs_column(name).values) == 40
        else:
            with pytest.raises(dz.DatasetError):
                ds.obs_column(name)
    assert run("inspect", path) == 0
    assert "broken_column (unreadable metadata, not batchable)" in capsys.readouterr().out


def test_an_element_with_unreadable_metadata_is_named_not_raised_raw(tmp_path, capsys):
    """An obsm entry whose zarr.json zarr cannot parse made inspect, and every error that
    lists a store's elements, fail with a bare JSONDecodeError (zarr lists a group by parsing
    its members); element= naming it, or a broken X, did too."""
    path = synthetic.make_single_cell(tmp_path / "s.zarr", n_obs=40, n_features=8, n_types=2)
    root = zarr.open_group(path, mode="r+")
    root["layers"].create_array("counts", data=np.zeros((40, 8), dtype=np.float32))
    root["obsm"].create_array("pca", data=np.zeros((40, 3), dtype=np.float32))
    (Path(path) / "obsm" / "pca" / "zarr.json").write_text("{")
    report = inspect_json(Path(path), capsys)
    assert report["elements"] == ["X", "layers/counts"]
    with pytest.raises(dz.DatasetError, match="one of: X, layers/counts"):
        dz.open_dataset(path, element="layers/nope")
    assert run("inspect", path, "--element", "obsm/pca") == 2
    assert "s.zarr/obsm/pca: its Zarr metadata cannot be read" in one_line_error(capsys)
    (Path(path) / "X" / "zarr.json").write_text("{")
    assert run("inspect", path) == 2
    assert "s.zarr/X: its Zarr metadata cannot be read" in one_line_error(capsys)


def test_the_window_size_printed_is_at_most_the_stores(tmp_path, capsys):
    """A batch larger than the store gives a window of a batch's rows, but the window reads
    only the store's: inspect printed ~6.1 MiB decoded for a store of 0.03 MiB."""
    cube = synthetic.make_dense_cube(tmp_path / "cube.zarr", n_obs=500, shape=(4, 4))
    assert run("inspect", cube, "--batch-size", 100_000, "--json") == 0
    suggestion = json.loads(capsys.readouterr().out)["suggestion"]
    assert suggestion["window_rows"] == 100_000  # the loader's window, in rows
    assert suggestion["window_mib"] == round(500 * 16 * 4 / 2**20, 2)
    big = synthetic.make_dense_cube(tmp_path / "big.zarr", n_obs=5_000, shape=(4, 4))
    assert run("inspect", big, "--batch-size", 256, "--json") == 0
    suggestion = json.loads(capsys.readouterr().out)["suggestion"]
    assert suggestion["window_mib"] == round(suggestion["window_rows"] * 64 / 2**20, 2)


# ---------------------------------------------------------------------------- bench, help


def test_bench_runs_a_few_batches(tmp_path, sc_store, capsys):
    argv = ["bench", sc_store, "--batches", 3, "--batch-size", 128, "--output", "csr", "--json"]
    assert run(*argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["batches"] == 3 and summary["rows"] == 3 * 128
    assert summary["rows_per_s"] > 0 and summary["mb_per_s"] > 0 and summary["batches_per_s"] > 0
    assert summary["chunk_size"] % 102 == 0  # inspect's suggestion: whole store chunks
    assert set(summary["read_paths"].values()) == {"direct"}
    text = bench_summary(summary)
    assert "rows/s" in text and "MB/s" in text and "batches/s" in text and "sparse CSR" in text
    assert "  dataset: sc.zarr/X" in text  # which element was timed
    cube = synthetic.make_dense_cube(tmp_path / "cube.zarr", n_obs=64)
    assert run("bench", cube, "--output", "csr") == 2
    assert "needs a sparse X" in one_line_error(capsys)
    # fewer rows than a batch: the suggested window still holds one (a partial batch)
    assert run("bench", cube, "--batch-size", 100, "--batches", 2, "--json") == 0
    small = json.loads(capsys.readouterr().out)
    assert small["batches"] == 2 and small["rows"] == 2 * 64
    # no warm-up would time the pipeline's build (numba compiles) as if it were reading
    assert run("bench", cube, "--warmup", 0) == 2
    assert "the first batch builds the DALI pipeline" in one_line_error(capsys)
    assert run("bench", cube, "--num-threads", 100_000) == 2  # DALI aborted the process
    assert "num_threads must be a whole number from 1 to 1024" in one_line_error(capsys)


@pytest.mark.parametrize("command", [[], ["convert"], ["inspect"], ["bench"]])
def test_help(command, capsys):
    assert run(*command, "--help") == 0
    assert "usage: dali-zarr" in capsys.readouterr().out


def test_no_command_is_an_error(capsys):
    assert run() == 2
    one_line_error(capsys)


def test_console_script(tmp_path, sc_store):
    script = shutil.which("dali-zarr", path=os.path.dirname(sys.executable))
    cmd = [script] if script else [sys.executable, "-m", "dali_zarr.cli"]
    proc = subprocess.run(
        [*cmd, "inspect", str(sc_store)], env=child_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "X/data" in proc.stdout and "gpu-decode" in proc.stdout
    assert proc.stderr == ""  # no warnings from zarr or anndata on a terminal


def test_a_reader_that_leaves_the_pipe_is_no_error(sc_store):
    """`dali-zarr inspect S | head -3`: the pipe closed early printed "error: [Errno 32]
    Broken pipe"; a reader that leaves is not the user's mistake (exit 1, nothing said)."""
    cmd = [sys.executable, "-m", "dali_zarr.cli", "inspect", str(sc_store)]
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # type: ignore[union-attr]
    err = proc.stderr.read().decode()  # type: ignore[union-attr]
    assert proc.wait(timeout=120) == 1 and err == "", err


def test_suggested_window_is_the_loaders() -> None:
    """inspect reports the window the loader will use: whole batches within the chunks read."""
    from dali_zarr.inspection import suggest

    s = suggest(n_obs=50_000, rows_per_chunk=64, row_bytes=4_000, batch_size=300)
    sampler = dz.ChunkSampler(
        chunk_size=s.chunk_size, preload_nchunks=s.preload_nchunks, batch_size=300
    )
    assert s.window_rows == sampler.window_rows > 0
    assert s.window_rows % 300 == 0 and not s.warning
    # a store (or split) of fewer rows than a batch: still a window of one batch, which the
    # planner serves as one partial batch (the suggestion used to stop at the store's chunks)
    tiny = suggest(n_obs=100, rows_per_chunk=10, row_bytes=4, batch_size=256)
    assert (tiny.chunk_size, tiny.preload_nchunks, tiny.window_rows) == (40, 7, 256)
    assert not tiny.warning
    # an empty store: the loader refuses it, so the suggestion must not read as usable
    assert "no observations" in suggest(n_obs=0, rows_per_chunk=10, row_bytes=4).warning
    huge = suggest(n_obs=1_000, rows_per_chunk=1, row_bytes=2**30, batch_size=64)
    assert huge.window_rows == 0 and "lower batch_size or raise preload_nchunks" in huge.warning
    # a whole store within the 1 GiB cap: the window (at most the store) is too, so the cap
    # must not leave a batch larger than the store without a window (inspect warned, and
    # bench refused, 100 frames of 4 MiB with batches of 512, which the loader serves)
    small = suggest(n_obs=100, rows_per_chunk=1, row_bytes=2**22, batch_size=512)
    assert (small.chunk_size, small.preload_nchunks, small.window_rows) == (32, 16, 512)
    assert not small.warning and small.window_mib == 400


def test_csr_suggestion_spans_several_store_chunks() -> None:
    """A CSR loader chunk decodes the store chunks at both of its ends whole, so it spans
    several of them; dense chunks line up with the store's and need not."""
    from dali_zarr.inspection import CSR_MIN_STORE_CHUNKS, read_amplification, suggest

    store = {"n_obs": 100_000, "rows_per_chunk": 98, "row_bytes": 12_000, "batch_size": 4096}
    dense, csr = suggest(**store), suggest(**store, aligned=False)
    assert dense.chunk_size == 98 and dense.read_amplification == 1.0
    assert csr.chunk_size == CSR_MIN_STORE_CHUNKS * 98 and csr.read_amplification == 1.25
    assert read_amplification(98, 98, aligned=False) == 2.0
    small = suggest(n_obs=100_000, rows_per_chunk=3, row_bytes=4, aligned=False)
    assert small.chunk_size == 33  # the 32-row minimum dominates: 11 store chunks


def test_a_suggested_window_over_the_whole_store_reads_each_chunk_once(tmp_path) -> None:
    """A store of one store chunk (anndata's default for small stores) got chunk_size = the
    store and preload_nchunks=1: a window of the whole batches in it (1,984 of 2,000 rows),
    so the last 16 rows were a second window that read (and decoded) the whole chunk again:
    2x the bytes per epoch where inspect printed ~1.00. The window now holds the store."""
    from dali_zarr.inspection import inspect_store, suggest

    path = tmp_path / "one_chunk.zarr"
    array = zarr.create_array(path, shape=(2_000, 4), chunks=(2_000, 4), dtype="f4")
    array[...] = np.arange(8_000, dtype="f4").reshape(2_000, 4)
    for batch_size in (64, 256, 300):
        s = inspect_store(path, batch_size=batch_size).suggestion
        sampler = dz.ChunkSampler(
            chunk_size=s.chunk_size, preload_nchunks=s.preload_nchunks, batch_size=batch_size
        )
        plan = sampler.plan_epoch(2_000, 0)
        reads = [c for w in range(plan.n_windows) for c in np.unique(plan.window(w).chunk_ids())]
        assert sorted(reads) == sorted(set(reads)), (batch_size, s)  # each chunk in 1 window
        assert s.read_amplification == 1.0 and s.window_rows >= 2_000
        ds = dz.open_dataset(path)
        with dz.Loader(ds, sampler, return_index=True) as loader:
            rows = np.concatenate([b["index"].numpy() for b in loader])
        np.testing.assert_array_equal(np.sort(rows), np.arange(2_000))
    # CSR: a loader chunk of the whole store decodes each store chunk once, not ~2x
    one = suggest(n_obs=1_000, rows_per_chunk=1_000, row_bytes=80, aligned=False)
    assert (one.chunk_size, one.read_amplification) == (1_000, 1.0) and one.window_rows >= 1_000


def test_a_window_over_the_cap_is_warned_of_with_what_to_change(tmp_path, capsys) -> None:
    """README: the window is capped at 1 GiB (for a store larger than that). The cap cannot
    go below one loader chunk, so a store chunked whole along axis 0 (a time series chunked
    by space: 2,000,000 rows of 200 values in chunks of (2,000,000, 1)) got a window of the
    whole 1.5 GiB store, ~1.00 read per byte used, and no warning."""
    from dali_zarr.inspection import suggest

    path = tmp_path / "tall.zarr"  # metadata only: the chunks read as fill values
    zarr.create_array(path, shape=(2_000_000, 200), chunks=(2_000_000, 1), dtype="f4")
    assert run("inspect", path) == 0
    text = capsys.readouterr().out
    assert "warning: a window of chunk_size=2,000,000 rows is 1,526 MiB" in text
    assert "--chunk-rows N, N <= 41,943" in text
    # a chunk_size of the 32-row minimum over the cap: lower it (the store's chunks fit)
    wide = suggest(n_obs=10_000, rows_per_chunk=1, row_bytes=40e6, batch_size=16)
    assert wide.window_rows == 32 and "lower chunk_size (a multiple of" in wide.warning
    # within the cap, or a store no larger than it: no warning
    assert not suggest(n_obs=2_000_000, rows_per_chunk=1_000, row_bytes=800).warning
    assert not suggest(n_obs=1_000, rows_per_chunk=1_000, row_bytes=2**20).warning


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_suggestion_gives_every_rank_a_chunk(world_size: int) -> None:
    """A small store in one store chunk (anndata's default chunking): under DDP the planner
    refuses fewer chunks than ranks, so the suggestion splits it."""
    from dali_zarr.inspection import suggest

    s = suggest(n_obs=2_000, rows_per_chunk=2_000, row_bytes=40, batch_size=64,
                aligned=False, world_size=world_size)  # fmt: skip
    assert s.chunk_size == 2_000 // world_size
    sampler = dz.DistributedSampler(
        dz.ChunkSampler(chunk_size=s.chunk_size, preload_nchunks=s.preload_nchunks,
                        batch_size=64, seed=0),
        dist_info=lambda: (world_size - 1, world_size),
    )  # fmt: skip
    assert sampler.num_batches(2_000) > 0  # the planner accepts it
    sampler.plan_epoch(2_000, 0)


def test_suggested_settings_fill_only_what_is_missing(sc_store, tmp_path) -> None:
    """The demo and ``bench`` take inspect's suggestion for what the user left unset; a given
    chunk_size keeps the suggested window size in rows."""
    from dali_zarr.inspection import inspect_store, suggested_settings

    s = inspect_store(sc_store, batch_size=256).suggestion
    assert suggested_settings(sc_store, batch_size=256) == (s.chunk_size, s.preload_nchunks)
    half = s.chunk_size // 2
    assert suggested_settings(sc_store, batch_size=256, chunk_size=half) == (
        half,
        math.ceil(s.preload_nchunks * s.chunk_size / half),
    )
    assert suggested_settings(sc_store, batch_size=256, preload_nchunks=3) == (s.chunk_size, 3)
    nowhere = tmp_path / "no-store"  # both given: the store is not even opened
    assert suggested_settings(nowhere, batch_size=256, chunk_size=7, preload_nchunks=2) == (7, 2)
    opened = dz.open_dataset(sc_store)  # an opened dataset gets the same as its path
    assert suggested_settings(opened, batch_size=256) == (s.chunk_size, s.preload_nchunks)
    # zeros (a training script's --chunk-size 0) were divisions by zero
    for bad in ({"batch_size": 0}, {"batch_size": 8, "chunk_size": 0}):
        with pytest.raises(dz.ConfigError, match="must be a positive integer, got 0"):
            suggested_settings(sc_store, **bad)


def test_suggestion_for_collections_and_subsets(tmp_path, sc_store) -> None:
    """Collections and subsets (what ZarrDataModule and ``bench`` of several paths load) get
    the rule from their stores' chunking: the coarsest store sets the unit, and a loader chunk
    that may start inside a store chunk spans several of them."""
    from dali_zarr.inspection import dataset_suggestion, inspect_store

    single = inspect_store(sc_store, batch_size=256).suggestion
    pair = dataset_suggestion(dz.open_dataset([sc_store, sc_store]), batch_size=256)
    assert pair.rows_per_store_chunk == single.rows_per_store_chunk
    assert pair.chunk_size == single.chunk_size

    def cube(name: str, n_obs: int, chunk_obs: int) -> Path:
        return synthetic.make_dense_cube(tmp_path / name, n_obs=n_obs, chunk_obs=chunk_obs)

    on_grid = dz.open_dataset([cube("a.zarr", 400, 10), cube("b.zarr", 300, 20)])
    s = dataset_suggestion(on_grid, batch_size=64)
    assert (s.rows_per_store_chunk, s.chunk_size, s.read_amplification) == (20, 40, 1.0)
    # a 305-row store shifts every loader chunk after it off the 20-row grid
    off_grid = dz.open_dataset([cube("c.zarr", 305, 20), cube("d.zarr", 300, 20)])
    s = dataset_suggestion(off_grid, batch_size=64)
    assert s.chunk_size == 4 * 20 and s.read_amplification == 1.25
    # 30-row loader chunks would cut the 20-row store's chunks: not aligned either
    mixed = dz.open_dataset([cube("f.zarr", 300, 30), cube("g.zarr", 300, 20)])
    s = dataset_suggestion(mixed, batch_size=64)
    assert s.rows_per_store_chunk == 30 and s.chunk_size == 4 * 30 and s.read_amplification == 1.25

    whole = dz.open_dataset(cube("e.zarr", 1_000, 40))
    assert dataset_suggestion(dz.Subset(whole, np.arange(1_000))).chunk_size == 40
    quarter = dataset_suggestion(dz.Subset(whole, np.arange(0, 1_000, 4)), batch_size=64)
    assert quarter.rows_per_store_chunk == 10  # a store chunk holds 10 of the subset's rows
    assert quarter.chunk_size == 40 and quarter.read_amplification == 1.25


def test_concatenated_obs_keeps_nullable_and_ordered_columns(tmp_path, capsys):
    """Several inputs: nullable integers and booleans stay nullable (they became float64
    and the text '<NA>'), one order of an ordered categorical is kept; categories of
    different types are refused in one line."""
    import anndata as ad
    import pandas as pd

    def write(name, n, obs):
        x = sp.random(n, 5, density=0.4, format="csr", dtype=np.float32, random_state=n)
        index = [f"{name}{i}" for i in range(n)]
        adata = ad.AnnData(
            x, obs=pd.DataFrame(obs, index=index), var=pd.DataFrame(index=list("abcde"))
        )
        adata.write_h5ad(tmp_path / f"{name}.h5ad")
        return adata

    ordered = pd.CategoricalDtype(["lo", "hi"], ordered=True)
    a = write("a", 3, {"n": pd.array([2**62 + 1, None, 5], dtype="Int64"),
                       "b": pd.array([True, None, False], dtype="boolean"),
                       "o": pd.Categorical(["lo", "hi", "lo"], dtype=ordered)})  # fmt: skip
    b = write("b", 2, {"n": pd.array([1, 2], dtype="Int64"),
                       "b": pd.array([True, True], dtype="boolean"),
                       "o": pd.Categorical(["hi", "lo"], dtype=ordered)})  # fmt: skip
    assert run("convert", tmp_path / "a.h5ad", tmp_path / "b.h5ad", tmp_path / "ab.zarr", "-q") == 0
    got, want = ad.read_zarr(tmp_path / "ab.zarr").obs, ad.concat([a, b]).obs
    for column in ("n", "b", "o"):
        assert got[column].dtype == want[column].dtype, column
        pd.testing.assert_series_equal(got[column], want[column], check_index=False)
    a.obs = pd.DataFrame({"batch": pd.Categorical([1, 1, 2])}, index=a.obs_names)
    b.obs = pd.DataFrame({"batch": pd.Categorical(["x", "y"])}, index=b.obs_names)
    a.write_h5ad(tmp_path / "a2.h5ad")
    b.write_h5ad(tmp_path / "b2.h5ad")
    assert run("convert", tmp_path / "a2.h5ad", tmp_path / "b2.h5ad", tmp_path / "x.zarr") == 2
    assert "obs column 'batch': its categories have different types" in one_line_error(capsys)


def test_concatenated_obs_text_beside_categories_keeps_missing_values(tmp_path, capsys):
    """anndata writes a text column as categorical where values repeat and as text where
    they do not: merged as categories, a missing value stays missing (it was the text
    'nan'), an input without rows takes no part; types no column keeps (booleans beside
    integers became the text '1') are refused in one line, nothing written."""

    def write(name, column):
        n = len(column)
        x = sp.random(n, 4, density=0.5, format="csr", dtype=np.float32, random_state=n)
        obs = pd.DataFrame({"c": column}, index=[f"{name}{i}" for i in range(n)])
        ad.AnnData(x, obs=obs, var=pd.DataFrame(index=list("abcd"))).write_h5ad(
            tmp_path / f"{name}.h5ad"
        )

    write("a", pd.Categorical(["x", None, "x", "y"]))
    write("z", [])  # no rows: anndata reads its column back as float64
    write("b", ["u", "v", "w"])
    paths = [tmp_path / f"{name}.h5ad" for name in "azb"]
    assert run("convert", *paths, tmp_path / "ab.zarr", "-q") == 0
    got = ad.read_zarr(tmp_path / "ab.zarr").obs["c"]
    assert got.isna().tolist() == [False, True, False, False, False, False, False]
    assert isinstance(got.dtype, pd.CategoricalDtype)
    assert got.astype(object).where(got.notna(), None).tolist() == [
        "x", None, "x", "y", "u", "v", "w"
    ]  # fmt: skip
    write("t", np.array([True, False]))
    write("i", np.array([1, 2, 3]))
    assert run("convert", tmp_path / "t.h5ad", tmp_path / "i.h5ad", tmp_path / "ti.zarr") == 2
    err = one_line_error(capsys)
    assert "obs column 'c'" in err and "t.h5ad (bool)" in err and "i.h5ad (int64)" in err
    assert not (tmp_path / "ti.zarr").exists()


def test_inputs_without_a_dtype_that_keeps_them_exact_are_refused(tmp_path, capsys):
    """uint64 beside int64 promotes to float64, which rounds 2**63 + 1: refused."""
    for name, values in {"u": np.array([2**63 + 1, 2**64 - 1], np.uint64),
                         "i": np.array([2**62 + 1, -3], np.int64)}.items():  # fmt: skip
        zarr.create_array(tmp_path / f"{name}.zarr", data=values.reshape(2, 1), chunks=(1, 1))
    assert run("convert", tmp_path / "u.zarr", tmp_path / "i.zarr", tmp_path / "ui.zarr") == 2
    err = one_line_error(capsys)
    assert "u.zarr (uint64)" in err and "would become float64" in err
    assert not (tmp_path / "ui.zarr").exists()


def test_convert_refuses_an_array_rewritten_after_consolidation(tmp_path, capsys):
    """X/data rewritten in place as float32 (normalised counts) without consolidating the
    store again: zarr.open reads the consolidated int32 metadata, and convert wrote the
    float bytes as garbage integers where open_dataset refuses the store: refused alike,
    and so is an obs column rewritten so (the loader refuses it when it reads it)."""
    x = sp.random(50, 10, density=0.4, format="csr", dtype=np.float32, random_state=0)
    x.data[:] = np.arange(1, x.nnz + 1)
    ad.AnnData(x.astype(np.int32)).write_zarr(tmp_path / "a.zarr")
    group = zarr.open_group(tmp_path / "a.zarr", mode="a", use_consolidated=False)
    old = group["X/data"]
    new = group.create_array(
        "X/data", shape=old.shape, chunks=old.chunks, dtype="float32", overwrite=True,
        compressors=old.compressors,
    )  # fmt: skip
    new[...] = x.data / 7
    assert run("convert", tmp_path / "a.zarr", tmp_path / "o.zarr", "-q") == 2
    err = one_line_error(capsys)
    assert "a.zarr/X/data: the store's consolidated metadata" in err and "dtype" in err
    assert not (tmp_path / "o.zarr").exists()
    # an obs column likewise (anndata read its float32 scores as int32 garbage)
    obs = pd.DataFrame({"score": np.arange(50, dtype=np.int32)}, index=[f"c{i}" for i in range(50)])
    ad.AnnData(x, obs=obs).write_zarr(tmp_path / "b.zarr")
    group = zarr.open_group(tmp_path / "b.zarr", mode="a", use_consolidated=False)
    old = group["obs/score"]
    group.create_array(
        "obs/score", shape=old.shape, chunks=old.chunks, dtype="float32", overwrite=True,
        compressors=old.compressors,
    )[...] = np.linspace(0, 1, 50)  # fmt: skip
    assert run("convert", tmp_path / "b.zarr", tmp_path / "o.zarr", "-q") == 2
    assert "b.zarr/obs/score: the store's consolidated metadata" in one_line_error(capsys)
    assert not (tmp_path / "o.zarr").exists()


def test_convert_refuses_a_float_indptr(tmp_path, capsys):
    """Row offsets of a float dtype were cast to int64, truncating 2.5 to 2 (rows shifted
    silently) where open_dataset refuses them: refused alike."""
    x = sp.random(6, 4, density=0.5, format="csr", dtype=np.float32, random_state=0)
    ad.AnnData(x).write_zarr(tmp_path / "a.zarr")
    indptr = x.indptr.astype(np.float64)
    indptr[2] += 0.5
    group = zarr.open_group(tmp_path / "a.zarr", mode="a", use_consolidated=False)
    group.create_array("X/indptr", data=indptr, overwrite=True)
    zarr.consolidate_metadata(tmp_path / "a.zarr")
    assert run("convert", tmp_path / "a.zarr", tmp_path / "o.zarr", "-q") == 2
    assert "a.zarr/X/indptr: dtype float64 is not an integer dtype" in one_line_error(capsys)
    assert not (tmp_path / "o.zarr").exists()


def test_convert_refuses_column_ids_outside_the_matrix(tmp_path, capsys):
    """A column id >= n_features (or < 0) was copied into the output, which the loader then
    refused mid-training; convert refuses it, naming the input's element, row and chunk.
    uint64 ids beside int32 ones were written as float64 (NumPy's promotion): int64 now."""
    x = sp.random(40, 6, density=0.5, format="csr", dtype=np.float32, random_state=0)
    ad.AnnData(x).write_h5ad(tmp_path / "a.h5ad")
    import h5py

    with h5py.File(tmp_path / "a.h5ad", "r+") as f:
        f["X/indices"][17] = 6
    assert run("convert", tmp_path / "a.h5ad", tmp_path / "o.zarr", "-q") == 2
    err = one_line_error(capsys)
    row = int(np.searchsorted(x.indptr, 17, side="right")) - 1
    assert f"a.h5ad/X/indices: column index 6 is outside [0, 6): element 17 (row {row})" in err
    assert not (tmp_path / "o.zarr").exists()
    wide = sp.csr_matrix(x)
    wide.indices = wide.indices.astype(np.uint64)
    ad.AnnData(wide).write_h5ad(tmp_path / "u.h5ad")
    ad.AnnData(x).write_h5ad(tmp_path / "b.h5ad")
    assert run("convert", tmp_path / "u.h5ad", tmp_path / "b.h5ad", tmp_path / "ub.zarr", "-q") == 0
    assert zarr.open_array(tmp_path / "ub.zarr/X/indices").dtype == np.int64
    np.testing.assert_array_equal(loader_rows(tmp_path / "ub.zarr"), sp.vstack([x, x]).toarray())


def test_legacy_h5sparse_x_converts(tmp_path):
    """anndata before 0.7 wrote sparse X with h5sparse_format / h5sparse_shape attributes."""
    import anndata as ad
    import h5py

    x = sp.random(20, 17, density=0.3, format="csr", dtype=np.float32, random_state=4)
    ad.AnnData(x).write_h5ad(tmp_path / "legacy.h5ad")
    with h5py.File(tmp_path / "legacy.h5ad", "r+") as f:
        attrs = f["X"].attrs
        shape = list(attrs["shape"])
        for key in list(attrs):
            del attrs[key]
        attrs["h5sparse_format"], attrs["h5sparse_shape"] = "csr", shape
    assert run("convert", tmp_path / "legacy.h5ad", tmp_path / "out.zarr", "-q") == 0
    assert (x != ad.read_zarr(tmp_path / "out.zarr").X).nnz == 0


def test_synthetic_labels_fit_any_number_of_types(tmp_path):
    import anndata as ad

    path = synthetic.make_single_cell(tmp_path / "t.zarr", n_obs=300, n_features=400, n_types=200)
    obs = ad.read_zarr(path).obs
    assert obs["cell_type"].notna().all() and obs["cell_type"].cat.categories.size == 200
    with pytest.raises(ValueError, match="n_types=8: need 1 <= n_types <= n_features=4"):
        synthetic.make_single_cell(tmp_path / "u.zarr", n_obs=10, n_features=4, n_types=8)


def test_synthetic_store_of_no_cells_is_refused_by_name(tmp_path):
    """n_obs=0 failed with numpy's "need at least one array to concatenate"."""
    with pytest.raises(ValueError, match="n_obs=0: need at least one cell"):
        synthetic.make_single_cell(tmp_path / "s.zarr", n_obs=0, n_features=4, n_types=2)
    assert not list(tmp_path.iterdir())


def test_synthetic_stores_appear_whole_or_not_at_all(tmp_path, monkeypatch):
    """An interrupted write leaves nothing at the path (the demo's --generate then writes
    it again, where it used to fail on the half store); a killed writer's partial is
    cleaned up by the next write, a running writer's is not touched (convert's mechanism)."""
    path = tmp_path / "s.zarr"
    real = synthetic._write_single_cell

    def interrupted(partial, *args, **kw):
        real(partial, *args, **kw)
        raise KeyboardInterrupt  # after X, obs and var were written

    monkeypatch.setattr(synthetic, "_write_single_cell", interrupted)
    with pytest.raises(KeyboardInterrupt):
        synthetic.make_single_cell(path, n_obs=50, n_features=10)
    assert not path.exists() and not list(tmp_path.iterdir())
    monkeypatch.setattr(synthetic, "_write_single_cell", real)
    killed = tmp_path / "s.zarr.partial"  # a killed writer's: marked, but nobody holds it
    (killed / "X").mkdir(parents=True)
    (killed / ".dali-zarr-partial").write_text("")
    synthetic.make_single_cell(path, n_obs=50, n_features=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]
    assert dz.open_dataset(path).n_obs == 50
    synthetic.make_single_cell(path, n_obs=30, n_features=10)  # replaces the store whole
    assert dz.open_dataset(path).n_obs == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]
    from dali_zarr.io.publish import _prepare_destination

    _, lock = _prepare_destination(str(path), [], overwrite=True)  # a writer running
    with pytest.raises(dz.ConfigError, match="another dali-zarr writer"):
        synthetic.make_single_cell(path, n_obs=20, n_features=10)
    lock.close()
    assert dz.open_dataset(path).n_obs == 30


def test_a_second_convert_to_a_destination_being_written_is_refused(tmp_path):
    """Each convert locks its DST.partial: a second one used to take the first's live partial
    for a stale one, delete it and write into it, and the first then published a store of
    rows from both (and rows from neither)."""
    from dali_zarr.io.publish import _prepare_destination

    src = tmp_path / "a.zarr"
    zarr.create_array(src, data=np.arange(40, dtype=np.float32).reshape(20, 2), chunks=(5, 2))
    dest = str(tmp_path / "out.zarr")
    partial, lock = _prepare_destination(dest, [str(src)], overwrite=False)  # a convert running
    with pytest.raises(dz.ConfigError, match=r"another dali-zarr writer .* is writing"):
        convert(src, dest)
    assert os.path.isdir(partial)  # the running convert's work is left alone
    lock.close()  # that convert was killed: its partial is stale now
    convert(src, dest)
    np.testing.assert_array_equal(zarr.open_array(dest)[...], zarr.open_array(src)[...])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.zarr", "out.zarr"]


def test_a_destination_created_during_the_convert_is_kept(tmp_path):
    """Without overwrite, a DST that appears while the convert runs is not replaced."""
    src = tmp_path / "a.zarr"
    zarr.create_array(src, data=np.arange(40, dtype=np.float32).reshape(20, 2), chunks=(5, 2))
    dest = tmp_path / "out.zarr"

    def someone_else_writes_dest(done: int, total: int) -> None:
        dest.mkdir(exist_ok=True)
        (dest / "theirs").write_text("keep me")

    with pytest.raises(dz.ConfigError, match="was created while this convert ran"):
        convert(src, dest, progress=someone_else_writes_dest)
    assert (dest / "theirs").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.zarr", "out.zarr"]


def test_convert_summary_of_a_one_dimensional_array(tmp_path, capsys):
    """A 1-D array (one value per row) was summarised as "300 × , float32"; it reads
    "300 × scalar", as inspect says."""
    src = zarr.create_array(tmp_path / "v.zarr", shape=(300,), dtype="f4", chunks=(64,))
    src[...] = np.arange(300, dtype="f4")
    capsys.readouterr()
    assert run("convert", tmp_path / "v.zarr", tmp_path / "o.zarr") == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.endswith("Zarr array, 300 × scalar, float32"), head
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "o.zarr", mode="r")[...], src[...])


def test_inspect_a_dali_zarr_attribute_not_written_by_convert(tmp_path, capsys):
    """The 'dali_zarr' attribute is plain JSON: {"shuffle": true} on a store made
    inspect end in a TypeError traceback ('bool' object is not subscriptable)."""
    path = synthetic.make_dense_cube(tmp_path / "c.zarr", n_obs=40, shape=(3,))
    zarr.open_array(path, mode="r+").attrs["dali_zarr"] = {"shuffle": True, "chunk_rows": 5}
    capsys.readouterr()
    assert run("inspect", path) == 0
    assert "written by dali-zarr convert: chunk_rows 5, codec None, shuffled (seed ?)" in (
        capsys.readouterr().out
    )


def test_an_input_column_named_like_convert_s_own_is_not_replaced_silently(tmp_path, capsys):
    """An input's obs column original_index (the user's own, or an earlier convert's row
    numbers into its .h5ad, when a converted store is converted again) was overwritten by
    this convert's row numbers without a word: its values were gone from the output."""
    obs = pd.DataFrame({"original_index": np.arange(100, 106)}, index=[f"c{i}" for i in range(6)])
    x = sp.random(6, 3, density=0.5, format="csr", dtype=np.float32, random_state=0)
    ad.AnnData(X=x, obs=obs).write_h5ad(tmp_path / "a.h5ad")
    capsys.readouterr()
    assert run("convert", tmp_path / "a.h5ad", tmp_path / "o.zarr") == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert any("'original_index'" in line and "replaced" in line for line in notes), notes
    back = ad.read_zarr(tmp_path / "o.zarr")
    np.testing.assert_array_equal(back.obs["original_index"], np.arange(6))


@pytest.mark.parametrize("name", ["original_index", "original_source"])
def test_an_input_index_named_like_convert_s_own_column_is_written(tmp_path, capsys, name):
    """An obs index named original_index (original_source: with several inputs) made
    anndata refuse to write obs, after the whole X was converted: a ValueError traceback
    ('DataFrame.index.name ... is also used by a column'), and no store."""
    x = sp.random(6, 3, density=0.5, format="csr", dtype=np.float32, random_state=0)
    paths = []
    for part in "ab":
        obs = pd.DataFrame(index=pd.Index([f"{part}{i}" for i in range(6)], name=name))
        ad.AnnData(X=x, obs=obs).write_h5ad(tmp_path / f"{part}.h5ad")
        paths.append(tmp_path / f"{part}.h5ad")
    capsys.readouterr()
    assert run("convert", *paths, tmp_path / "o.zarr") == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert any(f"index name {name!r} was dropped" in line for line in notes), notes
    back = ad.read_zarr(tmp_path / "o.zarr")
    assert list(back.obs_names) == [f"{p}{i}" for p in "ab" for i in range(6)]
    np.testing.assert_array_equal(back.obs["original_index"], np.arange(12))


def test_obs_and_var_names_with_a_slash_are_written_with_an_underscore(tmp_path, capsys):
    """anndata writes an obs column "pct/mt" to an .h5ad (with a FutureWarning) and reads it
    back, but refuses it in a Zarr store: convert failed at its very end, after the whole
    X, with a ValueError traceback (Forward slashes are not allowed in keys) and no store."""
    x = sp.random(6, 3, density=0.5, format="csr", dtype=np.float32, random_state=0)
    obs = pd.DataFrame(
        {"pct/mt": np.arange(6.0), "kind/x": pd.Categorical(["a", "b", "a", "b", None, "a"])},
        index=pd.Index([f"c{i}" for i in range(6)], name="cell/id"),
    )
    var = pd.DataFrame({"gene/kind": ["a", "b", "c"]}, index=["g0", "g1", "g2"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # anndata's: "will be disallowed"
        ad.AnnData(X=x, obs=obs, var=var).write_h5ad(tmp_path / "a.h5ad")
    src = ad.read_h5ad(tmp_path / "a.h5ad")
    assert list(src.obs.columns) == ["pct/mt", "kind/x"]  # read back as written
    capsys.readouterr()
    assert run("convert", tmp_path / "a.h5ad", tmp_path / "o.zarr") == 0
    out = capsys.readouterr().out
    assert "obs names with '/'" in out and "'pct/mt' as 'pct_mt'" in out, out
    assert "var names with '/'" in out and "'gene/kind' as 'gene_kind'" in out, out
    back = ad.read_zarr(tmp_path / "o.zarr")
    assert back.obs.index.name == "cell_id" and list(back.obs_names) == list(src.obs_names)
    pd.testing.assert_series_equal(back.obs["pct_mt"], src.obs["pct/mt"], check_names=False)
    pd.testing.assert_series_equal(back.obs["kind_x"], src.obs["kind/x"], check_names=False)
    assert list(back.var["gene_kind"]) == ["a", "b", "c"]
    # where the new name is taken, refused before anything is written
    obs["pct_mt"] = 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ad.AnnData(X=x, obs=obs, var=var).write_h5ad(tmp_path / "b.h5ad")
    assert run("convert", tmp_path / "b.h5ad", tmp_path / "b.zarr") == 2
    assert "obs column 'pct/mt' holds '/'" in one_line_error(capsys)
    assert not (tmp_path / "b.zarr").exists()


@pytest.mark.parametrize(
    "other", [np.array([0.5, 1.5]), np.array([1, 2], np.uint64)], ids=["float64", "uint64"]
)
def test_obs_integers_a_float_would_round_are_refused(tmp_path, capsys, other):
    """An int64 obs column (ids, hashes) beside float64 or uint64 in another input was
    concatenated as float64: 2**60 + 1 came out 2**60, silently. Refused, as for X."""
    x = sp.random(2, 3, density=0.5, format="csr", dtype=np.float32, random_state=0)
    for name, k in {"a": np.array([2**60 + 1, 2], np.int64), "b": other}.items():
        obs = pd.DataFrame({"k": k}, index=[f"{name}{i}" for i in range(2)])
        ad.AnnData(X=x, obs=obs).write_h5ad(tmp_path / f"{name}.h5ad")
    assert run("convert", tmp_path / "a.h5ad", tmp_path / "b.h5ad", tmp_path / "o.zarr") == 2
    err = one_line_error(capsys)
    assert "obs column 'k'" in err and "a.h5ad (int64)" in err, err
    assert not (tmp_path / "o.zarr").exists()
    # integers a float64 holds exactly still join floats
    small = pd.DataFrame({"k": np.array([7, 2**53], np.int64)}, index=["a0", "a1"])
    ad.AnnData(X=x, obs=small).write_h5ad(tmp_path / "a.h5ad")
    assert run("convert", tmp_path / "a.h5ad", tmp_path / "b.h5ad", tmp_path / "o.zarr") == 0
    back = ad.read_zarr(tmp_path / "o.zarr").obs["k"].to_numpy()
    np.testing.assert_array_equal(back, np.concatenate([[7, 2**53], other]).astype(np.float64))


def test_csr_beside_dense_inputs_are_refused_for_their_layout(tmp_path, capsys):
    """A CSR and a dense input of the same width were refused as not sharing "the feature
    axis", naming the same (3,) for both: the layout differs, and the message says so."""
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    ad.AnnData(X=sp.csr_matrix(x)).write_h5ad(tmp_path / "s.h5ad")
    ad.AnnData(X=x).write_h5ad(tmp_path / "d.h5ad")
    assert run("convert", tmp_path / "s.h5ad", tmp_path / "d.h5ad", tmp_path / "o.zarr") == 2
    err = one_line_error(capsys)
    assert "d.h5ad has dense X but" in err and "s.h5ad has csr X" in err, err
    assert "feature axis" not in err and "csr_matrix(adata.X)" in err, err


def test_concatenated_obs_keeps_the_index_name(tmp_path):
    """The obs index's name ("cell_id") was kept for one input but dropped for several."""
    x = sp.random(3, 2, density=0.5, format="csr", dtype=np.float32, random_state=0)
    for name in "ab":
        index = pd.Index([f"{name}{i}" for i in range(3)], name="cell_id")
        ad.AnnData(X=x, obs=pd.DataFrame(index=index)).write_h5ad(tmp_path / f"{name}.h5ad")
    assert run("convert", tmp_path / "a.h5ad", tmp_path / "b.h5ad", tmp_path / "o.zarr", "-q") == 0
    back = ad.read_zarr(tmp_path / "o.zarr").obs
    assert back.index.name == "cell_id"
    assert list(back.index) == ["a0", "a1", "a2", "b0", "b1", "b2"]


def test_concatenated_var_columns_that_differ_are_named(tmp_path, capsys):
    """Only var_names were compared: a var column the inputs hold otherwise (each batch's
    highly_variable) was written as the first input's without a word."""
    x = sp.random(3, 2, density=0.5, format="csr", dtype=np.float32, random_state=0)
    for name, hv in {"a": [True, False], "b": [False, True]}.items():
        ids = pd.Categorical(["E1", "E2"], categories=["E1", "E2", "E3"][: 2 + (name == "b")])
        var = pd.DataFrame({"hv": hv, "gene_id": ids}, index=["g0", "g1"])
        obs = pd.DataFrame(index=[f"{name}{i}" for i in range(3)])
        ad.AnnData(X=x, obs=obs, var=var).write_h5ad(tmp_path / f"{name}.h5ad")
    capsys.readouterr()
    assert run("convert", tmp_path / "a.h5ad", tmp_path / "b.h5ad", tmp_path / "o.zarr") == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    # gene_id's values are the same (an unused category aside): not named
    assert any("var columns hv:" in line and "a.h5ad's" in line for line in notes), notes
    assert list(ad.read_zarr(tmp_path / "o.zarr").var["hv"]) == [True, False]


def test_convert_names_the_elements_it_leaves_out(tmp_path, capsys):
    """A layer, an obsm entry or uns were left out of the output without a word in the
    summary (only --help said convert copies X, obs and var)."""
    x = sp.random(5, 3, density=0.5, format="csr", dtype=np.float32, random_state=0)
    a = ad.AnnData(X=x, layers={"counts": x.copy()}, obsm={"pca": np.ones((5, 2))})
    a.uns["note"] = "kept in the input"
    a.raw = a.copy()
    a.write_h5ad(tmp_path / "a.h5ad")

    def left_out(*argv) -> str:
        capsys.readouterr()
        assert run("convert", *argv, tmp_path / "a.h5ad", tmp_path / "o.zarr", "--overwrite") == 0
        notes = [s for s in capsys.readouterr().out.splitlines() if "not copied" in s]
        assert len(notes) == 1, notes
        return notes[0].split(": ", 2)[2].split(";")[0]

    # obsm/pca is dense: carried (test_convert_carries_dense_obsm_entries)
    assert left_out() == "layers/counts, raw, uns/note"
    assert left_out("--element", "raw/X") == "X, layers/counts, uns/note"
    assert left_out("--element", "layers/counts") == "X, raw, uns/note"


@pytest.mark.parametrize("source", ["h5ad", "zarr"])
def test_convert_carries_dense_obsm_entries(tmp_path, capsys, source):
    """Dense obsm entries (spatial coordinates, a protein panel) are copied in the output's
    row order, so the loader serves them beside X (obs=["obsm/<key>"]); before, convert
    left every obsm entry out, and a converted .h5ad could not train with its coordinates.
    Entries that cannot be carried are named with why, once; those carried are listed."""
    rng = np.random.default_rng(0)
    stores = []
    for k, n_obs in enumerate((70, 50)):
        x = sp.random(n_obs, 6, density=0.5, format="csr", dtype=np.float32, random_state=k)
        a = ad.AnnData(X=x, obs=pd.DataFrame(index=[f"s{k}c{i}" for i in range(n_obs)]))
        a.obsm["spatial"] = rng.random((n_obs, 2))
        a.obsm["patches"] = rng.integers(0, 9, (n_obs, 2, 3)).astype(np.int16)
        a.obsm["pca"] = rng.random((n_obs, 2 + k)).astype(np.float32)  # other widths
        a.obsm["meta"] = pd.DataFrame({"v": np.arange(n_obs)}, index=a.obs_names)
        a.obsm["sparse"] = sp.random(n_obs, 4, density=0.5, format="csr", random_state=k)
        if k == 0:
            a.obsm["only_first"] = np.zeros((n_obs, 2))
        path = tmp_path / f"in{k}.{source}"
        a.write_h5ad(path) if source == "h5ad" else a.write_zarr(path)
        stores.append(a)
    dst = tmp_path / "o.zarr"
    assert run("convert", *(tmp_path / f"in{k}.{source}" for k in (0, 1)), dst, "--shuffle") == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "note:" in line and "obsm" in line]
    assert len(notes) == 1, out  # not also in "not copied"
    # the summary names what was carried too (it said nothing of it), as inspect lists it
    beside = 'beside X (obs=["obsm/<key>"]): obsm/patches (2, 3) int16, obsm/spatial (2,) float64'
    assert f"\n  {beside}\n" in out, out
    for element, why in (
        ("obsm/meta", "not a dense numeric array in"),
        ("obsm/sparse", "not a dense numeric array in"),
        ("obsm/pca", "rows of other shapes in the inputs"),
        ("obsm/only_first", f"not in {tmp_path / f'in1.{source}'}"),
    ):
        assert f"{element} ({why}" in notes[0], notes[0]
    written = ad.read_zarr(dst)
    assert sorted(written.obsm) == ["patches", "spatial"]
    original = written.obs["original_index"].to_numpy()
    assert not np.array_equal(original, np.arange(120))  # shuffled: rows moved
    for key in ("spatial", "patches"):
        joined = np.concatenate([a.obsm[key] for a in stores])
        assert written.obsm[key].dtype == joined.dtype
        np.testing.assert_array_equal(written.obsm[key], joined[original])
    sampler = dz.ChunkSampler(chunk_size=16, preload_nchunks=2, batch_size=20, seed=0)
    with dz.Loader(dz.open_dataset(dst), sampler, obs=["obsm/spatial"], return_index=True) as L:
        for batch in L:
            rows = original[batch["index"].numpy()]
            np.testing.assert_array_equal(
                batch["obsm/spatial"].numpy(),
                np.concatenate([a.obsm["spatial"] for a in stores])[rows],
            )


def _two_obsm_entries(tmp_path: Path) -> tuple[Path, ad.AnnData]:
    """A zarr v2 AnnData store (one file per member's metadata) with obsm spatial and pca."""
    src = tmp_path / "in.zarr"
    a = ad.AnnData(X=np.arange(40, dtype=np.float32).reshape(20, 2))
    a.obsm["spatial"] = np.random.default_rng(0).random((20, 2))
    a.obsm["pca"] = np.ones((20, 3), dtype=np.float32)
    with ad.settings.override(zarr_write_format=2):
        a.write_zarr(src)
    return src, a


def test_convert_notes_an_obsm_entry_whose_metadata_cannot_be_read(tmp_path, capsys):
    """convert lists obsm to carry its entries; zarr parses every member's metadata to list
    a group, so one unreadable .zarray (an entry X does not need) ended the convert with a
    bare JSONDecodeError traceback, where before obsm was carried it converted. The entry
    is now named in a note and the others are carried."""
    src, a = _two_obsm_entries(tmp_path)
    (src / ".zmetadata").unlink()  # zarr lists the group from each member's own file
    (src / "obsm" / "pca" / ".zarray").write_text("{")
    dst = tmp_path / "o.zarr"
    assert run("convert", src, dst) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "note: obsm entries not carried: obsm/pca (its metadata cannot be read in " in out
    assert "JSONDecodeError)" in out and "obsm/?" not in out, out
    written = ad.read_zarr(dst)
    assert list(written.obsm) == ["spatial"]
    np.testing.assert_array_equal(written.obsm["spatial"], a.obsm["spatial"])


def test_convert_notes_an_obsm_entry_with_a_corrupted_chunk(tmp_path, capsys):
    """Carrying obsm reads each entry whole: one corrupted chunk (of an entry X does not
    need) ended the convert with blosc's bare RuntimeError traceback, where before obsm
    was carried it converted. The entry is named in the note with the chunk; the others
    are carried."""
    src, a = _two_obsm_entries(tmp_path)
    (src / "obsm" / "pca" / "0.0").write_bytes(b"garbage, not a blosc frame")
    dst = tmp_path / "o.zarr"
    assert run("convert", src, dst) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"obsm entries not carried: obsm/pca (cannot be read in {src}: chunk '0.0': " in out
    assert "blosc header says 1646289184 compressed bytes but the chunk holds 26" in out, out
    written = ad.read_zarr(dst)
    assert list(written.obsm) == ["spatial"]
    np.testing.assert_array_equal(written.obsm["spatial"], a.obsm["spatial"])


def test_legacy_obs_table_is_refused_by_name(tmp_path, capsys):
    """anndata before 0.7 wrote obs and var as one compound table (categories in uns), which
    anndata.read_h5ad still reads; convert ended in a bare AttributeError ('numpy.ndarray'
    object has no attribute 'columns')."""
    import h5py

    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    ad.AnnData(x).write_h5ad(tmp_path / "old.h5ad")
    with h5py.File(tmp_path / "old.h5ad", "r+") as f:
        del f["obs"]
        table = np.zeros(4, dtype=[("index", "S8"), ("louvain", np.int8)])
        table["index"], table["louvain"] = [b"c0", b"c1", b"c2", b"c3"], [0, 1, 0, 1]
        f.create_dataset("obs", data=table)
    assert ad.read_h5ad(tmp_path / "old.h5ad").n_obs == 4  # anndata reads it
    assert run("convert", tmp_path / "old.h5ad", tmp_path / "o.zarr") == 2
    err = one_line_error(capsys)
    assert "old.h5ad/obs: is a table in the format of anndata before 0.7" in err, err
    assert "write_h5ad" in err and not (tmp_path / "o.zarr").exists()


_KILL_IN_COMMIT = """
import os, signal, sys
import dali_zarr.convert as c
import dali_zarr.io.publish as p

src, dst, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
state = {"committing": False, "calls": 0}
real_publish = p._publish


def publish(*args, **kw):
    state["committing"] = True
    return real_publish(*args, **kw)


def counted(fn):
    def call(*args, **kw):
        if state["committing"]:
            state["calls"] += 1
            if state["calls"] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kw)

    return call


p._publish = publish
for name in ("rename", "replace", "remove", "unlink", "rmdir"):
    setattr(os, name, counted(getattr(os, name)))
p._renameat2 = counted(p._renameat2)
c.convert(src, dst, overwrite=True, chunk_rows=5, shard_bytes=0)
print(state["calls"])
"""


@pytest.mark.parametrize("replace", [False, True], ids=["fresh", "replace"])
def test_a_convert_killed_while_it_commits_leaves_a_whole_store_and_reruns(tmp_path, replace):
    """SIGKILL at each file-system step of the commit (publishing DST.partial as DST). The
    marker was removed before the rename, so a kill there left a finished DST.partial that
    every re-run refused as "not left by an interrupted dali-zarr writer"; --overwrite
    moved the old DST aside first, so a kill there left no DST at all; and a kill while the
    old store was removed left a DST.old-<pid> that nothing cleaned up. DST must always hold
    the old store or the new one, whole, and a re-run must leave nothing else behind."""
    new_src, old_src = tmp_path / "new.zarr", tmp_path / "old.zarr"
    new = np.arange(40, dtype=np.float32).reshape(20, 2)
    zarr.create_array(new_src, data=new, chunks=(5, 2))
    zarr.create_array(old_src, data=-new[:10], chunks=(5, 2))
    dst = tmp_path / "out.zarr"

    def child(kill_at: int) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", _KILL_IN_COMMIT, str(new_src), str(dst), str(kill_at)]
        return subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True)

    def reset() -> None:
        shutil.rmtree(dst, ignore_errors=True)
        if replace:
            convert(old_src, dst, chunk_rows=5, shard_bytes=0)

    reset()
    whole = child(0)
    assert whole.returncode == 0, whole.stderr
    steps = int(whole.stdout.split()[-1])
    assert steps >= 1
    for kill_at in range(1, steps + 1):
        reset()
        assert child(kill_at).returncode == -signal.SIGKILL
        if replace or dst.exists():
            held = zarr.open_array(dst, mode="r")[...]
            assert np.array_equal(held, new) or np.array_equal(held, -new[:10]), kill_at
            assert dz.open_dataset(dst).n_obs == len(held)
        convert(new_src, dst, overwrite=True)  # a re-run
        np.testing.assert_array_equal(zarr.open_array(dst, mode="r")[...], new)
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == ["new.zarr", "old.zarr", "out.zarr"], f"killed at step {kill_at}: {left}"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names descriptors by /proc")
def test_convert_makes_the_store_durable_before_publishing_it(tmp_path, sc_store, monkeypatch):
    """Nothing was fsynced: after a power loss the rename (journaled) could survive while the
    chunks it points at did not, leaving a DST of empty or missing chunk files. Every file
    and folder of the store is now fsynced before the rename, and the parent folder after."""
    import dali_zarr.io.publish as publish_module

    synced: list[str] = []
    real_fsync, real_publish = os.fsync, publish_module._publish

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def publish(*args, **kw):
        synced.append("<commit>")
        real_publish(*args, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(publish_module, "_publish", publish)
    dst = tmp_path / "out.zarr"
    convert(sc_store, dst)
    partial = f"{dst}.partial"
    in_store = [os.path.join(partial, os.path.relpath(os.path.join(d, n), dst))
                for d, dirs, files in os.walk(dst) for n in dirs + files]  # fmt: skip
    # named by their DST.partial paths: synced before the rename
    missing = [p for p in [partial, *in_store] if p not in synced]
    assert not missing, f"not fsynced before the commit: {missing[:5]} ({len(missing)})"
    last = max(i for i, p in enumerate(synced) if p.startswith(partial))
    assert str(tmp_path) in synced[last + 1 :]  # the rename itself, after it


def test_a_killed_converts_partial_plain_array_is_refused_not_read_as_zeros(tmp_path, capsys):
    """A plain array's metadata is written first, so the DST.partial of a killed convert
    opened (in open_dataset, inspect, a Loader) and read every chunk not yet written as
    fill values: all 2000 rows here were zeros, without a word. Given to convert as an
    input (`convert data/* data/out.zarr` takes it in), it was read the same way, and, as
    that convert's own DST.partial, removed as stale while being read: its rows were zeros
    in a published store."""
    src = tmp_path / "in.zarr"
    zarr.create_array(
        src, data=np.arange(1, 4001, dtype=np.float32).reshape(2000, 2), chunks=(100, 2)
    )
    dst = tmp_path / "out.zarr"
    code = textwrap.dedent(
        f"""
        import os, signal
        from dali_zarr.convert import convert

        def die(done, total):
            if done >= total // 2 > 0:
                os.kill(os.getpid(), signal.SIGKILL)

        convert({str(src)!r}, {str(dst)!r}, block_rows=500, chunk_rows=100, progress=die)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    partial = Path(f"{dst}.partial")
    with pytest.raises(dz.DatasetError, match="unfinished output of a dali-zarr writer"):
        dz.open_dataset(partial)
    assert run("inspect", partial) == 2
    assert f"open {dst} once it has finished" in one_line_error(capsys)
    assert run("convert", partial, tmp_path / "other.zarr", "-q") == 2
    assert f"open {dst} once it has finished" in one_line_error(capsys)
    # `convert data/* data/out.zarr` takes in the killed run's out.zarr.partial
    assert run("convert", src, partial, dst, "-q") == 2
    assert "out.zarr.partial: is the unfinished output of an earlier convert" in (
        one_line_error(capsys)
    )
    assert partial.is_dir() and not dst.exists() and not (tmp_path / "other.zarr").exists()
    # a store of the user's own under that name is not called ours (nor to be removed)
    theirs = tmp_path / "theirs.zarr.partial"
    shutil.copytree(src, theirs)
    assert run("convert", theirs, tmp_path / "theirs.zarr", "-q") == 2
    assert "is an input, and the path this convert writes" in one_line_error(capsys)
    assert sorted(os.listdir(theirs)) == sorted(os.listdir(src))
    assert run("convert", src, dst, "-q") == 0
    np.testing.assert_array_equal(dz.open_dataset(dst).read_rows(np.array([[0, 2000]])).values,
                                  zarr.open_array(src)[...])  # fmt: skip


def test_overwrite_without_an_atomic_swap_still_replaces_the_store(tmp_path, monkeypatch):
    """Where renameat2 is missing (not Linux, an old libc, a file system without
    RENAME_EXCHANGE), --overwrite falls back to two renames and leaves nothing else."""
    import dali_zarr.io.publish as publish_module

    monkeypatch.setattr(publish_module, "_renameat2", lambda *args: None)
    src = tmp_path / "a.zarr"
    zarr.create_array(src, data=np.arange(40, dtype=np.float32).reshape(20, 2), chunks=(5, 2))
    dst = tmp_path / "out.zarr"
    synthetic.make_dense_cube(dst, n_obs=7)
    convert(src, dst, overwrite=True)
    np.testing.assert_array_equal(zarr.open_array(dst)[...], zarr.open_array(src)[...])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.zarr", "out.zarr"]
    assert not (dst / ".dali-zarr-partial").exists()


def test_inspect_of_an_empty_store_suggests_no_settings(tmp_path: Path, capsys) -> None:
    """The report of a store without rows printed chunk_size=1, preload_nchunks=256 beside
    its warning that there is nothing to load; it now gives the warning alone."""
    zarr.create_array(tmp_path / "empty.zarr", shape=(0, 5), chunks=(4, 5), dtype="f4")
    assert run("inspect", tmp_path / "empty.zarr") == 0
    out = capsys.readouterr().out
    assert "nothing to load; no settings to suggest" in out, out
    assert "suggested:" not in out and "chunk_size=" not in out, out


def test_a_stale_partial_this_process_cannot_remove_is_named_not_called_busy(
    tmp_path, monkeypatch, caplog
):
    """A stale DST.partial that this process cannot remove (a convert run under sudo and
    killed leaves root's files) was reported as "another dali-zarr writer is writing this
    destination now": the user waited for a writer that did not exist. It is named, with
    what stays. A replaced store that cannot be removed after the swap stayed behind at
    DST.partial without a word; the new store is published and the remains are named.
    (A folder whose removal fails stands in for another user's files, which a test run as
    root cannot make for itself.)"""
    src = tmp_path / "in.zarr"
    zarr.create_array(src, data=np.arange(40, dtype=np.float32).reshape(20, 2), chunks=(5, 2))
    dst = tmp_path / "out.zarr"
    stale = Path(f"{dst}.partial")
    (stale / "foreign").mkdir(parents=True)
    (stale / ".dali-zarr-partial").write_text("left by a killed run\n")
    real_rmdir = os.rmdir

    def rmdir(path, *args, **kw):
        if os.path.basename(os.fsdecode(path)) == "foreign":
            raise PermissionError(13, "Permission denied", path)
        return real_rmdir(path, *args, **kw)

    monkeypatch.setattr(os, "rmdir", rmdir)
    with pytest.raises(dz.ConfigError, match=r"out.zarr.partial: left by an interrupted .*"
                       r"cannot remove it \(.*foreign stays"):  # fmt: skip
        convert(src, dst)
    monkeypatch.setattr(os, "rmdir", real_rmdir)
    shutil.rmtree(stale)
    convert(src, dst)
    (dst / "foreign").mkdir()  # the old store holds what cannot be removed
    monkeypatch.setattr(os, "rmdir", rmdir)
    with caplog.at_level("WARNING", logger="dali_zarr"):
        convert(src, dst, overwrite=True)
    assert dz.open_dataset(dst).n_obs == 20 and not (dst / "foreign").exists()
    assert f"the store it replaced stays at {stale}" in caplog.text, caplog.text


def test_overwrite_of_a_store_this_process_cannot_write_is_refused_up_front(
    tmp_path, sc_store, capsys, monkeypatch
):
    """Replacing a store marks it (writes a file in it) before the swap: a store of another
    user or read-only failed only then, and the whole conversion was thrown away. It is
    refused before converting. The tests run as root, whom chmod does not stop, so the
    permission answer is the other user's for that one folder."""
    dst = tmp_path / "out.zarr"
    synthetic.make_dense_cube(dst, n_obs=20)
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **kw: p != str(dst) and access(p, m, **kw))
    assert run("convert", sc_store, dst, "--overwrite", "-q") == 2
    assert "cannot write in it" in one_line_error(capsys)
    assert not Path(f"{dst}.partial").exists() and dz.open_dataset(dst).n_obs == 20


def test_cli_errors_name_the_element_as_the_command_line_takes_it(tmp_path, capsys):
    """Errors written for open_dataset said "pass element= one of ..." on the command line,
    where it is --element; and a part of an AnnData store given as the path
    (`inspect cells.zarr/raw`) was "neither an AnnData store nor an array" with no word of
    the store it is part of or the element that loads it."""
    rng = np.random.default_rng(0)
    adata = ad.AnnData(X=sp.random(40, 6, density=0.3, format="csr", random_state=rng))
    adata.raw = adata.copy()
    adata.layers["counts"] = adata.X.copy()
    store = tmp_path / "cells.zarr"
    adata.write_zarr(store)
    assert run("inspect", store, "--element", "layers/nope") == 2
    err = one_line_error(capsys)
    assert "Pass --element one of: X, raw/X, layers/counts." in err, err
    assert "element=" not in err, err
    assert run("inspect", store / "raw") == 2
    err = one_line_error(capsys)
    assert f"It is 'raw' of the AnnData store {store}: open that store with --element one of: " \
        "raw/X." in err, err  # fmt: skip
    assert run("inspect", store / "obs") == 2
    assert "pass --element '_index'" not in one_line_error(capsys)  # obs: no array advice
    with pytest.raises(dz.DatasetError, match=r"open that store with element= one of: layers/c"):
        dz.open_dataset(store / "layers")


def test_bench_opens_a_packed_array_with_mask_and_scale(tmp_path, capsys):
    """bench of a CF-packed array warned to open it with mask_and_scale=True, an option it
    did not have. --mask-and-scale reaches open_dataset: the run times it without the
    warning (that the decoding itself is right is test_elements')."""
    path = tmp_path / "t2m.zarr"
    array = zarr.create_array(path, data=np.arange(6000, dtype="i2").reshape(300, 20))
    array.attrs.update({"scale_factor": 0.01, "add_offset": 280.0, "_FillValue": -32767})
    argv = ["bench", path, "--batches", 2, "--batch-size", 64, "--json", "-q"]
    with pytest.warns(dz.PackedValuesWarning):
        assert run(*argv) == 0
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error", dz.PackedValuesWarning)
        assert run(*argv, "--mask-and-scale") == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 2 * 64


def test_convert_refuses_a_truncated_blosc_chunk_zarr_would_misread(tmp_path, capsys):
    """anndata's zarr v2 codec is blosc, and numcodecs trusts a blosc chunk's header: a
    chunk cut short (here one blosc had stored uncompressed) was decoded past its end, and
    convert wrote its rows (and a var column's) as other memory's bytes with exit 0.
    Each stored blosc chunk's size is now checked against its header before zarr reads
    it: the chunk is named, nothing is written; the loader already refused it."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 5))  # 10-row chunks of 400 bytes: stored uncompressed
    var = pd.DataFrame({"m": rng.normal(size=5)}, index=[f"g{i}" for i in range(5)])
    with ad.settings.override(zarr_write_format=2):
        ad.AnnData(X=x, var=var).write_zarr(tmp_path / "in.zarr", chunks=(10, 5))
    chunk = tmp_path / "in.zarr" / "X" / "3.0"
    head = chunk.read_bytes()[:16]
    assert int.from_bytes(head[12:16], "little") == chunk.stat().st_size  # blosc, whole
    os.truncate(chunk, chunk.stat().st_size // 2)
    assert run("convert", "-q", tmp_path / "in.zarr", tmp_path / "o.zarr") == 2
    err = one_line_error(capsys)
    assert (
        "in.zarr/X: chunk '3.0': blosc header says 416 compressed bytes but the chunk holds 208"
        in err
    ), err
    assert not (tmp_path / "o.zarr").exists()
    from dali_zarr.io import open_reader  # the loader's zarr fallback checks it too

    with pytest.raises(dz.ChunkReadError, match=r"X: chunk '3.0': blosc header says 416 "):
        open_reader(zarr.open_array(tmp_path / "in.zarr" / "X"), name="X", force_zarr=True)
    shutil.rmtree(tmp_path / "in.zarr")
    with ad.settings.override(zarr_write_format=2):
        ad.AnnData(X=x, var=var).write_zarr(tmp_path / "in.zarr", chunks=(10, 5))
    column = tmp_path / "in.zarr" / "var" / "m" / "0"
    column.write_bytes(column.read_bytes()[:-8])
    assert run("convert", "-q", tmp_path / "in.zarr", tmp_path / "o.zarr") == 2
    assert "in.zarr/var/m: chunk '0': blosc header says " in one_line_error(capsys)


def test_a_bad_chunk_of_indptr_or_a_frame_column_is_named_by_convert_and_inspect(tmp_path, capsys):
    """A truncated chunk of X/indptr or of an obs/var column ended convert in a traceback
    (zstd's bare error) or, in an .h5ad, in h5py's "Can't synchronously read data" with
    exit 1 and nothing named; inspect crashed on a nullable column's bad mask. convert now
    names the array and chunk (exit 2) as for X's data; inspect reports the column as
    unreadable and goes on."""
    import h5py

    n = 300
    adata = ad.AnnData(
        X=sp.random(n, 20, density=0.1, format="csr", dtype=np.float32, random_state=1),
        obs=pd.DataFrame(
            {"v": np.linspace(0, 1, n), "nint": pd.array([1, None] * (n // 2), dtype="Int64")},
            index=[f"c{i}" for i in range(n)],
        ),
        var=pd.DataFrame({"m": np.arange(20.0)}, index=[f"g{i}" for i in range(20)]),
    )
    for chunk, name in [("X/indptr/c/0", "X/indptr"), ("obs/v/c/0", "obs/v"),
                        ("var/m/c/0", "var/m")]:  # fmt: skip
        store = tmp_path / f"{name.replace('/', '_')}.zarr"
        with ad.settings.override(zarr_write_format=3):
            adata.write_zarr(store)
        os.truncate(store / chunk, (store / chunk).stat().st_size // 2)
        assert run("convert", "-q", store, tmp_path / "o.zarr") == 2
        err = one_line_error(capsys)
        assert f"{store}/{name}: zarr-python failed to read rows [0, " in err, err
        assert "(chunk 0 along axis 0" in err and not (tmp_path / "o.zarr").exists()
    h5 = tmp_path / "a.h5ad"
    adata.write_h5ad(h5, compression="gzip")
    with h5py.File(h5, "r") as f:
        at = f["obs/v"].id.get_chunk_info(0).byte_offset
    with open(h5, "r+b") as f:
        f.seek(at + 10)
        f.write(b"\xff" * 40)
    assert run("convert", "-q", h5, tmp_path / "o.zarr") == 2
    assert f"{h5}/obs/v: h5py failed to read rows [0, " in one_line_error(capsys)
    store = tmp_path / "X_indptr.zarr"  # its obs column's mask cut short
    shutil.rmtree(store)
    with ad.settings.override(zarr_write_format=3):
        adata.write_zarr(store)
    mask = store / "obs" / "nint" / "mask" / "c" / "0"
    os.truncate(mask, mask.stat().st_size // 2)
    assert run("inspect", store) == 0
    assert "nint (unreadable chunks, not batchable)" in capsys.readouterr().out
