"""Training on an AnnData element other than X: layers, raw/X, obsm, obsp (open_dataset, the
loader's CPU and GPU-wiring paths, convert, inspect, bench), on stores written by anndata."""

from __future__ import annotations

import base64
import json
import struct
import warnings
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import zarr

import dali_zarr as dz
from dali_zarr.cli import main
from dali_zarr.convert import convert
from tests.test_gpu_loader import WHERE, assert_same_batches, both, gpu_kwargs
from tests.test_loader import assert_rows_match, run_epoch, sampler

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

N_OBS, N_VARS, N_RAW_VARS = 600, 30, 45


def make_adata(seed: int = 0, n_obs: int = N_OBS) -> ad.AnnData:
    """Normalised X, integer counts (CSR) and a dense layer, a PCA in obsm, a dataframe in
    obsm, a neighbour graph in obsp, raw/X with more genes, varm (genes on axis 0)."""
    rng = np.random.default_rng(seed)

    def csr(n_rows: int, n_cols: int, dtype) -> sp.csr_matrix:
        m = sp.random(n_rows, n_cols, density=0.15, format="csr", random_state=rng)
        m.data[:] = rng.integers(1, 60, size=m.nnz)
        return m.astype(dtype)

    counts = csr(n_obs, N_VARS, np.int32)
    normalised = counts.astype(np.float32)
    normalised.data = np.log1p(normalised.data)
    obs = pd.DataFrame(
        {"cell_type": pd.Categorical(rng.choice(["B", "T", "NK"], size=n_obs))},
        index=[f"c{seed}_{i}" for i in range(n_obs)],
    )
    var = pd.DataFrame(index=[f"g{j}" for j in range(N_VARS)])
    adata = ad.AnnData(X=normalised, obs=obs, var=var)
    adata.layers["counts"] = counts
    adata.layers["scaled"] = rng.standard_normal((n_obs, N_VARS)).astype(np.float32)
    adata.obsm["X_pca"] = rng.standard_normal((n_obs, 8))  # float64
    adata.obsm["meta"] = pd.DataFrame({"a": np.arange(n_obs)}, index=obs.index)
    adata.obsp["connectivities"] = csr(n_obs, n_obs, np.float32)
    adata.varm["PCs"] = rng.standard_normal((N_VARS, 8))
    raw_var = pd.DataFrame(index=[f"raw_g{j}" for j in range(N_RAW_VARS)])
    adata.raw = ad.AnnData(X=csr(n_obs, N_RAW_VARS, np.float32), obs=obs, var=raw_var)
    return adata


def element_of(adata: ad.AnnData, element: str) -> np.ndarray:
    """What anndata itself holds at ``element``, dense (the oracle)."""
    kind, _, key = element.partition("/")
    value = {
        "X": lambda: adata.X,
        "raw": lambda: adata.raw.X,
        "layers": lambda: adata.layers[key],
        "obsm": lambda: adata.obsm[key],
        "obsp": lambda: adata.obsp[key],
    }[kind]()
    return value.toarray() if sp.issparse(value) else np.asarray(value)


@pytest.fixture(scope="module")
def rich(tmp_path_factory) -> tuple[Path, ad.AnnData]:
    path = tmp_path_factory.mktemp("elements") / "rich.zarr"
    adata = make_adata()
    adata.write_zarr(path)
    return path, ad.read_zarr(path)


LOADABLE = ["X", "raw/X", "layers/counts", "layers/scaled", "obsm/X_pca", "obsp/connectivities"]


def test_store_lists_its_loadable_elements(rich) -> None:
    from dali_zarr.data.elements import available_elements

    # varm (genes on axis 0) and the obsm dataframe are not loadable matrices
    assert available_elements(zarr.open_group(rich[0], mode="r")) == [
        "X",
        "raw/X",
        "layers/counts",
        "layers/scaled",
        "obsm/X_pca",
        "obsp/connectivities",
    ]


@pytest.mark.parametrize("element", LOADABLE)
def test_every_element_loads_like_anndata_reads_it(rich, element: str) -> None:
    path, adata = rich
    want = element_of(adata, element)
    dataset = dz.open_dataset(path, element=element)
    assert (dataset.n_obs, dataset.n_features) == want.shape
    assert dataset.layout == ("dense" if element in ("layers/scaled", "obsm/X_pca") else "csr")
    loader = dz.Loader(dataset, sampler(), obs=["cell_type"], return_index=True)
    got = run_epoch(loader, epoch=1)
    assert got["X"].dtype == np.float32
    assert_rows_match(got, want.astype(np.float32), N_OBS)
    labels = np.array(loader.categories("cell_type"))[got["cell_type"]]
    np.testing.assert_array_equal(labels, adata.obs["cell_type"].to_numpy()[got["index"]])


@pytest.mark.parametrize("element", ["layers/counts", "obsm/X_pca"])
def test_gpu_path_wiring_loads_an_element(rich, element: str) -> None:
    """The GPU path plans byte reads through the element's own readers (host backend here):
    batch for batch what the CPU path delivers, which the test above holds to anndata."""
    dataset = dz.open_dataset(rich[0], element=element)
    cpu, gpu = both(dataset, "host", obs=["cell_type"], return_index=True)
    arrays = (
        [f"rich.zarr/{element}{p}" for p in ("/data", "/indices")]
        if "layers" in element
        else [f"rich.zarr/{element}"]
    )
    assert list(cpu.read_paths()) == list(gpu.read_paths()) == arrays
    # the byte plan of the element's own arrays, not the host read of other datasets
    assert all(p.startswith("host-backend plan") for p in gpu.read_paths().values())
    assert assert_same_batches(cpu, gpu, epochs=(2,)) == len(cpu) > 0


def test_collection_of_layers(tmp_path: Path) -> None:
    paths, blocks = [], []
    for seed, n in enumerate((250, 171)):
        path = tmp_path / f"part{seed}.zarr"
        adata = make_adata(seed, n_obs=n)
        adata.write_zarr(path)
        paths.append(path)
        blocks.append(adata.layers["counts"].toarray())
    dataset = dz.open_dataset(paths, element="layers/counts")
    assert isinstance(dataset, dz.Collection) and dataset.n_obs == 421
    got = run_epoch(dz.Loader(dataset, sampler(chunk_size=16), return_index=True))
    assert_rows_match(got, np.concatenate(blocks).astype(np.float32), 421)


def test_element_errors_name_the_store_and_what_it_has(rich, tmp_path: Path) -> None:
    path, _ = rich
    with pytest.raises(dz.DatasetError, match=r"rich.zarr: AnnData store has no 'layers/nope'.*"
                       r"one of: X, raw/X, layers/counts"):  # fmt: skip
        dz.open_dataset(path, element="layers/nope")
    with pytest.raises(dz.DatasetError, match=r"varm/PCs.*not an element whose rows are obs"):
        dz.open_dataset(path, element="varm/PCs")
    with pytest.raises(dz.DatasetError, match=r"element='obs'.*use X, raw/X, layers/<name>"):
        dz.open_dataset(path, element="obs")
    with pytest.raises(dz.DatasetError, match=r"rich.zarr/obsm/meta: is a dataframe"):
        dz.open_dataset(path, element="obsm/meta")

    # an obsm entry whose rows are not the store's observations
    bad = tmp_path / "bad.zarr"
    adata = make_adata(n_obs=50)
    adata.write_zarr(bad)
    zarr.open_group(bad, mode="r+")["obsm"].create_array("short", shape=(49, 3), dtype="f4")
    zarr.consolidate_metadata(bad)  # anndata consolidates; the new array must show
    with pytest.raises(dz.DatasetError, match=r"bad.zarr/obsm/short: has 49 rows but the "
                       r"store's obs has 50 observations"):  # fmt: skip
        dz.open_dataset(bad, element="obsm/short")

    # an AnnData store that keeps its data in a layer only
    no_x = tmp_path / "no_x.zarr"
    ad.AnnData(obs=adata.obs, layers={"counts": adata.layers["counts"]}).write_zarr(no_x)
    with pytest.raises(dz.DatasetError, match=r"has no 'X'; nothing to load.*one of: "
                       r"layers/counts"):  # fmt: skip
        dz.open_dataset(no_x)
    assert dz.open_dataset(no_x, element="layers/counts").n_obs == 50
    # a store's sparse X opened as if it were a store: its arrays are no observations, so
    # "pass element='data'" (the advice for a plain group) would load X's values as rows
    with pytest.raises(dz.DatasetError, match=r"sparse matrix group .*element=") as err:
        dz.open_dataset(no_x / "layers" / "counts")
    assert "element='data'" not in str(err.value)


