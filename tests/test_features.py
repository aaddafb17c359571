"""Feature selection (dz.FeatureSubset / open_dataset(features=)): a gene panel in a chosen
order, on stores written by anndata, through real DALI pipelines on both loader paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import zarr

import dali_zarr as dz
from dali_zarr.data.dataset import CsrRows
from dali_zarr.data.features import keep_csr_columns
from tests.test_elements import N_OBS, N_RAW_VARS, N_VARS, element_of, make_adata
from tests.test_gpu_loader import WHERE, assert_same_batches, both
from tests.test_loader import assert_rows_match, run_epoch, sampler

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PANEL = np.array([17, 3, 29, 0, 11, 4])  # out of order on purpose


@pytest.fixture(scope="module")
def rich(tmp_path_factory):
    import anndata as ad

    path = tmp_path_factory.mktemp("features") / "rich.zarr"
    make_adata().write_zarr(path)
    return path, ad.read_zarr(path)


def test_keep_csr_columns_matches_scipy() -> None:
    """Empty rows, duplicate column ids (kept as stored) and a reordering map."""
    rng = np.random.default_rng(3)
    m = sp.random(40, 25, density=0.3, format="csr", random_state=rng, dtype=np.float32)
    m.indices[:4] = m.indices[0]  # duplicates within row 0's run (scipy sums them)
    m[5] = 0
    m.eliminate_zeros()
    cols = np.array([24, 0, 7, 3, 12])
    column_map = np.full(25, -1, np.int64)
    column_map[cols] = np.arange(len(cols))
    rows = CsrRows(m.data, m.indices, m.indptr.astype(np.int64))
    got = keep_csr_columns(rows, column_map)
    dense = sp.csr_matrix((got.data, got.indices, got.indptr), shape=(40, len(cols))).toarray()
    np.testing.assert_array_equal(dense, m.toarray()[:, cols])
    assert got.indices.dtype == m.indices.dtype and got.indptr[0] == 0
    with pytest.raises(dz.DatasetError, match="outside the 24 features"):  # no write past the map
        keep_csr_columns(rows, column_map[:24])


@pytest.mark.parametrize("output", ["dense", "csr"])
@pytest.mark.parametrize("how", ["ids", "names", "mask"])
def test_selected_features_in_the_order_given(rich, how: str, output: str) -> None:
    path, adata = rich
    cols = np.sort(PANEL) if how == "mask" else PANEL  # a mask keeps the store's order
    features = {
        "ids": PANEL,
        "names": [f"g{j}" for j in PANEL],
        "mask": np.isin(np.arange(N_VARS), PANEL),
    }[how]
    dataset = dz.open_dataset(path, features=features)
    assert isinstance(dataset, dz.FeatureSubset) and dataset.feature_shape == (len(PANEL),)
    assert dataset.var_names() == tuple(f"g{j}" for j in cols)
    loader = dz.Loader(dataset, sampler(), output=output, obs=["cell_type"], return_index=True)
    got = run_epoch(loader, epoch=1)  # run_epoch densifies CSR batches
    assert_rows_match(got, adata.X.toarray()[:, cols], N_OBS)
    labels = np.array(loader.categories("cell_type"))[got["cell_type"]]
    np.testing.assert_array_equal(labels, adata.obs["cell_type"].to_numpy()[got["index"]])


@pytest.mark.parametrize(("element", "width"), [("layers/scaled", N_VARS), ("raw/X", N_RAW_VARS)])
def test_features_of_other_elements(rich, element: str, width: int) -> None:
    path, adata = rich
    cols = np.array([width - 1, 2, 9])
    dataset = dz.open_dataset(path, element=element, features=cols)
    got = run_epoch(dz.Loader(dataset, sampler(), return_index=True))
    assert_rows_match(got, element_of(adata, element).astype(np.float32)[:, cols], N_OBS)
    if element == "raw/X":  # raw/X is named by raw/var
        assert dataset.var_names() == (f"raw_g{width - 1}", "raw_g2", "raw_g9")


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("output", ["dense", "csr"])
def test_gpu_path_wiring_with_features(rich, where: str, output: str) -> None:
    """The GPU path reads the store's windows by byte plans and keeps the panel on the
    device: ids mapped to the panel as the window is read, then densify skips the dropped
    ones (dense output) or each row is cut to its kept entries (CSR output). Batch for
    batch what the CPU path delivers, which the tests above hold to anndata."""
    dataset = dz.open_dataset(rich[0], features=PANEL)
    cpu, gpu = both(dataset, where, output=output, return_index=True)
    paths = gpu.read_paths()
    where_kept = {
        "dense": "as each window is read (ids mapped to the panel, densify skips the rest)",
        "csr": "as each window is read (ids mapped to the panel, rows cut to it)",
    }[output]
    kept = f"{len(PANEL)} of {N_VARS} features kept {where_kept}"
    assert all(p.endswith(kept) and "host read" not in p for p in paths.values()), paths
    assert assert_same_batches(cpu, gpu, epochs=(2,), where=where) == len(cpu) > 0


@pytest.mark.parametrize("where", WHERE)
def test_gpu_path_selects_features_of_collections_and_dense_stores(
    rich, tmp_path: Path, where: str
) -> None:
    path = rich[0]
    second = tmp_path / "second.zarr"
    make_adata(3, n_obs=57).write_zarr(second)
    joined = dz.Subset(dz.open_dataset([path, second]), np.arange(2, N_OBS + 57, 2))
    cube = tmp_path / "cube.zarr"
    zarr.save_array(str(cube), np.arange(N_OBS * 30, dtype=np.float32).reshape(N_OBS, 30))
    panels = [dz.open_dataset(p, features=PANEL) for p in (path, second)]
    on_device = (
        dz.FeatureSubset(joined, PANEL),
        dz.open_dataset(cube, features=[29, 3, 4]),
        dz.Subset(panels[0], np.arange(1, N_OBS, 3)),  # a train split of a panel
        dz.Subset(dz.Collection(panels), np.arange(0, N_OBS + 57, 4)),  # like panels
    )
    for dataset in on_device:
        cpu, gpu = both(dataset, where, return_index=True)
        paths = gpu.read_paths()
        assert not any("host read" in p for p in paths.values()), paths
        kept = f"{dataset.n_features} of {30 if dataset.layout == 'dense' else N_VARS} features"
        assert all(kept in p for p in paths.values()), paths
        assert assert_same_batches(cpu, gpu, epochs=(0, 1), where=where) == 2 * len(cpu) > 0
    # panels keeping different columns (a store of another gene order): each store's ids
    # mapped as the window is read
    reversed_genes = tmp_path / "reversed.zarr"
    make_adata(3, n_obs=57)[:, ::-1].copy().write_zarr(reversed_genes)
    unlike = dz.open_dataset([path, reversed_genes], features=[f"g{j}" for j in PANEL])
    cpu, gpu = both(unlike, where, return_index=True)
    paths = gpu.read_paths()
    assert all(
        p.endswith("(ids mapped to the panel, densify skips the rest)") for p in paths.values()
    ), paths
    assert assert_same_batches(cpu, gpu, epochs=(0,), where=where) == len(cpu) > 0
    # dense stores under different panels (and one read whole beside a panel of all its
    # columns): each run's panel columns copied out of its stored rows on the device
    half = tmp_path / "half.zarr"
    zarr.save_array(str(half), np.arange(N_OBS * 30, dtype=np.float16).reshape(N_OBS, 30))
    one_cube = dz.open_dataset(cube)
    unlike_dense = (
        dz.Collection([dz.open_dataset(cube, features=c) for c in ([29, 3], [3, 29])]),
        dz.Subset(
            dz.Collection([dz.open_dataset(half, features=c) for c in ([0, 7, 9], [9, 1, 0])]),
            np.arange(1, 2 * N_OBS, 3),
        ),
        dz.Collection([dz.open_dataset(cube), dz.open_dataset(cube, features=np.arange(30)[::-1])]),
        dz.Collection([dz.FeatureSubset(one_cube, c) for c in ([29, 3], [3, 29])]),  # one store
    )
    for dataset in unlike_dense:
        cpu, gpu = both(dataset, where, return_index=True)
        paths = gpu.read_paths()
        assert all(p.endswith("(each row's panel columns copied out)") for p in paths.values())
        assert assert_same_batches(cpu, gpu, epochs=(0, 1), where=where) == 2 * len(cpu) > 0


def _reordered_store(tmp_path: Path, seed: int, n_obs: int):
    """An AnnData store of other cells whose var lists the genes in another order, with
    extra genes around them (what a second lab's store looks like); and its AnnData."""
    import anndata as ad
    import pandas as pd

    base = make_adata(seed, n_obs=n_obs)
    rng = np.random.default_rng(seed)
    order = rng.permutation(N_VARS)
    extra = sp.random(n_obs, 9, density=0.3, format="csr", random_state=rng, dtype=np.float32)
    x = sp.hstack([extra[:, :4], base.X[:, order], extra[:, 4:]], format="csr")
    names = [f"x{j}" for j in range(4)] + [f"g{j}" for j in order] + [f"x{j}" for j in range(4, 9)]
    other = ad.AnnData(X=x, obs=base.obs, var=pd.DataFrame(index=names))
    path = tmp_path / f"reordered{seed}.zarr"
    other.write_zarr(path)
    return path, other


def test_names_select_each_stores_own_columns(rich, tmp_path: Path) -> None:
    """``open_dataset([a, b], features=names)``: stores with different gene orders and
    gene sets, each panel looked up in its own var; rows equal anndata's by name."""
    path, adata = rich
    other_path, other = _reordered_store(tmp_path, 5, 41)
    names = [f"g{j}" for j in PANEL]
    dataset = dz.open_dataset([path, other_path], features=names)
    assert dataset.feature_shape == (len(PANEL),) and dataset.var_names() == tuple(names)
    got = run_epoch(dz.Loader(dataset, sampler(), return_index=True))
    want = np.concatenate([adata[:, names].X.toarray(), other[:, names].X.toarray()])
    assert_rows_match(got, want, N_OBS + 41)
    with pytest.raises(dz.DatasetError, match="not in the store's var index"):
        dz.open_dataset([path, other_path], features=["g0", "x3"])  # x3: only the second
    with pytest.raises(dz.DatasetError, match="share the feature axis"):
        dz.open_dataset([path, other_path], features=PANEL)  # ids: one axis for all


@pytest.mark.parametrize("where", WHERE)
def test_gpu_path_maps_each_stores_panel(rich, tmp_path: Path, where: str) -> None:
    """Stores whose panels keep different stored columns (another gene order and width)
    are read by byte plans, their ids mapped per store as each window is read; batch for
    batch what the CPU path delivers (held to anndata above)."""
    import anndata as ad

    path, _ = rich
    other_path, _ = _reordered_store(tmp_path, 6, 37)
    names = [f"g{j}" for j in PANEL]
    joined = dz.open_dataset([path, other_path], features=names)
    narrow = tmp_path / "narrow.zarr"  # a store of exactly the panel's genes, read whole
    small = make_adata(7, n_obs=23)[:, names]  # in the panel's order: its columns are its genes
    ad.AnnData(X=small.X, obs=small.obs, var=small.var).write_zarr(narrow)
    mixed = dz.Collection([joined, dz.open_dataset(narrow)])
    cases = (
        joined,
        dz.Subset(joined, np.arange(1, N_OBS + 37, 3)),  # a train split
        dz.FeatureSubset(joined, [4, 0, 5]),  # a panel of the panels: maps composed
        mixed,
    )
    for dataset in cases:
        cpu, gpu = both(dataset, where, return_index=True)
        paths = gpu.read_paths()
        assert len(paths) == (6 if dataset is mixed else 4), paths  # data+indices per store
        assert all("mapped to the panel" in p for p in paths.values()), paths
        assert assert_same_batches(cpu, gpu, epochs=(0, 1), where=where) == 2 * len(cpu) > 0
    # CSR output: each row cut to its panel's entries as the window is read
    for dataset in cases:
        cpu, gpu = both(dataset, where, output="csr", return_index=True)
        paths = gpu.read_paths()
        assert all(p.endswith("rows cut to it)") for p in paths.values()), paths
        assert assert_same_batches(cpu, gpu, epochs=(0, 1), where=where) == 2 * len(cpu) > 0


@pytest.mark.parametrize("where", WHERE)
def test_gpu_path_dense_stores_of_other_gene_sets(rich, tmp_path: Path, where: str) -> None:
    """Dense ``X`` (a protein panel, say) in stores of other gene sets and orders, joined
    by names: the stores differ in width, so each row's panel columns are copied out of its
    own store's row on the device. Rows equal anndata's by name (CPU path), and the GPU path
    equals the CPU path batch for batch."""
    import anndata as ad

    adata = rich[1]
    other = _reordered_store(tmp_path, 9, 31)[1]  # 9 genes wider, in another order
    paths = []
    for name, source in (("dense_a", adata), ("dense_b", other)):
        paths.append(tmp_path / f"{name}.zarr")
        ad.AnnData(X=source.X.toarray(), obs=source.obs, var=source.var).write_zarr(paths[-1])
    names = [f"g{j}" for j in PANEL]
    joined = dz.open_dataset(paths, features=names)
    assert joined.layout == "dense"
    assert [p.n_features for p in joined.stores()] == [N_VARS, N_VARS + 9]
    got = run_epoch(dz.Loader(joined, sampler(), return_index=True))
    want = np.concatenate([adata[:, names].X.toarray(), other[:, names].X.toarray()])
    assert_rows_match(got, want, N_OBS + 31)
    cases = (
        joined,
        dz.Subset(joined, np.arange(1, N_OBS + 31, 3)),  # a train split
        dz.FeatureSubset(joined, [4, 0, 5]),  # a panel of the panels: maps composed
    )
    for dataset in cases:
        cpu, gpu = both(dataset, where, return_index=True)
        read = gpu.read_paths()
        assert len(read) == 2, read
        assert all(p.endswith("(each row's panel columns copied out)") for p in read.values())
        assert assert_same_batches(cpu, gpu, epochs=(0, 1), where=where) == 2 * len(cpu) > 0


def test_store_runs_carry_each_panel(rich, tmp_path: Path) -> None:
    """The ``store_runs`` contract through panels: each run's stored rows, kept to its
    ``columns``, concatenated, are the window's rows; every run's (store, columns) is one
    ``store_columns`` names, by identity (what the GPU reader looks maps up by)."""
    path, _ = rich
    other_path, _ = _reordered_store(tmp_path, 8, 45)
    base = dz.open_dataset(path)
    names = [f"g{j}" for j in PANEL]
    joined = dz.open_dataset([path, other_path], features=names)
    datasets = [
        dz.Subset(dz.FeatureSubset(base, PANEL), np.arange(0, N_OBS, 5)),
        # the same genes kept from a store of another gene order: other stored columns
        dz.Collection([dz.FeatureSubset(base, PANEL), dz.open_dataset(other_path, features=names)]),
        dz.FeatureSubset(dz.Subset(joined, np.arange(3, N_OBS + 45, 2)), [5, 1, 2]),
        dz.Collection([joined, dz.FeatureSubset(base, PANEL)]),
    ]
    rng = np.random.default_rng(0)
    for dataset in datasets:
        named = {(id(s), id(c)) for s, c in dataset.store_columns()}
        for _ in range(3):
            starts = np.sort(rng.choice(dataset.n_obs, 6, replace=False))
            stops = np.minimum(starts + rng.integers(1, 9, 6), dataset.n_obs)
            ranges = np.stack([starts, stops], 1)
            want = dataset.read_rows(ranges)
            runs = dataset.store_runs(ranges)
            assert runs and all(r.columns is not None for r in runs)
            assert {(id(r.store), id(r.columns)) for r in runs} <= named
            shape = (0, dataset.n_features)
            got = sp.vstack(
                [
                    sp.csr_matrix(
                        (p.data, p.indices, p.indptr), shape=(p.n_rows, dataset.n_features)
                    )
                    for p in (
                        keep_csr_columns(r.store.read_rows(r.ranges), r.columns) for r in runs
                    )
                ]
            )
            shape = got.shape
            wanted = sp.csr_matrix((want.data, want.indices, want.indptr), shape=shape)
            np.testing.assert_array_equal(got.toarray(), wanted.toarray())


def test_selections_compose_with_subsets_and_each_other(rich) -> None:
    path, adata = rich
    x = adata.X.toarray()
    base = dz.open_dataset(path)
    rows = np.arange(0, N_OBS, 3)
    inner = dz.Subset(dz.FeatureSubset(base, PANEL), rows)
    outer = dz.FeatureSubset(dz.Subset(base, rows), PANEL)
    twice = dz.FeatureSubset(dz.FeatureSubset(base, PANEL), [5, 0])  # flattened
    assert twice.parent is base and twice.columns.tolist() == [4, 17]
    for dataset, want in ((inner, x[rows][:, PANEL]), (outer, x[rows][:, PANEL])):
        got = run_epoch(dz.Loader(dataset, sampler(), return_index=True))
        np.testing.assert_array_equal(got["X"], want[np.searchsorted(rows, got["index"])])
    got = run_epoch(dz.Loader(twice, sampler(), return_index=True))
    assert_rows_match(got, x[:, [4, 17]], N_OBS)


def test_collections_select_by_each_stores_names(tmp_path: Path) -> None:
    """open_dataset looks names up per store (a store that lacks one is named); a selection
    over a collection built first needs its stores' names to agree."""
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    first, second = make_adata(0, n_obs=120), make_adata(1, n_obs=80)
    first.write_zarr(a)
    second.write_zarr(b)
    dataset = dz.open_dataset([a, b], features=["g5", "g1"])
    got = run_epoch(dz.Loader(dataset, sampler(chunk_size=16), return_index=True))
    both = np.concatenate([first.X.toarray(), second.X.toarray()])[:, [5, 1]]
    assert_rows_match(got, both, 200)
    second.var_names = [f"h{j}" for j in range(N_VARS)]
    second.write_zarr(b)
    with pytest.raises(dz.DatasetError, match=r"of .*b.zarr/X: 1 name\(s\) not in .* 'g5'"):
        dz.open_dataset([a, b], features=["g5"])
    # stores naming other genes at one position do not join (ids would mix genes), unless
    # asked: the same genes under other names, stacked by position
    with pytest.raises(dz.DatasetError, match=r"b.zarr/X names feature 0 'h0' but a.zarr/X"):
        dz.open_dataset([a, b])
    with pytest.raises(dz.DatasetError, match=r"names feature 0 'h0'.*check_var_names=False"):
        dz.open_dataset([a, b], features=[5])
    stacked = dz.Collection([dz.open_dataset(a), dz.open_dataset(b)], check_var_names=False)
    assert dz.FeatureSubset(stacked, [5]).n_features == 1 and stacked.var_names() is None


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_categorical_var_index_names_its_genes(tmp_path: Path, zarr_format: int) -> None:
    """A store whose var index is a ``pd.CategoricalIndex`` (anndata writes it as a
    categorical group) named no genes: beside a store of the same genes in reverse order
    it joined by position, every row of the second store with its columns reversed, and
    ``features=`` said the store names none. Its names are now read through the codes, as
    anndata reads them, and checked and looked up as any other index's; a wider X than
    its names is refused as for a plain index."""
    import anndata as ad
    import pandas as pd

    names = [f"g{j}" for j in range(6)]
    matrix = sp.random(50, 6, density=0.5, format="csr", random_state=1, dtype=np.float32)
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    with ad.settings.override(zarr_write_format=zarr_format):
        # categories in another order than the rows: names come through the codes
        index = pd.CategoricalIndex(names, categories=names[::-1])
        ad.AnnData(X=matrix, var=pd.DataFrame(index=index)).write_zarr(a)
        ad.AnnData(X=matrix[:, ::-1].tocsr(), var=pd.DataFrame(index=names[::-1])).write_zarr(b)
    assert zarr.open_group(a / "var")["_index"].attrs["encoding-type"] == "categorical"
    assert dz.open_dataset(a).var_names() == tuple(ad.read_zarr(a).var_names) == tuple(names)
    with pytest.raises(dz.DatasetError, match=r"b.zarr/X names feature 0 'g5' but a.zarr/X"):
        dz.open_dataset([a, b])
    joined = dz.open_dataset([a, b], features=["g4", "g0"])
    loader = dz.Loader(
        joined, sampler(chunk_size=8, batch_size=8, drop_last=False), return_index=True
    )
    got = run_epoch(loader)
    assert_rows_match(got, np.concatenate([matrix.toarray()] * 2)[:, [4, 0]], 100)
    zarr.open_group(a / "X", mode="r+").attrs["shape"] = [50, 9]  # X wider than var's names
    zarr.consolidate_metadata(a)
    with pytest.raises(dz.DatasetError, match=r"var has 6 names but .*X is 9 features wide"):
        dz.open_dataset(a)


def test_a_collection_around_an_unchecked_one_still_checks_its_other_parts(
    tmp_path: Path,
) -> None:
    """dz.Collection([dz.Collection([a, b], check_var_names=False), c]): the inner collection
    names no features, so the outer one (check_var_names=True) joined c unchecked, whatever
    genes c names: a column held other genes in c's rows, silently. The inner collection's
    columns stand for its first part's genes, and c is compared with those."""
    a, b, c, other = (tmp_path / f"{n}.zarr" for n in ("a", "b", "c", "other"))
    first, renamed, same, shuffled = (
        make_adata(k, n_obs=n) for k, n in enumerate((30, 20, 25, 15))
    )
    renamed.var_names = [f"h{j}" for j in range(N_VARS)]  # the same genes named otherwise
    shuffled.var_names = list(first.var_names[::-1])  # other genes at each position
    for path, adata in ((a, first), (b, renamed), (c, same), (other, shuffled)):
        adata.write_zarr(path)
    stacked = dz.Collection([dz.open_dataset(a), dz.open_dataset(b)], check_var_names=False)
    for parts in (
        [stacked, dz.open_dataset(other)],
        [dz.Subset(stacked, np.arange(0, 50, 2)), dz.open_dataset(other)],
        [dz.FeatureSubset(stacked, [5, 1]), dz.open_dataset(other, features=[5, 1])],
        [dz.Collection([stacked, dz.open_dataset(c)]), dz.open_dataset(other)],
    ):
        with pytest.raises(dz.DatasetError, match=r"other.zarr/X.* names feature 0 'g\d+' but"):
            dz.Collection(parts)
    joined = dz.Collection([stacked, dz.open_dataset(c)])  # c names a's genes: joins
    assert joined.var_names() is None  # b's names differ: no names to select by
    with pytest.raises(dz.DatasetError, match="names no features"):
        dz.FeatureSubset(joined, ["g1"])
    panel = dz.Collection(
        [dz.FeatureSubset(stacked, [5, 1]), dz.open_dataset(c, features=["g5", "g1"])]
    )
    got = run_epoch(dz.Loader(panel, sampler(chunk_size=8, batch_size=16), return_index=True))
    rows = [first.X.toarray(), renamed.X.toarray(), same.X.toarray()]
    assert_rows_match(got, np.concatenate(rows)[:, [5, 1]], 75)
    with pytest.raises(dz.DatasetError, match=r"c.zarr/X.* names feature 0 'g1' but"):
        dz.Collection([dz.FeatureSubset(stacked, [5, 1]), dz.open_dataset(c, features=[1, 5])])


def test_collection_of_paths_is_refused_naming_open_dataset(tmp_path: Path) -> None:
    """dz.Collection of store paths (the README's check_var_names=False case, written with
    paths) failed with AttributeError: 'str' object has no attribute 'layout'; one dataset
    or a generator failed with TypeError. Now paths and a lone dataset are refused naming
    open_dataset, and a generator of datasets joins like a list."""
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    make_adata(0, n_obs=30).write_zarr(a)
    second = make_adata(1, n_obs=20)
    second.var_names = [f"h{j}" for j in range(N_VARS)]
    second.write_zarr(b)
    with pytest.raises(dz.DatasetError, match=r"item 0 is a str .*dz.open_dataset\(p\) for p"):
        dz.Collection([str(a), str(b)], check_var_names=False)
    with pytest.raises(dz.DatasetError, match=r"item 1 is a PosixPath"):
        dz.Collection([dz.open_dataset(a), b], check_var_names=False)
    one = dz.open_dataset(a)
    with pytest.raises(dz.DatasetError, match=r"list of datasets, got one CsrDataset"):
        dz.Collection(one)
    stacked = dz.Collection((dz.open_dataset(p) for p in (a, b)), check_var_names=False)
    assert stacked.n_obs == 50 and len(stacked.parts) == 2
    got = run_epoch(dz.Loader(stacked, sampler(chunk_size=16), return_index=True))
    both = np.concatenate([make_adata(0, n_obs=30).X.toarray(), second.X.toarray()])
    assert_rows_match(got, both, 50)


def test_panel_of_a_collection_with_uint64_and_int64_column_ids(tmp_path: Path) -> None:
    """A store whose X/indices are uint64 beside one with int64 ids: NumPy joins the two as
    float64, and the panel's column filter then failed to compile (numba TypingError)
    instead of reading; the collection's rows keep its integer index dtype."""
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    first, second = make_adata(0, n_obs=30), make_adata(1, n_obs=20)
    first.write_zarr(a)
    second.write_zarr(b)
    for path, dtype in ((a, np.uint64), (b, np.int64)):
        x = zarr.open_group(path / "X", mode="r+")
        ids = x["indices"][...].astype(dtype)
        x.create_array("indices", shape=ids.shape, dtype=dtype, chunks=(50,), overwrite=True)
        x["indices"][...] = ids
        zarr.consolidate_metadata(str(path))
    both = np.concatenate([first.X.toarray(), second.X.toarray()])
    dataset = dz.open_dataset([a, b])
    rows = dataset.read_rows(np.array([[25, 35]]))
    assert rows.indices.dtype == dataset.index_dtype == np.int64
    panel = dz.FeatureSubset(dataset, PANEL)
    rows = panel.read_rows(np.array([[25, 35]]))
    got = sp.csr_matrix((rows.data, rows.indices, rows.indptr), shape=(10, len(PANEL)))
    np.testing.assert_array_equal(got.toarray(), both[25:35][:, PANEL])


def test_bad_selections_say_what_to_change(rich, tmp_path: Path) -> None:
    path, _ = rich
    cases = [
        ([3, 3], r"feature 3 is selected 2 times"),
        ([N_VARS], rf"feature id {N_VARS} is outside \[0, {N_VARS}\)"),
        ([-1], r"feature id -1 is outside"),
        ([], r"non-empty 1-D"),
        (np.ones(N_VARS - 1, bool), rf"one entry per feature \({N_VARS}\), got {N_VARS - 1}"),
        (np.zeros(N_VARS, bool), "selects no feature"),
        (
            ["g1", "CD3E", "MS4A1"],
            r"2 name\(s\) not in the store's var index \(which holds e.g. 'g0', 'g1', 'g2'\), "
            r"e.g. 'CD3E'",
        ),
        ([0.5], "integer ids, names or a boolean mask"),
    ]
    for features, message in cases:
        with pytest.raises(dz.DatasetError, match=message):
            dz.open_dataset(path, features=features)
    with pytest.raises(dz.DatasetError, match="names no features"):
        dz.open_dataset(path, element="obsm/X_pca", features=["PC1"])
    cube = dz.synthetic.make_dense_cube(tmp_path / "cube.zarr", n_obs=10, shape=(2, 3))
    with pytest.raises(dz.DatasetError, match=r"shape \(2, 3\); a feature selection needs one"):
        dz.open_dataset(cube, features=[0])


def test_suggestion_reads_the_parents_rows(rich) -> None:
    from dali_zarr.inspection import dataset_suggestion

    path, _ = rich
    base = dz.open_dataset(path)
    assert dataset_suggestion(dz.FeatureSubset(base, PANEL)) == dataset_suggestion(base)


def test_only_panels_out_of_stored_order_sort_their_csr_rows(rich) -> None:
    """Rows of a panel whose columns keep the stored order come out sorted as stored; only a
    panel that reorders columns pays the per-batch sort. Dropped columns (map -1) once
    made every panel count as reordered."""
    from dali_zarr.loader import panel_reorders

    path, _ = rich
    ds = dz.open_dataset(path)
    assert not panel_reorders(ds)
    assert not panel_reorders(dz.FeatureSubset(ds, [0, 3, 4, 11, 17, 29]))
    assert panel_reorders(dz.FeatureSubset(ds, PANEL))
    joined = dz.open_dataset([path, path])
    assert not panel_reorders(dz.FeatureSubset(joined, [2, 5]))
    assert panel_reorders(dz.FeatureSubset(joined, [5, 2]))


def test_object_arrays_select_by_what_their_elements_are(tmp_path: Path) -> None:
    """An object array (a pandas object column) of ints selects by id, of bools is a mask:
    its ids were looked up as names, so a store whose var names are numbers ("1", "2", in
    another order: a store written after a column subset) loaded other genes, silently."""
    import anndata as ad
    import pandas as pd

    names = ["10", "3", "5", "0", "2", "1"]
    x = sp.csr_matrix(np.arange(4 * len(names), dtype=np.float32).reshape(4, len(names)))
    path = tmp_path / "numeric_names.zarr"
    ad.AnnData(X=x, var=pd.DataFrame(index=names)).write_zarr(path)

    by_id = dz.open_dataset(path, features=np.array([1, 2], dtype=object))
    assert by_id.var_names() == ("3", "5")
    assert np.array_equal(by_id.columns, [1, 2])
    mask = np.array([True, False, True, False, False, True], dtype=object)
    assert dz.open_dataset(path, features=mask).var_names() == ("10", "5", "1")
    # names given as objects are still names
    named = dz.open_dataset(path, features=np.array(["1", "2"], dtype=object))
    assert named.var_names() == ("1", "2")
    with pytest.raises(dz.DatasetError, match=r"of numeric_names.zarr/X: .*NoneType, bool"):
        dz.open_dataset(path, features=np.array([True, None] * 3, dtype=object))
    with pytest.raises(dz.DatasetError, match="0/1 mask given as integers"):
        dz.open_dataset(path, features=[1, 0, 1, 0, 0, 1])
    # stores of other widths, joined by name: mixed kinds are named, not a width mismatch
    narrow = tmp_path / "narrow.zarr"
    ad.AnnData(X=x[:, :3], var=pd.DataFrame(index=names[:3])).write_zarr(narrow)
    with pytest.raises(dz.DatasetError, match=r"\+narrow.zarr/X: .*type int, str"):
        dz.open_dataset([path, narrow], features=np.array(["3", 5], dtype=object))
    # a collection stacked by position names no features: the message says why
    stacked = dz.Collection([dz.open_dataset(path), dz.open_dataset(path)], check_var_names=False)
    with pytest.raises(dz.DatasetError, match="check_var_names=False"):
        dz.FeatureSubset(stacked, ["3"])
    # rows come back with the chosen columns, on the loader too
    loader = dz.Loader(by_id, dz.ChunkSampler(chunk_size=2, preload_nchunks=2, batch_size=4),
                       return_index=True)  # fmt: skip
    (batch,) = list(loader)
    loader.close()
    assert np.array_equal(batch["X"].numpy(), x.toarray()[batch["index"].numpy()][:, [1, 2]])


@pytest.mark.parametrize("writer", ["zarr", "h5ad-convert"])
def test_names_held_by_a_var_column_are_pointed_to(tmp_path: Path, writer: str) -> None:
    """CELLxGENE-style stores name genes by Ensembl id in var's index and hold the symbols
    in a column (``feature_name``): ``features=["CD3E", ...]``, as README shows it, said only
    "not in the store's var index", neither what the index holds nor where the names are."""
    import anndata as ad
    import pandas as pd

    symbols = ["CD3E", "MS4A1", "CD3E", "NKG7"]  # symbols repeat in real data
    var = pd.DataFrame(
        {"feature_name": pd.Categorical(symbols), "note": ["a", "b", "c", "d"]},
        index=[f"ENSG{i:011d}" for i in range(4)],
    )
    x = sp.random(6, 4, density=0.5, format="csr", dtype=np.float32, random_state=0)
    adata = ad.AnnData(X=x, obs=pd.DataFrame(index=[f"c{i}" for i in range(6)]), var=var)
    path = tmp_path / "census.zarr"
    if writer == "zarr":
        adata.write_zarr(path)
    else:
        from dali_zarr.convert import convert

        adata.write_h5ad(tmp_path / "census.h5ad")
        convert(tmp_path / "census.h5ad", path)
    message = (
        r"2 name\(s\) not in the store's var index \(which holds e.g. 'ENSG00000000000', "
        r"'ENSG00000000001', 'ENSG00000000002'\), e.g. 'MS4A1', 'NKG7'.*var column "
        r"'feature_name' holds them"
    )
    with pytest.raises(dz.DatasetError, match=message):
        dz.open_dataset(path, features=["ENSG00000000000", "MS4A1", "NKG7"])
    with pytest.raises(dz.DatasetError, match=message):  # through a subset too
        dz.FeatureSubset(dz.Subset(dz.open_dataset(path), [1, 2]), ["MS4A1", "NKG7"])
    with pytest.raises(dz.DatasetError) as names_elsewhere:  # no column holds them all
        dz.open_dataset(path, features=["MS4A1", "a"])
    assert "holds them" not in str(names_elsewhere.value)


def test_names_only_raw_var_holds_point_to_raw_x(tmp_path: Path) -> None:
    """After scanpy's ``highly_variable_genes(subset=True)`` X holds a few genes and
    ``raw`` all of them: a panel gene outside X was "not in the store's var index", not
    that ``element='raw/X'`` names it."""
    import anndata as ad
    import pandas as pd

    x = sp.random(6, 5, density=0.5, format="csr", dtype=np.float32, random_state=0)
    full = ad.AnnData(X=x, var=pd.DataFrame(index=[f"g{i}" for i in range(5)]))
    full.obs_names = [f"c{i}" for i in range(6)]
    full.raw = full
    hvg = full[:, [1, 3]].copy()
    hvg.write_zarr(tmp_path / "hvg.zarr")
    with pytest.raises(dz.DatasetError, match=r"e.g. 'g0', 'g4'. raw/var names them.*'raw/X'"):
        dz.open_dataset(tmp_path / "hvg.zarr", features=["g3", "g0", "g4"])
    with pytest.raises(dz.DatasetError) as not_in_raw:
        dz.open_dataset(tmp_path / "hvg.zarr", features=["g0", "CD3E"])
    assert "raw/var" not in str(not_in_raw.value)
    raw = dz.open_dataset(tmp_path / "hvg.zarr", element="raw/X", features=["g3", "g0", "g4"])
    assert raw.feature_shape == (3,)
