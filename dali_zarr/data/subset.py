"""A dataset restricted to chosen observations (train/validation/test splits, filters).

A :class:`Subset` is a :class:`~dali_zarr.data.dataset.Dataset` of its own: samplers plan
over its ``m`` rows (ids ``0..m-1``, in the parent's order), and :meth:`Subset.read_rows`
turns those local ranges into runs of consecutive parent rows, so a split that is contiguous
in storage is read as whole ranges and a scattered one as short runs of the same chunks.
Batches still report the *parent's* observation ids in ``batch["index"]``
(:meth:`Subset.global_ids`).
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from dali_zarr.data.dataset import Dataset, Rows, StoreRun
from dali_zarr.data.elements import CfDecoding
from dali_zarr.data.obs import ObsColumn
from dali_zarr.errors import DatasetError
from dali_zarr.io import ArrayReader, StoredObjectsWatch
from dali_zarr.planning.partition import concat_aranges, run_offsets


def _runs(rows: np.ndarray, forced: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(k, 2)`` ``[start, stop)`` runs of consecutive ids, in the order given, and where
    each run starts in ``rows``; a run also starts at each position in ``forced``."""
    if len(rows) == 0:
        return np.zeros((0, 2), dtype=np.int64), np.zeros(0, dtype=np.int64)
    head = np.empty(len(rows), dtype=bool)
    head[0] = True
    head[1:] = np.diff(rows) != 1
    if forced is not None:
        head[forced] = True
    heads = np.flatnonzero(head)
    ends = np.append(heads[1:], len(rows)) - 1
    return np.stack([rows[heads], rows[ends] + 1], axis=1), heads


def refuse_integer_mask(ids: np.ndarray, n: int, *, where: str, argument: str, item: str) -> None:
    """Refuse ids with repeats (the caller found some) that are a 0/1 mask given as integers,
    one entry per item of ``n`` (``(x > 0).astype(np.uint8)``): read as ids they select
    items 0 and 1, many times over, where a boolean mask was meant."""
    if len(ids) == n and ids.min() >= 0 and ids.max() <= 1:
        raise DatasetError(
            f"{where}: {argument} holds only 0s and 1s, one per {item}: a 0/1 mask given as "
            f"integers is read as {item} ids (0 and 1, many times over); pass it as booleans, "
            f"{argument}.astype(bool)."
        )


def select_rows(rows: np.ndarray | list | tuple, n_obs: int, name: str) -> np.ndarray:
    """Sorted int64 row ids of a dataset of ``n_obs`` rows from a boolean mask or an array
    of ids (checked, duplicates refused): the dataset's own ids, where a :class:`Subset`
    of a subset holds its stored rows instead."""
    from dali_zarr.data.features import as_selection  # builds on this module

    # ids or a mask held as objects (a pandas object column) take their elements' type
    rows = as_selection(rows, where=name, argument="rows", accepted="row ids or a boolean mask")
    if rows.dtype.kind in "USO":
        raise DatasetError(
            f"{name}: rows holds text (obs names?, e.g. {str(rows.flat[0])!r}); a subset takes "
            "row ids or a boolean mask: pass the names' row ids, "
            "adata.obs_names.get_indexer(names) (-1 where a name is missing)."
        )
    if rows.dtype == bool:
        if rows.shape != (n_obs,):
            raise DatasetError(
                f"{name}: a boolean mask must have one entry per observation ({n_obs}), "
                f"got shape {rows.shape}."
            )
        return np.flatnonzero(rows).astype(np.int64)
    if rows.size == 0:
        return np.zeros(0, dtype=np.int64)
    if rows.ndim != 1 or rows.dtype.kind not in "iu":
        raise DatasetError(
            f"{name}: rows must be a 1-D array of integer observation ids or a boolean mask, "
            f"got dtype {rows.dtype} and shape {rows.shape}."
        )
    if rows.dtype.kind == "u" and int(rows.max()) >= n_obs:  # before int64 wraps it negative
        raise DatasetError(f"{name}: row id {int(rows.max())} is outside [0, {n_obs}).")
    rows = rows.astype(np.int64, copy=False)
    if np.any(rows[1:] <= rows[:-1]):
        rows = np.sort(rows)
        dup = np.flatnonzero(rows[1:] == rows[:-1])
        if len(dup):
            # np.unique would turn a 0/1 mask into the subset of rows 0 and 1, silently
            refuse_integer_mask(rows, n_obs, where=name, argument="rows", item="row")
            raise DatasetError(
                f"{name}: row id {int(rows[dup[0]])} is selected more than once; a subset "
                "holds each observation once (use np.unique)."
            )
    if rows[0] < 0 or rows[-1] >= n_obs:
        bad = int(rows[0] if rows[0] < 0 else rows[-1])
        raise DatasetError(f"{name}: row id {bad} is outside [0, {n_obs}).")
    return rows