def test_plain_groups_and_arrays(tmp_path: Path) -> None:
    group = zarr.open_group(tmp_path / "climate.zarr", mode="w")
    values = np.arange(120, dtype="f4").reshape(20, 2, 3)
    group.create_group("surface").create_array("t2m", data=values, chunks=(5, 2, 3))
    group.create_array("mask", data=np.ones((20, 4), "u1"), chunks=(10, 4))
    with pytest.raises(dz.DatasetError, match=r"neither an AnnData store.*element='mask'"):
        dz.open_dataset(tmp_path / "climate.zarr")
    dataset = dz.open_dataset(tmp_path / "climate.zarr", element="surface/t2m")
    assert dataset.name == "climate.zarr/surface/t2m" and dataset.feature_shape == (2, 3)
    got = run_epoch(dz.Loader(dataset, sampler(chunk_size=5, batch_size=4), return_index=True))
    np.testing.assert_array_equal(got["X"], values[got["index"]])
    with pytest.raises(dz.DatasetError, match=r"'surface' is a group, not an array \(arrays "
                       r"in it: surface/t2m\)"):  # fmt: skip
        dz.open_dataset(tmp_path / "climate.zarr", element="surface")
    with pytest.raises(dz.DatasetError, match=r"has no array 't2m' \(arrays here: mask, "
                       r"surface/t2m\)"):  # fmt: skip
        dz.open_dataset(tmp_path / "climate.zarr", element="t2m")
    with pytest.raises(dz.ConfigError, match="is a Zarr array, so element='X'"):
        dz.open_dataset(tmp_path / "climate.zarr" / "mask", element="X")


def test_a_group_whose_arrays_are_all_in_subgroups_lists_them(tmp_path: Path) -> None:
    """The arrays of a climate store kept in subgroups (``surface/t2m``) were not listed:
    errors said the group "holds no arrays", and element= a subgroup told the user to
    re-consolidate a store that has no consolidated metadata."""
    path = tmp_path / "era5.zarr"
    group = zarr.open_group(path, mode="w")
    for sub, name in (("surface", "t2m"), ("upper", "z500")):
        group.create_group(sub).create_array(name, data=np.zeros((8, 3), "f4"), chunks=(4, 3))
    listing = r"\(arrays here: surface/t2m, upper/z500\)"
    with pytest.raises(dz.DatasetError, match=r"pass element='surface/t2m' " + listing):
        dz.open_dataset(path)
    with pytest.raises(dz.DatasetError, match=r"has no array 't2m' " + listing):
        dz.open_dataset(path, element="t2m")
    with pytest.raises(dz.DatasetError) as refused:
        dz.open_dataset(path, element="upper")
    message = str(refused.value)
    assert "'upper' is a group, not an array (arrays in it: upper/z500)" in message
    assert "consolidate" not in message and "holds no arrays" not in message
    with pytest.raises(dz.DatasetError, match="holds no arrays"):
        dz.open_dataset(zarr.open_group(tmp_path / "empty.zarr", mode="w"), element="a")


