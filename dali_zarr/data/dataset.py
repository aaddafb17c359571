"""Datasets: what a store holds (AnnData CSR, AnnData dense, plain N-D arrays, collections).

A dataset answers one question for the loader: "give me the rows of these global
``[start, stop)`` ranges, concatenated". It turns row ranges into element ranges (CSR) and
delegates the bytes to an :class:`~dali_zarr.io.ArrayReader`, so the I/O backend can change
(pread, zarr, kvikio) without touching planning or the DALI graph.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import urllib.parse
import warnings
import zipfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import zarr

from dali_zarr.data.elements import (
    CfDecoding,
    bad_column_error,
    cf_decoding,
    dimension_names,
    first_bad_column,
    frame_index,
    frame_index_names,
    indptr_as_int64,
    matrix_layout,
    misplaced_observation_axis,
    packing_attributes,
    pick_element,
    refuse_bad_indptr,
    refuse_non_integer,
    shape_attribute,
    text_values,
    var_key,
    zarr_member,
)
from dali_zarr.data.obs import (
    ObsColumn,
    as_text,
    concat_obs_columns,
    is_obsm,
    read_obs_column,
    read_obsm_entry,
)
from dali_zarr.errors import (
    ConfigError,
    DatasetError,
    ObservationAxisWarning,
    PackedValuesWarning,
)
from dali_zarr.io import (
    ArrayReader,
    StoredObjectsWatch,
    check_ranges,
    checked_around,
    metadata_file,
    missing_codec_advice,
    open_reader,
    read_whole,
    refuse_stale_metadata,
    refuse_unfinished,
    unknown_codec_id,
)
from dali_zarr.planning.partition import (
    concat_aranges,
    ranges_to_rows,
    run_offsets,
    validate_flag,
)

Layout = Literal["csr", "dense"]


@dataclass(frozen=True)
class CsrRows:
    """Rows of a CSR matrix, re-based so ``indptr[0] == 0`` (one window's worth)."""

    data: np.ndarray
    indices: np.ndarray
    indptr: np.ndarray

    @property
    def n_rows(self) -> int:
        return len(self.indptr) - 1


@dataclass(frozen=True)
class DenseRows:
    """Rows of a dense array: ``values`` has shape ``(n_rows, *feature_shape)``."""

    values: np.ndarray

    @property
    def n_rows(self) -> int:
        return len(self.values)


Rows = CsrRows | DenseRows


@dataclass(frozen=True)
class StoreRun:
    """Consecutive rows of one window that come from one store: ``ranges`` ``(k, 2)`` of
    ``store``'s rows, in window order (see :meth:`Dataset.store_runs`), and, for rows seen
    through a gene panel, ``columns``: each stored column's column in the panel (-1 where
    the panel drops it); None keeps the columns as stored."""

    store: Dataset
    ranges: np.ndarray
    columns: np.ndarray | None = None

    @property
    def n_rows(self) -> int:
        return int((self.ranges[:, 1] - self.ranges[:, 0]).sum())


class Dataset(ABC):
    """A readable set of observations along axis 0 with optional obs columns."""

    name: str
    n_obs: int
    feature_shape: tuple[int, ...]
    dtype: np.dtype
    layout: Layout
    #: dtype of CSR column ids handed to the DALI graph (every window uses the same one).
    index_dtype: np.dtype = np.dtype(np.int64)

    @abstractmethod
    def read_rows(self, ranges: np.ndarray) -> Rows:
        """Rows of the ``(k, 2)`` global ``[start, stop)`` ranges, concatenated in order."""

    @abstractmethod
    def obs_column(self, name: str) -> ObsColumn:
        """One obs column over all observations (loaded once, then cached)."""

    def readers(self) -> list[ArrayReader]:
        """The readers of every array the dataset reads rows from (none known: a subclass
        of the user's own that reads otherwise overrides :meth:`read_paths` instead, and is
        not watched by :meth:`check_unchanged`)."""
        return []

    def sampled_rows_digest(self) -> str:
        """A digest of three rows' values (the first, the middle and the last), which the
        ranks compare store by store: sizes alone take equal-size stores joined in another
        order, or a node's stale copy, for the same stores, and each rank then numbers
        other rows alike (rows twice or never). Three rows cost a chunk read per array."""
        n = int(self.n_obs)
        starts = np.unique(np.array([0, n // 2, n - 1], dtype=np.int64)) if n else []
        ranges = np.array([[s, s + 1] for s in starts], dtype=np.int64).reshape(-1, 2)
        rows = self.read_rows(ranges)
        arrays = (rows.data, rows.indices, rows.indptr) if isinstance(rows, CsrRows) else (
            rows.values,
        )  # fmt: skip
        digest = hashlib.blake2b(digest_size=8)
        for array in arrays:
            array = np.ascontiguousarray(array)
            digest.update(f"{array.dtype.str}{array.shape}".encode())
            digest.update(array.view(np.uint8).tobytes())
        return digest.hexdigest()

    def read_paths(self) -> dict[str, str]:
        """Which read path serves each array ("direct", or "zarr: <why>"), for reporting."""
        return {r.name: _describe(r) for r in self.readers()}

    def check_unchanged(self) -> None:
        """DatasetError where an array was rewritten since the dataset was opened (the loader
        asks before each epoch; each reader also checks around every read): what was read
        at open (a CSR's row offsets, shapes, chunk and shard indexes) would describe the old
        array and give the new one's rows wrong."""
        for reader in [*self.readers(), *self.watches()]:
            reader.check_unchanged()

    def watches(self) -> list[StoredObjectsWatch]:
        """Watches of the arrays read whole at open (a CSR's row offsets), which
        :meth:`check_unchanged` checks besides the readers."""
        return []

    def unchanged_around(self) -> contextlib.AbstractContextManager[None]:
        """:meth:`check_unchanged` before and after a read that bypasses the readers (the
        GPU path's byte plans), and when it fails (:func:`~dali_zarr.io.checked_around`)."""
        return checked_around(self.check_unchanged)

    def categories(self, column: str) -> tuple[str, ...] | None:
        """Category names of a categorical obs column, to map batch codes back to labels."""
        if not isinstance(column, str):  # failed deep inside as "'int' has no 'startswith'"
            raise ConfigError(
                f"{self.name}: categories() takes an obs column's name, not {column!r}."
            )
        return self.obs_column(column).categories

    def var_names(self) -> tuple[str, ...] | None:
        """Names of the features (an AnnData store's ``var`` index), or None where the store
        names none (plain arrays, ``obsm``/``obsp`` entries)."""
        return None

    def packing(self) -> dict[str, Any]:
        """The CF attributes that pack the stored values (``scale_factor``, ``add_offset``,
        ``_FillValue``: xarray's int16 encoding), which batches carry as stored unless opened
        with ``mask_and_scale=True``; empty where the stored values are what they mean."""
        return {}

    def cf_decoding(self) -> CfDecoding | None:
        """What the graph applies to ``X`` to decode the :meth:`packing` (opened with
        ``mask_and_scale=True``), or None: ``X`` arrives as stored."""
        return None

    def names_hint(self, names: Sequence[str]) -> str:
        """Where the store holds feature ``names`` that var's index lacks, for that error:
        a var column (CELLxGENE-style stores index genes by Ensembl id and hold the symbols
        in ``feature_name``), or ``raw/var`` (X holds only the highly variable genes)."""
        return ""

    def names_by_position(self) -> tuple[str, ...] | None:
        """The names a collection compares this dataset's columns by: :meth:`var_names`,
        or, where those are None for a collection joined with ``check_var_names=False``,
        its first part's (the genes its columns stand for), so a collection around it
        still refuses a part naming other genes."""
        return self.var_names()

    def store_runs(self, ranges: np.ndarray) -> list[StoreRun] | None:
        """Which stores and rows ``read_rows(ranges)`` reads, in order, or None where the rows
        are not stored rows (a dataset that computes them).

        Concatenating ``run.store.read_rows(run.ranges)``, each kept to the columns of
        ``run.columns`` where it has them, over the runs gives ``read_rows(ranges)``. The GPU
        path reads windows of collections, subsets and gene panels this way, through each
        store's byte plans, instead of reading them on the host.
        """
        return None

    def grouped_store_runs(self, groups: list[np.ndarray]) -> list[list[StoreRun]] | None:
        """:meth:`store_runs` of each group of ranges (None if any is None). A collection
        asks each part once per window for all of that part's runs, not once per run."""
        out = []
        for ranges in groups:
            runs = self.store_runs(ranges)
            if runs is None:
                return None
            out.append(runs)
        return out

    def store_columns(self) -> list[tuple[Dataset, np.ndarray | None]] | None:
        """Every (store, columns) pair a :class:`StoreRun` of :meth:`store_runs` can carry,
        once each (None where it names none): what a reader must be ready for before the
        first window (which stores' arrays, which panels)."""
        return None

    def stores(self) -> tuple[Dataset, ...] | None:
        """The single-store datasets :meth:`store_runs` can name (None where it names none)."""
        pairs = self.store_columns()
        return None if pairs is None else tuple(dict.fromkeys(store for store, _ in pairs))

    def global_ids(self, rows: np.ndarray) -> np.ndarray:
        """This dataset's row ids → the observation ids batches report (``batch["index"]``).

        The identity here; a :class:`~dali_zarr.data.subset.Subset` maps to its parent's ids,
        a :class:`Collection` to its parts' ids after the id spaces of the parts before.
        """
        return rows

    @property
    def n_ids(self) -> int:
        """How many observation ids :meth:`global_ids` can report (``[0, n_ids)``): a
        subset reports its parent's ids, so it spans the parent's."""
        return self.n_obs

    @property
    def n_features(self) -> int:
        return int(np.prod(self.feature_shape, dtype=np.int64))

    def selections(self) -> list[object]:
        """What this dataset selects of its stores, without their paths (the ranks compare
        it: two splits of one size differ only here): a store selects nothing."""
        return []

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name!r}, n_obs={self.n_obs}, "
            f"features={self.feature_shape}, dtype={self.dtype}, layout={self.layout})"
        )


def _text_of(node: Any) -> tuple[str, ...]:
    """The text a dataframe column holds: a text array's values, a categorical's categories
    (anndata 0.13's nullable strings too); none for other columns."""
    if isinstance(node, zarr.Group) and node.attrs.get("encoding-type") == "categorical":
        node = node["categories"]
    values = text_values(node)
    if values is None or values.dtype.kind not in "USOT":
        return ()
    return as_text(values[...])


class _StoreDataset(Dataset):
    """A single store: holds its obs and var groups (if any) and caches loaded columns."""

    def __init__(
        self,
        name: str,
        obs: zarr.Group | None,
        var: zarr.Group | None = None,
        *,
        store: str | None = None,
        element: str | None = None,
    ) -> None:
        self.name = name
        #: the array's path in its store (``X``, ``layers/counts``); None: the store is it
        self.element = element
        #: where obs lives, for messages: the store's name (``name`` may end in X's key)
        self.obs_name = f"{store or name}/obs"
        self._obs = obs
        self._var = var
        self._var_names: tuple[str, ...] | None = None
        self._columns: dict[str, ObsColumn] = {}

    def selections(self) -> list[object]:
        # which array of the store, and whether it is decoded: X on one rank and
        # layers/counts (or the packed values decoded) on another have the same size
        element = [] if self.element is None else [f"element {self.element}"]
        decoding = self.cf_decoding()
        return element + ([] if decoding is None else [f"decoded {tuple(decoding)}"])

    def store_runs(self, ranges: np.ndarray) -> list[StoreRun]:
        return [StoreRun(self, np.asarray(ranges, dtype=np.int64).reshape(-1, 2))]

    def store_columns(self) -> list[tuple[Dataset, np.ndarray | None]]:
        return [(self, None)]

    def var_names(self) -> tuple[str, ...] | None:
        if self._var is None:
            return None
        if self._var_names is None:
            names = frame_index_names(self._var, where=f"{self.name}: var")
            if names is None:
                return None
            if len(names) != self.n_features:
                raise DatasetError(
                    f"{self.name}: var has {len(names)} names for {self.n_features} "
                    "features; the store is inconsistent."
                )
            self._var_names = names
        return self._var_names

    def names_hint(self, names: Sequence[str]) -> str:
        if self._var is None:
            return ""
        wanted = set(names)
        # a hint for an error being raised: a node it cannot read is not one to name
        for key in sorted(self._var):
            if key != self._var.attrs.get("_index"):
                with contextlib.suppress(Exception):
                    if wanted <= set(_text_of(self._var[key])):
                        return (
                            f" var column {key!r} holds them: pass the var index names of its "
                            f"rows that hold them, in your order (var.index[var[{key!r}] == "
                            "name] for each name; a name on several rows is several genes)."
                        )
        parent, _, leaf = self._var.path.rpartition("/")
        if leaf == "var" and not parent.endswith("raw"):  # X's or a layer's var
            with contextlib.suppress(Exception):
                raw = zarr.open_group(
                    self._var.store, path=f"{parent}/raw/var".lstrip("/"), mode="r"
                )
                index = frame_index_names(raw, where="raw/var")
                if index is not None and wanted <= set(index):
                    return (
                        " raw/var names them: open the raw matrix, "
                        "open_dataset(..., element='raw/X', features=...)."
                    )
        return ""

    def obs_column(self, name: str) -> ObsColumn:
        if name not in self._columns:
            if self._obs is None:
                raise DatasetError(
                    f"{self.name}: has no obs dataframe, so obs column {name!r} cannot be "
                    "loaded; open an AnnData store or drop obs=[...]."
                )
            if is_obsm(name):
                store = self.obs_name.removesuffix("/obs")
                column = read_obsm_entry(self._obs, name, where=store)
                where = f"{store}/{name}"
            else:
                column = read_obs_column(self._obs, name, where=self.obs_name)
                where = f"{self.obs_name}/{name}"
            if len(column.values) != self.n_obs:
                raise DatasetError(
                    f"{where}: has {len(column.values)} values for "
                    f"{self.n_obs} observations; the store is inconsistent."
                )
            self._columns[name] = column
        return self._columns[name]


def not_batchable(dtype: np.dtype) -> str:
    """Why values of ``dtype`` (not bool, integer or real float) cannot be batched, and
    what to store instead: "not numeric" said nothing of what to do, and of complex values
    it was wrong."""
    kind = np.dtype(dtype).kind
    if kind == "c":
        what = (
            "holds complex numbers, which a batch of real values cannot carry: store the real "
            "and imaginary parts on a last axis of length 2 (np.stack([z.real, z.imag], "
            "axis=-1)), or their magnitude (np.abs(z)), and open that array"
        )
    elif kind in "mM":
        what = (
            "holds dates or durations: store them as numbers (values.astype('int64'), counts "
            "of the dtype's unit, or seconds as float) and open that array"
        )
    elif kind in "USOT":
        what = (
            "holds text, which does not ride in batches: encode it as integer codes (a "
            "categorical obs column) or look it up by row with return_index=True"
        )
    else:
        what = (
            "is not a bool, integer or float dtype (a structured or raw-bytes dtype): write "
            "each field as a numeric array of its own (or one with a field axis) and open that"
        )
    return f"dtype {dtype} {what}; only bool, integer and float arrays can be batched."


class DenseDataset(_StoreDataset):
    """A dense array with observations on axis 0 (plain Zarr array or AnnData dense ``X``)."""

    layout: Layout = "dense"

    def __init__(
        self,
        reader: ArrayReader,
        *,
        name: str,
        obs: zarr.Group | None = None,
        var: zarr.Group | None = None,
        store: str | None = None,
        element: str | None = None,
        packing: dict[str, Any] | None = None,
        mask_and_scale: bool = False,
    ) -> None:
        super().__init__(name, obs, var, store=store, element=element)
        if len(reader.shape) < 1:
            raise DatasetError(f"{name}: a 0-d array holds no observations.")
        if reader.dtype.kind not in "biuf":
            raise DatasetError(f"{name}: {not_batchable(reader.dtype)}")
        #: the array's reader (public: the GPU path plans byte reads through it)
        self.values_reader = reader
        self.n_obs = int(reader.shape[0])
        self.feature_shape = tuple(int(s) for s in reader.shape[1:])
        self.dtype = np.dtype(reader.dtype)
        self._packing = dict(packing or {})
        self._decoding = (
            cf_decoding(self._packing, self.dtype, name=name) if mask_and_scale else None
        )

    def read_rows(self, ranges: np.ndarray) -> DenseRows:
        return DenseRows(self.values_reader.read_rows(ranges))

    def packing(self) -> dict[str, Any]:
        return dict(self._packing)

    def cf_decoding(self) -> CfDecoding | None:
        return self._decoding

    def readers(self) -> list[ArrayReader]:
        return [self.values_reader]


class CsrDataset(_StoreDataset):
    """An AnnData ``csr_matrix`` group: ``indptr`` in memory, ``data``/``indices`` read by range."""

    layout: Layout = "csr"

    def __init__(
        self,
        group: zarr.Group,
        *,
        name: str,
        obs: zarr.Group | None,
        executor: Executor | None,
        force_zarr: bool,
        var: zarr.Group | None = None,
        store: str | None = None,
        element: str | None = None,
    ) -> None:
        super().__init__(name, obs, var, store=store, element=element)
        arrays = {key: zarr_member(group, key, where=name) for key in ("data", "indices", "indptr")}
        for key, array in arrays.items():
            if not isinstance(array, zarr.Array):
                raise DatasetError(
                    f"{name}: a csr_matrix group needs arrays data, indices and indptr; "
                    f"{key!r} is missing. The store is incomplete: re-write it."
                )
        for key in ("data", "indices"):
            if len(arrays[key].shape) != 1:
                raise DatasetError(
                    f"{name}/{key}: has shape {arrays[key].shape}; a csr_matrix's data and "
                    "indices are 1-D (one entry per stored value). Re-write the matrix, e.g. "
                    "with X.data and X.indices of a scipy.sparse.csr_matrix."
                )
        self.n_obs, n_features = shape_attribute(group, where=name)
        self.feature_shape = (n_features,)
        # the arrays' readers (public: the GPU path plans byte reads through them)
        self.data_reader = open_reader(
            arrays["data"], name=f"{name}/data", executor=executor, force_zarr=force_zarr
        )
        self.indices_reader = open_reader(
            arrays["indices"], name=f"{name}/indices", executor=executor, force_zarr=force_zarr
        )
        self.dtype = np.dtype(self.data_reader.dtype)
        self.index_dtype = np.dtype(self.indices_reader.dtype)
        if self.dtype.kind not in "biuf":
            raise DatasetError(f"{name}/data: {not_batchable(self.dtype)}")
        if self.indices_reader.dtype.kind not in "iu":
            raise DatasetError(
                f"{name}: data dtype {self.dtype} / indices dtype {self.indices_reader.dtype} "
                "are not numeric/integer."
            )
        self.indptr = self._read_indptr(arrays["indptr"])
        self._check_indptr()

    def _read_indptr(self, array: zarr.Array) -> np.ndarray:
        """``indptr`` as int64, refused before the cast where the cast would change it: float
        offsets are truncated (rows shift silently) and uint64 ones past int64 wrap negative."""
        where, expected = f"{self.name}/indptr", (self.n_obs + 1,)
        refuse_non_integer(array.dtype, where, part="indptr")
        if array.shape != expected:
            raise DatasetError(
                f"{where}: has shape {array.shape} for {self.n_obs} rows (expected {expected}: "
                "one offset per row, plus one); the store is inconsistent: re-write the matrix."
            )
        refuse_stale_metadata(array, name=where)
        self.indptr_watch = StoredObjectsWatch(array, name=where)  # stamped before the read
        return indptr_as_int64(read_whole(array, name=where), where)

    def _check_indptr(self) -> None:
        indptr, name = self.indptr, self.name
        refuse_bad_indptr(indptr, f"{name}/indptr")
        nnz = int(indptr[-1])
        for reader in (self.data_reader, self.indices_reader):
            if reader.shape[0] < nnz:
                raise DatasetError(
                    f"{reader.name}: has {reader.shape[0]} elements but indptr ends at {nnz}; "
                    "the store is truncated or inconsistent."
                )

    def read_rows(self, ranges: np.ndarray) -> CsrRows:
        ranges = check_ranges(ranges, self.n_obs, self.name)
        # the offsets read at open, checked around the window's reads (a few stats)
        with self.indptr_watch.around(ranges):
            element_ranges = self.indptr[ranges]  # (k, 2): [indptr[start], indptr[stop])
            indptr = sub_indptr(self.indptr, ranges_to_rows(ranges))
            data = self.data_reader.read_rows(element_ranges)
            indices = self.indices_reader.read_rows(element_ranges)
        self.check_indices(indices, ranges)
        return CsrRows(data, indices, indptr)

    def check_indices(self, indices: np.ndarray, ranges: np.ndarray) -> None:
        """Refuse column ids outside the matrix, which densify would write out of bounds.

        ``indices``: the ids of rows ``ranges`` end to end, as read (on the host). The error
        names the first bad id's element, row and chunk of ``X/indices``.
        """
        n = self.feature_shape[0]
        at = first_bad_column(indices, n)
        if at is None:
            return
        elements = self.indptr[np.asarray(ranges, dtype=np.int64).reshape(-1, 2)]
        starts = run_offsets(elements[:, 1] - elements[:, 0])
        r = int(np.searchsorted(starts, at, side="right")) - 1  # the range holding it
        element = int(elements[r, 0] + at - starts[r])
        row = int(np.searchsorted(self.indptr, element, side="right")) - 1
        reader = self.indices_reader
        raise bad_column_error(
            reader.name, int(indices[at]), n, element, f"row {row:,} of {self.name}",
            reader.chunk_where((element // reader.rows_per_chunk,)),
        )  # fmt: skip

    def readers(self) -> list[ArrayReader]:
        return [self.data_reader, self.indices_reader]

    def watches(self) -> list[StoredObjectsWatch]:
        return [self.indptr_watch]


def sub_indptr(indptr: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Row starts (len(rows)+1 int64) of the CSR made of rows ``rows`` of a CSR with
    ``indptr``, in that order: the prefix sum of their lengths."""
    out = np.zeros(len(rows) + 1, dtype=np.int64)
    if len(rows):
        np.cumsum(indptr[rows + 1] - indptr[rows], out=out[1:])
    return out


class Collection(Dataset):
    """Several datasets with the same feature axis, concatenated along observations."""

    def __init__(self, parts: Sequence[Dataset], *, check_var_names: bool = True) -> None:
        """``check_var_names``: refuse parts whose var names differ (their columns would be
        other genes); ``False`` stacks them by position, for stores that name the same
        genes otherwise (Ensembl ids here, symbols there)."""
        if isinstance(parts, Dataset | str | bytes | os.PathLike):
            raise DatasetError(
                f"Collection needs a list of datasets, got one {type(parts).__name__} "
                f"({parts!r}); pass [dataset, ...]."
            )
        parts = list(parts)  # a generator too (indexed and walked more than once below)
        if not parts:
            raise DatasetError("an empty list of stores is not a dataset.")
        for i, part in enumerate(parts):
            # a path here (stores that name their genes otherwise, check_var_names=False)
            # failed with AttributeError: 'str' object has no attribute 'layout'
            if not isinstance(part, Dataset):
                raise DatasetError(
                    f"Collection joins datasets, but item {i} is a {type(part).__name__} "
                    f"({part!r}); open each store first: dz.Collection([dz.open_dataset(p) "
                    "for p in paths], ...), or dz.open_dataset(paths) to join stores whose "
                    "var names agree."
                )
        first = parts[0]
        for part in parts[1:]:
            if (part.layout, part.feature_shape) != (first.layout, first.feature_shape):
                raise DatasetError(
                    f"collection: {part.name} has {part.layout} X with features "
                    f"{part.feature_shape} but {first.name} has {first.layout} X with features "
                    f"{first.feature_shape}; all stores must share the feature axis."
                )
            if part.dtype != first.dtype:
                raise DatasetError(
                    f"collection: {part.name} stores X as {part.dtype} but {first.name} as "
                    f"{first.dtype}; re-write them with one dtype."
                )
            if part.packing() != first.packing():  # one transform cannot unpack both
                raise DatasetError(
                    f"collection: {part.name} is packed with {part.packing() or 'nothing'} "
                    f"but {first.name} with {first.packing() or 'nothing'} (CF scale_factor, "
                    "add_offset, _FillValue): their stored values mean different numbers, and "
                    "one decoding (mask_and_scale=True or a transform=) would unpack one of "
                    "them wrong. Load them apart, or write them with one encoding."
                )
            if (part.cf_decoding() is None) != (first.cf_decoding() is None):  # one graph
                raise DatasetError(
                    f"collection: {part.name} is opened with mask_and_scale="
                    f"{part.cf_decoding() is not None} but {first.name} with "
                    f"{first.cf_decoding() is not None}: one would arrive decoded and the "
                    "other as stored. Open them with the same mask_and_scale=."
                )
        self.parts = list(parts)
        self.name = "+".join(p.name for p in parts)
        self.layout = first.layout
        self.feature_shape = first.feature_shape
        self.dtype = first.dtype
        self.index_dtype = common_index_dtype([p.index_dtype for p in parts])
        self.offsets = np.cumsum([0] + [p.n_obs for p in parts]).astype(np.int64)
        self.n_obs = int(self.offsets[-1])
        # each part's observation ids after those of the parts before: a collection of
        # subsets reports the ids a subset of the collection of their stores would
        self.id_offsets = np.cumsum([0] + [p.n_ids for p in parts]).astype(np.int64)
        self._columns: dict[str, ObsColumn] = {}
        self._check_var_names = check_var_names
        # stores whose var names differ would put other genes in one column: refused here,
        # not only when features are selected by name
        self.var_names()

    def part_runs(self, ranges: np.ndarray) -> list[tuple[Dataset, np.ndarray]]:
        """``ranges`` split at store boundaries, as (part, its local ranges) in order, with
        consecutive pieces of one part joined (read in one call).

        Vectorized: a subset with scattered rows makes windows of thousands of short ranges,
        and this runs for every window on the loader's hot path.
        """
        ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        ranges = ranges[ranges[:, 1] > ranges[:, 0]]
        cuts = self.offsets[1:-1]
        first = np.searchsorted(cuts, ranges[:, 0], side="right")
        last = np.searchsorted(cuts, ranges[:, 1] - 1, side="right")
        counts = last - first + 1
        which = np.repeat(np.arange(len(ranges)), counts)  # one piece per (range, part)
        part = concat_aranges(first, counts)
        base = self.offsets[part]
        lo = np.maximum(ranges[which, 0], base) - base
        hi = np.minimum(ranges[which, 1], self.offsets[part + 1]) - base
        keep = hi > lo  # a range meets an empty part only in passing
        part, pieces = part[keep], np.stack([lo[keep], hi[keep]], axis=1)
        heads = np.flatnonzero(np.diff(part, prepend=-1))
        bounds = [*heads.tolist(), len(part)]
        return [(self.parts[int(part[a])], pieces[a:b]) for a, b in itertools.pairwise(bounds)]

    def read_rows(self, ranges: np.ndarray) -> Rows:
        outputs = [part.read_rows(local) for part, local in self.part_runs(ranges)]
        return _concat_rows(outputs, self.layout, self.feature_shape, self.dtype, self.index_dtype)

    def store_runs(self, ranges: np.ndarray) -> list[StoreRun] | None:
        pieces = self.part_runs(ranges)
        by_part: dict[int, list[int]] = {}
        for i, (part, _) in enumerate(pieces):
            by_part.setdefault(id(part), []).append(i)
        found: list[list[StoreRun]] = [[] for _ in pieces]
        for members in by_part.values():
            part = pieces[members[0]][0]
            runs = part.grouped_store_runs([pieces[i][1] for i in members])
            if runs is None:
                return None
            for i, part_runs in zip(members, runs, strict=True):
                found[i] = part_runs
        return [run for runs in found for run in runs]

    def store_columns(self) -> list[tuple[Dataset, np.ndarray | None]] | None:
        unique: dict[tuple[int, int], tuple[Dataset, np.ndarray | None]] = {}
        for part in self.parts:
            pairs = part.store_columns()
            if pairs is None:
                return None
            for store, columns in pairs:
                unique.setdefault((id(store), id(columns)), (store, columns))
        return list(unique.values())

    def obs_column(self, name: str) -> ObsColumn:
        if name not in self._columns:
            # parts named by position too: stores are named by their folder's name, and
            # run1/cells.zarr beside run2/cells.zarr left an error naming neither
            labels = [f"{p.name} (part {i})" for i, p in enumerate(self.parts)]
            columns = []
            for label, part in zip(labels, self.parts, strict=True):
                try:
                    columns.append(part.obs_column(name))
                except DatasetError as exc:
                    raise DatasetError(f"{self.name}, {label}: {exc}") from exc
            self._columns[name] = concat_obs_columns(columns, labels)
        return self._columns[name]

    @property
    def n_ids(self) -> int:
        return int(self.id_offsets[-1])

    def global_ids(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        part = np.searchsorted(self.offsets, rows, side="right") - 1
        out = np.empty_like(rows)
        for i, p in enumerate(self.parts):  # per part, not per row
            mine = part == i
            if mine.any():
                out[mine] = self.id_offsets[i] + p.global_ids(rows[mine] - self.offsets[i])
        return out

    def selections(self) -> list[object]:
        # each part's size, in order: the same stores joined in another order (a glob listed
        # in another order on another node) number their rows otherwise, and the ranks'
        # shards then overlap; sizes, not paths, so node-local copies still agree
        return [{"rows": int(part.n_obs), "selects": part.selections()} for part in self.parts]

    def packing(self) -> dict[str, Any]:
        return self.parts[0].packing()  # the parts' one packing (refused otherwise)

    def cf_decoding(self) -> CfDecoding | None:
        return self.parts[0].cf_decoding()

    def var_names(self) -> tuple[str, ...] | None:
        """The parts' common feature names (None if a part names none); parts whose names
        differ are refused: their columns would not mean the same genes."""
        names = self._checked_names()
        return names if all(p.var_names() is not None for p in self.parts) else None

    def names_by_position(self) -> tuple[str, ...] | None:
        return self._checked_names() if self._check_var_names else self.parts[0].names_by_position()

    def _checked_names(self) -> tuple[str, ...] | None:
        """The first part's names by position, after refusing parts that name a column
        otherwise (None: unchecked, or a part names none)."""
        if not self._check_var_names:
            return None
        # by position: a part that is a collection joined with check_var_names=False names
        # no features, and was joined unchecked here (other genes in one column)
        names = [p.names_by_position() for p in self.parts]
        if any(n is None for n in names):
            return None
        for part, other in zip(self.parts[1:], names[1:], strict=True):
            if other != names[0]:
                j = next(i for i, (a, b) in enumerate(zip(names[0], other, strict=True)) if a != b)
                raise DatasetError(
                    f"collection: {part.name} names feature {j} {other[j]!r} but "
                    f"{self.parts[0].name} names it {names[0][j]!r}, so one column would hold "
                    "other genes in different stores. Pass features=[names] to open_dataset "
                    "(each store's own var is looked up), or align the stores' var; if they "
                    "are the same genes named otherwise, dz.Collection([...], "
                    "check_var_names=False) stacks them by position."
                )
        return names[0]

    def readers(self) -> list[ArrayReader]:
        return [reader for part in self.parts for reader in part.readers()]

    def watches(self) -> list[StoredObjectsWatch]:
        return [watch for part in self.parts for watch in part.watches()]


def common_index_dtype(dtypes: Sequence[np.dtype]) -> np.dtype:
    """One integer dtype for the column ids of several stores. NumPy's common type of int64
    and uint64 is float64, which the graph's ops cannot index with; every column id is
    below the matrix's width, so int64 holds them all."""
    common = np.result_type(*dtypes)
    return common if common.kind in "iu" else np.dtype(np.int64)


def _concat_rows(
    outputs: list[Rows],
    layout: Layout,
    feature_shape: tuple[int, ...],
    dtype: np.dtype,
    index_dtype: np.dtype,
) -> Rows:
    """The parts' rows end to end. Column ids go to ``index_dtype`` (the collection's):
    NumPy's concatenation of uint64 and int64 ids is float64, which the column filter of a
    feature panel cannot index with."""
    if len(outputs) == 1:
        return outputs[0]
    if layout == "dense":
        if not outputs:
            return DenseRows(np.zeros((0, *feature_shape), dtype))
        return DenseRows(np.concatenate([o.values for o in outputs]))  # type: ignore[union-attr]
    csr = [o for o in outputs if isinstance(o, CsrRows)]
    if not csr:
        return CsrRows(np.zeros(0, dtype), np.zeros(0, index_dtype), np.zeros(1, np.int64))
    return CsrRows(
        np.concatenate([c.data for c in csr]),
        np.concatenate([c.indices for c in csr], dtype=index_dtype, casting="same_kind"),
        run_offsets(np.concatenate([np.diff(c.indptr) for c in csr])),
    )


def _describe(reader: ArrayReader) -> str:
    return reader.path if reader.path == "direct" else f"{reader.path}: {reader.reason}"


# ---------------------------------------------------------------------------------------------
# open_dataset


Source = str | os.PathLike | zarr.Group | zarr.Array | zarr.abc.store.Store


def open_dataset(
    source: Source | Sequence[Source],
    *,
    element: str | None = None,
    features: Any = None,
    executor: Executor | None = None,
    force_zarr: bool = False,
    mask_and_scale: bool | None = None,
) -> Dataset:
    """Open a store, a Zarr node, or a list of them (a collection) for loading.

    Accepted: an AnnData store (``encoding-type: anndata``; ``X`` CSR or dense) or a plain
    Zarr array with observations on axis 0, given as a path, a ``zarr.Group``, a
    ``zarr.Array`` or a zarr store object (opened as ``zarr.open(store)`` opens it).
    ``element`` picks what to load from every store: in an AnnData store
    ``"X"`` (the default), ``"raw/X"``, ``"layers/<name>"``, ``"obsm/<name>"`` or
    ``"obsp/<name>"`` (obs columns still come from the store's ``obs``); in a plain Zarr
    group, the path of one of its arrays. ``features`` keeps only those features, in that
    order: integer ids, ``var`` names or a boolean mask (a
    :class:`~dali_zarr.data.features.FeatureSubset`). Names given with several stores are
    looked up in each store's own ``var``, so stores written with different gene orders or
    gene sets load as one collection in the order asked. ``force_zarr`` makes every array
    use zarr-python's reading instead of the direct path (for debugging or comparison).
    ``mask_and_scale`` (dense arrays, AnnData's included; xarray's name and meaning; a CSR
    matrix with packed values is refused, as its implicit zeros cannot be decoded): True
    decodes CF-packed values in the graph (``_Unsigned``, then a ``_FillValue``/
    ``missing_value`` becomes NaN, then ``* scale_factor + add_offset``, in float32); False
    hands them on as stored; None, the default, hands them on as stored and warns
    (:class:`PackedValuesWarning`) where the attributes pack them.
    """
    from dali_zarr.data.features import FeatureSubset, selects_by_name  # builds on this module

    if element is not None and not isinstance(element, str):  # a list failed in str.strip
        raise ConfigError(
            f"element= takes one array's path, got {element!r}: arrays are not joined side "
            "by side. To load variables as channels, write them as one array with a variable "
            "axis (xarray: ds[['t2m', 'sst']].to_dataarray('variable').transpose('time', "
            "'variable', ...).to_dataset(name='x').to_zarr(...)), then pass element='x'."
        )
    if mask_and_scale is not None and not isinstance(mask_and_scale, bool | np.bool_):
        raise ConfigError(f"mask_and_scale= takes True, False or None, not {mask_and_scale!r}.")
    mask_and_scale = None if mask_and_scale is None else bool(mask_and_scale)
    force_zarr = validate_flag("force_zarr", force_zarr, numpy=True)  # "no" was taken as True
    options = {"force_zarr": force_zarr, "mask_and_scale": mask_and_scale}
    if isinstance(source, Sequence) and not isinstance(source, str | bytes):
        parts = []
        for s in source:  # a loop, not a comprehension: on Python 3.11 that is a frame of its
            # own, and a PackedValuesWarning named this line instead of the caller's
            parts.append(_open_one(s, element=element, executor=executor, **options))
        by_name = features is not None and selects_by_name(
            features, dataset="+".join(p.name for p in parts)
        )
        if by_name and len(parts) > 1:
            parts = [FeatureSubset(part, features) for part in parts]
            features = None
        dataset = parts[0] if len(parts) == 1 else Collection(parts)
    else:
        dataset = _open_one(source, element=element, executor=executor, **options)
    return dataset if features is None else FeatureSubset(dataset, features)


def _open_one(
    source: Source,
    *,
    element: str | None,
    executor: Executor | None,
    force_zarr: bool,
    mask_and_scale: bool | None,
) -> Dataset:
    if isinstance(source, Dataset):
        raise ConfigError(
            f"open_dataset opens stores and Zarr nodes, not datasets ({source!r}): join "
            "datasets with dz.Collection([...])."
        )
    node, name = _open_node(source)
    picked = pick_element(node, element, store=name)
    if not picked.anndata:  # a plain array, or one array of a plain group
        array_name = name if picked.key is None else f"{name}/{picked.key}"
        reader = open_reader(picked.node, name=array_name, executor=executor, force_zarr=force_zarr)
        packing = packing_attributes(picked.node)
        if mask_and_scale is None:
            _warn_if_packed(packing, picked.node, array_name)
        _warn_if_observations_lie_later(picked.node, array_name)
        return DenseDataset(
            reader,
            name=array_name,
            element=picked.key,
            packing=packing,
            mask_and_scale=bool(mask_and_scale),
        )
    x, x_key = picked.node, picked.key
    assert x_key is not None
    x_name = f"{name}/{x_key}"
    obs = zarr_member(node, "obs", where=name)
    obs = obs if isinstance(obs, zarr.Group) else None
    names_at = var_key(x_key)
    var = zarr_member(node, names_at, where=name) if names_at is not None else None
    var = var if isinstance(var, zarr.Group) else None
    dataset: Dataset
    if matrix_layout(x, where=x_name, any_rank=x_key.startswith("obsm/")) == "dense":
        reader = open_reader(x, name=x_name, executor=executor, force_zarr=force_zarr)
        shown = name if x_key == "X" else x_name
        packing = packing_attributes(x)
        if mask_and_scale is None:
            _warn_if_packed(packing, x, x_name)
        dataset = DenseDataset(
            reader,
            name=shown,
            obs=obs,
            var=var,
            store=name,
            element=x_key,
            packing=packing,
            mask_and_scale=bool(mask_and_scale),
        )
    else:
        dataset = CsrDataset(
            x,
            name=x_name,
            obs=obs,
            var=var,
            executor=executor,
            force_zarr=force_zarr,
            store=name,
            element=x_key,
        )
        _refuse_packed_sparse_values(x, x_name, mask_and_scale)  # after the arrays' checks
    if var is not None:
        _check_var_width(var, dataset.feature_shape, var_name=f"{name}/{names_at}", x_name=x_name)
    return dataset


def _refuse_packed_sparse_values(group: Any, name: str, mask_and_scale: bool | None) -> None:
    """Refuse ``mask_and_scale=True`` on a CSR element whose values carry CF packing: decoding
    only the stored non-zeros would leave every implicit zero at 0 where the packing means
    ``add_offset`` (or a scaled 0), so no batch would be what xarray's decoding means. Left
    as stored, it is decoded in a ``transform=`` the user writes knowingly."""
    data = group.get("data") if isinstance(group, zarr.Group) else None
    packing = {
        **packing_attributes(group),
        **(packing_attributes(data) if data is not None else {}),
    }
    if not packing or mask_and_scale is False:
        return
    if mask_and_scale is None:
        _warn_if_packed(packing, data if data is not None else group, name, stacklevel=5)
        return
    listed = ", ".join(f"{k}={v!r}" for k, v in packing.items())
    raise ConfigError(
        f"{name}: a sparse (CSR) matrix whose attributes pack its values ({listed}) cannot be "
        "decoded with mask_and_scale=True: only its stored non-zeros would be unpacked, and "
        "every implicit zero would stay 0 instead of what the packing makes of it. Open it "
        "with mask_and_scale=False and decode the values in a transform=, or store it unpacked."
    )


def _warn_if_packed(found: dict[str, Any], node: Any, name: str, *, stacklevel: int = 4) -> None:
    """Warn that a CF-packed array (xarray's int16 + scale_factor/add_offset) arrives as its
    stored values: trained on as such, a temperature of 280 K is a count in -32767..32767, and
    nothing else would say so."""
    if not found:
        return
    listed = ", ".join(f"{k}={v!r}" for k, v in found.items())
    fill = next((found[k] for k in ("_FillValue", "missing_value") if k in found), None)
    missing = "" if fill is None else f" A missing value arrives as {fill!r}, not NaN."
    warnings.warn(
        f"{name}: its attributes pack its values ({listed}), and X arrives as stored "
        f"({np.dtype(node.dtype)}), not decoded as xarray reads it.{missing} Open it with "
        "dz.open_dataset(..., mask_and_scale=True) to have the graph decode them as xarray "
        "does, or with mask_and_scale=False to take the stored values without this warning.",
        PackedValuesWarning,
        stacklevel=stacklevel,  # open_dataset's caller
    )


def _warn_if_observations_lie_later(node: Any, name: str) -> None:
    """Warn where the dimension names say the samples run along a later axis than axis 0
    (a ``(lat, lon, time)`` variable): batches would be latitude bands, silently."""
    dims = dimension_names(node)
    later = misplaced_observation_axis(dims)
    if later is None:
        return
    warnings.warn(
        f"{name}: its dimensions are {dims}, and observations are taken along axis 0, so each "
        f"row is one {dims[0]!r} holding every {later!r} step, and batches are {dims[0]!r} "
        f"slices. For batches of {later!r} steps, write the variable with {later!r} first "
        f"(xarray: ds.transpose({later!r}, ...).to_zarr(...)). (Silence this with "
        "warnings.filterwarnings('ignore', category=dz.ObservationAxisWarning).)",
        ObservationAxisWarning,
        stacklevel=4,  # open_dataset's caller
    )


def _check_var_width(
    var: zarr.Group, feature_shape: tuple[int, ...], *, var_name: str, x_name: str
) -> None:
    """Refuse X as wide as var's index is not (anndata refuses it too): by position, columns
    past the names (or names past the columns) would be some other gene's. Reads only the
    index's metadata, not its names; an index deleted since the store was consolidated is
    refused here too (its names would read as ``''``: no feature name found)."""
    node = frame_index(var, where=var_name)
    if node is None:
        return
    refuse_stale_metadata(node, name=f"{var_name}/{var.attrs.get('_index')}")
    if not node.shape or len(feature_shape) != 1:
        return
    if node.shape[0] != feature_shape[0]:
        raise DatasetError(
            f"{var_name}/{var.attrs.get('_index')}: var has {node.shape[0]} names but {x_name} is "
            f"{feature_shape[0]} features wide; the store is inconsistent (anndata refuses "
            "it too). Re-write it with one var row per column (for a sparse matrix, check "
            "its 'shape' attribute first)."
        )


def _open_url(url: str) -> tuple[zarr.Group | zarr.Array, str]:
    """A remote store (``s3://``, ``gs://``, ``https://``, ...) opened through zarr's fsspec
    store; zarr-python reads it (the direct path reads local files only)."""
    try:
        node = zarr.open(url, mode="r")
    except ImportError as exc:  # fsspec names the package its protocol needs
        raise DatasetError(
            f"{url}: this kind of URL needs a package that is not installed ({exc}); install "
            "it, or copy the store to a local disk (faster: local stores are read directly)."
        ) from exc
    except Exception as exc:
        raise DatasetError(
            f"{url}: could not open it as a Zarr store ({type(exc).__name__}: {exc}); check "
            "the URL, or open it yourself with zarr.open(url, mode='r', "
            "storage_options={...}) (credentials, endpoint) and pass the zarr node."
        ) from exc
    return node, url.rstrip("/").rsplit("/", 1)[-1] or url


def _open_store(store: zarr.abc.store.Store) -> zarr.Group | zarr.Array:
    """The node at the root of a zarr store object, opened as ``zarr.open(store)`` would
    (users hold stores: a LocalStore, an FsspecStore carrying their credentials)."""
    try:
        return zarr.open(store, mode="r")
    except Exception as exc:  # zarr raises several types for "nothing here"
        raise DatasetError(
            f"{store}: the store holds no Zarr array or group at its root ({type(exc).__name__}: "
            f"{exc}); pass the store of the array or group to load, or the node itself."
        ) from exc


def _store_name(store: Any) -> str:
    """What a user calls a store in messages: the last part of its path (a local store's
    folder, a zip file, an fsspec store's key prefix), else its class (``MemoryStore``).
    Not the store's URL: the name identifies the dataset in a resume state, and a memory
    store's URL changes from process to process."""
    for attribute in ("root", "path"):
        where = str(getattr(store, attribute, "") or "").rstrip("/")
        if where:
            return os.path.basename(where)
    return type(store).__name__


def _open_node(source: Source) -> tuple[zarr.Group | zarr.Array, str]:
    if isinstance(source, zarr.abc.store.Store):
        source = _open_store(source)
    if isinstance(source, zarr.Array | zarr.Group):
        path = source.path
        name = "/".join(p for p in (_store_name(source.store), path) if p) or "<zarr node>"
        return source, name
    try:
        path = os.fspath(source)
    except TypeError:
        accepted = "open_dataset opens a path or URL of a Zarr store, a zarr.Group, zarr.Array or "
        if type(source).__name__ == "AnnData":  # zarr.create_array would lose obs, var, CSR
            backed = getattr(source, "filename", None) if getattr(source, "isbacked", 0) else None
            how = (
                f"convert its file (dali-zarr convert {backed} cells.zarr)"
                if backed is not None
                else "write it first (adata.write_zarr('cells.zarr'))"
            )
            raise ConfigError(
                f"{accepted}zarr store, not an AnnData object: {how} and open that path."
            ) from None
        raise ConfigError(
            f"{accepted}zarr store, not a {type(source).__name__}. Write in-memory data to a "
            "Zarr array first (zarr.create_array(path, data=values, chunks=...)) and open that."
        ) from None
    if isinstance(path, bytes):  # os.fspath passes bytes on; every check below takes str
        path = os.fsdecode(path)
    if not path:
        raise ConfigError("open_dataset got an empty path; pass the path of a Zarr store.")
    if path.startswith("file://"):  # a local store, read directly
        url = urllib.parse.urlparse(path)
        if url.netloc not in ("", "localhost"):  # file://cells.zarr: "cells.zarr" is a host
            raise ConfigError(
                f"{path}: a file:// URL names a host ({url.netloc!r}) here, not a local path; "
                f"write file:///absolute/path/{url.netloc} (three slashes) or the plain path."
            )
        path = urllib.parse.unquote(url.path)  # Path.as_uri() writes a space as %20
    elif "://" in path:
        return _open_url(path)
    name = os.path.basename(os.path.normpath(path)) or path
    if not os.path.exists(path):
        raise DatasetError(f"{path}: no such file or directory; pass the path of a Zarr store.")
    refuse_unfinished(path)
    try:
        node = zarr.open(path, mode="r")
    except Exception as exc:  # zarr raises several types for "not a store"
        found = metadata_file(path)
        codec = unknown_codec_id(exc)
        if found and codec is not None:  # metadata naming a codec no package here registers
            raise DatasetError(
                f"{path}: {missing_codec_advice(codec)} (its {os.path.basename(found)} "
                f"names it; {type(exc).__name__}: {exc})."
            ) from exc
        if found:  # a store whose metadata zarr cannot take
            raise DatasetError(
                f"{path}: its Zarr metadata ({os.path.basename(found)}) cannot be read "
                f"({type(exc).__name__}: {exc}); fix that file (e.g. a fill_value that fits "
                "the dtype) or re-write the store."
            ) from exc
        if os.path.isfile(path) and zipfile.is_zipfile(path):  # zarr opens folders only
            raise DatasetError(
                f"{path}: is a zip file, which zarr opens only as a store object: pass "
                f"zarr.storage.ZipStore({os.fspath(path)!r}, mode='r') instead of its path "
                "(read through zarr-python), or unzip it to a folder and pass that (read "
                "directly, faster)."
            ) from exc
        raise DatasetError(
            f"{path}: is not a Zarr store ({type(exc).__name__}: {exc}). Pass the directory "
            "that holds zarr.json (v3) or .zgroup/.zarray (v2); convert .h5ad files first."
        ) from exc
    return node, name