class Subset(Dataset):
    """The observations ``rows`` of ``dataset`` (a boolean mask or integer ids), as a dataset.

    Local row ``i`` is parent row ``parent_rows[i]``; ``parent_rows`` is sorted (ids given
    out of order are sorted, duplicates refused), so the subset keeps the parent's storage
    order. Obs columns are the parent's, taken at those rows (same categories). A subset of
    a subset is flattened onto the original dataset.
    """

    def __init__(self, dataset: Dataset, rows: np.ndarray | list | tuple) -> None:
        if not isinstance(dataset, Dataset):
            raise DatasetError(
                f"Subset needs a dali_zarr Dataset (from open_dataset), got {type(dataset)!r}."
            )
        selected = select_rows(rows, dataset.n_obs, f"subset of {dataset.name}")
        if isinstance(dataset, Subset):  # flatten: one mapping straight onto the stored rows
            selected = dataset.parent_rows[selected]
            dataset = dataset.parent
        self.parent = dataset
        self.parent_rows = selected
        self.parent_rows.setflags(write=False)
        # the row set is part of the name, which identifies the dataset (e.g. when resuming)
        digest = zlib.crc32(np.ascontiguousarray(selected).view(np.uint8))
        #: the rows taken, without the store's path (the ranks compare it: dali_zarr.loader)
        self.selection = f"{len(selected)} of {dataset.n_obs} rows #{digest:08x}"
        self.name = f"{dataset.name}[{self.selection}]"
        self.n_obs = len(selected)
        self.feature_shape = dataset.feature_shape
        self.dtype = dataset.dtype
        self.layout = dataset.layout
        self.index_dtype = dataset.index_dtype
        self._columns: dict[str, ObsColumn] = {}

    def read_rows(self, ranges: np.ndarray) -> Rows:
        """Rows of local ``[start, stop)`` ranges, read as runs of consecutive parent rows."""
        return self.parent.read_rows(self._parent_ranges(ranges))

    def _parent_ranges(self, ranges: np.ndarray) -> np.ndarray:
        """Local ``[start, stop)`` ranges → runs of consecutive parent rows, in order."""
        rows, _ = self._rows_of(ranges)
        return _runs(rows)[0]

    def _parent_pieces(self, ranges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each local range as runs of consecutive parent rows: ``(runs, how many runs each
        range gave)``; no run spans two ranges, so a collection can split them back."""
        rows, offsets = self._rows_of(ranges)
        runs, heads = _runs(rows, forced=offsets[:-1][np.diff(offsets) > 0])
        return runs, np.diff(np.searchsorted(heads, offsets))

    def _rows_of(self, ranges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The parent rows of local ranges, and where each range's rows start among them."""
        r = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        if len(r) and (r[:, 0].min() < 0 or r[:, 1].max() > self.n_obs):
            raise DatasetError(f"{self.name}: row ranges reach outside [0, {self.n_obs}).")
        lens = np.maximum(r[:, 1] - r[:, 0], 0)
        return self.parent_rows[concat_aranges(r[:, 0], lens)], run_offsets(lens)

    def selections(self) -> list[object]:
        return [self.selection, *self.parent.selections()]

    def store_runs(self, ranges: np.ndarray) -> list[StoreRun] | None:
        return self.parent.store_runs(self._parent_ranges(ranges))

    def grouped_store_runs(self, groups: list[np.ndarray]) -> list[list[StoreRun]] | None:
        runs, counts = self._parent_pieces(np.concatenate(groups))
        per_range = run_offsets(counts)
        cut = per_range[run_offsets(np.array([len(g) for g in groups], dtype=np.int64))]
        return self.parent.grouped_store_runs(
            [runs[a:b] for a, b in itertools.pairwise(cut.tolist())]
        )

    def store_columns(self) -> list[tuple[Dataset, np.ndarray | None]] | None:
        return self.parent.store_columns()

    def obs_column(self, name: str) -> ObsColumn:
        if name not in self._columns:
            column = self.parent.obs_column(name)
            self._columns[name] = replace(column, values=column.values[self.parent_rows])
        return self._columns[name]

    @property
    def n_ids(self) -> int:
        return self.parent.n_ids

    def global_ids(self, rows: np.ndarray) -> np.ndarray:
        """Local row ids → the parent's observation ids (what ``batch["index"]`` reports)."""
        return self.parent.global_ids(self.parent_rows[rows])

    def var_names(self) -> tuple[str, ...] | None:
        return self.parent.var_names()

    def packing(self) -> dict[str, Any]:
        return self.parent.packing()

    def cf_decoding(self) -> CfDecoding | None:
        return self.parent.cf_decoding()

    def names_hint(self, names: Sequence[str]) -> str:
        return self.parent.names_hint(names)

    def names_by_position(self) -> tuple[str, ...] | None:
        return self.parent.names_by_position()

    def readers(self) -> list[ArrayReader]:
        return self.parent.readers()

    def watches(self) -> list[StoredObjectsWatch]:
        return self.parent.watches()
