"""Stores written by anndata 0.13 (Python 3.12), read by dali_zarr.

anndata 0.13 needs Python 3.12 and this suite runs on 3.11 with anndata 0.12, so the stores
are written in a second interpreter, ``.venv-anndata013``: ``scripts/test.sh`` makes it with
``scripts/anndata013_env.sh`` where a Python 3.12 is installed (``DZ_ANNDATA013_PYTHON``
names another). Written with anndata 0.13's defaults (zarr v3, sharded, zstd; nullable
string obs columns), with zarr v2, and with small chunks and shards and column ids in the
narrowest dtype (``uint8`` here): the layouts annbatch's users have on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import zarr

import dali_zarr as dz
from dali_zarr.graph.window_backends import HostBackend

ROOT = Path(__file__).resolve().parents[1]
STORES = ["default_csr", "default_dense", "csr_v2", "csr_small_chunks", "dense_small_chunks"]
OBS = ["cell_type", "n_genes", "score", "is_doublet", "plate"]


def writer_python() -> str | None:
    explicit = os.environ.get("DZ_ANNDATA013_PYTHON")
    default = ROOT / ".venv-anndata013" / "bin" / "python"
    return explicit or (str(default) if default.exists() else None)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict]:
    python = writer_python()
    if python is None:
        pytest.skip(
            "no anndata 0.13 interpreter: scripts/anndata013_env.sh makes .venv-anndata013 where a "
            "Python 3.12 is installed (or set DZ_ANNDATA013_PYTHON)"
        )
    out = tmp_path_factory.mktemp("anndata013")
    done = subprocess.run(
        [python, str(ROOT / "tests" / "anndata013_writer.py"), str(out)],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    versions = json.loads(done.stdout.strip().splitlines()[-1])
    assert versions["anndata"].startswith("0.13."), versions
    return out, dict(np.load(out / "reference.npz"))


def read_all(loader: dz.Loader) -> dict[str, np.ndarray]:
    """One epoch of ``loader``, its batches put back in row order by ``index``."""
    parts: dict[str, list[np.ndarray]] = {}
    for batch in loader:
        for name, value in batch.items():
            parts.setdefault(name, []).append(value.numpy())
    joined = {name: np.concatenate(values) for name, values in parts.items()}
    order = np.argsort(joined["index"])
    assert np.array_equal(joined["index"][order], np.arange(len(order)))  # each row once
    return {name: values[order] for name, values in joined.items()}


def one_epoch_sampler() -> dz.ChunkSampler:
    return dz.ChunkSampler(chunk_size=40, preload_nchunks=3, batch_size=64, seed=5, drop_last=False)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize(
    ("element", "key"),
    [(None, "X"), ("layers/counts", "counts"), ("raw/X", "X"), ("obsm/X_pca", "X_pca")],
    ids=["X", "layers", "raw", "obsm"],
)
def test_every_row_and_obs_value_as_anndata_013_wrote_them(written, store, element, key):
    out, ref = written
    ds = dz.open_dataset(out / f"{store}.zarr", element=element)
    with dz.Loader(ds, one_epoch_sampler(), obs=OBS, return_index=True) as loader:
        got = read_all(loader)
    np.testing.assert_array_equal(got["X"], ref[key].astype(np.float32))
    categories = np.array(loader.categories("cell_type"))
    np.testing.assert_array_equal(
        categories[got["cell_type"]], ref["cell_type_categories"][ref["cell_type_codes"]]
    )
    for name in ("n_genes", "score", "is_doublet", "plate"):
        np.testing.assert_array_equal(got[name], ref[name])


@pytest.mark.parametrize("store", STORES)
def test_gpu_path_on_the_host_backend_matches_the_cpu_path(written, store):
    """The GPU path parses the layouts itself (byte plans): same batches as the CPU path."""
    out, _ = written
    path = out / f"{store}.zarr"
    kwargs = dict(obs=["cell_type"], return_index=True)
    cpu = dz.Loader(dz.open_dataset(path), one_epoch_sampler(), **kwargs)
    gpu = dz.Loader(
        dz.open_dataset(path), one_epoch_sampler(), device="gpu", gpu_backend=HostBackend(),
        **kwargs,
    )  # fmt: skip
    assert all("host read" not in p for p in gpu.read_paths().values()), gpu.read_paths()
    n = 0
    for a, b in zip(cpu, gpu, strict=True):
        for name in a:
            np.testing.assert_array_equal(a[name].numpy(), b[name].numpy(), err_msg=name)
        n += 1
    assert n == len(cpu) > 1
    cpu.close()
    gpu.close()


def test_nullable_string_obs_column_is_refused_by_name(written):
    """anndata 0.13 writes text as ``nullable-string-array``: say so, and what to do."""
    out, _ = written
    ds = dz.open_dataset(out / "default_csr.zarr")
    with pytest.raises(dz.DatasetError, match=r"default_csr.zarr/obs/barcode: encoding "
                       r"'nullable-string-array' cannot ride.*categorical"):  # fmt: skip
        dz.Loader(ds, one_epoch_sampler(), obs=["barcode"])


@pytest.mark.parametrize("store", ["default_csr", "default_dense", "csr_v2"])
def test_gene_names_of_anndata_013_stores_pick_panels_and_join_collections(written, store):
    """anndata 0.13 (pandas 3) writes var's index as a ``nullable-string-array`` group: a
    panel by names, any collection, and the check of X's width against var failed on it
    (zarr's TypeError) or were skipped."""
    out, ref = written
    path = out / f"{store}.zarr"
    panel = dz.open_dataset(path, features=["gene7", "gene2"])
    with dz.Loader(panel, one_epoch_sampler(), return_index=True) as loader:
        got = read_all(loader)
    np.testing.assert_array_equal(got["X"], ref["X"][:, [7, 2]].astype(np.float32))
    like = "dense_small_chunks" if "dense" in store else "csr_small_chunks"
    both = dz.open_dataset([path, out / f"{like}.zarr"])
    assert both.n_obs == 2 * len(ref["X"]) and both.feature_shape == (ref["X"].shape[1],)


def test_x_wider_than_an_anndata_013_var_is_refused(written, tmp_path):
    out, ref = written
    copy = tmp_path / "wide.zarr"
    shutil.copytree(out / "default_csr.zarr", copy)
    x = zarr.open_group(copy / "X", mode="r+", use_consolidated=False)
    x.attrs["shape"] = [len(ref["X"]), ref["X"].shape[1] + 1]
    zarr.consolidate_metadata(copy)  # anndata 0.13 reads (and we read) the root's copy
    with pytest.raises(dz.DatasetError, match=r"var has 120 names but .*X is 121 features wide"):
        dz.open_dataset(copy)


def test_convert_writes_anndata_013_text_as_every_anndata_reads_it(written, tmp_path):
    """anndata 0.12 reads 0.13's text as pandas string arrays and refused to write them back:
    convert died with a traceback. Text comes out as object strings (with missing values:
    categorical), the values unchanged."""
    import anndata as ad

    from dali_zarr.convert import convert

    out, ref = written
    convert(out / "default_csr.zarr", tmp_path / "c.zarr")
    back = ad.read_zarr(tmp_path / "c.zarr")
    source = ad.read_zarr(out / "default_csr.zarr")
    assert back.obs_names.tolist() == source.obs_names.tolist()
    assert back.var_names.tolist() == source.var_names.tolist()
    assert back.obs["barcode"].tolist() == source.obs["barcode"].tolist()
    note = back.obs["note"]  # text with missing values: categorical, missing where missing
    assert note.dtype == "category"
    assert (
        note.isna().tolist()
        == source.obs["note"].isna().tolist()
        == [i % 7 == 0 for i in range(len(note))]
    )
    assert note.dropna().astype(str).tolist() == source.obs["note"].dropna().tolist()
    np.testing.assert_array_equal(back.X.toarray(), ref["X"])


def test_the_store_n_obs_of_anndata_013_stores_is_read(written):
    """anndata 0.13's obs index is a nullable-string-array group: the count of observations
    an element's rows are held to was None, and that check was skipped."""
    from dali_zarr.data.elements import store_n_obs

    out, ref = written
    for store in STORES:
        assert store_n_obs(zarr.open_group(out / f"{store}.zarr", mode="r")) == len(ref["X"])


def test_convert_joins_anndata_013_and_012_inputs_of_the_same_genes(written, tmp_path):
    """anndata 0.13's var index (pandas' string dtype) never .equals 0.12's object index:
    convert refused them as 'var_names differ (feature 0: 'gene0' vs 'gene0')'."""
    import anndata as ad
    import scipy.sparse as sp

    from dali_zarr.convert import convert

    out, ref = written
    var = pd.DataFrame(index=[f"gene{j}" for j in range(ref["X"].shape[1])])
    old = ad.AnnData(X=sp.csr_matrix(ref["X"]), var=var)  # written by anndata 0.12
    old.obs_names = [f"old{i}" for i in range(old.n_obs)]
    old.write_h5ad(tmp_path / "old.h5ad")
    convert([out / "default_csr.zarr", tmp_path / "old.h5ad"], tmp_path / "both.zarr")
    back = ad.read_zarr(tmp_path / "both.zarr")
    assert back.var_names.tolist() == var.index.tolist()
    np.testing.assert_array_equal(back.X.toarray(), np.concatenate([ref["X"], ref["X"]]))


def test_convert_names_no_var_column_that_0_12_and_0_13_inputs_hold_alike(tmp_path, capsys):
    """A var column of the same values in an anndata 0.13 store and a 0.12 file was named
    as held otherwise ("other inputs hold other values"): the columns were compared with
    their index, whose dtype (0.13's pandas strings, 0.12's objects) differs."""
    import anndata as ad
    import scipy.sparse as sp

    from dali_zarr.cli import main

    python = writer_python()
    if python is None:
        pytest.skip("no anndata 0.13 interpreter (see the module's docstring)")
    script = (
        "import sys, anndata as ad, numpy as np, pandas as pd, scipy.sparse as sp\n"
        "var = pd.DataFrame({'hv': [True, False, True], 'gene_id': ['E0', 'E1', 'E2']},"
        " index=['g0', 'g1', 'g2'])\n"
        "x = sp.csr_matrix(np.eye(4, 3, dtype=np.float32))\n"
        "obs = pd.DataFrame(index=[f'new{i}' for i in range(4)])\n"
        "ad.AnnData(X=x, obs=obs, var=var).write_zarr(sys.argv[1])\n"
    )
    subprocess.run(
        [python, "-c", script, str(tmp_path / "new.zarr")],
        check=True, capture_output=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    var = pd.DataFrame(
        {"hv": [True, False, True], "gene_id": ["E0", "E1", "E2"]}, index=["g0", "g1", "g2"]
    )
    obs = pd.DataFrame(index=[f"old{i}" for i in range(4)])
    x = sp.csr_matrix(np.eye(4, 3, dtype=np.float32))
    ad.AnnData(X=x, obs=obs, var=var).write_h5ad(tmp_path / "old.h5ad")
    capsys.readouterr()
    assert (
        main(
            [
                "convert",
                str(tmp_path / "old.h5ad"),
                str(tmp_path / "new.zarr"),
                str(tmp_path / "o.zarr"),
            ]
        )
        == 0
    )
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert not any("var columns" in line for line in notes), notes
    assert ad.read_zarr(tmp_path / "o.zarr").var["hv"].tolist() == [True, False, True]
