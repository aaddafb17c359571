"""Broken or unusual stores written on disk with anndata and zarr: each is refused with a
DatasetError naming the store's array and what to change, or, where anndata reads it, loads
the values anndata reads. Never silent wrong data, never a raw error from deep inside."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
import zarr

import dali_zarr as dz
from dali_zarr import synthetic
from dali_zarr.io import DirectReader
from tests.stores import needs_cuda, same_size_shards

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

N_OBS, N_VARS = 120, 12


def make_adata(*, sparse: bool = True, obs_extra: dict | None = None):
    import anndata as ad

    rng = np.random.default_rng(0)
    dense = rng.random((N_OBS, N_VARS)).astype(np.float32)
    dense[dense > 0.3] = 0
    dense = (dense * 100).round()
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(rng.choice(["a", "b", "c"], size=N_OBS)),
            "score": rng.random(N_OBS),
            **(obs_extra or {}),
        },
        index=[f"cell{i}" for i in range(N_OBS)],
    )
    var = pd.DataFrame(index=[f"g{j}" for j in range(N_VARS)])
    return ad.AnnData(X=sp.csr_matrix(dense) if sparse else dense, obs=obs, var=var)


def write_store(path: Path, adata, *, zarr_format: int = 3) -> Path:
    import anndata as ad

    previous = ad.settings.zarr_write_format
    ad.settings.zarr_write_format = zarr_format
    try:
        adata.write_zarr(path)
    finally:
        ad.settings.zarr_write_format = previous
    return path


def replace_array(path: Path, key: str, values: np.ndarray) -> None:
    """Overwrite array ``key`` of the store with ``values`` (attributes kept, one chunk)."""
    group = zarr.open_group(path, mode="a")
    parent, _, name = key.rpartition("/")
    where = group[parent] if parent else group
    attrs = dict(where[name].attrs)
    values = np.asarray(values)
    array = where.create_array(
        name, shape=values.shape, dtype=values.dtype, chunks=values.shape, overwrite=True
    )
    array[...] = values
    array.attrs.update(attrs)
    zarr.consolidate_metadata(path)  # anndata consolidates: refresh, or zarr reads the old


def set_x_shape(path: Path, shape: list) -> None:
    zarr.open_group(path, mode="a")["X"].attrs["shape"] = shape
    zarr.consolidate_metadata(path)


def sampler() -> dz.ChunkSampler:
    return dz.ChunkSampler(
        chunk_size=32, preload_nchunks=2, batch_size=16, shuffle=True, drop_last=False, seed=0
    )


def epoch(dataset: dz.Dataset, *, obs=(), output: str = "dense") -> dict[str, np.ndarray]:
    """One full epoch on the CPU path, concatenated per output (CSR densified)."""
    loader = dz.Loader(
        dataset, sampler(), device="cpu", num_threads=1, obs=list(obs), return_index=True,
        output=output,
    )  # fmt: skip
    parts: dict[str, list[np.ndarray]] = {}
    try:
        for batch in loader:
            for name, value in batch.items():
                if value.layout == torch.sparse_csr:
                    value = value.to_dense()
                parts.setdefault(name, []).append(value.numpy())
    finally:
        loader.close()
    out = {name: np.concatenate(values) for name, values in parts.items()}
    assert np.array_equal(np.sort(out["index"]), np.arange(dataset.n_obs)), "each row once"
    return out


# --- X/indptr and X's shape attribute -------------------------------------------------------


def _float_indptr(indptr: np.ndarray) -> np.ndarray:
    out = indptr.astype(np.float64)
    out[1:-1] -= 1e-6
    return out


def _past_int64(indptr: np.ndarray) -> np.ndarray:
    out = indptr.astype(np.uint64)
    out[-1] = np.uint64(2**63 + 5)
    return out


@pytest.mark.parametrize(
    ("zarr_format", "indptr_of", "match"),
    [
        # 12 stored as 11.999999 was truncated to 11: every later row shifted silently
        (2, _float_indptr, r"X/indptr: dtype float64 is not an int"),
        # 2**63 + 5 wrapped negative in the int64 cast and passed the checks
        (3, _past_int64, r"X/indptr: offset 9223372036854775813 "),
    ],
    ids=["float", "uint64-past-int64"],
)
def test_an_indptr_the_int64_cast_would_change_is_refused(
    tmp_path: Path, zarr_format: int, indptr_of, match: str
) -> None:
    from dali_zarr.convert import convert

    adata = make_adata()
    path = write_store(tmp_path / "ip.zarr", adata, zarr_format=zarr_format)
    replace_array(path, "X/indptr", indptr_of(adata.X.indptr))
    with pytest.raises(dz.DatasetError, match=rf"ip\.zarr/{match}"):
        dz.open_dataset(path)
    # convert refuses it as open_dataset does (it named the wrapped offset as decreasing)
    with pytest.raises(dz.DatasetError, match=rf"ip\.zarr/{match}"):
        convert(path, tmp_path / "out.zarr")


def _decreasing_at_row_7(indptr: np.ndarray) -> np.ndarray:
    out = indptr.copy()
    out[8] = out[7] - 1  # row 7 would hold -1 values
    return out


def _starting_at_3(indptr: np.ndarray) -> np.ndarray:
    return indptr + 3


@pytest.mark.parametrize(
    ("indptr_of", "match"),
    [
        (_decreasing_at_row_7, r"decreases at row 7: indptr\[7\] = \d+ > indptr\[8\] = \d+"),
        (_starting_at_3, r"indptr\[0\] is 3, not 0"),
    ],
    ids=["decreasing", "not-from-0"],
)
def test_bad_indptr_names_its_first_bad_offset(tmp_path: Path, indptr_of, match: str) -> None:
    """Offsets that decrease or do not start at 0 were refused as "must start at 0 and never
    decrease" (convert: "must hold 121 non-decreasing offsets from 0 (has 121)"), naming
    neither which rule failed nor where: on a 10**8-row store the row could not be found.
    Both open_dataset and convert name the first bad offset and how to re-write it."""
    from dali_zarr.convert import convert

    adata = make_adata()
    path = write_store(tmp_path / "ip.zarr", adata)
    replace_array(path, "X/indptr", indptr_of(adata.X.indptr))
    with pytest.raises(dz.DatasetError, match=rf"ip\.zarr/X/indptr: {match}.*re-write"):
        dz.open_dataset(path)
    with pytest.raises(dz.DatasetError, match=rf"ip\.zarr/X/indptr: {match}.*re-write"):
        convert(path, tmp_path / "out.zarr")


def test_two_d_indptr_reports_its_shape(tmp_path: Path) -> None:
    adata = make_adata()
    path = write_store(tmp_path / "ip2.zarr", adata)
    replace_array(path, "X/indptr", np.stack([adata.X.indptr] * 2, axis=1))
    with pytest.raises(
        dz.DatasetError, match=rf"X/indptr: has shape \({N_OBS + 1}, 2\) for {N_OBS} rows"
    ):
        dz.open_dataset(path)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_stale_consolidated_metadata_is_refused(tmp_path: Path, zarr_format: int) -> None:
    """anndata consolidates a store's metadata, and zarr does not update that copy when an
    array is rewritten: X's new chunks were decoded with its old dtype (garbage), and a
    layer added later was called missing. Which copy matches the chunks depends on how the
    array was written, so a disagreement is refused, naming the fix."""
    adata = make_adata(sparse=False)
    path = write_store(tmp_path / "stale.zarr", adata, zarr_format=zarr_format)
    counts = (adata.X * 10).astype(np.int32)
    group = zarr.open_group(path, mode="a", use_consolidated=False)
    attrs = dict(group["X"].attrs)
    x = group.create_array("X", shape=counts.shape, dtype="i4", chunks=(7, 5), overwrite=True)
    x[...] = counts
    x.attrs.update(attrs)
    layer = group["layers"].create_array("new", shape=counts.shape, dtype="f4", chunks=(9, 4))
    layer[...] = counts + 1
    with pytest.raises(dz.DatasetError, match=r"stale\.zarr/X: .*consolidated metadata"):
        dz.open_dataset(path)
    with pytest.raises(dz.DatasetError, match=r"layers/new.*consolidate_metadata"):
        dz.open_dataset(path, element="layers/new")
    with pytest.raises(dz.DatasetError, match=r"X: .*consolidated metadata"):  # no escape
        dz.open_dataset(path, force_zarr=True)
    zarr.consolidate_metadata(path)  # what the errors ask for
    got = epoch(dz.open_dataset(path))
    np.testing.assert_array_equal(got["X"], counts[got["index"]])
    got = epoch(dz.open_dataset(path, element="layers/new"))
    np.testing.assert_array_equal(got["X"], counts[got["index"]] + 1)


def test_obs_annotated_after_consolidation_is_named(tmp_path: Path) -> None:
    """Re-annotating obs after anndata consolidated the store (a category added, a split
    column added) gave zarr's raw "cannot reshape" and "no column 'split'" (it is there)."""
    path = write_store(tmp_path / "notes.zarr", make_adata())
    obs = zarr.open_group(path, mode="a", use_consolidated=False)["obs"]
    names = np.array(["a", "b", "c", "d"], dtype=object)
    obs["cell_type"].create_array("categories", shape=(4,), dtype=str, overwrite=True)[...] = names
    obs.create_array("split", shape=(N_OBS,), dtype="i1")[...] = 1
    dataset = dz.open_dataset(path)
    with pytest.raises(dz.DatasetError, match=r"obs/cell_type/categories: .*consolidated"):
        dataset.categories("cell_type")
    with pytest.raises(dz.DatasetError, match=r"no column 'split'.*It is on disk"):
        dataset.obs_column("split")
    zarr.consolidate_metadata(path)  # what the errors ask for
    dataset = dz.open_dataset(path)
    assert dataset.categories("cell_type") == ("a", "b", "c", "d")
    assert set(epoch(dataset, obs=["split"])["split"].tolist()) == {1}


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_arrays_deleted_after_consolidation_are_refused(tmp_path: Path, zarr_format: int) -> None:
    """The consolidated copy still lists arrays deleted from disk since (obs rewritten
    without a column, a CSR X rewritten dense through ``anndata.io.write_elem``): zarr
    reads their missing chunks as fill values, so the column's labels all came as code 0
    (categories ``''``) and every row of X as zeros, with no error."""
    import anndata as ad

    adata = make_adata()
    path = write_store(tmp_path / "gone.zarr", adata, zarr_format=zarr_format)
    group = zarr.open_group(path, mode="a", use_consolidated=False)
    with ad.settings.override(zarr_write_format=zarr_format):
        ad.io.write_elem(group, "obs", adata.obs[["score"]])  # cell_type dropped
        ad.io.write_elem(group, "X", adata.X.toarray())  # X/data, X/indptr, ... gone
    with pytest.raises(dz.DatasetError, match=r"gone\.zarr/X/\w+: .*no metadata file.*consol"):
        dz.open_dataset(path)
    zarr.consolidate_metadata(path)  # what the error asks for: the store as it is on disk
    dataset = dz.open_dataset(path)
    got = epoch(dataset, obs=["score"])
    np.testing.assert_array_equal(got["X"], adata.X.toarray()[got["index"]])
    with pytest.raises(dz.DatasetError, match=r"no column 'cell_type'"):
        dataset.obs_column("cell_type")


