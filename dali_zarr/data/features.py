"""A dataset restricted to chosen features (a gene panel, highly variable genes, a model's
gene order), in the order given.

Rewriting a 100M-cell store to keep 2,000 of its 30,000 genes costs hours; selecting them
as the rows are read costs one pass over each window's non-zeros. :class:`FeatureSubset`
is a :class:`~dali_zarr.data.dataset.Dataset` of its own, so samplers, both loader paths,
CSR output, subsets, collections and resuming work on it unchanged: its ``read_rows`` reads
the parent's rows and keeps the chosen columns, renumbered ``0..k-1`` in the order given
(CSR: one compiled pass per window; dense: one NumPy ``take``). The batches are then ``k``
features wide, so densify writes ``k`` columns per row instead of all of them.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any

import numpy as np

from dali_zarr.data.dataset import CsrRows, Dataset, DenseRows, Rows, StoreRun
from dali_zarr.data.elements import CfDecoding
from dali_zarr.data.obs import ObsColumn, as_text
from dali_zarr.data.subset import refuse_integer_mask
from dali_zarr.errors import DatasetError
from dali_zarr.io import ArrayReader, StoredObjectsWatch

FeatureSelection = np.ndarray | Sequence[int] | Sequence[str] | Sequence[bool]


def select_features(
    features: FeatureSelection,
    n_features: int,
    names: tuple[str, ...] | None,
    *,
    dataset: str,
    names_hint: Callable[[Sequence[str]], str] | None = None,
) -> np.ndarray:
    """int64 column ids of ``features``: integer ids, a boolean mask over all features, or
    feature names looked up in ``names`` (the store's ``var`` index). Order is kept;
    repeated features are refused (one stored value cannot fill two CSR columns).
    ``names_hint`` says where the store holds names the index lacks, for the error
    (:meth:`~dali_zarr.data.dataset.Dataset.names_hint`)."""
    where = f"feature selection of {dataset}"
    chosen = as_selection(features, where=where)
    if chosen.ndim != 1 or chosen.size == 0:
        raise DatasetError(
            f"{where}: pass a non-empty 1-D list of feature ids, names or a boolean mask; got "
            f"shape {chosen.shape}."
        )
    if chosen.dtype == bool:
        if chosen.shape != (n_features,):
            raise DatasetError(
                f"{where}: a boolean mask needs one entry per feature ({n_features}), got "
                f"{chosen.shape[0]}."
            )
        ids = np.flatnonzero(chosen).astype(np.int64)
        if ids.size == 0:
            raise DatasetError(f"{where}: the mask selects no feature.")
        return ids
    if chosen.dtype.kind in "USO":
        if names is None:
            raise DatasetError(
                f"{where}: the dataset names no features (no var index for this element, or "
                "a collection joined with check_var_names=False, whose stores may name a "
                "column differently), so select them by integer id, or pass the names to "
                "open_dataset with the stores (each store's own var is looked up)."
            )
        lookup: dict[str, int] = {}
        repeated: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            if lookup.setdefault(name, i) != i:
                repeated.setdefault(name, [lookup[name]]).append(i)
        wanted = list(as_text(chosen))  # names given as bytes too
        missing = [f for f in wanted if f not in lookup]
        if missing:
            shown = ", ".join(repr(m) for m in missing[:5])
            held = ", ".join(repr(n) for n in names[:3])
            raise DatasetError(
                f"{where}: {len(missing)} name(s) not in the store's var index (which holds "
                f"e.g. {held}), e.g. {shown}.{names_hint(missing) if names_hint else ''}"
            )
        ambiguous = [f for f in dict.fromkeys(wanted) if f in repeated]
        if ambiguous:  # which of the columns would be a guess
            f = ambiguous[0]
            raise DatasetError(
                f"{where}: {len(ambiguous)} requested name(s) name several columns of the "
                f"store's var index, e.g. {f!r} at columns {repeated[f]}; make var names "
                "unique (anndata: var_names_make_unique) or select by integer id."
            )
        ids = np.array([lookup[f] for f in wanted], dtype=np.int64)
    elif chosen.dtype.kind in "iu":
        ids = chosen.astype(np.int64)
        bad = ids[(ids < 0) | (ids >= n_features)]
        if bad.size:
            raise DatasetError(f"{where}: feature id {int(bad[0])} is outside [0, {n_features}).")
    else:
        raise DatasetError(
            f"{where}: features must be integer ids, names or a boolean mask, got dtype "
            f"{chosen.dtype}."
        )
    counts = np.bincount(ids, minlength=n_features)
    if counts.max() > 1:
        refuse_integer_mask(ids, n_features, where=where, argument="features", item="feature")
        j = int(np.argmax(counts))
        named = f" ({names[j]!r})" if names is not None and j < len(names) else ""
        raise DatasetError(
            f"{where}: feature {j}{named} is selected {int(counts[j])} times; pick once."
        )
    return ids


@lru_cache(maxsize=1)
def _compiled_filter() -> Any:
    """The CSR column filter, compiled on first use (numba: a window's non-zeros in one pass
    with the GIL released; NumPy's mask-and-compress took ~4x as long). Returns the number
    of kept values, or -1 at a column id outside ``column_map`` (numba does not check
    bounds, and a dataset's rows are checked already, so this costs no extra pass)."""
    import numba

    @numba.njit(nogil=True, cache=False)
    def keep_columns(data, indices, indptr, column_map, out_data, out_indices, out_indptr):
        k = 0
        n_columns = column_map.shape[0]
        out_indptr[0] = 0
        for r in range(indptr.shape[0] - 1):
            for p in range(indptr[r], indptr[r + 1]):
                j = indices[p]
                if j < 0 or j >= n_columns:
                    return -1
                c = column_map[j]
                if c >= 0:
                    out_data[k] = data[p]
                    out_indices[k] = c
                    k += 1
            out_indptr[r + 1] = k
        return k

    return keep_columns


def keep_csr_columns(rows: CsrRows, column_map: np.ndarray) -> CsrRows:
    """The rows with only the columns whose ``column_map`` entry is >= 0, renumbered to it.

    Values only move, so they go through the filter as unsigned ints of their width: numba
    has no float16, and a float16 store would otherwise fail here."""
    data = np.ascontiguousarray(rows.data)
    bits = data.view(f"u{data.dtype.itemsize}")
    indices = np.ascontiguousarray(rows.indices)
    out_data = np.empty(bits.shape, dtype=bits.dtype)
    out_indices = np.empty(indices.shape, dtype=indices.dtype)
    out_indptr = np.empty(rows.indptr.shape, dtype=np.int64)
    n = _compiled_filter()(
        bits,
        indices,
        np.ascontiguousarray(rows.indptr, dtype=np.int64),
        column_map,
        out_data,
        out_indices,
        out_indptr,
    )
    if n < 0:
        raise DatasetError(
            f"a column id reaches outside the {len(column_map)} features; the store is "
            "inconsistent."
        )
    return CsrRows(out_data[:n].view(data.dtype), out_indices[:n], out_indptr)


class FeatureSubset(Dataset):
    """The features ``features`` of ``dataset`` (ids, var names or a boolean mask), as a
    dataset ``len(features)`` wide, in the order given.

    The dataset must have one feature axis (AnnData X, a layer, an obsm entry; 2-D arrays).
    A selection of a selection is flattened onto the original dataset. CSR windows keep each
    row's stored column order, so with reordered features their column ids are not sorted;
    the Loader sorts each batch's rows for torch (``loader.canonical_csr``).
    """

    def __init__(self, dataset: Dataset, features: FeatureSelection) -> None:
        if not isinstance(dataset, Dataset):
            raise DatasetError(
                "FeatureSubset needs a dali_zarr Dataset (from open_dataset), got "
                f"{type(dataset)!r}."
            )
        if len(dataset.feature_shape) != 1:
            raise DatasetError(
                f"{dataset.name}: has observations of shape {dataset.feature_shape}; a feature "
                "selection needs one feature axis (select on N-D arrays with transform=)."
            )
        ids = select_features(
            features,
            dataset.n_features,
            dataset.var_names() if selects_by_name(features, dataset=dataset.name) else None,
            dataset=dataset.name,
            names_hint=dataset.names_hint,
        )
        if isinstance(dataset, FeatureSubset):  # flatten: one map onto the stored columns
            ids = dataset.columns[ids]
            dataset = dataset.parent
        self.parent = dataset
        self.columns = ids
        self.columns.setflags(write=False)
        self.column_map = np.full(dataset.n_features, -1, dtype=np.int64)
        self.column_map[ids] = np.arange(len(ids))
        self.column_map.setflags(write=False)
        digest = zlib.crc32(np.ascontiguousarray(ids).view(np.uint8))
        #: the features taken, without the store's path (the ranks compare it)
        self.selection = f"{len(ids)} of {dataset.n_features} features #{digest:08x}"
        self.name = f"{dataset.name}[{self.selection}]"
        self.n_obs = dataset.n_obs
        self.feature_shape = (len(ids),)
        self.dtype = dataset.dtype
        self.layout = dataset.layout
        self.index_dtype = dataset.index_dtype
        self._composed: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def read_rows(self, ranges: np.ndarray) -> Rows:
        rows = self.parent.read_rows(ranges)
        if isinstance(rows, CsrRows):
            try:
                return keep_csr_columns(rows, self.column_map)
            except DatasetError as exc:
                raise DatasetError(f"{self.parent.name}: {exc}") from None
        assert isinstance(rows, DenseRows)
        return DenseRows(np.take(rows.values, self.columns, axis=1))

    def selections(self) -> list[object]:
        return [self.selection, *self.parent.selections()]

    def store_runs(self, ranges: np.ndarray) -> list[StoreRun] | None:
        runs = self.parent.store_runs(ranges)
        return None if runs is None else [self._through(run) for run in runs]

    def grouped_store_runs(self, groups: list[np.ndarray]) -> list[list[StoreRun]] | None:
        grouped = self.parent.grouped_store_runs(groups)
        return None if grouped is None else [[self._through(r) for r in runs] for runs in grouped]

    def store_columns(self) -> list[tuple[Dataset, np.ndarray | None]] | None:
        pairs = self.parent.store_columns()
        return None if pairs is None else [(s, self._panel_of(c)) for s, c in pairs]

    def _through(self, run: StoreRun) -> StoreRun:
        return replace(run, columns=self._panel_of(run.columns))

    def _panel_of(self, columns: np.ndarray | None) -> np.ndarray:
        """A parent run's column map (None: the stored columns) followed by this panel's.

        Composed once per parent map and cached, so every window's runs carry the same
        arrays that :meth:`store_columns` named (readers look them up by identity)."""
        if columns is None:
            return self.column_map
        hit = self._composed.get(id(columns))
        if hit is None:
            composed = np.full(len(columns), -1, dtype=np.int64)
            kept = columns >= 0
            composed[kept] = self.column_map[columns[kept]]
            composed.setflags(write=False)
            # the map is held too, so its id names it while cached; setdefault: one winner
            hit = self._composed.setdefault(id(columns), (columns, composed))
        return hit[1]

    def obs_column(self, name: str) -> ObsColumn:
        return self.parent.obs_column(name)

    @property
    def n_ids(self) -> int:
        return self.parent.n_ids

    def global_ids(self, rows: np.ndarray) -> np.ndarray:
        return self.parent.global_ids(rows)

    def readers(self) -> list[ArrayReader]:
        return self.parent.readers()

    def watches(self) -> list[StoredObjectsWatch]:
        return self.parent.watches()

    def var_names(self) -> tuple[str, ...] | None:
        names = self.parent.var_names()
        return None if names is None else tuple(names[i] for i in self.columns.tolist())

    def names_by_position(self) -> tuple[str, ...] | None:
        names = self.parent.names_by_position()
        return None if names is None else tuple(names[i] for i in self.columns.tolist())

    def packing(self) -> dict[str, Any]:
        return self.parent.packing()

    def cf_decoding(self) -> CfDecoding | None:
        return self.parent.cf_decoding()


def selects_by_name(features: FeatureSelection, *, dataset: str = "") -> bool:
    """Whether ``features`` are names (looked up in a ``var`` index), not ids or a mask;
    features of mixed kinds are refused here, for ``dataset``, before a collection is
    joined (whose stores' widths may differ by design when selecting by name)."""
    where = f"feature selection of {dataset}" if dataset else "feature selection"
    return as_selection(features, where=where).dtype.kind in "USO"


def as_selection(
    features: FeatureSelection,
    *,
    where: str,
    argument: str = "features",
    accepted: str = "integer ids, str names or a boolean mask",
) -> np.ndarray:
    """``features`` as an array whose dtype says what they are: bool (a mask), integers
    (ids) or text (names).

    An object array (a pandas object column, ``np.array([...], dtype=object)``) takes the
    type of its elements: left as objects, ids ``[1, 2]`` were looked up as the names
    ``"1"`` and ``"2"``, other columns of a store whose var names are numbers, and a
    boolean mask as the names ``"True"``/``"False"``. Elements of mixed types (or None)
    are refused, naming ``argument`` and what it ``accepted``."""
    if isinstance(features, list | tuple):  # np.asarray([True, 3]) is the ids [1, 3]
        bools = [isinstance(v, bool | np.bool_) for v in features]
        if any(bools) and not all(bools):
            kinds = sorted({type(v).__name__ for v in features})
            raise DatasetError(
                f"{where}: {argument} mixes booleans with other values ({', '.join(kinds)}); "
                f"pass {accepted}, one kind only."
            )
    chosen = np.asarray(features)
    if chosen.dtype != object or chosen.size == 0:
        return chosen
    values = chosen.ravel().tolist()
    if all(isinstance(v, bool | np.bool_) for v in values):
        return chosen.astype(bool)
    if all(isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_) for v in values):
        return chosen.astype(np.int64)
    if all(isinstance(v, str) for v in values):
        return chosen
    kinds = sorted({type(v).__name__ for v in values})
    raise DatasetError(
        f"{where}: {argument} holds values of type {', '.join(kinds)}; pass {accepted}, one "
        "kind only (and no missing values)."
    )