def xarray_like_store(path: Path, zarr_format: int) -> np.ndarray:
    """A store laid out as xarray's ``Dataset.to_zarr`` writes one (written with zarr, so
    the tests need no xarray): dimension coordinates ``time``, ``lat``, ``lon`` beside a
    CF-packed int16 ``t2m`` (``scale_factor``, ``add_offset``, ``_FillValue``) and a float32
    ``sst`` with a NaN fill. Returns t2m's stored integers."""
    group = zarr.open_group(path, mode="w", zarr_format=zarr_format)
    v3 = zarr_format == 3

    def variable(name: str, data: np.ndarray, dims: tuple[str, ...], **attrs) -> None:
        fill = attrs.pop("_FillValue", None)
        attrs = {**attrs, "_FillValue": fill} if v3 and fill is not None else attrs
        fill = np.nan if data.dtype.kind == "f" else (0 if v3 else fill)
        extra = {"dimension_names": dims} if v3 else {}
        attrs = attrs if v3 else {**attrs, "_ARRAY_DIMENSIONS": list(dims)}
        chunks = (7, *data.shape[1:])
        array = group.create_array(name, data=data, chunks=chunks, fill_value=fill, **extra)
        array.attrs.update(attrs)

    rng = np.random.default_rng(0)
    packed = rng.integers(-3000, 3000, (30, 3, 4)).astype("i2")
    packed[4, 1, 2] = -32767  # missing
    variable("time", np.arange(30, dtype="i8"), ("time",), units="days since 2000-01-01")
    variable("lat", np.linspace(-10, 10, 3), ("lat",))
    variable("lon", np.linspace(0, 30, 4), ("lon",))
    variable("t2m", packed, ("time", "lat", "lon"),
             scale_factor=0.01, add_offset=280.0, _FillValue=-32767)  # fmt: skip
    nan = "AAAAAAAA+H8=" if v3 else np.nan  # xarray writes a v3 float fill as base64 bytes
    sst = rng.random((30, 3, 4), dtype="f4")
    sst[7:14] = np.nan  # a whole chunk of fill: zarr writes no file for it
    variable("sst", sst, ("time", "lat", "lon"), _FillValue=nan)
    zarr.consolidate_metadata(path)
    return packed


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_cf_packed_variables_warn_at_open(tmp_path: Path, zarr_format: int) -> None:
    """A CF-packed variable (xarray's int16 + scale_factor/add_offset encoding) arrived as
    its stored integers without a word: a t2m of 280 K trained on as -32767..32767 counts.
    README promises the raw values; opening one now warns, naming the array, its attributes
    and the transform that unpacks them. A float variable with a NaN fill does not warn."""
    path = tmp_path / "era5.zarr"
    packed = xarray_like_store(path, zarr_format)
    with pytest.warns(dz.PackedValuesWarning) as caught:
        dataset = dz.open_dataset(path, element="t2m")
    assert len(caught) == 1
    message = str(caught[0].message)
    for part in ("era5.zarr/t2m", "scale_factor=0.01", "add_offset=280.0", "_FillValue=-32767",
                 "arrives as -32767, not NaN"):  # fmt: skip
        assert part in message, (part, message)
    assert "mask_and_scale=True" in message and "mask_and_scale=False" in message
    got = run_epoch(dz.Loader(dataset, sampler(chunk_size=7, batch_size=4), return_index=True))
    np.testing.assert_array_equal(got["X"], packed[got["index"]])  # still raw, as promised

    def unpack(out):  # a transform of one's own still sees the stored values
        return {**out, "X": out["X"] * 0.01 + 280.0}

    loader = dz.Loader(
        dataset, sampler(chunk_size=7, batch_size=4), return_index=True, transform=unpack
    )
    got = run_epoch(loader)
    expected = packed.astype("f4") * np.float32(0.01) + np.float32(280.0)
    np.testing.assert_allclose(got["X"], expected[got["index"]], rtol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sst = dz.open_dataset(path, element="sst")
        dz.open_dataset(path, element="time")  # units, but nothing packed
    got = run_epoch(dz.Loader(sst, sampler(chunk_size=7, batch_size=4), return_index=True))
    np.testing.assert_array_equal(got["X"], zarr.open_array(path / "sst")[:][got["index"]])
    assert np.isnan(got["X"][(got["index"] >= 7) & (got["index"] < 14)]).all()


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_xarray_store_opened_at_its_root_suggests_a_variable(
    tmp_path: Path, zarr_format: int
) -> None:
    """An xarray store opened at its root was told "pass element='lat'": its first array by
    name, a dimension coordinate whose rows are 3 latitudes, not the 30 time steps. The
    advice now names a data variable, and the coordinates as such."""
    path = tmp_path / "era5.zarr"
    xarray_like_store(path, zarr_format)
    with pytest.raises(dz.DatasetError) as refused:
        dz.open_dataset(path)
    message = str(refused.value)
    assert "pass element='sst'" in message, message
    assert "arrays here: lat, lon, sst, t2m, time" in message
    assert "lat, lon, time are coordinates" in message
    # a curvilinear grid: 2-D coordinates named by the variable's `coordinates` attribute
    group = zarr.open_group(tmp_path / "curvilinear.zarr", mode="w", zarr_format=zarr_format)
    for name, shape in (("lat2d", (4, 5)), ("lon2d", (4, 5)), ("tas", (20, 4, 5))):
        group.create_array(name, data=np.zeros(shape, "f4"), chunks=shape)
    group["tas"].attrs["coordinates"] = "lat2d lon2d"
    with pytest.raises(dz.DatasetError, match=r"pass element='tas' .* lat2d, lon2d are coord"):
        dz.open_dataset(tmp_path / "curvilinear.zarr")


def test_element_as_a_list_of_variables_is_refused_by_name(tmp_path: Path) -> None:
    """``element=["t2m", "sst"]`` (two variables as channels, as xarray users ask for them)
    failed with a bare AttributeError: 'list' object has no attribute 'strip'."""
    path = tmp_path / "era5.zarr"
    xarray_like_store(path, 2)
    with pytest.raises(dz.ConfigError, match=r"element= takes one array's path, got "
                       r"\['t2m', 'sst'\].*to_dataarray"):  # fmt: skip
        dz.open_dataset(path, element=["t2m", "sst"])


# ---------------------------------------------------------------------------- command line


def cli(*argv: object) -> int:
    return main([str(a) for a in argv])


def test_convert_resolves_elements_like_open_dataset(tmp_path: Path, capsys) -> None:
    """convert picks (and refuses) a plain group's array as open_dataset does."""
    group = zarr.open_group(tmp_path / "climate.zarr", mode="w")
    values = np.arange(120, dtype="f4").reshape(20, 6)
    group.create_group("surface").create_array("t2m", data=values, chunks=(5, 6))
    dst = tmp_path / "t2m.zarr"
    assert cli("convert", tmp_path / "climate.zarr", dst, "--element", "surface/t2m", "-q") == 0
    np.testing.assert_array_equal(zarr.open_array(dst, mode="r")[...], values)
    assert zarr.open_array(dst, mode="r").attrs["dali_zarr"]["element"] == "surface/t2m"
    for source, options, message in [
        (tmp_path / "climate.zarr", (), "neither an AnnData store"),
        (tmp_path / "climate.zarr", ("--element", "surface"), "'surface' is a group, not"),
        (dst, ("--element", "X"), "is a Zarr array, so --element 'X' has nothing to pick"),
    ]:
        assert cli("convert", *options, "-q", source, tmp_path / "o.zarr") == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o.zarr").exists()


def test_a_collection_of_variables_packed_otherwise_is_refused(tmp_path: Path) -> None:
    """Two stores of one variable packed with other scale_factors (netCDF files packed one
    by one, then converted) joined into one collection: a stored 3000 is 310 K in one and
    340 K in the other, and one transform= unpacks one of them wrong, without an error."""
    a, b = tmp_path / "y2000.zarr", tmp_path / "y2001.zarr"
    xarray_like_store(a, 2)
    xarray_like_store(b, 2)
    with pytest.warns(dz.PackedValuesWarning):
        same = dz.open_dataset([a, b], element="t2m")
    assert same.n_obs == 60 and same.packing()["scale_factor"] == 0.01
    zarr.open_array(b / "t2m", mode="r+").attrs["scale_factor"] = 0.02
    zarr.consolidate_metadata(b)
    with pytest.warns(dz.PackedValuesWarning), pytest.raises(
        dz.DatasetError, match=r"y2001.zarr/t2m is packed with .*0.02.* but y2000.zarr/t2m"
    ):  # fmt: skip
        dz.open_dataset([a, b], element="t2m")
    with pytest.warns(dz.PackedValuesWarning):
        parts = [dz.open_dataset(a, element="t2m"), dz.open_dataset(b, element="t2m")]
    with pytest.raises(dz.DatasetError, match="a transform=\\) would unpack one of them wrong"):
        dz.Collection([dz.Subset(parts[0], [1, 2]), parts[1]])


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_convert_keeps_a_packed_variables_attributes(tmp_path: Path, zarr_format: int) -> None:
    """convert of a CF-packed variable wrote its integers without scale_factor, add_offset
    or _FillValue (and fill value 0): nothing could unpack the copy, and opening it no longer
    warned. The packing now travels with the values; inputs packed otherwise are refused."""
    src = tmp_path / "era5.zarr"
    packed = xarray_like_store(src, zarr_format)
    dst = tmp_path / "t2m.zarr"
    convert(src, dst, element="t2m", chunk_rows=8)
    out = zarr.open_array(dst, mode="r")
    np.testing.assert_array_equal(out[...], packed)
    wanted = {"scale_factor": 0.01, "add_offset": 280.0, "_FillValue": -32767}
    assert {k: out.attrs.get(k) for k in wanted} == wanted
    with pytest.warns(dz.PackedValuesWarning, match="scale_factor=0.01, add_offset=280.0"):
        dz.open_dataset(dst)
    other = tmp_path / "other.zarr"
    xarray_like_store(other, zarr_format)
    zarr.open_array(other / "t2m", mode="r+").attrs["scale_factor"] = 0.02
    zarr.consolidate_metadata(other)
    with pytest.raises(dz.DatasetError, match=r"other.zarr/t2m.*scale_factor.*0.02.*0.01"):
        convert([src, other], tmp_path / "both.zarr", element="t2m")
    assert not (tmp_path / "both.zarr").exists()


@pytest.mark.parametrize(
    ("element", "var_names"),
    [
        ("layers/counts", [f"g{j}" for j in range(N_VARS)]),
        ("raw/X", [f"raw_g{j}" for j in range(N_RAW_VARS)]),
        ("obsm/X_pca", [str(j) for j in range(8)]),
    ],
)
@pytest.mark.parametrize("source", ["zarr", "h5ad"])
def test_convert_an_element(rich, tmp_path: Path, element, var_names, source) -> None:
    path, adata = rich
    if source == "h5ad":
        path = tmp_path / "rich.h5ad"
        adata.write_h5ad(path)
    dst = tmp_path / "out.zarr"
    assert cli("convert", path, dst, "--element", element, "--chunk-rows", 64, "-q") == 0
    back = ad.read_zarr(dst)
    want = element_of(adata, element)
    got = back.X.toarray() if sp.issparse(back.X) else back.X
    np.testing.assert_array_equal(got, want)
    assert got.dtype == want.dtype
    assert list(back.var_names) == var_names
    np.testing.assert_array_equal(back.obs["cell_type"], adata.obs["cell_type"])
    assert zarr.open_group(dst, mode="r").attrs["dali_zarr"]["element"] == element


def test_inspect_and_bench_an_element(rich, capsys) -> None:
    path, _ = rich
    assert cli("inspect", path, "--element", "layers/counts", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["element"] == "layers/counts" and report["layout"] == "csr"
    assert report["dtype"] == "int32" and report["elements"][:3] == ["X", "raw/X", "layers/counts"]
    names = [a["name"] for a in report["arrays"]]
    assert names == ["layers/counts/data", "layers/counts/indices", "layers/counts/indptr"]
    assert cli("inspect", path, "--element", "obsm/X_pca") == 0
    text = capsys.readouterr().out
    assert "AnnData store, obsm/X_pca dense" in text
    assert "loadable elements (element=...): X, raw/X, layers/counts" in text
    # what rides beside X: dense obsm entries (not the dataframe obsm/meta)
    assert '\n  beside X (obs=["obsm/<key>"]): obsm/X_pca (8,) float64\n' in text, text
    assert report["beside"] == ["obsm/X_pca (8,) float64"]
    assert cli("bench", path, "--element", "raw/X", "--batches", 2, "--batch-size", 64,
               "--json") == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows"] == 2 * 64
    assert set(summary["read_paths"]) == {"rich.zarr/raw/X/data", "rich.zarr/raw/X/indices"}
    assert cli("inspect", path, "--element", "varm/PCs") == 2
    assert "not an element whose rows are observations" in capsys.readouterr().err


def test_a_mistyped_obsm_key_beside_an_unreadable_entry_is_named(tmp_path: Path) -> None:
    """The refusal of a missing obsm entry lists the others; zarr lists a group by parsing
    every member, so one unreadable .zarray made obs=["obsm/<typo>"] a bare JSONDecodeError.
    The group is listed as inspect lists it (its folder), and the typo is named."""
    path = tmp_path / "broken.zarr"
    adata = make_adata(6)
    adata.obsm["spatial"] = np.zeros((N_OBS, 2))
    with ad.settings.override(zarr_write_format=2):
        adata.write_zarr(path)
    (path / ".zmetadata").unlink()  # zarr lists the group from each member's own file
    (path / "obsm" / "X_pca" / ".zarray").write_text("{")
    dataset = dz.open_dataset(path)
    with pytest.raises(dz.DatasetError) as caught:
        dz.Loader(dataset, sampler(), obs=["obsm/spatail"])
    message = str(caught.value)
    assert "broken.zarr/obsm/spatail: not in the store; its obsm entries: " in message
    assert "X_pca" in message and "spatial" in message, message
    loader = dz.Loader(dataset, sampler(), obs=["obsm/spatial"])  # the readable one rides
    assert next(iter(loader))["obsm/spatial"].shape[1:] == (2,)
    loader.close()


@pytest.mark.parametrize("column", ["obsm/spatial", "cell_type", "X/indptr"])
def test_a_corrupted_chunk_of_what_rides_beside_x_is_named(tmp_path: Path, column: str) -> None:
    """obsm entries, obs columns and a CSR's row offsets are read whole by zarr-python: a
    corrupted chunk stopped the Loader (or open_dataset) with blosc's bare "RuntimeError:
    error during blosc decompression: -1", naming no store, array or chunk. Now the array
    and the chunk are named: a blosc chunk by the check of its size against its header
    before zarr reads it, other failures by the read that fails."""
    path = tmp_path / "bad.zarr"
    adata = make_adata(7)
    adata.obsm["spatial"] = np.random.default_rng(0).random((N_OBS, 2))
    adata.write_zarr(path)
    array = {"obsm/spatial": "obsm/spatial", "cell_type": "obs/cell_type/codes"}.get(column, column)
    chunk = sorted(p for p in (path / array).iterdir() if not p.name.startswith("."))[0]
    chunk.write_bytes(b"garbage, not a blosc frame")
    with pytest.raises(dz.ChunkReadError) as caught:
        obs = [] if column == "X/indptr" else [column]
        dz.Loader(dz.open_dataset(path), sampler(), obs=obs)
    message = str(caught.value)
    assert message.startswith(f"bad.zarr/{array}: chunk '0"), message
    assert "compressed bytes but the chunk holds 26 (truncated" in message, message
    assert "restore this chunk from an intact copy" in message
    chunk.write_bytes(b"\x02\x01")  # cut inside its header
    with pytest.raises(dz.ChunkReadError, match=r"blosc chunk is 2 bytes, shorter than its 16-"):
        dz.Loader(dz.open_dataset(path), sampler(), obs=obs)


def test_inspect_gives_the_dtype_an_obsm_entry_has_in_batches(tmp_path: Path, capsys) -> None:
    """inspect's "beside X" listing gave the stored dtype: float16 (batches hold float32)
    and a v2 big-endian '>f8' or '>i4' (batches hold native float64, int32)."""
    path = tmp_path / "be.zarr"
    with ad.settings.override(zarr_write_format=2):
        make_adata(5).write_zarr(path)
    rng = np.random.default_rng(0)
    entries = {
        "half": rng.random((N_OBS, 3)).astype(np.float16),
        "coords": rng.random((N_OBS, 2)).astype(">f8"),
        "counts": rng.integers(-9, 9, (N_OBS, 4)).astype(">i4"),
    }
    obsm = zarr.open_group(path, mode="r+", use_consolidated=False)["obsm"]
    for key, values in entries.items():
        obsm.create_array(key, shape=values.shape, dtype=values.dtype)[...] = values
    zarr.consolidate_metadata(str(path))
    assert cli("inspect", path, "--json") == 0
    beside = json.loads(capsys.readouterr().out)["beside"]
    loader = dz.Loader(dz.open_dataset(path), sampler(), obs=[f"obsm/{k}" for k in entries])
    batch = next(iter(loader))
    got = {k: str(batch[f"obsm/{k}"].numpy().dtype) for k in entries}
    loader.close()
    assert got == {"half": "float32", "coords": "float64", "counts": "int32"}
    want = sorted(f"obsm/{k} {entries[k].shape[1:]} {got[k]}" for k in entries)
    assert [b for b in beside if b.split()[0][5:] in entries] == want, beside


def test_a_v3_packed_variable_without_fill_value_names_none(tmp_path: Path) -> None:
    """xarray writes a v3 variable's _FillValue as an attribute and leaves the array's fill
    value at zarr's default (0 for int16). A v3 variable packed without _FillValue was read
    as packed with _FillValue=0: the warning said a missing value arrives as 0 (a valid
    count), and the v2 and v3 copies of one variable were refused as one collection."""
    stores = []
    for zarr_format in (2, 3):
        path = tmp_path / f"v{zarr_format}.zarr"
        group = zarr.open_group(path, mode="w", zarr_format=zarr_format)
        dims = {"dimension_names": ("time", "x")} if zarr_format == 3 else {}
        array = group.create_array(
            "t2m", shape=(20, 4), chunks=(8, 4), dtype="i2", fill_value=None, **dims
        )
        array[...] = np.arange(80, dtype="i2").reshape(20, 4)
        array.attrs.update({"scale_factor": 0.01, "add_offset": 280.0})
        if zarr_format == 2:
            array.attrs["_ARRAY_DIMENSIONS"] = ["time", "x"]
        stores.append(path)
    with pytest.warns(dz.PackedValuesWarning) as record:
        both = dz.open_dataset(stores, element="t2m")
    assert both.n_obs == 40
    assert both.packing() == {"scale_factor": 0.01, "add_offset": 280.0}
    assert not any("_FillValue" in str(w.message) for w in record)


def test_a_v2_xarray_variable_with_a_fill_value_warns_as_its_v3_copy(tmp_path: Path) -> None:
    """xarray keeps a v2 variable's _FillValue in the array's fill value, a v3 one's in an
    attribute. A float variable with _FillValue -9999 (netCDF's missing marker, no packing)
    warned in v3 but not in v2, where its -9999s arrived silently; and the two copies were
    refused as one collection ("packed with nothing"). A plain v2 array with a fill value
    (not written by xarray) still does not warn."""
    data = np.ones((20, 3), "f4")
    data[5] = -9999.0
    v2 = zarr.open_group(tmp_path / "v2.zarr", mode="w", zarr_format=2)
    v2.create_array("sst", data=data, chunks=(8, 3), fill_value=-9999.0).attrs.update(
        {"_ARRAY_DIMENSIONS": ["time", "x"]}
    )
    v3 = zarr.open_group(tmp_path / "v3.zarr", mode="w", zarr_format=3)
    v3.create_array("sst", data=data, chunks=(8, 3), dimension_names=("time", "x")).attrs.update(
        {"_FillValue": base64.standard_b64encode(struct.pack("<d", -9999.0)).decode()}
    )
    with pytest.warns(dz.PackedValuesWarning, match=r"v2.zarr/sst: .*_FillValue=-9999.0"):
        dz.open_dataset(tmp_path / "v2.zarr", element="sst")
    with pytest.warns(dz.PackedValuesWarning):
        both = dz.open_dataset([tmp_path / "v2.zarr", tmp_path / "v3.zarr"], element="sst")
    assert both.n_obs == 40 and both.packing() == {"_FillValue": -9999.0}
    plain = zarr.open_group(tmp_path / "plain.zarr", mode="w", zarr_format=2)
    plain.create_array("x", data=data, chunks=(8, 3), fill_value=-9999.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dz.PackedValuesWarning)
        dz.open_dataset(tmp_path / "plain.zarr", element="x")


def cf_decoded_reference(stored: np.ndarray, *, scale=1.0, offset=0.0, fills=()) -> np.ndarray:
    """What xarray's mask_and_scale makes of ``stored`` (already read as unsigned where
    ``_Unsigned`` says so), in float32: a fill is NaN, the rest ``* scale + offset``."""
    out = stored.astype("f4") * np.float32(scale) + np.float32(offset)
    out[np.isin(stored, fills)] = np.nan
    return out


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_mask_and_scale_decodes_cf_packed_values(tmp_path: Path, zarr_format: int) -> None:
    """A CF-packed variable could only be unpacked by a transform, and a missing value
    arrived as -32767 (scaled to 52.33 K by that transform), not NaN: a demanding climate
    user expects what xarray reads. open_dataset(..., mask_and_scale=True) now decodes in
    the graph, on both paths, without the warning; False keeps the stored values, silently."""
    path = tmp_path / "era5.zarr"
    packed = xarray_like_store(path, zarr_format)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dz.PackedValuesWarning)
        decoded = dz.open_dataset(path, element="t2m", mask_and_scale=True)
        raw = dz.open_dataset(path, element="t2m", mask_and_scale=False)
        sst = dz.open_dataset(path, element="sst", mask_and_scale=True)  # NaN fill: as stored
    expected = cf_decoded_reference(packed, scale=0.01, offset=280.0, fills=[-32767])
    assert np.isnan(expected[4, 1, 2]) and np.isnan(expected).sum() == 1
    kw = {"return_index": True}
    for dtype in ("float32", "float16"):
        got = run_epoch(dz.Loader(decoded, sampler(chunk_size=7, batch_size=4), dtype=dtype, **kw))
        assert got["X"].dtype == dtype and sorted(got["index"]) == list(range(30))
        np.testing.assert_allclose(
            got["X"], expected[got["index"]].astype(dtype), rtol=1e-6 if dtype == "float32" else 0
        )
    got = run_epoch(dz.Loader(raw, sampler(chunk_size=7, batch_size=4), **kw))
    np.testing.assert_array_equal(got["X"], packed[got["index"]])
    got = run_epoch(dz.Loader(sst, sampler(chunk_size=7, batch_size=4), **kw))
    np.testing.assert_array_equal(got["X"], zarr.open_array(path / "sst")[:][got["index"]])
    some = dz.Subset(decoded, np.arange(0, 30, 2))  # wrappers decode as their parent does
    got = run_epoch(dz.Loader(some, sampler(chunk_size=7, batch_size=4, drop_last=False), **kw))
    np.testing.assert_allclose(got["X"], expected[got["index"]], rtol=1e-6)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mask_and_scale_on_the_gpu_path(tmp_path: Path, where: str, dtype: str) -> None:
    """The GPU path decodes as the CPU path does, batch for batch, NaNs included."""
    xarray_like_store(tmp_path / "era5.zarr", 3)
    unsigned_store(tmp_path / "bytes.zarr")
    for path, element in (("era5.zarr", "t2m"), ("bytes.zarr", "counts")):
        decoded = dz.open_dataset(tmp_path / path, element=element, mask_and_scale=True)
        cpu, gpu = both(decoded, where, return_index=True, dtype=dtype)
        assert_same_batches(cpu, gpu, where=where)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_variable_with_time_last_warns_that_batches_are_grid_slices(
    tmp_path: Path, zarr_format: int
) -> None:
    """A (lat, lon, time) variable, as many netCDF files order them, batched by latitude:
    each row was one latitude band holding every time step, and nothing said so. Opening
    one now warns, naming its dimensions and the transpose; time first does not warn, nor
    do dimensions that say nothing of samples."""
    group = zarr.open_group(tmp_path / "t.zarr", mode="w", zarr_format=zarr_format)
    data = np.zeros((3, 4, 30), "f4")
    variables = {"lat_first": ("lat", "lon", "time"), "time_first": ("time", "lat", "lon"),
                 "image": ("y", "x", "band")}  # fmt: skip
    for name, dims in variables.items():
        shaped = data if dims[0] != "time" else data.transpose(2, 0, 1)
        extra = {"dimension_names": dims} if zarr_format == 3 else {}
        array = group.create_array(
            name, data=shaped, chunks=shaped.shape, fill_value=np.nan, **extra
        )
        if zarr_format == 2:
            array.attrs["_ARRAY_DIMENSIONS"] = list(dims)
    with pytest.warns(dz.ObservationAxisWarning) as caught:
        dataset = dz.open_dataset(tmp_path / "t.zarr", element="lat_first")
    assert dataset.n_obs == 3 and len(caught) == 1
    message = str(caught[0].message)
    assert "t.zarr/lat_first: its dimensions are ('lat', 'lon', 'time')" in message, message
    assert (
        "ds.transpose('time', ...)" in message
        and Path(caught[0].filename).name == Path(__file__).name
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", dz.ObservationAxisWarning)
        assert dz.open_dataset(tmp_path / "t.zarr", element="time_first").n_obs == 30
        dz.open_dataset(tmp_path / "t.zarr", element="image")


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_convert_keeps_a_variables_dimension_names(tmp_path: Path, zarr_format: int) -> None:
    """convert of a (lat, lon, time) variable wrote a copy without dimension names: opening
    the copy no longer warned that its rows are latitude bands, so the one warning about it
    was lost by the step that prepares a store for training. The copy now keeps the names
    (v3 dimension_names) and warns as the input does; a (time, lat, lon) copy does not."""
    group = zarr.open_group(tmp_path / "t.zarr", mode="w", zarr_format=zarr_format)
    for name, dims in {
        "lat_first": ("lat", "lon", "time"),
        "time_first": ("time", "lat", "lon"),
    }.items():
        extra = {"dimension_names": dims} if zarr_format == 3 else {}
        array = group.create_array(name, data=np.ones((3, 4, 5), "f4"), chunks=(3, 4, 5), **extra)
        if zarr_format == 2:
            array.attrs["_ARRAY_DIMENSIONS"] = list(dims)
    with pytest.warns(dz.ObservationAxisWarning):
        dz.open_dataset(tmp_path / "t.zarr", element="lat_first")
    convert(tmp_path / "t.zarr", tmp_path / "lat_first.zarr", element="lat_first")
    convert(tmp_path / "t.zarr", tmp_path / "time_first.zarr", element="time_first")
    copy = zarr.open_array(tmp_path / "lat_first.zarr", mode="r")
    assert copy.metadata.dimension_names == ("lat", "lon", "time")
    with pytest.warns(
        dz.ObservationAxisWarning, match=r"lat_first.zarr: its dimensions are \('lat'"
    ):
        dz.open_dataset(tmp_path / "lat_first.zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("error", dz.ObservationAxisWarning)
        dz.open_dataset(tmp_path / "time_first.zarr")


def unsigned_store(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """int8 counts netCDF-packed as unsigned bytes (``_Unsigned="true"``, fill -1 which is
    255, missing_value -2 which is 254) and uint8 values packed as signed
    (``_Unsigned="false"``, fill 128 which is -128); returns both as xarray reads their bits."""
    rng = np.random.default_rng(3)
    group = zarr.open_group(path, mode="w", zarr_format=3)
    as_unsigned = rng.integers(0, 256, (40, 6)).astype("u1")
    as_unsigned[3, 1], as_unsigned[17, 5] = 255, 254
    attrs = {"_Unsigned": "true", "_FillValue": -1, "missing_value": [-2], "scale_factor": 0.5}
    group.create_array("counts", data=as_unsigned.view("i1"), chunks=(9, 4)).attrs.update(
        {**attrs, "add_offset": 10.0}
    )
    as_signed = rng.integers(-128, 128, (40, 6)).astype("i1")
    as_signed[0, 0] = -128
    group.create_array("anomaly", data=as_signed.view("u1"), chunks=(9, 4)).attrs.update(
        {"_Unsigned": "false", "_FillValue": 128, "scale_factor": 0.25}
    )
    return as_unsigned, as_signed


def test_mask_and_scale_reads_unsigned_bytes_and_every_missing_value(tmp_path: Path) -> None:
    """``_Unsigned`` reinterprets the stored bytes before the fills are compared and the
    scale applied, as xarray does: int8 -1 is 255 and missing, a uint8 128 is -128 and
    missing; ``missing_value`` (a list) is missing too. Gene-panel and row subsets of the
    decoded array decode the same."""
    path = tmp_path / "bytes.zarr"
    as_unsigned, as_signed = unsigned_store(path)
    counts = dz.open_dataset(path, element="counts", mask_and_scale=True)
    anomaly = dz.open_dataset(path, element="anomaly", mask_and_scale=True)
    assert counts.cf_decoding() == (256, (255.0, 254.0), 0.5, 10.0)
    assert anomaly.cf_decoding() == (-256, (-128.0,), 0.25, 0.0)
    want_counts = cf_decoded_reference(as_unsigned, scale=0.5, offset=10.0, fills=[255, 254])
    want_anomaly = cf_decoded_reference(as_signed, scale=0.25, fills=[-128])
    for dataset, want in ((counts, want_counts), (anomaly, want_anomaly)):
        got = run_epoch(dz.Loader(dataset, sampler(chunk_size=9, batch_size=8), return_index=True))
        np.testing.assert_allclose(got["X"], want[got["index"]], rtol=1e-6)
        assert np.isnan(got["X"]).sum() == np.isnan(want).sum() > 0
    panel = dz.Subset(dz.FeatureSubset(counts, [5, 1]), np.arange(1, 40, 3))
    got = run_epoch(
        dz.Loader(panel, sampler(chunk_size=4, batch_size=2, drop_last=False), return_index=True)
    )
    np.testing.assert_allclose(got["X"], want_counts[got["index"]][:, [5, 1]], rtol=1e-6)


def test_a_fill_outside_the_stored_range_masks_no_valid_value(tmp_path: Path) -> None:
    """``_Unsigned`` bytes with a generic ``missing_value`` of -9999 (or a ``_FillValue`` of
    300): neither is a byte, so none of the stored values is missing. The fill was wrapped
    into the stored type (-9999 as int8 is 241, 300 is 44), and every valid 241 and 44
    arrived as NaN. Only a fill the stored bits can hold is reinterpreted; -1 is still 255."""
    path = tmp_path / "bytes.zarr"
    as_unsigned = np.arange(256, dtype="u1").reshape(32, 8)
    group = zarr.open_group(path, mode="w", zarr_format=3)
    group.create_array("counts", data=as_unsigned.view("i1"), chunks=(8, 8)).attrs.update(
        {"_Unsigned": "true", "_FillValue": -1, "missing_value": [-9999, 300]}
    )
    counts = dz.open_dataset(path, element="counts", mask_and_scale=True)
    got = run_epoch(dz.Loader(counts, sampler(chunk_size=8, batch_size=8), return_index=True))
    want = cf_decoded_reference(as_unsigned, fills=[255])
    np.testing.assert_array_equal(got["X"], want[got["index"]])
    assert np.isnan(got["X"]).sum() == 1


@pytest.mark.parametrize("where", ["cpu", *WHERE])
def test_unsigned_words_are_reinterpreted_before_they_become_float32(
    tmp_path: Path, where: str
) -> None:
    """``_Unsigned="false"`` on uint32/uint64 words (signed values stored unsigned): the
    graph made the stored words float32 first and subtracted 2**32 (2**64) after, so
    4294967295 rounded to 2**32 and came out 0, not -1; -100 came out 0, 2**31 - 1
    came out -2**31, and a fill of -1 masked nothing. The bits are now read as the signed
    (or unsigned) type before they are made float32, on both paths."""
    group = zarr.open_group(tmp_path / "w.zarr", mode="w", zarr_format=3)
    signed = np.array([-1, -2, -100, -1000, 5, 2**31 - 1, -(2**31), 0] * 3, "i8")
    meant = {  # what the words mean: signed in uint32/uint64 words, unsigned in int32 ones
        "u4": signed.astype("i4"),
        "u8": signed,
        "i4": np.array([2**32 - 1, 2**32 - 1000, 2**31, 5, 0, 2**31 - 1, 100, 7] * 3, "u4"),
    }
    fill = {"u4": -1, "u8": -1, "i4": 2**32 - 1}  # -1 in the stored words
    for name, values in meant.items():
        words = values.view(np.dtype(name))
        group.create_array(name, data=words[:, None], chunks=(5, 1)).attrs.update(
            {"_Unsigned": "true" if name == "i4" else "false", "_FillValue": -1, "scale_factor": 2}
        )
    for name, values in meant.items():
        want = values.astype("f4")[:, None] * np.float32(2.0)
        want[values == fill[name]] = np.nan
        ds = dz.open_dataset(tmp_path / "w.zarr", element=name, mask_and_scale=True)
        assert_decoded_epoch(ds, want, where=where, name=name)


def assert_decoded_epoch(ds: dz.Dataset, want: np.ndarray, *, where: str, name: str) -> None:
    """One epoch of ``ds`` on ``where`` ("cpu", or a :data:`WHERE` entry) delivers each row
    once, as ``want`` holds it (NaN where ``want`` has it)."""
    kw = {} if where == "cpu" else gpu_kwargs(where)
    with dz.Loader(
        ds, sampler(chunk_size=5, batch_size=4, drop_last=False), return_index=True, **kw
    ) as loader:
        got = run_epoch(loader)
    assert sorted(got["index"]) == list(range(len(want)))
    np.testing.assert_array_equal(got["X"], want[got["index"]], err_msg=name)


def wide_fill_store(path: Path) -> dict[str, tuple[np.ndarray, list]]:
    """Arrays whose netCDF fills float32 cannot tell from their neighbours, each with
    values beside its fill; returns ``{name: (stored values, fills xarray masks)}``."""
    int32_fill, int64_fill, double_fill = -2147483647, -9223372036854775806, 9.969209968386869e36
    arrays = {
        # NC_FILL_INT, a fill past float32's exact integers, a fill no int32 is (dropped)
        "int32": (
            [int32_fill, -2147483600, -2147483646, -2147483648, 2147483647, 0, 16777217, 25000000],
            {"_FillValue": int32_fill, "missing_value": [16777217, 25000000.5],
             "scale_factor": 0.01},
            [int32_fill, 16777217],
        ),
        "int64": (  # NC_FILL_INT64: xarray compares in float64, where it is -2**63, as are
            # the words up to -2**63 + 512 (xarray's to_zarr stores the fill as -2**63)
            [int64_fill, -(2**63), -(2**63) + 512, -(2**63) + 513, 2**62, 7, -7, 0],
            {"_FillValue": int64_fill},
            [int64_fill],
        ),
        "uint64": (  # 2**63 in float64: the words around it, across the signed boundary
            [2**63 - 1, 2**63, 2**63 + 1024, 2**63 + 1025, 2**64 - 1, 5, 0, 1],
            {"_FillValue": 2**63, "scale_factor": 2.0},
            [2**63],
        ),
        "uint32": (  # NC_FILL_UINT; words past int32 compare by their bits
            [4294967295, 4294967294, 4294967040, 2**31, 5, 0, 1, 2],
            {"_FillValue": 4294967295, "add_offset": 1.5},
            [4294967295],
        ),
        "float64": (  # NC_FILL_DOUBLE, and 0.0 as missing: -0.0 is missing too
            [double_fill, double_fill * (1 + 1e-15), np.inf, -0.0, 0.0, 1e-300, 2.5, -3.0],
            {"_FillValue": double_fill, "missing_value": [0.0]},
            [double_fill, 0.0],
        ),
    }  # fmt: skip
    group = zarr.open_group(path, mode="w", zarr_format=3)
    found = {}
    for name, (values, attrs, fills) in arrays.items():
        stored = np.array(values * 3, dtype=name)[:, None] * np.ones(3, dtype=name)
        group.create_array(name, data=stored, chunks=(5, 3)).attrs.update(attrs)
        found[name] = (stored, fills)
    return found


@pytest.mark.parametrize("where", ["cpu", *WHERE])
def test_wide_fills_are_compared_with_the_stored_words(tmp_path: Path, where: str) -> None:
    """A 32/64-bit integer or float64 array was masked after its values became float32,
    where netCDF's int fill -2147483647 is -2147483648, as are -2147483600 and every word
    within 128 of it: valid values arrived as NaN. Such fills are now compared with the
    stored words as xarray compares them (made float64), on both paths: exactly for 32-bit
    words; a 64-bit fill past 2**53 masks the words float64 rounds to it, so xarray's own
    int64 round trip (NaN stored as -2**63 under the fill -2**63 + 2) reads back as NaN,
    where -2**63 had arrived as -9.2e18; a fill no word can be (25000000.5) masks nothing."""
    stores = wide_fill_store(tmp_path / "wide.zarr")
    for name, (stored, fills) in stores.items():
        ds = dz.open_dataset(tmp_path / "wide.zarr", element=name, mask_and_scale=True)
        decoding = ds.cf_decoding()
        assert decoding is not None
        want = cf_decoded_reference(stored, scale=decoding.scale, offset=decoding.offset)
        # xarray compares the words made float64 with the fills made float64
        masked = np.isin(stored.astype(np.float64), np.array(fills, dtype=np.float64))
        want[masked] = np.nan
        assert 0 < np.isnan(want).sum() < want.size
        assert_decoded_epoch(ds, want, where=where, name=name)


def test_mask_and_scale_refuses_what_it_cannot_decode(tmp_path: Path) -> None:
    """A collection of a decoded and an undecoded copy would mix 280.5 K with 50 counts;
    an attribute that is not a number cannot be applied; both are refused by name."""
    path = tmp_path / "era5.zarr"
    xarray_like_store(path, 3)
    decoded = dz.open_dataset(path, element="t2m", mask_and_scale=True)
    raw = dz.open_dataset(path, element="t2m", mask_and_scale=False)
    with pytest.raises(dz.DatasetError, match=r"rows .*\] is opened with mask_and_scale=False"):
        dz.Collection([decoded, dz.Subset(raw, [0, 1])])
    assert dz.Collection([decoded, decoded]).cf_decoding() == decoded.cf_decoding()
    other = tmp_path / "y2001.zarr"  # packed with another scale: the packing is named
    xarray_like_store(other, 3)
    zarr.open_array(other / "t2m", mode="r+").attrs["scale_factor"] = 0.02
    zarr.consolidate_metadata(other)
    with pytest.raises(dz.DatasetError, match=r"y2001.zarr/t2m is packed with .*0.02.* but era5"):
        dz.open_dataset([path, other], element="t2m", mask_and_scale=True)
    zarr.open_array(path / "t2m", mode="r+").attrs["scale_factor"] = "0.01 K"
    zarr.consolidate_metadata(path)
    with pytest.raises(dz.DatasetError, match=r"era5.zarr/t2m: its attribute scale_factor='0.01"):
        dz.open_dataset(path, element="t2m", mask_and_scale=True)
    with pytest.raises(dz.ConfigError, match="mask_and_scale= takes True, False or None"):
        dz.open_dataset(path, element="t2m", mask_and_scale="yes")


def test_a_packed_warning_names_the_callers_line_for_a_list_of_stores(tmp_path: Path) -> None:
    """open_dataset([a, b]) opened its parts in a list comprehension, a frame of its own on
    Python 3.11: the PackedValuesWarning pointed at dali_zarr/data/dataset.py, not at the
    caller's line, so a filter by module or a look at the line led nowhere."""
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    xarray_like_store(a, 2)
    xarray_like_store(b, 2)
    with pytest.warns(dz.PackedValuesWarning) as record:
        dz.open_dataset([a, b], element="t2m")
    assert {Path(w.filename).name for w in record} == {Path(__file__).name}


@pytest.mark.parametrize(
    "decoding",
    [
        (0, (255.0, 254.0), 0.5, 10.0),  # int8 read as uint8 (by the gather, cf_gather_reading)
        (0, (-128.0,), 0.25, 0.0),  # uint8 read as int8
        (0, (-32767.0,), 0.01, 280.0),  # int16 packed
        (0, (1e20,), 1.0, 0.0),  # a float's missing marker only
        (0, (), 1.0, -5.5),  # an offset only
        (0, (-1.0, 7.0, 250.0, -250.0), 2.0, 0.0),  # missing_value lists: fills past two
    ],
)
def test_the_cpu_decode_kernel_matches_the_devices_arithmetic(decoding) -> None:
    """mask_and_scale decodes on the CPU in one kernel pass (the DALI arithmetic ops cost
    ~7x as much there) and on the GPU by those ops: both run here, in one CPU pipeline, on
    the same batch, and give the same values (NaN where missing, -0 kept)."""
    from nvidia.dali import fn, pipeline_def, types

    from dali_zarr.data.elements import CfDecoding
    from dali_zarr.graph.pipeline import GraphOps, cf_decoded

    d = CfDecoding(*decoding)
    rng = np.random.default_rng(0)
    x = rng.integers(-300, 300, (64, 9)).astype("f4")
    x[0, :4] = [-0.0, 0.0, 1e20, -32767.0]
    x[1, :6] = [255.0, -1.0, -2.0, 128.0, -128.0, 254.0]

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def both():
        node = fn.external_source(source=lambda: [x], batch=True, dtype=types.FLOAT)
        return GraphOps().cf_decoded(node, d, (9,)), cf_decoded(node, d)

    pipe = both()
    pipe.build()
    kernel, arithmetic = (np.asarray(out[0]) for out in pipe.run())
    np.testing.assert_array_equal(kernel, arithmetic)
    same_sign = np.signbit(kernel) == np.signbit(arithmetic)
    assert (same_sign | np.isnan(kernel)).all()
    assert np.isnan(kernel).any() == bool(d.fills)
    np.testing.assert_array_equal(np.isnan(kernel), np.isin(x, np.float32(d.fills)))


# ---------------------------------------------------------------------------- obsm beside X


@pytest.mark.parametrize("element", ["X", "layers/scaled"])
def test_obsm_entries_ride_beside_x(rich, tmp_path: Path, element: str) -> None:
    """obs=["obsm/<key>"]: an obsm entry's rows arrive beside X, each row's own (spatial
    coordinates, a protein panel): before, obs columns were 1-D only and the refusal sent
    users to obsm, which only loaded as the dataset itself, never beside X."""
    path, adata = rich
    dataset = dz.open_dataset(path, element=element)
    obs = ["cell_type", "obsm/X_pca"]
    got = run_epoch(dz.Loader(dataset, sampler(), obs=obs, return_index=True), epoch=3)
    assert_rows_match(got, element_of(adata, element).astype(np.float32), N_OBS)
    pca = got["obsm/X_pca"]
    assert pca.dtype == np.float64 and pca.shape == (N_OBS, 8)  # the stored dtype, as obs
    np.testing.assert_array_equal(pca, adata.obsm["X_pca"][got["index"]])
    # the same batches on the GPU path's wiring (host backend), and in a subset
    cpu, gpu = both(dataset, "host", obs=obs, return_index=True)
    assert assert_same_batches(cpu, gpu, epochs=(1,)) == len(cpu) > 0
    rows = np.arange(0, N_OBS, 3)
    part = run_epoch(dz.Loader(dz.Subset(dataset, rows), sampler(), obs=obs, return_index=True))
    assert set(part["index"]) == set(rows)  # ids of the parent's rows
    np.testing.assert_array_equal(part["obsm/X_pca"], adata.obsm["X_pca"][part["index"]])


@pytest.mark.parametrize("where", WHERE)
def test_obsm_entries_beside_x_on_the_gpu_path(rich, where: str) -> None:
    """An obsm entry rides the host external source with the obs columns, then to the
    device: batch for batch what the CPU path delivers (held to anndata above)."""
    cpu, gpu = both(dz.open_dataset(rich[0]), where, obs=["obsm/X_pca"], return_index=True)
    assert assert_same_batches(cpu, gpu, epochs=(0,), where=where) == len(cpu) > 0


def test_obsm_entries_of_any_rank_and_dtype_in_a_collection(tmp_path: Path) -> None:
    """N-D entries keep their row shape; float16 arrives as float32 (no float16 reaches
    DALI); the stores of a collection join theirs, and a row shape that differs between
    them is refused naming each store, not with NumPy's bare concatenate error."""
    paths, patches = [], []
    for seed, n_obs in enumerate((150, 90)):
        adata = make_adata(seed, n_obs=n_obs)
        patches.append(np.random.default_rng(seed).random((n_obs, 3, 4)).astype(np.float16))
        adata.obsm["patches"] = patches[-1]
        adata.obsm["spatial"] = np.ones((n_obs, 2 + seed), dtype=np.int32)  # widths differ
        paths.append(tmp_path / f"s{seed}.zarr")
        adata.write_zarr(paths[-1])
    both_stores = dz.open_dataset(paths)
    got = run_epoch(dz.Loader(both_stores, sampler(), obs=["obsm/patches"], return_index=True))
    want = np.concatenate(patches).astype(np.float32)
    assert got["obsm/patches"].dtype == np.float32 and got["obsm/patches"].shape == (240, 3, 4)
    np.testing.assert_array_equal(got["obsm/patches"], want[got["index"]])
    with pytest.raises(dz.DatasetError) as caught:
        dz.Loader(both_stores, sampler(), obs=["obsm/spatial"])
    message = str(caught.value)
    assert "'obsm/spatial': its rows have other shapes in the stores of the collection" in message
    assert "s0.zarr/X (part 0) (None, 2)" in message, message
    assert "s1.zarr/X (part 1) (None, 3)" in message, message


def test_obsm_entries_that_cannot_ride_are_named_with_what_to_do(
    rich, tmp_path: Path, monkeypatch
) -> None:
    path, _ = rich
    dataset = dz.open_dataset(path)
    # held whole on every rank: a wide entry is warned of (the limit lowered to this store's)
    monkeypatch.setattr("dali_zarr.data.obs.OBSM_WARN_BYTES", N_OBS * 8 * 8 - 1)
    with pytest.warns(UserWarning, match=r"rich.zarr/obsm/X_pca: is held whole in memory"):
        dz.open_dataset(path).obs_column("obsm/X_pca")
    monkeypatch.undo()

    def refused(column: str) -> str:
        with pytest.raises(dz.DatasetError) as caught:
            dz.Loader(dataset, sampler(), obs=[column])
        return str(caught.value)

    message = refused("obsm/umap")
    assert "rich.zarr/obsm/umap: not in the store; its obsm entries: X_pca, meta." in message
    message = refused("obsm/meta")  # a dataframe
    assert "rich.zarr/obsm/meta: is dataframe, not a dense array" in message, message
    assert "element='obsm/meta'" in message
    sparse = make_adata(3)
    sparse.obsm["counts"] = sp.random(N_OBS, 5, density=0.3, format="csr", random_state=0)
    sparse.write_zarr(tmp_path / "sparse.zarr")
    with pytest.raises(dz.DatasetError, match=r"is csr_matrix, not a dense array.*toarray"):
        dz.Loader(dz.open_dataset(tmp_path / "sparse.zarr"), sampler(), obs=["obsm/counts"])
    plain = tmp_path / "plain.zarr"
    zarr.create_array(plain, data=np.zeros((40, 3), dtype=np.float32))
    with pytest.raises(dz.DatasetError, match="has no obs dataframe"):
        dz.Loader(dz.open_dataset(plain), sampler(), obs=["obsm/X_pca"])
    from dali_zarr.lightning import ZarrDataModule

    module = ZarrDataModule(
        data=dataset, split_column="obsm/X_pca", split_labels={"train": 1.0}, batch_size=50
    )
    module.setup("fit")
    with pytest.raises(dz.DatasetError, match=r"holds \(8,\) values per observation"):
        module.train_dataloader()


def test_an_obsm_entry_added_after_consolidation_is_named_as_such(tmp_path: Path) -> None:
    """An obsm entry written after the store's metadata was consolidated (anndata writes it
    consolidated) is on disk but not in zarr's listing: obs=["obsm/<key>"] said "not in
    the store" and listed the other entries, as element= does not; now it says why."""
    path = tmp_path / "late.zarr"
    make_adata(4).write_zarr(path)
    spatial = np.random.default_rng(0).random((N_OBS, 2))
    zarr.open_group(path, mode="r+", use_consolidated=False)["obsm"].create_array(
        "spatial", data=spatial
    )
    with pytest.raises(dz.DatasetError) as caught:
        dz.Loader(dz.open_dataset(path), sampler(), obs=["obsm/spatial"])
    message = str(caught.value)
    assert "late.zarr/obsm/spatial: not in the store" in message, message
    assert f"It is on disk at {path / 'obsm' / 'spatial'}, but not in the store's " in message
    assert "run zarr.consolidate_metadata on the store" in message
    zarr.consolidate_metadata(str(path))  # what the message says to do
    loader = dz.Loader(dz.open_dataset(path), sampler(), obs=["obsm/spatial"], return_index=True)
    got = run_epoch(loader)
    np.testing.assert_array_equal(got["obsm/spatial"], spatial[got["index"]])


def test_a_v2_bool_array_with_dimension_names_is_not_packed(tmp_path: Path) -> None:
    """zarr's default fill False of a v2 bool array with xarray's dimension names was taken
    as a CF _FillValue: a PackedValuesWarning at open, and mask_and_scale=True refused the
    array ("_FillValue=False is not a number"), an attribute it does not have."""
    path = tmp_path / "flags.zarr"
    flags = np.random.default_rng(0).random((40, 3)) < 0.5
    array = zarr.create_array(path, shape=flags.shape, dtype=bool, chunks=(8, 3), zarr_format=2)
    array[...] = flags
    array.attrs["_ARRAY_DIMENSIONS"] = ["time", "x"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", dz.PackedValuesWarning)
        assert dz.open_dataset(path).packing() == {}
    decoded = dz.open_dataset(path, mask_and_scale=True)
    assert decoded.cf_decoding() is None
    got = run_epoch(dz.Loader(decoded, sampler(), return_index=True))
    np.testing.assert_array_equal(got["X"], flags.astype(np.float32)[got["index"]])


def test_mask_and_scale_on_anndata_elements(tmp_path: Path) -> None:
    """mask_and_scale= was only read for plain arrays: on an AnnData element whose attributes
    pack its values it was silently ignored, so True delivered the stored int16 counts. A
    dense element now decodes (and warns when not asked), and a CSR element with packing is
    refused with True, since its implicit zeros cannot be unpacked."""
    rng = np.random.default_rng(3)
    packed = rng.integers(-100, 100, size=(30, 5)).astype("i2")
    packed[2, 3] = -32767
    adata = ad.AnnData(
        X=sp.csr_matrix(packed.astype("f4")), obsm={"packed": packed}, layers={"dense": packed}
    )
    path = tmp_path / "packed.zarr"
    adata.write_zarr(path)
    group = zarr.open_group(path, mode="r+")
    cf = {"scale_factor": 0.5, "add_offset": 10.0, "_FillValue": -32767}
    for element in ("obsm/packed", "layers/dense", "X/data"):
        group[element].attrs.update(cf)
    zarr.consolidate_metadata(path)  # anndata consolidates; the store is opened through it
    expected = cf_decoded_reference(packed, scale=0.5, offset=10.0, fills=[-32767])
    for element in ("obsm/packed", "layers/dense"):
        with pytest.warns(dz.PackedValuesWarning, match=element):
            dz.open_dataset(path, element=element)
        decoded = dz.open_dataset(path, element=element, mask_and_scale=True)
        got = run_epoch(dz.Loader(decoded, sampler(chunk_size=7, batch_size=5), return_index=True))
        np.testing.assert_allclose(got["X"], expected[got["index"]], rtol=1e-6)
    raw = dz.open_dataset(path, element="obsm/packed", mask_and_scale=False)
    got = run_epoch(dz.Loader(raw, sampler(chunk_size=7, batch_size=5), return_index=True))
    np.testing.assert_array_equal(got["X"], packed[got["index"]])
    with pytest.raises(dz.ConfigError, match=r"packed\.zarr/X.*implicit zero"):
        dz.open_dataset(path, mask_and_scale=True)
    with pytest.warns(dz.PackedValuesWarning, match="X"):
        dz.open_dataset(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dz.PackedValuesWarning)
        dz.open_dataset(path, mask_and_scale=False)


def test_float64_batches_of_a_decoded_variable_warn_of_float32_decoding(tmp_path: Path) -> None:
    """mask_and_scale=True decodes in float32, so dtype="float64" delivered xarray's values
    to about 7 digits (259.0914001464844 for 259.0914) without a word: the warning for
    float64 batches looked at the stored int16 only, which float32 holds exactly."""
    path = tmp_path / "era5.zarr"
    xarray_like_store(path, 3)
    decoded = dz.open_dataset(path, element="t2m", mask_and_scale=True)
    with pytest.warns(UserWarning, match=r"t2m: mask_and_scale=True decodes in float32"):
        dz.Loader(decoded, sampler(chunk_size=7, batch_size=4), dtype="float64").close()
    raw = dz.open_dataset(path, element="t2m", mask_and_scale=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dz.Loader(raw, sampler(chunk_size=7, batch_size=4), dtype="float64").close()
        dz.Loader(decoded, sampler(chunk_size=7, batch_size=4)).close()