def test_obs_column_deleted_after_consolidation_is_refused(tmp_path: Path) -> None:
    """An obs column the consolidated copy lists but that is gone from disk read as fill
    values: every label code 0, categories ``('', '', '')``."""
    path = write_store(tmp_path / "gone.zarr", make_adata())
    del zarr.open_group(path, mode="a", use_consolidated=False)["obs/cell_type"]
    dataset = dz.open_dataset(path)
    with pytest.raises(dz.DatasetError, match=r"obs/cell_type/\w+: .*no metadata file.*consol"):
        dataset.obs_column("cell_type")


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_arrays_made_groups_after_consolidation_are_refused(tmp_path: Path, zarr_format: int):
    """A numeric obs column made categorical (clusters as labels) and a dense X made sparse
    after consolidation: the copy's arrays are groups on disk now, and zarr read them as
    fill values (every value 0, every row of X zeros), with no error."""
    import anndata as ad

    adata = make_adata(sparse=False, obs_extra={"leiden": np.arange(N_OBS) % 4 + 1})
    path = write_store(tmp_path / "regrouped.zarr", adata, zarr_format=zarr_format)
    obs = adata.obs.copy()
    obs["leiden"] = pd.Categorical(obs["leiden"].astype(str))
    group = zarr.open_group(path, mode="a", use_consolidated=False)
    with ad.settings.override(zarr_write_format=zarr_format):
        ad.io.write_elem(group, "obs", obs)
    with pytest.raises(dz.DatasetError, match=r"obs/leiden: .*holds a group, not an array"):
        dz.open_dataset(path).obs_column("leiden")
    with ad.settings.override(zarr_write_format=zarr_format):
        ad.io.write_elem(group, "X", sp.csr_matrix(adata.X))
    with pytest.raises(dz.DatasetError, match=r"regrouped\.zarr/X: .*holds a group, not an"):
        dz.open_dataset(path)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_var_index_renamed_after_consolidation_is_refused(tmp_path: Path, zarr_format: int):
    """var rewritten with a named index (``var/symbol``) after consolidation: the copy's
    ``var/_index`` is gone from disk, so every var name read as ``''`` and ``features=`` by
    any name said "not in the store's var index"."""
    import anndata as ad

    path = write_store(tmp_path / "renamed.zarr", make_adata(), zarr_format=zarr_format)
    group = zarr.open_group(path, mode="a", use_consolidated=False)
    symbols = pd.Index([f"S{j}" for j in range(N_VARS)], name="symbol")
    with ad.settings.override(zarr_write_format=zarr_format):
        ad.io.write_elem(group, "var", pd.DataFrame(index=symbols))
    with pytest.raises(dz.DatasetError, match=r"renamed\.zarr/var/_index: .*no metadata file"):
        dz.open_dataset(path, features=["S3"])
    zarr.consolidate_metadata(path)
    got = epoch(dz.open_dataset(path, features=["S3", "S0"]))
    np.testing.assert_array_equal(got["X"], make_adata().X.toarray()[got["index"]][:, [3, 0]])


def test_int64_csr_values_densify_rounded_once(tmp_path: Path) -> None:
    """Past 2**53, int64 + float32 went through float64 and rounded twice (one float32 step
    off what output="csr", dense int64 stores and NumPy give)."""
    adata = make_adata()
    big = np.array([2**60 + 2**36 + 1, 2**62 - 1, 2**53 + 1], dtype=np.int64)
    adata.X = adata.X.astype(np.int64)
    adata.X.data = np.resize(big, adata.X.nnz) * np.sign(adata.X.data).astype(np.int64)
    path = write_store(tmp_path / "i64.zarr", adata)
    expected = adata.X.toarray().astype(np.float32)
    assert not np.array_equal(expected, adata.X.toarray().astype(np.float64).astype(np.float32))
    for output in ("dense", "csr"):
        got = epoch(dz.open_dataset(path), output=output)
        np.testing.assert_array_equal(got["X"], expected[got["index"]])


@pytest.mark.parametrize("key", ["data", "indices"])
def test_two_d_csr_data_or_indices_are_refused_at_open(tmp_path: Path, key: str) -> None:
    """A column vector of values (nnz, 1) passed open and died in the DALI graph."""
    adata = make_adata()
    path = write_store(tmp_path / "v.zarr", adata)
    replace_array(path, f"X/{key}", getattr(adata.X, key)[:, None])
    with pytest.raises(dz.DatasetError, match=rf"X/{key}: has shape \({adata.X.nnz}, 1\)"):
        dz.open_dataset(path)


@pytest.mark.parametrize("shape", [[N_OBS, 11.5], [N_OBS, "twelve"], [N_OBS, -1], [N_OBS]])
def test_bad_shape_attribute_is_refused(tmp_path: Path, shape: list) -> None:
    """[n, 11.5] was truncated to 11 columns; text raised a bare ValueError."""
    path = write_store(tmp_path / "shape.zarr", make_adata())
    set_x_shape(path, shape)
    with pytest.raises(
        dz.DatasetError, match=r"shape\.zarr/X: 'shape' attribute is .* two non-negative integers"
    ):
        dz.open_dataset(path)


@pytest.mark.parametrize("width", [N_VARS + 5, N_VARS - 2])
def test_csr_width_other_than_var_is_refused(tmp_path: Path, width: int) -> None:
    path = write_store(tmp_path / "wide.zarr", make_adata())
    set_x_shape(path, [N_OBS, width])
    with pytest.raises(
        dz.DatasetError,
        match=rf"wide\.zarr/var/_index: var has {N_VARS} names but wide\.zarr/X is {width} ",
    ):
        dz.open_dataset(path)


def test_dense_x_wider_than_var_is_refused(tmp_path: Path) -> None:
    path = write_store(tmp_path / "wide.zarr", make_adata(sparse=False))
    replace_array(path, "X", np.zeros((N_OBS, N_VARS + 3), np.float32))
    with pytest.raises(
        dz.DatasetError, match=rf"var has {N_VARS} names but wide\.zarr/X is {N_VARS + 3} "
    ):
        dz.open_dataset(path)


# --- X values anndata reads -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("features", "columns", "output"),
    [
        ([5, 2, 11], [5, 2, 11], "dense"),
        (["g5", "g2"], [5, 2], "csr"),
        (np.arange(N_VARS) % 2 == 0, list(range(0, N_VARS, 2)), "dense"),
    ],
    ids=["ids-dense", "names-csr", "mask-dense"],
)
def test_float16_csr_with_features_matches_anndata(
    tmp_path: Path, features, columns: list[int], output: str
) -> None:
    """float16 X/data through a feature selection crashed in the numba column filter.

    anndata cannot read float16 CSR (scipy has no float16), so the reference is the matrix
    anndata wrote, whose small integer counts float16 holds exactly."""
    adata = make_adata()
    path = write_store(tmp_path / "half.zarr", adata, zarr_format=2)
    half = adata.X.data.astype(np.float16)
    assert np.array_equal(half, adata.X.data)
    replace_array(path, "X/data", half)
    reference = adata.X.toarray()[:, columns]
    got = epoch(dz.open_dataset(path, features=features), output=output)
    np.testing.assert_array_equal(got["X"], reference[got["index"]].astype(np.float32))


