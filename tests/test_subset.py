"""Subset: a dataset view on chosen observations, read as runs of parent rows; batches report
the parent's observation ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import zarr

import dali_zarr as dz
from dali_zarr import synthetic
from tests.stores import as_dense, csr_reference


@pytest.fixture(scope="module")
def csr_store(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("subset") / "sc.zarr"
    return synthetic.make_single_cell(path, n_obs=1_000, n_features=32, chunk_elements=512)


def _reference_runs(parent_rows: np.ndarray) -> list[list[int]]:
    """Runs of consecutive ids, row by row."""
    runs: list[list[int]] = []
    for row in parent_rows.tolist():
        if runs and runs[-1][1] == row:
            runs[-1][1] += 1
        else:
            runs.append([row, row + 1])
    return runs


def test_parent_runs_per_range_and_joined(csr_store: str) -> None:
    """Local ranges → runs of consecutive parent rows, against a row-by-row reference: per
    range (what a collection's window asks for) and joined (what read_rows reads), for
    scattered, blocky and full subsets, empty and edge ranges."""
    rng = np.random.default_rng(2)
    parent = dz.open_dataset(csr_store)
    masks = [rng.random(1000) < 0.8, np.repeat(rng.random(50) < 0.5, 20), np.ones(1000, bool)]
    for mask in masks:
        sub = dz.Subset(parent, mask)
        for _ in range(20):
            starts = rng.integers(0, sub.n_obs + 1, 8)
            ranges = np.stack([starts, np.minimum(starts + rng.integers(0, 60, 8), sub.n_obs)], 1)
            runs, counts = sub._parent_pieces(ranges)
            each = [_reference_runs(sub.parent_rows[a:b]) for a, b in ranges]
            assert counts.tolist() == [len(e) for e in each]
            assert runs.tolist() == [run for e in each for run in e]
            rows = np.concatenate([sub.parent_rows[a:b] for a, b in ranges])
            assert sub._parent_ranges(ranges).tolist() == _reference_runs(rows)
    # ranges that continue each other: one run each (a collection splits them back by
    # range), one run joined
    full = dz.Subset(parent, np.arange(100, 200))
    adjacent = np.array([[0, 5], [5, 9], [9, 9], [9, 12]])
    runs, counts = full._parent_pieces(adjacent)
    assert counts.tolist() == [1, 1, 0, 1] and runs.tolist() == [[100, 105], [105, 109], [109, 112]]
    assert full._parent_ranges(adjacent).tolist() == [[100, 112]]
    empty = dz.Subset(parent, [])
    assert empty._parent_ranges(np.zeros((0, 2), np.int64)).shape == (0, 2)
    with pytest.raises(dz.DatasetError, match="outside"):
        dz.Subset(parent, np.arange(10))._parent_ranges(np.array([[5, 11]]))


def test_csr_subset_reads_parent_rows(csr_store: str) -> None:
    parent = dz.open_dataset(csr_store)
    reference = csr_reference(csr_store).toarray()
    rng = np.random.default_rng(0)
    rows = np.sort(rng.choice(1_000, size=321, replace=False))
    rows[:40] = np.arange(100, 140)  # a contiguous stretch too
    rows = np.unique(rows)
    sub = dz.Subset(parent, rows)
    assert sub.n_obs == len(rows) and sub.layout == "csr" and sub.feature_shape == (32,)
    ranges = np.array([[5, 30], [0, 3], [len(rows) - 7, len(rows)], [50, 50]])
    local = np.concatenate([np.arange(a, b) for a, b in ranges])
    np.testing.assert_array_equal(as_dense(sub.read_rows(ranges), 32), reference[rows[local]])
    np.testing.assert_array_equal(sub.global_ids(local), rows[local])
    codes = zarr.open_group(csr_store)["obs/cell_type/codes"][...]
    column = sub.obs_column("cell_type")
    np.testing.assert_array_equal(column.values, codes[rows])
    assert sub.categories("cell_type") == parent.categories("cell_type")
    assert sub.read_paths() == parent.read_paths()


def test_masks_unsorted_ids_nesting_and_errors(csr_store: str) -> None:
    parent = dz.open_dataset(csr_store)
    mask = np.zeros(1_000, dtype=bool)
    mask[[7, 3, 500, 999]] = True
    np.testing.assert_array_equal(dz.Subset(parent, mask).parent_rows, [3, 7, 500, 999])
    np.testing.assert_array_equal(dz.Subset(parent, [999, 3, 7]).parent_rows, [3, 7, 999])
    outer = dz.Subset(parent, np.arange(100, 200))
    inner = dz.Subset(outer, np.array([0, 5, 99]))
    assert inner.parent is parent  # flattened onto the stored rows
    np.testing.assert_array_equal(inner.global_ids(np.arange(3)), [100, 105, 199])
    with pytest.raises(dz.DatasetError, match="more than once"):
        dz.Subset(parent, [4, 2, 4])
    with pytest.raises(dz.DatasetError, match=r"outside \[0, 1000\)"):
        dz.Subset(parent, [0, 1_000])
    with pytest.raises(dz.DatasetError, match="one entry per observation"):
        dz.Subset(parent, np.ones(10, dtype=bool))
    with pytest.raises(dz.DatasetError, match="integer observation ids"):
        dz.Subset(parent, np.array([0.5, 1.5]))


def test_a_mask_of_zeros_and_ones_is_not_taken_for_ids(csr_store: str) -> None:
    """A 0/1 mask as integers (``(x > 0).astype(np.uint8)``) reads as the ids 0 and 1 many
    times over: the refusal said to apply np.unique, which silently gives a subset of rows
    0 and 1. It names the mask instead, and the boolean mask is the way out."""
    parent = dz.open_dataset(csr_store)
    mask = np.zeros(parent.n_obs, dtype=np.uint8)
    mask[[3, 7, 500]] = 1
    with pytest.raises(dz.DatasetError, match=r"0/1 mask.*astype\(bool\)") as info:
        dz.Subset(parent, mask)
    assert "np.unique" not in str(info.value)
    with pytest.raises(dz.DatasetError, match="0/1 mask"):  # a mask that selects nothing
        dz.Subset(parent, np.zeros(parent.n_obs, dtype=np.int64))
    np.testing.assert_array_equal(dz.Subset(parent, mask.astype(bool)).parent_rows, [3, 7, 500])
    with pytest.raises(dz.DatasetError, match=r"np\.unique"):  # real ids keep their hint
        dz.Subset(parent, [4, 2, 4])


def test_dense_and_collection_subsets(tmp_path: Path) -> None:
    cube = synthetic.make_dense_cube(tmp_path / "c.zarr", n_obs=300, shape=(3, 4), chunk_obs=16)
    reference = zarr.open_array(cube)[...]
    sub = dz.Subset(dz.open_dataset(cube), np.arange(1, 300, 7))
    got = as_dense(sub.read_rows(np.array([[0, sub.n_obs]])), 12)
    np.testing.assert_array_equal(got, reference[np.arange(1, 300, 7)])
    a = synthetic.make_single_cell(tmp_path / "a.zarr", n_obs=120, n_features=32, seed=1)
    b = synthetic.make_single_cell(tmp_path / "b.zarr", n_obs=90, n_features=32, seed=2)
    both = sp.vstack([csr_reference(a), csr_reference(b)]).toarray()
    rows = np.array([0, 1, 2, 118, 119, 120, 121, 200, 209])  # runs across the store boundary
    sub = dz.Subset(dz.open_dataset([a, b]), rows)
    np.testing.assert_array_equal(as_dense(sub.read_rows(np.array([[0, 9]])), 32), both[rows])


def test_collection_splits_ranges_at_store_boundaries(tmp_path: Path) -> None:
    """``part_runs`` against a row-by-row reference: ranges across several stores, an empty
    store among them (a range passes it by), empty ranges, consecutive pieces of one store
    joined; and the rows read equal the stores' rows."""
    sizes = [7, 0, 5, 1, 9]
    paths = [
        synthetic.make_single_cell(tmp_path / f"{i}.zarr", n_obs=n, n_features=32, seed=i)
        if n
        else None
        for i, n in enumerate(sizes)
    ]
    parts = [dz.open_dataset(p) if p else dz.Subset(dz.open_dataset(paths[0]), []) for p in paths]
    joined = dz.Collection(parts)
    stacked = sp.vstack([csr_reference(p) for p in paths if p]).toarray()
    owner = np.repeat(np.arange(len(sizes)), sizes)  # store of each collection row
    rng = np.random.default_rng(0)
    for _ in range(50):
        starts = rng.integers(0, joined.n_obs + 1, 6)
        ranges = np.stack([starts, np.minimum(starts + rng.integers(0, 12, 6), joined.n_obs)], 1)
        runs = joined.part_runs(ranges)
        rows = np.concatenate([np.arange(a, b) for a, b in ranges])
        # expected: the rows' stores, one run per change of store
        want = [
            int(owner[r]) for i, r in enumerate(rows) if i == 0 or owner[r] != owner[rows[i - 1]]
        ]
        assert [parts.index(part) for part, _ in runs] == want
        local = np.concatenate([np.arange(a, b) for _, r in runs for a, b in r] or [[]])
        np.testing.assert_array_equal(local, rows - joined.offsets[owner[rows]])
        assert all(len(r) and np.all(r[:, 1] > r[:, 0]) for _, r in runs)
        got = as_dense(joined.read_rows(ranges), 32)
        np.testing.assert_array_equal(got, stacked[rows])


def test_store_runs_of_a_collection_of_subsets_read_the_window(tmp_path: Path) -> None:
    """``store_runs`` contract: the runs' stored rows, in order, are the window's rows (each
    part asked once per window for all of its runs)."""
    a = synthetic.make_single_cell(tmp_path / "a.zarr", n_obs=300, n_features=32, seed=1)
    b = synthetic.make_single_cell(tmp_path / "b.zarr", n_obs=200, n_features=32, seed=2)
    rng = np.random.default_rng(4)
    parts = [
        dz.Subset(dz.open_dataset(a), rng.random(300) < 0.7),
        dz.open_dataset(b),
        dz.Subset(dz.open_dataset(b), np.arange(0, 200, 3)),
    ]
    joined = dz.Collection(parts)
    for dataset in (joined, dz.Subset(joined, rng.random(joined.n_obs) < 0.6)):
        for _ in range(10):
            chunks = rng.permutation(dataset.n_obs // 16)[:6]
            ranges = np.stack([chunks * 16, chunks * 16 + 16], 1)
            runs = dataset.store_runs(ranges)
            assert {id(run.store) for run in runs} <= {id(s) for s in dataset.stores()}
            got = np.concatenate([as_dense(r.store.read_rows(r.ranges), 32) for r in runs])
            np.testing.assert_array_equal(got, as_dense(dataset.read_rows(ranges), 32))


def test_loader_over_subset_reports_parent_ids(csr_store: str) -> None:
    reference = csr_reference(csr_store).toarray()
    codes = zarr.open_group(csr_store)["obs/cell_type/codes"][...]
    rows = np.flatnonzero(np.random.default_rng(3).random(1_000) < 0.4)
    sampler = dz.ChunkSampler(chunk_size=16, preload_nchunks=4, batch_size=40, seed=1)
    loader = dz.Loader(
        dz.Subset(dz.open_dataset(csr_store), rows),
        sampler,
        obs=["cell_type"],
        return_index=True,
    )
    assert len(loader) == -(-len(rows) // 40)
    parts = [{k: v.numpy() for k, v in batch.items()} for batch in loader]
    index = np.concatenate([p["index"] for p in parts])
    np.testing.assert_array_equal(np.sort(index), rows)  # every chosen row once, parent ids
    np.testing.assert_array_equal(np.concatenate([p["X"] for p in parts]), reference[index])
    np.testing.assert_array_equal(np.concatenate([p["cell_type"] for p in parts]), codes[index])
    loader.close()


def test_a_collection_of_subsets_reports_its_stores_ids(tmp_path: Path) -> None:
    """Each part's ids after the id spaces of the parts before: a collection of splits of
    stores a and b reports what a split of the collection [a, b] would, so every index maps
    back to (store, row). It reported positions in the collection before."""
    a = synthetic.make_single_cell(tmp_path / "a.zarr", n_obs=300, n_features=40, seed=1)
    b = synthetic.make_single_cell(tmp_path / "b.zarr", n_obs=200, n_features=40, seed=2)
    rows_a, rows_b = np.arange(0, 300, 3), np.arange(1, 200, 4)
    both = csr_reference(a).toarray(), csr_reference(b).toarray()
    stacked = np.concatenate(both)
    pieces = dz.Collection([dz.Subset(dz.open_dataset(a), rows_a),
                            dz.Subset(dz.open_dataset(b), rows_b)])  # fmt: skip
    whole = dz.Subset(dz.open_dataset([a, b]), np.concatenate([rows_a, 300 + rows_b]))
    assert pieces.n_ids == whole.n_ids == 500
    for dataset in (pieces, whole, dz.FeatureSubset(pieces, [3, 1])):
        sampler = dz.ChunkSampler(chunk_size=8, preload_nchunks=4, batch_size=32, seed=0)
        loader = dz.Loader(dataset, sampler, return_index=True)
        got = [(b["index"].numpy(), b["X"].numpy()) for b in loader]
        index = np.concatenate([i for i, _ in got])
        np.testing.assert_array_equal(np.sort(index), np.concatenate([rows_a, 300 + rows_b]))
        want = stacked[index] if dataset.n_features == 40 else stacked[index][:, [3, 1]]
        np.testing.assert_array_equal(np.concatenate([x for _, x in got]), want)
        loader.close()


def test_rows_as_objects_and_obs_names_say_what_to_pass(csr_store: str) -> None:
    """Ids held as objects (a pandas object column) were refused as "dtype object", which
    ``FeatureSubset`` takes; obs names (``adata.obs_names[mask]``) and a nullable boolean
    mask with missing values got the same "dtype object" refusal, naming neither."""
    import pandas as pd

    ds = dz.open_dataset(csr_store)
    as_objects = dz.Subset(ds, np.array([7, 3, 5], dtype=object))
    np.testing.assert_array_equal(as_objects.parent_rows, [3, 5, 7])
    mask = np.zeros(ds.n_obs, dtype=object)
    mask[:] = False
    mask[[2, 4]] = True
    np.testing.assert_array_equal(dz.Subset(ds, mask).parent_rows, [2, 4])
    with pytest.raises(dz.DatasetError, match=r"rows holds text \(obs names\?.*'c1'.*get_indexer"):
        dz.Subset(ds, pd.Index(["c1", "c2"]))
    nullable = pd.array([True, None, *[False] * (ds.n_obs - 2)], dtype="boolean")
    with pytest.raises(dz.DatasetError, match=r"rows holds values of type NAType, bool"):
        dz.Subset(ds, nullable)