def test_three_d_obsm_entry_matches_anndata(tmp_path: Path) -> None:
    """An N-D obsm entry is valid AnnData; element="obsm/cube" refused it as "not 2-D"."""
    import anndata as ad

    adata = make_adata()
    adata.obsm["cube"] = np.random.default_rng(1).random((N_OBS, 2, 3)).astype(np.float32)
    path = write_store(tmp_path / "cube.zarr", adata)
    reference = ad.read_zarr(path).obsm["cube"]
    dataset = dz.open_dataset(path, element="obsm/cube")
    assert dataset.feature_shape == (2, 3)
    got = epoch(dataset)
    np.testing.assert_array_equal(got["X"], reference[got["index"]])


# --- obs columns ----------------------------------------------------------------------------


def test_names_stored_as_fixed_length_bytes_read_as_text(tmp_path: Path) -> None:
    """var names and category labels stored as ``S`` (bytes) arrays read as "b'g1'": no name
    given to features= matched, though anndata reads the var names as "g1"."""
    import anndata as ad

    adata = make_adata()
    path = write_store(tmp_path / "bytes.zarr", adata)
    index = zarr.open_group(path, mode="r")["var"].attrs["_index"]
    names = np.array([f"g{i}".encode() for i in range(N_VARS)], dtype="S3")
    replace_array(path, f"var/{index}", names)
    replace_array(path, "obs/cell_type/categories", np.array([b"a", b"b", b"c"]))
    ds = dz.open_dataset(path)
    assert ds.var_names() == tuple(ad.read_zarr(path).var_names)  # anndata decodes them too
    assert ds.var_names()[:2] == ("g0", "g1")
    assert ds.categories("cell_type") == ("a", "b", "c")
    panel = dz.open_dataset(path, features=["g5", "g2"])
    np.testing.assert_array_equal(epoch(panel)["X"], epoch(ds)["X"][:, [5, 2]])
    assert dz.open_dataset(path, features=np.array([b"g5", b"g2"])).var_names() == ("g5", "g2")


@pytest.mark.parametrize("key", ["obs/depth", "X/indptr"])
def test_arrays_zarr_reads_byte_swapped_are_refused_at_open(tmp_path: Path, key: str) -> None:
    """A v3 array with a numcodecs delta filter before a big-endian bytes codec: zarr-python
    reads it byte-swapped (depth 3 as 50331648), and obs columns and indptr are read through
    zarr at open: the labels arrived wrong without a word, the row offsets as "truncated"."""
    from zarr.codecs import BytesCodec
    from zarr.codecs import numcodecs as znc

    depth = np.arange(N_OBS, dtype=np.int32) * 3
    path = write_store(tmp_path / "a.zarr", make_adata(obs_extra={"depth": depth}))
    group = zarr.open_group(path, mode="a")
    parent, _, name = key.rpartition("/")
    values = np.asarray(group[key][...]).astype(np.int32)
    attrs = dict(group[key].attrs)
    array = group[parent].create_array(
        name, shape=values.shape, dtype=values.dtype, chunks=(16,), overwrite=True,
        filters=[znc.Delta(dtype="int32")], serializer=BytesCodec(endian="big"),
    )  # fmt: skip
    array[...] = values
    array.attrs.update(attrs)
    zarr.consolidate_metadata(path)
    assert not np.array_equal(zarr.open_array(path / key, mode="r")[...], values)
    with pytest.raises(
        dz.DatasetError,
        match=rf"a\.zarr/{key}: zarr-python would read this array \(it is read whole at open\)"
        r".*'numcodecs\.delta'.*big-endian.*Re-write the array with BytesCodec\(endian='little'\)",
    ):
        epoch(dz.open_dataset(path), obs=["depth"])


def test_float16_obs_column_arrives_as_float32(tmp_path: Path) -> None:
    """A float16 column failed at the first batch ("no DALI equivalent"), naming no column."""
    import anndata as ad

    half = np.random.default_rng(2).random(N_OBS).astype(np.float16)
    path = write_store(tmp_path / "h.zarr", make_adata(obs_extra={"h": half}))
    reference = ad.read_zarr(path).obs["h"].to_numpy()
    assert reference.dtype == np.float16
    got = epoch(dz.open_dataset(path), obs=["h"])
    assert got["h"].dtype == np.float32
    np.testing.assert_array_equal(got["h"], reference[got["index"]].astype(np.float32))


@pytest.mark.parametrize("how", ["float", "nan"])
def test_float_category_codes_are_refused(tmp_path: Path, how: str) -> None:
    """Codes 0.999999 were truncated to 0 (the wrong label); NaN became -2**63."""
    adata = make_adata()
    path = write_store(tmp_path / "cat.zarr", adata, zarr_format=2)
    stored = adata.obs["cell_type"].cat.codes.to_numpy()
    codes = np.where(stored > 0, stored - 1e-6, 0).astype(np.float32)
    if how == "nan":
        codes = stored.astype(np.float32)
        codes[3] = np.nan
    replace_array(path, "obs/cell_type/codes", codes)
    dataset = dz.open_dataset(path)
    with pytest.raises(
        dz.DatasetError, match=r"cat\.zarr/obs/cell_type/codes: dtype float32 is not an integer"
    ):
        dz.Loader(dataset, sampler(), device="cpu", obs=["cell_type"])


@pytest.mark.parametrize("column", ["score", "cell_type"])
def test_two_d_obs_columns_are_refused(tmp_path: Path, column: str) -> None:
    """A 2-D numeric column or 2-D codes passed open and failed inside the DALI graph."""
    adata = make_adata()
    path = write_store(tmp_path / "o2.zarr", adata)
    if column == "score":
        key, values = "obs/score", adata.obs["score"].to_numpy()
    else:
        key, values = "obs/cell_type/codes", adata.obs["cell_type"].cat.codes.to_numpy()
    replace_array(path, key, np.stack([values, values], axis=1))
    dataset = dz.open_dataset(path)
    with pytest.raises(
        dz.DatasetError, match=rf"o2\.zarr/{key}: has shape \({N_OBS}, 2\), but obs columns are"
    ):
        dz.Loader(dataset, sampler(), device="cpu", obs=[column])


@pytest.mark.parametrize(
    ("column", "missing", "encoding"),
    [("cell_type", "categories", "categorical"), ("cell_type", "codes", "categorical"),
     ("ni", "mask", "nullable-integer")],
)  # fmt: skip
def test_obs_columns_missing_an_array_are_named(
    tmp_path: Path, column: str, missing: str, encoding: str
) -> None:
    ni = pd.array([1, 2, 3] * (N_OBS // 3), dtype="Int64")
    path = write_store(tmp_path / "sub.zarr", make_adata(obs_extra={"ni": ni}))
    del zarr.open_group(path, mode="a")[f"obs/{column}/{missing}"]
    zarr.consolidate_metadata(path)
    dataset = dz.open_dataset(path)
    with pytest.raises(
        dz.DatasetError,
        match=rf"sub\.zarr/obs/{column}: a {encoding} column needs an array '{missing}', "
        "which is missing",
    ):
        dataset.obs_column(column)


# --- unreadable metadata and what is not a store --------------------------------------------


def test_unreadable_array_metadata_is_named(tmp_path: Path) -> None:
    """Raw JSONDecodeError / TypeError before; a v3 array with invalid zarr.json "missing"."""
    adata = make_adata()
    v2 = write_store(tmp_path / "v2.zarr", adata, zarr_format=2)
    os.remove(v2 / ".zmetadata")
    (v2 / "X" / "data" / ".zarray").write_text("{not json")
    with pytest.raises(dz.DatasetError, match=r"v2\.zarr/X/data: its Zarr metadata cannot be read"):
        dz.open_dataset(v2)

    obs = write_store(tmp_path / "obs.zarr", adata, zarr_format=2)
    os.remove(obs / ".zmetadata")
    (obs / "obs" / "score" / ".zarray").write_text("[]")
    with pytest.raises(
        dz.DatasetError, match=r"obs\.zarr/obs/score: its Zarr metadata cannot be read"
    ):
        dz.open_dataset(obs).obs_column("score")

    v3 = write_store(tmp_path / "v3.zarr", adata)
    root = json.loads((v3 / "zarr.json").read_text())
    root.pop("consolidated_metadata", None)
    (v3 / "zarr.json").write_text(json.dumps(root))
    (v3 / "X" / "indices" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "array"}')
    with pytest.raises(
        dz.DatasetError, match=r"v3\.zarr/X/indices: its Zarr metadata cannot be read"
    ):
        dz.open_dataset(v3)


def test_a_plain_group_with_one_unreadable_array_loads_the_others(tmp_path: Path) -> None:
    """In a plain group, one array with unreadable metadata made every element= (a healthy
    array beside it too) fail with a bare JSONDecodeError; "./a" raised zarr's ValueError."""
    path = tmp_path / "vars.zarr"
    group = zarr.open_group(path, mode="w")
    values = np.arange(12, dtype="f4").reshape(6, 2)
    group.create_array("good", data=values, chunks=(3, 2))
    group.create_group("sub").create_array("bad", data=values, chunks=(3, 2))
    group.create_array("worse", data=values, chunks=(3, 2))
    (path / "sub" / "bad" / "zarr.json").write_text("{not json")
    (path / "worse" / "zarr.json").write_text("{not json")
    dataset = dz.open_dataset(path, element="good")
    np.testing.assert_array_equal(dataset.read_rows(np.array([[0, 6]])).values, values)
    for element in ("sub/bad", "worse"):
        with pytest.raises(dz.DatasetError, match=rf"vars\.zarr/{element}: its Zarr metadata "
                           r"cannot be read"):  # fmt: skip
            dz.open_dataset(path, element=element)
    with pytest.raises(dz.DatasetError, match=r"pass element='good' \(arrays here: good\)"):
        dz.open_dataset(path)
    with pytest.raises(dz.DatasetError, match=r"element='\./good' is not a path.*'\.' or '\.\.'"):
        dz.open_dataset(path, element="./good")


def _lacks(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


@pytest.mark.skipif(not (_lacks("zfpy") and _lacks("imagecodecs")), reason="codecs installed")
def test_a_codec_this_python_lacks_is_named_with_what_to_install(tmp_path: Path) -> None:
    """A v3 numcodecs.zfpy array without zfpy opened, then failed at the first batch with
    "the store may be truncated or corrupted: re-write the array"; a v2 compressor that no
    package registers was "metadata cannot be read ... (e.g. a fill_value ...)"."""
    values = np.arange(40, dtype="f4").reshape(10, 4)
    group = zarr.open_group(tmp_path / "g.zarr", mode="w")
    group.create_array("zfp", data=values, chunks=(4, 4))
    meta_file = tmp_path / "g.zarr" / "zfp" / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["codecs"] = [{"name": "numcodecs.zfpy", "configuration": {"mode": 4}}]
    meta_file.write_text(json.dumps(meta))
    for source, element in ((tmp_path / "g.zarr", "zfp"), (tmp_path / "g.zarr" / "zfp", None)):
        with pytest.raises(dz.DatasetError, match=r"zfp: codec 'numcodecs\.zfpy' is not "
                           r"available in this Python.*run pip install zfpy"):  # fmt: skip
            dz.open_dataset(source, element=element)

    v2 = tmp_path / "v2.zarr"
    zarr.create_array(v2, data=values, chunks=(4, 4), zarr_format=2)
    meta = json.loads((v2 / ".zarray").read_text())
    meta["compressor"] = {"id": "imagecodecs_jpegxl", "level": 3}
    (v2 / ".zarray").write_text(json.dumps(meta))
    nested = tmp_path / "nested.zarr"
    zarr.open_group(nested, mode="w", zarr_format=2)
    os.rename(v2, nested / "x")
    for source, element in ((nested / "x", None), (nested, "x")):
        with pytest.raises(dz.DatasetError, match=r"x: codec 'imagecodecs_jpegxl' is not "
                           r"available.*run pip install imagecodecs"):  # fmt: skip
            dz.open_dataset(source, element=element)


@pytest.mark.parametrize(
    ("dtype", "advice"),
    [
        ("c8", r"holds complex numbers.*np\.stack\(\[z\.real, z\.imag\], axis=-1\)"),
        ("M8[s]", r"holds dates or durations.*astype\('int64'\)"),
        ("U3", r"holds text.*return_index=True"),
    ],
)
def test_an_array_of_values_batches_cannot_carry_says_what_to_store(
    tmp_path: Path, dtype: str, advice: str
) -> None:
    """The message "dtype complex64 is not numeric" was wrong of complex values and said
    nothing of what to store instead."""
    path = tmp_path / "a.zarr"
    zarr.create_array(path, shape=(6, 2), chunks=(3, 2), dtype=dtype, zarr_format=2)
    with pytest.raises(dz.DatasetError, match=rf"a\.zarr: dtype \S+ {advice}"):
        dz.open_dataset(path)


def test_a_zipped_store_says_how_to_open_it(tmp_path: Path) -> None:
    """A zip file was "not a Zarr store ... pass the directory that holds zarr.json"."""
    path = tmp_path / "cells.zarr.zip"
    with zarr.storage.ZipStore(path, mode="w") as store:
        zarr.create_array(store, data=np.arange(12, dtype="f4").reshape(6, 2), chunks=(3, 2))
    with pytest.raises(dz.DatasetError, match=r"cells\.zarr\.zip: is a zip file.*pass "
                       r"zarr\.storage\.ZipStore\('.*cells\.zarr\.zip', mode='r'\)"):  # fmt: skip
        dz.open_dataset(path)
    from dali_zarr.inspection import inspect_store  # `dali-zarr inspect` said to convert it

    with pytest.raises(dz.DatasetError, match=r"is a zip file.*or unzip it to a folder"):
        inspect_store(path)
    dataset = dz.open_dataset(zarr.storage.ZipStore(path, mode="r"))  # the advice works
    assert dataset.read_rows(np.array([[0, 6]])).values.sum() == 66


def test_array_with_a_bad_fill_value_is_not_called_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "fill.zarr"
    zarr.create_array(path, shape=(64, 4), dtype="i4", chunks=(16, 4), zarr_format=2)
    meta = json.loads((path / ".zarray").read_text())
    meta["fill_value"] = "NaN"
    (path / ".zarray").write_text(json.dumps(meta))
    with pytest.raises(dz.DatasetError) as info:
        dz.open_dataset(path)
    assert "its Zarr metadata (.zarray) cannot be read" in str(info.value)
    assert "not a Zarr store" not in str(info.value)


@pytest.mark.parametrize("group_format", [2, 3])
def test_anndata_inside_a_plain_group_is_pointed_at(tmp_path: Path, group_format: int) -> None:
    """Also where the group is in the other Zarr format (zarr 3 makes v3 groups, anndata
    0.12 writes v2 stores): zarr lists a group's members in its own format only, and the
    error named no store."""
    from anndata.io import write_elem

    root = tmp_path / "nested.zarr"
    write_elem(zarr.open_group(root, mode="w", zarr_format=2), "sample1", make_adata())
    if group_format == 3:  # the same v2 store inside a v3 group
        (root / ".zgroup").unlink()
        zarr.open_group(root, mode="a", zarr_format=3)
    hint = r"It holds AnnData stores: open one of nested\.zarr/sample1\."
    with pytest.raises(dz.DatasetError, match=rf"neither an AnnData store .*{hint}"):
        dz.open_dataset(root)
    with pytest.raises(
        dz.DatasetError,
        match=rf"'sample1/X' is a group \(encoding-type 'csr_matrix'\), not an array.*{hint}"
        if group_format == 2
        # zarr does not reach into the v2 store (the hint had blamed consolidated metadata)
        else rf"has no array 'sample1/X'.*{hint} .*in Zarr format 2 inside a format 3 group",
    ):
        dz.open_dataset(root, element="sample1/X")
    assert dz.open_dataset(root / "sample1").n_obs == N_OBS


def test_a_path_through_an_array_is_missing_not_corrupt(tmp_path: Path) -> None:
    """In a consolidated store zarr answers a path through an array (``obs/score/x``, an
    obs name with a slash) with a bare KeyError, which had been called corrupt metadata."""
    path = write_store(tmp_path / "c.zarr", make_adata())
    ds = dz.open_dataset(path)
    with pytest.raises(dz.DatasetError, match="no column 'score/x'"):
        ds.obs_column("score/x")


def test_a_batch_larger_than_memory_is_refused_by_name(tmp_path: Path) -> None:
    """An array whose rows are absurdly wide (here 2**36 float32 values, 256 GiB a row) had
    failed with NumPy's MemoryError or DALI's bad_alloc; it is refused up front, by name.
    Only metadata is written: the chunks are all missing (fill value)."""
    path = tmp_path / "wide.zarr"
    zarr.create_array(path, shape=(64, 2**36), dtype="f4", chunks=(8, 2**20), zarr_format=3)
    ds = dz.open_dataset(path)
    # a window of sampler()'s 2 chunks of 32 rows, 256 GiB a row
    with pytest.raises(
        dz.ConfigError,
        match=r"wide\.zarr: a window of 64 rows x 68,719,476,736 features is 16,384 GiB, more",
    ):
        dz.Loader(ds, sampler())


def test_a_legacy_h5sparse_matrix_loads_as_it_converts(tmp_path: Path) -> None:
    """anndata before 0.7 wrote sparse X with ``h5sparse_format`` / ``h5sparse_shape``. The
    layout check took such a group as CSR, but only ``convert`` read its shape, so the
    loader refused the store it recognised; one shape reader serves both now."""
    adata = make_adata()
    path = write_store(tmp_path / "legacy.zarr", adata, zarr_format=2)
    attrs = zarr.open_group(path, mode="a")["X"].attrs
    shape = list(attrs["shape"])
    for key in list(attrs):
        del attrs[key]
    attrs.update({"h5sparse_format": "csr", "h5sparse_shape": shape})
    zarr.consolidate_metadata(path)
    got = epoch(dz.open_dataset(path))
    np.testing.assert_array_equal(got["X"], adata.X.toarray()[got["index"]])


def test_a_collection_whose_obs_dtypes_would_round_values_is_refused(tmp_path: Path) -> None:
    """int64 beside uint64 (or a float) in one column of a collection joined as float64:
    2**60 + 1 arrived as 2**60, with no error. It is refused naming the stores and dtypes;
    a mix that keeps every value (int8 beside int16) still loads, exactly."""
    big = np.full(N_OBS, 2**60 + 1, dtype=np.int64)
    a = write_store(tmp_path / "a.zarr", make_adata(obs_extra={"v": big, "w": np.int8(-3)}))
    b = write_store(
        tmp_path / "b.zarr",
        make_adata(obs_extra={"v": np.full(N_OBS, 2**63 + 5, np.uint64), "w": np.int16(300)}),
    )
    ds = dz.open_dataset([a, b])
    with pytest.raises(
        dz.DatasetError,
        match=r"obs column 'v': joining its dtypes \(a.zarr.* \(int64\), b.zarr.* \(uint64\)\) "
        r"gives float64, which changes values of a.zarr.*, b.zarr",
    ):
        dz.Loader(ds, dz.ChunkSampler(chunk_size=40, preload_nchunks=3, batch_size=40), obs=["v"])
    w = ds.obs_column("w").values
    assert w.dtype == np.int16 and w.tolist() == [-3] * N_OBS + [300] * N_OBS


def test_inspect_calls_a_nullable_column_with_missing_values_not_batchable(
    tmp_path: Path,
) -> None:
    """inspect said a nullable column with missing values was batchable; the Loader refuses
    it. A nullable column without missing values stays batchable."""
    from dali_zarr.inspection import inspect_store

    gaps = pd.array([1, None] + [3] * (N_OBS - 2), dtype="Int64")
    full = pd.array([True] * N_OBS, dtype="boolean")
    path = write_store(tmp_path / "n.zarr", make_adata(obs_extra={"gaps": gaps, "full": full}))
    info = {o.name: o.batchable for o in inspect_store(path).obs}
    assert (info["gaps"], info["full"]) == (False, True)
    with pytest.raises(dz.DatasetError, match=r"obs/gaps: 1 missing values"):
        dz.Loader(dz.open_dataset(path), dz.ChunkSampler(chunk_size=40, preload_nchunks=3,
                                                         batch_size=40), obs=["gaps"])  # fmt: skip


def test_a_column_categorical_in_one_store_and_numeric_in_another_names_both(
    tmp_path: Path,
) -> None:
    a = write_store(tmp_path / "a.zarr", make_adata(obs_extra={"k": pd.Categorical(["x"] * N_OBS)}))
    b = write_store(tmp_path / "b.zarr", make_adata(obs_extra={"k": np.arange(N_OBS)}))
    with pytest.raises(
        dz.DatasetError,
        match=r"'k' is categorical .*: a.zarr.* \(categorical\), b.zarr.* \(numeric\)",
    ):
        dz.open_dataset([a, b]).obs_column("k")


def test_an_ordered_categorical_ranked_otherwise_in_another_store_is_refused(
    tmp_path: Path,
) -> None:
    """Categories are merged first-seen, so an ordered column (a disease stage, which a
    model may read as ranks) ranked low < high in one store and low < mid < high in
    another got mid's code above high's, silently. Stores that agree on the ranking (or
    add categories at its end) join, and keep the order; any other mix is refused."""

    def stage(path: Path, categories: list[str], *, ordered: bool = True) -> Path:
        values = pd.Categorical([categories[i % len(categories)] for i in range(N_OBS)],
                                categories=categories, ordered=ordered)  # fmt: skip
        return write_store(path, make_adata(obs_extra={"stage": values}))

    a = stage(tmp_path / "a.zarr", ["low", "high"])
    extended = stage(tmp_path / "b.zarr", ["low", "high", "severe"])
    joined = dz.open_dataset([a, extended]).obs_column("stage")
    assert joined.categories == ("low", "high", "severe") and joined.ordered
    np.testing.assert_array_equal(joined.values[:4], [0, 1, 0, 1])
    np.testing.assert_array_equal(joined.values[N_OBS : N_OBS + 3], [0, 1, 2])
    assert dz.Subset(dz.open_dataset([a, extended]), [0, 1]).obs_column("stage").ordered
    between = stage(tmp_path / "c.zarr", ["low", "mid", "high"])
    unordered = stage(tmp_path / "d.zarr", ["low", "high"], ordered=False)
    for other, said in ((between, "ordered \\['low', 'mid', 'high'\\]"), (unordered, "unordered")):
        with pytest.raises(dz.DatasetError, match=f"'stage': an ordered categorical .*{said}"):
            dz.open_dataset([a, other]).obs_column("stage")
    assert not dz.open_dataset([unordered, unordered]).obs_column("stage").ordered


@pytest.mark.parametrize("kind", ["csr", "dense-smaller", "sharded-csr"])
def test_a_store_rewritten_while_a_loader_reads_it_is_refused(tmp_path: Path, kind: str) -> None:
    """A loader keeps what it read at open (a CSR's row offsets, shapes, shard indexes). A
    store rewritten under it (a new convert or anndata write to the same path) gave rows of
    neither store, zeros past a smaller store's end, or a misleading "corrupted" error."""

    path = tmp_path / "moving.zarr"

    def write(seed: int) -> None:
        if kind == "dense-smaller":
            synthetic.make_dense_cube(path, n_obs=400 - 200 * seed, shape=(6,), seed=seed)
        else:
            shards = 4 if kind == "sharded-csr" else None
            synthetic.make_single_cell(
                path, n_obs=400, n_features=30, chunk_elements=256, shard_chunks=shards, seed=seed
            )

    write(0)
    loader = dz.Loader(dz.open_dataset(path), sampler(), device="cpu", num_threads=1)
    try:
        assert sum(len(b["X"]) for b in loader) == 400
        write(1)
        loader.set_epoch(1)
        with pytest.raises(
            dz.DatasetError, match=r"moving\.zarr.*changed since the store was opened"
        ):
            next(iter(loader))
    finally:
        loader.close()


#: where a rewrite test runs its loader: the CPU path, the GPU path's window reader on the
#: host backend (CI), and the GPU path itself (kvikio, nvCOMP; on a GPU only)
WHERE = ["cpu", "gpu-path-on-host", pytest.param("gpu", marks=[pytest.mark.gpu, needs_cuda])]


def _device(where: str) -> dict:
    """The loader's device arguments for a :data:`WHERE` entry."""
    from dali_zarr.graph.window_backends import HostBackend

    if where == "gpu-path-on-host":
        return {"device": "gpu", "gpu_backend": HostBackend()}
    return {"device": where}


@pytest.mark.parametrize("where", WHERE)
def test_a_store_rewritten_in_the_middle_of_an_epoch_is_refused(tmp_path: Path, where) -> None:
    """The check ran only as an epoch started: a store rewritten during the epoch served the
    rest of it as rows of neither store. Each window is now checked before and after it is
    read; what came before the rewrite is the old store's rows, then the loader refuses."""
    from dali_zarr import synthetic

    path = tmp_path / "moving.zarr"

    def write(seed: int) -> None:
        # written beside it, then swapped in: the prefetch thread reads meanwhile, and a
        # store deleted file by file under a read can read as zeros before its metadata
        # file goes (the check cannot see that; this test is about what it can see)
        synthetic.make_single_cell(
            tmp_path / "new.zarr", n_obs=2_000, n_features=30, chunk_elements=256,
            shard_chunks=4, seed=seed,
        )  # fmt: skip
        if path.exists():
            path.rename(tmp_path / f"old{seed}.zarr")
        (tmp_path / "new.zarr").rename(path)

    write(0)
    old = zarr.open_group(path)
    old_x = sp.csr_matrix(
        (old["X/data"][...], old["X/indices"][...], old["X/indptr"][...]), shape=(2_000, 30)
    ).toarray()
    loader = dz.Loader(
        dz.open_dataset(path), sampler(), num_threads=1, return_index=True, prefetch_windows=1,
        **_device(where),
    )  # fmt: skip
    served = 0
    try:
        with pytest.raises(dz.DatasetError, match=r"moving\.zarr.*changed since the store"):
            for i, batch in enumerate(loader):
                index = batch["index"].cpu().numpy()
                np.testing.assert_array_equal(batch["X"].cpu().numpy(), old_x[index])
                served += len(index)
                if i == 0:
                    write(1)
    finally:
        loader.close()
    assert 0 < served < 2_000, served  # a few windows read ahead of the rewrite, not the epoch


@pytest.mark.parametrize("layout", ["sharded store", "unsharded store in a collection"])
@pytest.mark.parametrize("where", WHERE)
def test_row_offsets_rewritten_in_place_are_refused(tmp_path: Path, where, layout) -> None:
    """A CSR's ``indptr`` is read at open. Rewritten in place (``g["X/indptr"][:] = ...``,
    same shape and nnz, no metadata file touched) beside new ``data`` and ``indices``
    (which are read anew), every later row was cut at the old offsets, with no error. Its
    files are now stamped at open and checked around each window and before each epoch."""
    from dali_zarr import synthetic

    sharded = layout == "sharded store"
    path = synthetic.make_single_cell(
        tmp_path / "moving.zarr", n_obs=2_000, n_features=30, chunk_elements=256,
        shard_chunks=4 if sharded else None,
    )  # fmt: skip
    group = zarr.open_group(path, mode="r+")
    n = 2_000
    old = sp.csr_matrix(
        (group["X/data"][...], group["X/indices"][...], group["X/indptr"][...]), shape=(n, 30)
    )
    new = old[np.random.default_rng(1).permutation(n)]  # the same nnz, other row lengths
    assert (new.indptr != old.indptr).any() and new.nnz == old.nnz
    dataset = dz.open_dataset(path)
    if not sharded:
        other = synthetic.make_single_cell(tmp_path / "other.zarr", n_obs=100, n_features=30)
        dataset = dz.Collection([dataset, dz.open_dataset(other)])
    loader = dz.Loader(
        dataset, sampler(), num_threads=1, return_index=True, prefetch_windows=1,
        **_device(where),
    )  # fmt: skip
    old_x, served = old.toarray(), 0
    try:
        with pytest.raises(dz.DatasetError, match=r"moving\.zarr/X/indptr: its values were"):
            for i, batch in enumerate(loader):
                index = batch["index"].cpu().numpy()
                mine = index[index < n]  # the collection's other store is not rewritten
                np.testing.assert_array_equal(batch["X"].cpu().numpy()[index < n], old_x[mine])
                served += len(index)
                if i == 0:
                    for key in ("indptr", "data", "indices"):
                        group[f"X/{key}"][:] = getattr(new, key)
        assert 0 < served < dataset.n_obs, served  # windows read ahead of it, not the epoch
        loader.set_epoch(1)  # ... and refused again as the next epoch starts
        with pytest.raises(dz.DatasetError, match=r"indptr/.* changed\), and they were read"):
            next(iter(loader))
    finally:
        loader.close()


def _compressible_store(tmp_path: Path, shards) -> Path:
    """400 x 16 float32 counting up, zstd, chunks of 10 rows (sharded by ``shards`` or not):
    values that compress well, so that random values rewritten in place change the sizes."""
    path = tmp_path / "inplace.zarr"
    z = zarr.create_array(
        path, shape=(400, 16), chunks=(10, 16), shards=shards, dtype="float32",
        compressors=zarr.codecs.ZstdCodec(),
    )  # fmt: skip
    z[...] = np.arange(400 * 16, dtype=np.float32).reshape(400, 16)
    return path


@pytest.mark.parametrize("shards", [(100, 16), None], ids=["sharded", "unsharded"])
@pytest.mark.parametrize("where", WHERE)
def test_values_rewritten_in_place_are_read_anew(tmp_path: Path, where: str, shards) -> None:
    """zarr rewrites a whole shard (or chunk file) when its values change (``z[:] = new``),
    with other sizes, but not the array's metadata, and deletes a chunk set to the fill
    value. Sharded: the reader's cached shard indexes cut the new files at the old offsets
    ("corrupted"); a shard file that changed is indexed again. Unsharded: the GPU path's
    byte plans (which cache each chunk file's size rather than stat it every window) failed
    the window as a corrupted or missing chunk; a plan that fails with chunk files changed
    since their sizes were taken is planned again, once."""
    path = _compressible_store(tmp_path, shards)
    loader = dz.Loader(
        dz.open_dataset(path), sampler(), return_index=True, num_threads=1, **_device(where)
    )
    new = np.random.default_rng(0).standard_normal((400, 16)).astype(np.float32)
    new[:10] = 0  # the fill value: zarr deletes the chunk (or keeps it in the shard)
    try:
        assert sum(len(b["X"]) for b in loader) == 400
        zarr.open_array(path, mode="r+")[...] = new  # incompressible: other offsets
        loader.set_epoch(1)
        got = np.zeros_like(new)
        for batch in loader:
            got[batch["index"].cpu().numpy()] = batch["X"].cpu().numpy()
    finally:
        loader.close()
    np.testing.assert_array_equal(got, new)


@pytest.mark.parametrize("meanwhile", ["alone", "another window planned again"])
@pytest.mark.parametrize("shards", [(100, 16), None], ids=["sharded", "unsharded"])
def test_values_rewritten_between_a_windows_plan_and_its_read_are_read_anew(
    tmp_path: Path, shards, meanwhile: str
) -> None:
    """The GPU path plans a window's reads, then reads: values rewritten in between (a
    writer of the store, or another window's reads in flight on the other read threads) leave
    the plan's files at other sizes, and the read refuses them. It planned again only where
    ``forget_changed_chunks`` forgot a chunk: never for shards (their indexes are stamped as
    planned), and not for chunks that another window, failing first, had forgotten and
    located anew. The window failed as a "truncated or corrupted" chunk, while the CPU path
    read the new values; it is now planned again wherever its files changed."""
    from dali_zarr.graph.window_backends import HostBackend

    path = _compressible_store(tmp_path, shards)
    new = np.random.default_rng(0).standard_normal((400, 16)).astype(np.float32)

    class WriterBetween(HostBackend):
        """Rewrites the values once, after the first plan was made and before it runs."""

        written = False

        def run_plan(self, plan, reader, out) -> None:
            if not self.written:
                self.written = True
                zarr.open_array(path, mode="r+")[...] = new  # incompressible: other sizes
                if meanwhile != "alone":  # what a window failing first on its thread does
                    reader.forget_changed_chunks()
                    reader.chunk_locations(np.arange(40))
            super().run_plan(plan, reader, out)

    loader = dz.Loader(
        dz.open_dataset(path), sampler(), return_index=True, num_threads=1, device="gpu",
        gpu_backend=WriterBetween(),
    )  # fmt: skip
    got = np.zeros_like(new)
    try:
        for batch in loader:
            got[batch["index"].cpu().numpy()] = batch["X"].cpu().numpy()
    finally:
        loader.close()
    np.testing.assert_array_equal(got, new)


@pytest.mark.parametrize("where", WHERE)
def test_a_shard_rewritten_at_the_same_size_under_a_window_is_read_anew(
    tmp_path: Path, monkeypatch, where: str
) -> None:
    """A window reads its shards' indexes (the GPU path: plans its reads from them), then the
    chunks. A shard rewritten in between at the same size, its chunks at other offsets, was
    read at the old ones on both paths: rows of other chunks, with no error, since only the
    size was compared. The file read is now compared by inode, modification time and size,
    and the window reads the new values."""
    v1, _, v2, want = same_size_shards(tmp_path)
    load_shards = DirectReader._load_shards
    rewrites: list[Path] = []

    def load_then_rewrite(self, shards) -> None:
        load_shards(self, shards)
        if not rewrites:  # a writer of the store, once: a new file renamed over the shard
            rewrites.append(v1 / "c" / "0" / "0")
            shutil.copyfile(v2 / "c" / "0" / "0", tmp_path / "next")
            os.replace(tmp_path / "next", rewrites[0])

    monkeypatch.setattr(DirectReader, "_load_shards", load_then_rewrite)
    loader = dz.Loader(
        dz.open_dataset(v1), sampler(), return_index=True, num_threads=1, **_device(where)
    )
    got = np.full_like(want, np.nan)
    try:
        for batch in loader:
            got[batch["index"].cpu().numpy()] = batch["X"].cpu().numpy()
    finally:
        loader.close()
    assert rewrites
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("where", WHERE)
def test_a_collection_of_like_stores_reads_values_rewritten_in_place_and_names_a_bad_chunk(
    tmp_path: Path, where: str
) -> None:
    """Stores written alike (a collection of plates) share one byte plan per array on the GPU
    path, run through a stand-in reader of all of them that had no
    ``forget_changed_chunks``: a chunk rewritten in place, and a corrupted one, ended the
    epoch in a bare AttributeError. The rewrite now reads anew, and the damage is named by
    its store and chunk, as on the CPU path."""
    paths = []
    for k in range(2):
        z = zarr.create_array(
            tmp_path / f"plate{k}.zarr", shape=(400, 16), chunks=(10, 16), dtype="float32",
            compressors=zarr.codecs.ZstdCodec(),
        )  # fmt: skip
        z[...] = np.arange(400 * 16, dtype=np.float32).reshape(400, 16) + k
        paths.append(tmp_path / f"plate{k}.zarr")
    loader = dz.Loader(
        dz.open_dataset(paths), sampler(), return_index=True, num_threads=1, **_device(where)
    )
    new = np.random.default_rng(0).standard_normal((400, 16)).astype(np.float32)
    try:
        assert sum(len(b["X"]) for b in loader) == 800
        zarr.open_array(paths[1], mode="r+")[...] = new  # incompressible: other sizes
        loader.set_epoch(1)
        got = np.zeros((800, 16), dtype=np.float32)
        for batch in loader:
            got[batch["index"].cpu().numpy()] = batch["X"].cpu().numpy()
        np.testing.assert_array_equal(got[400:], new)
    finally:
        loader.close()
    with open(paths[1] / "c" / "3" / "0", "r+b") as f:
        f.write(b"garbage!")  # not a zstd frame any more
    loader = dz.Loader(dz.open_dataset(paths), sampler(), num_threads=1, **_device(where))
    try:
        with pytest.raises(dz.ChunkReadError, match=r"plate1\.zarr: chunk 'c/3/0'"):
            for _ in loader:
                pass
    finally:
        loader.close()


@pytest.mark.parametrize("compressors", [None, "zstd"])
def test_a_shard_rewritten_to_fill_values_reads_as_fill(tmp_path: Path, compressors) -> None:
    """zarr deletes a shard whose values are all set to the fill value (metadata unchanged).
    The reader saw the file change but kept the shard's old index, so both the host read
    and a planned (GPU-path) read failed on the vanished file as "corrupted"; the shard
    now reads as the fill value, as zarr reads it."""
    from dali_zarr.io import open_reader
    from dali_zarr.io.gpu import execute_plan_cpu, plan_rows

    path = tmp_path / "refilled.zarr"
    z = zarr.create_array(
        path, shape=(40, 3), chunks=(4, 3), shards=(8, 3), dtype="float32", fill_value=0,
        compressors=zarr.codecs.ZstdCodec() if compressors else None,
    )  # fmt: skip
    z[...] = np.arange(1, 121, dtype=np.float32).reshape(40, 3)
    reader = open_reader(zarr.open_array(path, mode="r"), name="refilled.zarr")
    ranges = np.array([[0, 40]])
    reader.read_rows(ranges)  # shard indexes cached
    z[0:8] = 0  # shard c/0/0 deleted
    z[12:14] = 5  # shard c/1/0 rewritten
    assert not (path / "c" / "0" / "0").exists()
    want = zarr.open_array(path, mode="r")[...]
    np.testing.assert_array_equal(reader.read_rows(ranges), want)
    np.testing.assert_array_equal(execute_plan_cpu(plan_rows(reader, ranges), reader), want)


def test_synthetic_stores_take_only_the_codecs_they_name(tmp_path):
    """``make_single_cell(codec=...)``: an unknown name is refused, not written as Blosc (the
    GPU tests' "v2-lz4" CSR store was Blosc for that reason, so nvCOMP's LZ4 never ran on CSR
    there), and ``lz4`` writes bare LZ4 blocks, which zarr v3's own codecs cannot."""
    with pytest.raises(ValueError, match="codec='lz5': use 'zstd', 'blosc', 'lz4' or 'none'"):
        synthetic.make_single_cell(
            tmp_path / "a.zarr", n_obs=10, n_features=4, n_types=2, codec="lz5"
        )
    with pytest.raises(ValueError, match="codec='lz4' needs zarr_format=2"):
        synthetic.make_single_cell(
            tmp_path / "b.zarr", n_obs=10, n_features=4, n_types=2, codec="lz4"
        )
    path = synthetic.make_single_cell(
        tmp_path / "c.zarr", n_obs=10, n_features=4, n_types=2, codec="lz4", zarr_format=2
    )
    for name in ("data", "indices"):
        assert type(zarr.open_array(f"{path}/X/{name}").compressors[0]).__name__ == "LZ4"


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("n_obs", [64, 0])
def test_chunks_with_a_zero_length_axis_are_refused_by_name(
    tmp_path: Path, zarr_format: int, n_obs: int
) -> None:
    """zarr writes metadata with chunk shape (0, 4) without complaint; opening such an array
    raised a bare ZeroDivisionError from the chunk grid."""
    path = tmp_path / "zero.zarr"
    zarr.create_array(path, shape=(n_obs, 4), dtype="f4", chunks=(0, 4), zarr_format=zarr_format)
    with pytest.raises(dz.DatasetError, match=r"zero\.zarr has chunk shape \(0, 4\)") as info:
        dz.open_dataset(path)
    assert "chunks of at least 1 along every axis" in str(info.value)


def _unsharded_store(tmp_path: Path) -> Path:
    """400 cells in unsharded chunks of 256 values (chunk files ``X/data/c/0``, ...)."""
    return Path(
        synthetic.make_single_cell(
            tmp_path / "s.zarr", n_obs=400, n_features=30, n_types=2, chunk_elements=256,
            shard_chunks=None,
        )
    )  # fmt: skip


def _attributes_updated_and_chunk_broken(path: Path) -> None:
    """A rewrite under a read: ``X/data``'s metadata file rewritten (an attribute update)
    and its first chunk no longer a zstd frame."""
    zarr.open_array(str(path / "X" / "data"), mode="r+").attrs["note"] = "rewritten"
    (path / "X" / "data" / "c" / "0").write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 40)


@pytest.mark.parametrize("force_zarr", [False, True], ids=["direct", "zarr-python"])
def test_a_read_broken_by_a_rewrite_under_it_names_the_rewrite(tmp_path: Path, force_zarr):
    """The metadata file is checked before and after each read, but a read that the rewrite
    broke failed first, as a corrupted chunk: the user was told to look for damage, not to
    reopen. It now fails with the rewrite's error, the chunk's error chained to it. (The
    rewrite happens as the read's first task is submitted: after the check before it.)"""
    import concurrent.futures

    from dali_zarr.errors import ChunkReadError
    from dali_zarr.io.readers import open_reader

    path = _unsharded_store(tmp_path)

    class RewriteAtFirstTask(concurrent.futures.ThreadPoolExecutor):
        rewritten = False

        def submit(self, *args, **kwargs):
            if not self.rewritten:
                self.rewritten = True
                _attributes_updated_and_chunk_broken(path)
            return super().submit(*args, **kwargs)

    with RewriteAtFirstTask(2) as executor:
        array = zarr.open_array(str(path / "X" / "data"), mode="r")
        reader = open_reader(array, name="s.zarr/X/data", executor=executor, force_zarr=force_zarr)
        ranges = np.array([[0, 100], [900, 1_000]])  # chunks 0 and 3: two tasks
        with pytest.raises(dz.DatasetError, match=r"s\.zarr/X/data: the array changed") as e:
            reader.read_rows(ranges)
        assert executor.rewritten and isinstance(e.value.__context__, ChunkReadError)


@pytest.mark.parametrize("where", WHERE[1:])
def test_a_gpu_path_window_broken_by_a_rewrite_under_it_names_the_rewrite(
    tmp_path: Path, where: str
):
    """As above for the GPU path's window reader (on the host backend, and on a GPU), whose
    byte plans bypass the readers: the rewrite happens as the window's plan starts to run."""
    from dali_zarr.errors import ChunkReadError
    from dali_zarr.graph.gpu_pipeline import GpuBatchSource
    from dali_zarr.graph.window_backends import CudaBackend, HostBackend

    path = _unsharded_store(tmp_path)
    base = HostBackend if where == "gpu-path-on-host" else CudaBackend

    class RewriteAtFirstPlan(base):
        rewritten = False

        def run_plan(self, plan, reader, out) -> None:
            if not self.rewritten:
                self.rewritten = True
                _attributes_updated_and_chunk_broken(path)
            super().run_plan(plan, reader, out)

    backend = RewriteAtFirstPlan()
    sampler = dz.ChunkSampler(chunk_size=400, preload_nchunks=1, batch_size=100, shuffle=False)
    source = GpuBatchSource(dz.open_dataset(path), sampler, output="dense", obs=[],
                            return_index=False, backend=backend)  # fmt: skip
    try:
        source.bind_epoch(0, 0)
        with pytest.raises(dz.DatasetError, match=r"s\.zarr/X/data: the array changed") as e:
            source.read_window((0, (0, ()), 0))
        assert backend.rewritten and isinstance(e.value.__context__, ChunkReadError)
    finally:
        source.close()


def test_an_anndata_object_is_pointed_to_write_zarr(tmp_path: Path) -> None:
    """``open_dataset(adata)`` (the AnnData in memory, or backed) advised writing "in-memory
    data to a Zarr array" with ``zarr.create_array``: the store would lose obs, var and the
    CSR layout. It now names ``adata.write_zarr``."""
    import anndata as ad

    x = sp.random(8, 3, density=0.5, format="csr", dtype=np.float32, random_state=0)
    adata = ad.AnnData(X=x)
    with pytest.raises(dz.ConfigError, match=r"not an AnnData object.*adata\.write_zarr"):
        dz.open_dataset(adata)
    adata.write_h5ad(tmp_path / "a.h5ad")
    backed = ad.read_h5ad(tmp_path / "a.h5ad", backed="r")
    with pytest.raises(dz.ConfigError, match=r"dali-zarr convert .*a\.h5ad"):
        dz.open_dataset(backed)
    backed.file.close()
    with pytest.raises(dz.ConfigError, match=r"not a ndarray.*zarr\.create_array"):
        dz.open_dataset(np.zeros((4, 2)))  # other in-memory data: as before


def test_a_truncated_blosc_obs_column_is_refused_not_misread(tmp_path: Path) -> None:
    """obs columns are read by zarr-python, which trusts a blosc chunk's header: a column
    chunk cut short (anndata's v2 codec is blosc) was decoded past its end, and
    ``obs=["v"]`` delivered other memory's bytes beside the right X, without an error. The
    chunk's size is now checked against its header first, and the chunk is named."""
    import anndata as ad

    rng = np.random.default_rng(0)
    obs = pd.DataFrame({"v": rng.normal(size=40)}, index=[f"c{i}" for i in range(40)])
    x = sp.random(40, 6, density=0.5, format="csr", random_state=0, dtype=np.float32)
    with ad.settings.override(zarr_write_format=2):
        ad.AnnData(X=x, obs=obs).write_zarr(tmp_path / "a.zarr")
    column = tmp_path / "a.zarr" / "obs" / "v" / "0"
    assert column.read_bytes()[:1] == b"\x02"  # a blosc frame (its format version)
    column.write_bytes(column.read_bytes()[:-40])
    ds = dz.open_dataset(tmp_path / "a.zarr")
    said = r"a.zarr/obs/v: chunk '0': blosc header says \d+ compressed bytes but the chunk "
    with pytest.raises(dz.ChunkReadError, match=said + r"holds \d+ \(truncated"):
        dz.Loader(ds, dz.ChunkSampler(chunk_size=8, preload_nchunks=2, batch_size=8), obs=["v"])


@pytest.mark.parametrize("sharded", [True, False])
def test_a_truncated_blosc_chunk_zarr_reads_is_refused_before_it_is_misread(
    tmp_path: Path, sharded: bool
) -> None:
    """An array with a transpose codec is read by zarr-python, and its blosc chunks were only
    checked where they were whole files: an inner chunk of a shard cut short (the index says
    where it ends; zarr never compares that with the file) was decoded past the shard's end,
    and a transpose before blosc skipped the check altogether. Both are refused at open now,
    naming the shard or chunk; the direct path refuses the same shard at its first read."""
    from zarr.codecs import BloscCodec, BytesCodec, ShardingCodec, TransposeCodec

    values = np.arange(32 * 8, dtype=np.float32).reshape(32, 8) + 1
    chain = [TransposeCodec(order=(1, 0)), BytesCodec(), BloscCodec(cname="lz4", clevel=1)]
    if sharded:
        serializer = ShardingCodec(chunk_shape=(8, 8), codecs=chain, index_location="start")
        kw = {"serializer": serializer, "compressors": None}
    else:
        kw = {"filters": chain[:1], "serializer": chain[1], "compressors": chain[2:]}
    path = tmp_path / "t.zarr"
    zarr.create_array(path, shape=values.shape, dtype="f4", chunks=(16, 8), **kw)[...] = values
    intact = dz.open_dataset(path)
    assert "transpose" in next(iter(intact.read_paths().values()))
    np.testing.assert_array_equal(intact.read_rows(np.array([[0, 32]])).values, values)
    stored = path / "c" / "1" / "0"
    stored.write_bytes(stored.read_bytes()[:-10])
    said = r"shard 'c/1/0': inner chunk 1 \(in C order\): shard index says bytes \[\d+, \d+\)"
    said = said if sharded else r"chunk 'c/1/0': blosc header says \d+ compressed bytes"
    with pytest.raises(dz.ChunkReadError, match=r"t\.zarr: " + said):
        dz.open_dataset(path)


def test_loader_flags_and_transform_are_checked_when_built(tmp_path: Path) -> None:
    """return_index="no" and enable_checkpointing="no" were taken as True (truthy), and
    transform=5 was accepted, to fail at the first batch with a bare "'int' object is not
    callable" from inside the graph. All are refused when the loader is built, by name."""
    path = tmp_path / "s.zarr"
    synthetic.make_single_cell(path, n_obs=64, n_features=8, chunk_elements=64)
    ds = dz.open_dataset(path)
    sampler = dz.ChunkSampler(chunk_size=8, preload_nchunks=2, batch_size=8)
    for flag in ("return_index", "enable_checkpointing", "allow_uneven_batches"):
        with pytest.raises(dz.ConfigError, match=f"{flag} must be True or False, got 'no'"):
            dz.Loader(ds, sampler, **{flag: "no"})
    with pytest.raises(dz.ConfigError, match=r"transform=5 is not callable"):
        dz.Loader(ds, sampler, transform=5)
    with dz.Loader(ds, sampler, return_index=np.True_) as loader:
        assert sorted(np.concatenate([b["index"] for b in loader])) == list(range(64))


def test_numpy_sizes_urls_flags_and_sparse_arrays_given_as_stores(tmp_path: Path) -> None:
    """Public arguments taken as given: prefetch_queue_depth=np.int64(2) failed at the first
    batch with a bare "an integer is required" (deque's maxlen); np.int32 sampler sizes
    wrapped past 2**31 in the window check ("at most -2147483648 rows"); a file:// URL from
    Path.as_uri() kept its %20; force_zarr="no" switched the slow reader on; bytes paths
    failed deep inside; and X/data of an AnnData store, opened by its path, loaded as a
    dense dataset of one "observation" per non-zero. Each is taken or refused by name."""
    path = tmp_path / "with space ü.zarr"
    synthetic.make_single_cell(path, n_obs=64, n_features=8, chunk_elements=64)
    ds = dz.open_dataset(path.as_uri())
    assert ds.n_obs == 64 and dz.open_dataset(os.fsencode(path)).n_obs == 64
    sampler = dz.ChunkSampler(chunk_size=np.int64(8), preload_nchunks=np.int64(2),
                              batch_size=np.int64(8))  # fmt: skip
    with dz.Loader(ds, sampler, prefetch_queue_depth=np.int64(2), num_threads=np.int32(1),
                   return_index=True) as loader:  # fmt: skip
        assert sorted(np.concatenate([b["index"] for b in loader])) == list(range(64))
    big = dz.ChunkSampler(chunk_size=np.int32(65536), preload_nchunks=np.int32(32768),
                          batch_size=np.int32(4096))  # fmt: skip
    assert big.window_rows == 2**31 and type(big.chunk_size) is int
    with pytest.raises(dz.ConfigError, match="force_zarr must be True or False, got 'no'"):
        dz.open_dataset(path, force_zarr="no")
    with pytest.raises(dz.ConfigError, match="mask_and_scale= takes True, False or None, not 1"):
        dz.open_dataset(path, mask_and_scale=1)
    with pytest.raises(dz.ConfigError, match=r"names a host \('cells\.zarr'\).*file:///"):
        dz.open_dataset("file://cells.zarr")
    with pytest.raises(dz.ConfigError, match="empty path"):
        dz.open_dataset("")
    for array in ("data", "indices", "indptr"):
        with pytest.raises(dz.DatasetError, match=f"{array}: is an array of a sparse matrix"):
            dz.open_dataset(path / "X" / array)
        with pytest.raises(dz.DatasetError, match="X: is an array of a sparse matrix"):
            dz.open_dataset(path / "X", element=array)
    node = zarr.open_group(path, mode="r")["X/data"]  # a node: its group is in its store
    with pytest.raises(dz.DatasetError, match="is an array of a sparse matrix"):
        dz.open_dataset(node)
    zarr.open_group(tmp_path / "plain.zarr", mode="w")  # a plain group holding a CSR group
    shutil.copytree(path / "X", tmp_path / "plain.zarr" / "counts")
    with pytest.raises(dz.DatasetError, match=r"plain\.zarr: is an array of a sparse matrix"):
        dz.open_dataset(tmp_path / "plain.zarr", element="counts/data")


def test_arguments_of_the_wrong_kind_are_refused_by_name(tmp_path: Path) -> None:
    """Each was a raw AttributeError from deep inside, or silently taken: Subset(ds,
    [True, 3]) was the rows {1, 3}; a uint64 row id past 2**63 was reported negative;
    gpu_backend="x" failed with "'str' object has no attribute 'path'", and any
    gpu_backend was ignored with device="cpu"; build_pipeline(dataset) and
    ds.categories(1) failed on attributes their arguments lack."""
    from dali_zarr.graph.window_backends import HostBackend

    path = tmp_path / "s.zarr"
    synthetic.make_single_cell(path, n_obs=64, n_features=8, chunk_elements=64)
    ds = dz.open_dataset(path)
    with pytest.raises(
        dz.DatasetError, match=r"rows mixes booleans with other values \(bool, int\)"
    ):
        dz.Subset(ds, [True, 3])
    with pytest.raises(dz.DatasetError, match=r"row id 9223372036854775813 is outside \[0, 64\)"):
        dz.Subset(ds, np.array([2**63 + 5], dtype=np.uint64))
    sampler = dz.ChunkSampler(chunk_size=8, preload_nchunks=2, batch_size=8)
    with pytest.raises(dz.ConfigError, match=r"gpu_backend='x' is not a window backend"):
        dz.Loader(ds, sampler, device="auto", gpu_backend="x")
    with pytest.raises(dz.ConfigError, match=r"gpu_backend= drives the GPU path"):
        dz.Loader(ds, sampler, device="cpu", gpu_backend=HostBackend())
    with pytest.raises(dz.ConfigError, match=r"build_pipeline takes a BatchSource, not CsrDataset"):
        dz.build_pipeline(ds)
    with pytest.raises(dz.ConfigError, match=r"categories\(\) takes an obs column's name, not 1"):
        ds.categories(1)
