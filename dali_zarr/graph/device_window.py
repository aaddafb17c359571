"""Windows on the device: where a window's arrays go in a ring slot, and how they get there.

:class:`DeviceWindowReader` turns a window's row ranges into its stores' runs
(:meth:`~dali_zarr.data.dataset.Dataset.store_runs`), lays the window's arrays out in one
slot (:class:`WindowLayout`) and fills it through each store's byte plans
(:func:`~dali_zarr.io.gpu.window_plans`): one plan per array and window for stores written
alike, every plan of the window run together (``backend.run_plans``: on the GPU one read
batch and one decode call per codec kind), narrower dtypes widened as the rows are placed.
Gene panels are kept on the device (:func:`panel_selection`) by one launch per window: for
CSR stores it maps each store's column ids to the panel (and, for CSR output, cuts each row
to its kept entries); for dense stores it copies each row's panel columns out of the stored
rows.

A backend (:mod:`dali_zarr.graph.window_backends`) is where the slot lives and where the
panel launches run: the device, or the host (how CI tests the GPU path end to end).
:mod:`dali_zarr.graph.gpu_pipeline` owns the ring of slots, the callbacks and the graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dali_zarr.data.dataset import CsrDataset, Dataset, DenseDataset, StoreRun
from dali_zarr.errors import ChunkReadError, DatasetError
from dali_zarr.graph.source import Output, window_arrays, window_dtype
from dali_zarr.io.gpu import Pieces, files_changed, round_up, window_plans
from dali_zarr.planning.partition import concat_aranges, ranges_to_rows, run_offsets

Slots = list[tuple[str, tuple, np.dtype, int]]  # (name, shape, dtype, byte offset)


def pack_slot(arrays: list[tuple[str, tuple, np.dtype]]) -> tuple[Slots, int]:
    """Byte offsets of ``arrays`` packed into one slot (each start aligned for kvikio and
    nvCOMP), and the slot's size."""
    slots, offset = [], 0
    for name, shape, dtype in arrays:
        slots.append((name, shape, dtype, offset))
        offset += round_up(max(1, math.prod(shape) * dtype.itemsize))
    return slots, offset


@dataclass(frozen=True)
class WindowLayout:
    """A window read by byte plans: its arrays' places in one ring slot, the store runs that
    fill it (:meth:`~dali_zarr.data.dataset.Dataset.store_runs`), where each run starts in
    the window (``run_starts``, rows, one more entry than runs) and, for CSR, the window's
    row starts on the host."""

    slots: Slots
    nbytes: int
    runs: list[StoreRun]
    run_starts: np.ndarray
    host_indptr: np.ndarray | None
    #: per store the window touches: the store, its runs' indices, and all of its rows'
    #: ranges, in window order
    by_store: list[tuple[Dataset, list[int], np.ndarray]]
    #: dense stores under panels: their rows as stored, read before the panel columns
    #: are copied out of them
    stored: StoredRows | None = None


@dataclass(frozen=True)
class StoredRows:
    """Where a dense panel window's rows go as stored, before each row's panel columns are
    copied out: one slot array per stored width (``stored0``, ``stored1``, ...: stores of
    other gene sets are wider or narrower), each run's rows together in its store's array.
    The kernel sees the arrays as one flat run of elements from ``stored0`` on."""

    array_of: dict[int, str]  # a store's width -> the slot array its rows go to
    run_at: np.ndarray  # each run's first row in its array
    row_starts: np.ndarray  # each window row's first stored element, from stored0's start
    row_maps: np.ndarray  # each window row's map offset in the panel table
    offset: int  # stored0's byte offset in the slot
    n_elements: int  # from stored0's start to the end of the last array


def _dense_panel_slots(
    run_rows: np.ndarray, run_maps: np.ndarray, widths: np.ndarray, n_kept: int, dtype: np.dtype
) -> tuple[Slots, int, StoredRows]:
    """A dense panel window's slot: ``values`` (the panel's columns, what the graph reads)
    and the stored rows (:class:`StoredRows`), from each run's rows, panel map offset and
    stored width (:meth:`PanelMaps.of_runs`)."""
    array_of: dict[int, str] = {}
    rows_of: dict[int, int] = {}
    run_at = np.empty(len(run_rows), dtype=np.int64)
    for i, width in enumerate(widths.tolist()):  # per run (a window has tens), not per row
        array_of.setdefault(width, f"stored{len(array_of)}")
        run_at[i] = rows_of.get(width, 0)
        rows_of[width] = int(run_at[i] + run_rows[i])
    n_rows = int(run_rows.sum())
    shapes = [("values", (n_rows, n_kept), dtype)]
    shapes += [(name, (rows_of[width], width), dtype) for width, name in array_of.items()]
    slots, nbytes = pack_slot(shapes)
    at = {name: offset for name, _, _, offset in slots}
    first = at.get("stored0", 0)  # none: a window of no rows
    array_start = [(at[array_of[w]] - first) // dtype.itemsize for w in widths.tolist()]
    run_start = np.array(array_start, dtype=np.int64) + run_at * widths
    within = concat_aranges(np.zeros(len(run_rows), dtype=np.int64), run_rows)
    row_starts = np.repeat(run_start, run_rows) + within * np.repeat(widths, run_rows)
    row_maps = np.repeat(run_maps, run_rows)
    _, last_shape, _, last = slots[-1]
    n_elements = (last - first) // dtype.itemsize + math.prod(last_shape)
    stored = StoredRows(array_of, run_at, row_starts, row_maps, first, n_elements)
    return slots, nbytes, stored


def _group_by_store(runs: list[StoreRun]) -> list[tuple[Dataset, list[int], np.ndarray]]:
    members: dict[int, list[int]] = {}
    for i, run in enumerate(runs):
        members.setdefault(id(run.store), []).append(i)
    return [
        (runs[m[0]].store, m, np.concatenate([runs[i].ranges for i in m])) for m in members.values()
    ]


def _store_arrays(store: Dataset) -> list[tuple[str, Any]]:
    """(slot name, reader) of the arrays a store's window rows are read from."""
    if isinstance(store, CsrDataset):
        return [("data", store.data_reader), ("indices", store.indices_reader)]
    assert isinstance(store, DenseDataset)
    return [("values", store.values_reader)]


@dataclass(frozen=True)
class PanelMaps:
    """The gene-panel maps a window goes through as it is read, all of a dataset's maps
    (one per panel; stores written with other gene orders have their own) end to end in
    ``table``. A CSR map takes each stored column to its panel column, ``n_kept`` where
    the panel drops it; a dense map lists the panel's stored columns in panel order.
    ``where`` gives each map's offset and its store's stored width by the identity of the
    run's ``columns`` (None: a store read whole, the identity)."""

    table: np.ndarray
    where: dict[int | None, tuple[int, int]]
    #: the maps themselves, so the ids in ``where`` stay theirs
    held: tuple[np.ndarray, ...]

    def of_runs(self, runs: list[StoreRun]) -> tuple[np.ndarray, np.ndarray]:
        """Each run's map offset in ``table`` and its store's stored width."""
        found = [self.where[None if r.columns is None else id(r.columns)] for r in runs]
        both = np.array(found, dtype=np.int64).reshape(-1, 2)
        return np.ascontiguousarray(both[:, 0]), np.ascontiguousarray(both[:, 1])

    def of_rows(
        self, runs: list[StoreRun], run_starts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`of_runs` for each row of a window (the kernels that give each row a block
        read their row's map without searching the runs)."""
        counts = np.diff(run_starts)
        return tuple(np.repeat(per_run, counts) for per_run in self.of_runs(runs))


def panel_selection(
    pairs: list[tuple[Dataset, np.ndarray | None]], layout: str, n_kept: int
) -> PanelMaps | None:
    """How a dataset's gene panels are kept on the device, from its
    :meth:`~dali_zarr.data.dataset.Dataset.store_columns`: None where no store is under a
    panel, else every map a window's runs go through, one launch per window.

    CSR stores: each run's column ids are mapped to its panel, dropped columns to
    ``n_kept``, which densify skips; with CSR output each row's kept entries are also
    moved to its start. Dense stores: each run's panel columns are copied out of its
    stored rows. One panel over every store and panels that differ per store (stores
    written with other gene orders) take the same path.
    """
    if all(columns is None for _, columns in pairs):
        return None
    where: dict[int | None, tuple[int, int]] = {}
    parts, held, offset = [], [], 0
    for store, columns in pairs:
        key = None if columns is None else id(columns)
        if key in where:
            continue
        if columns is None:  # a whole store beside panels: already the panel's columns
            table = np.arange(store.n_features, dtype=np.int64)
        elif layout == "csr":
            table = np.where(columns >= 0, columns, n_kept).astype(np.int64)
        else:
            kept = np.flatnonzero(columns >= 0)
            table = np.empty(n_kept, dtype=np.int64)
            table[columns[kept]] = kept
        if columns is not None:
            held.append(columns)
        where[key] = (offset, store.n_features if columns is None else len(columns))
        parts.append(table)
        offset += len(table)
    return PanelMaps(np.concatenate(parts), where, tuple(held))


class DeviceWindowReader:
    """Reads a window's rows of a dataset into one device buffer (one ring slot).

    Stores, collections, subsets and gene panels of them are read through each store's byte
    plans: per window, one plan per array of each store the window touches, the plans of
    stores written alike joined and placed so the rows land in window order
    (:func:`~dali_zarr.io.gpu.window_plans`), all of them run together. A panel is read as
    its stores' rows with every stored column and kept on the device
    (:func:`panel_selection`). A store's narrower CSR dtype (int32 ids in an int64 window,
    float16 values) is widened by its plan's final copy. Datasets that name no stores
    (``store_columns`` None: a user's own subclass) are read on the host with
    ``dataset.read_rows`` and copied once (:meth:`read_generic`).
    """

    def __init__(self, dataset: Dataset, backend: Any, *, output: Output = "dense") -> None:
        self.dataset = dataset
        self.backend = backend
        self.dtype = window_dtype(dataset.layout, dataset.dtype)
        self.index_dtype = np.dtype(dataset.index_dtype)
        pairs = dataset.store_columns()
        maps = None if pairs is None else panel_selection(pairs, dataset.layout, dataset.n_features)
        self.stores = self._planned_stores(panels=maps is not None)
        self.panel_maps: PanelMaps | None = None if self.stores is None else maps
        #: CSR output of a panel: rows cut to their kept entries as each window is read
        self.cuts_rows = output == "csr" and self.panel_maps is not None
        self._device_maps = (
            None if self.panel_maps is None else backend.to_device(self.panel_maps.table)
        )
        #: the stored width of every store (stores under panels may differ)
        self.stored_width = dataset.n_features if not self.stores else self.stores[0].n_features

    def _planned_stores(self, *, panels: bool) -> tuple[Dataset, ...] | None:
        """The stores read by byte plans, or None when windows are read on the host.
        Under ``panels`` the stores' widths may differ (each row's panel columns are
        taken from its own store's row)."""
        stores = self.dataset.stores()
        if not stores:
            return None
        for store in stores:
            if self.dataset.layout == "csr":  # a narrower dtype is widened as it is placed
                same = (
                    isinstance(store, CsrDataset)
                    and np.can_cast(np.dtype(store.dtype).newbyteorder("="), self.dtype, "safe")
                    and np.can_cast(store.index_dtype, self.index_dtype, "safe")
                )
            else:
                same = (
                    isinstance(store, DenseDataset)
                    and store.dtype == self.dataset.dtype
                    and (panels or store.feature_shape == stores[0].feature_shape)
                )
            if not same:
                return None
        return stores

    def layout(self, ranges: np.ndarray) -> WindowLayout | None:
        """Where the window of row ``ranges`` goes in a slot (None: read by read_generic,
        whose sizes are known only after reading)."""
        if self.stores is None:
            return None
        runs = self.dataset.store_runs(np.asarray(ranges, dtype=np.int64).reshape(-1, 2))
        assert runs is not None  # stores() named them
        run_rows = np.array([run.n_rows for run in runs], dtype=np.int64)
        run_starts = run_offsets(run_rows)
        n_rows = int(run_starts[-1])
        by_store = _group_by_store(runs)
        if self.dataset.layout == "csr":
            # each row's length, store by store (NumPy per store, not per run), in window order
            lengths = np.empty(n_rows, dtype=np.int64)
            for store, members, store_ranges in by_store:
                rows = ranges_to_rows(store_ranges)
                at = concat_aranges(run_starts[members], run_rows[members])
                lengths[at] = store.indptr[rows + 1] - store.indptr[rows]
            host_indptr = run_offsets(lengths)
            nnz = int(host_indptr[-1])
            shapes = [
                ("data", (nnz,), self.dtype),
                ("indices", (nnz,), self.index_dtype),
                ("indptr", (n_rows + 1,), np.dtype(np.int64)),
            ]
        elif self.panel_maps is not None:  # the stored rows, read before their panel columns
            run_maps, widths = self.panel_maps.of_runs(runs)
            slots, nbytes, stored = _dense_panel_slots(
                run_rows, run_maps, widths, self.dataset.n_features, self.dtype
            )
            return WindowLayout(slots, nbytes, runs, run_starts, None, by_store, stored)
        else:
            host_indptr = None
            shapes = [("values", (n_rows, self.stored_width), self.dtype)]
        slots, nbytes = pack_slot(shapes)
        return WindowLayout(slots, nbytes, runs, run_starts, host_indptr, by_store)

    def read(self, window: WindowLayout, buf: Any) -> tuple[tuple, np.ndarray | None]:
        """Fill ``buf`` with the window; returns its device arrays and, for CSR, the host
        indptr of what its rows hold now (with rows cut to a panel: their kept lengths)."""
        be = self.backend
        views = {name: be.view(buf, off, shape, dt) for name, shape, dt, off in window.slots}
        host_indptr = window.host_indptr
        if host_indptr is not None:
            be.upload(host_indptr, views["indptr"])  # each row's start in the slot
            if host_indptr[-1] > 0:
                self._read_runs(window, views)
                if self.cuts_rows:
                    host_indptr = self._keep_panel_rows(views, window)
                elif self.panel_maps is not None:
                    self._map_panels(views["indices"], window)
                else:
                    self._check_indices(views["indices"], window)
            arrays = (views["data"], views["indices"], views["indptr"])
        else:
            self._read_runs(window, views)
            stored = window.stored
            if stored is not None:  # a panel: each row's columns out of its stored row
                flat = be.view(buf, stored.offset, (stored.n_elements,), self.dtype)
                be.select_columns(
                    views["values"], flat, stored.row_starts, stored.row_maps, self._device_maps
                )
            arrays = (views["values"],)
        be.finish()
        return arrays, host_indptr

    def _read_runs(self, window: WindowLayout, views: dict[str, Any]) -> None:
        """Each array of the window from every store it touches (all of a store's runs at
        once), by the fewest byte plans (:func:`~dali_zarr.io.gpu.window_plans`: one per
        array and window when the stores are written alike), placed so the rows land in
        window order; arrays with no plan are read on the host and copied into place."""
        csr = window.host_indptr is not None
        whole = len(window.runs) == 1  # the window is this one run: no placing
        items: dict[str, list[tuple[Any, np.ndarray, Pieces | None]]] = {}
        stored = window.stored
        for store, members, ranges in window.by_store:
            starts = window.run_starts[members]
            stops = window.run_starts[np.add(members, 1)]
            if csr:  # rows -> elements of data/indices
                ranges = store.indptr[ranges]
                starts, stops = window.host_indptr[starts], window.host_indptr[stops]
            lengths = stops - starts
            if stored is not None:  # rows of the store's own width, in its own array
                starts = stored.run_at[members]
            pieces = None if whole else (starts, lengths)
            for name, reader in _store_arrays(store):
                if stored is not None:
                    name = stored.array_of[store.n_features]
                items.setdefault(name, []).append((reader, ranges, pieces))
        self._read_arrays(items, views)

    def _read_arrays(
        self, items: dict[str, list[tuple[Any, np.ndarray, Pieces | None]]], views: dict[str, Any]
    ) -> None:
        """The arrays' shares of :meth:`_read_runs`: every array's byte plans run together
        (``backend.run_plans``: on the GPU the reads of all in flight, one decode call per
        codec kind). A byte plan that fails is planned and run again once where chunk or
        shard files changed since planned (values rewritten in place, before the window or
        while it was read: the cached chunk stamps are forgotten by
        ``DirectReader.forget_changed_chunks``, and each plan's files are looked at, as a
        shard's index or a chunk another window located anew leaves nothing to forget);
        otherwise its error stands."""

        def planned(*, upload: bool) -> list[tuple[Any, Any, Any]]:
            jobs = []
            for name, array_items in items.items():
                plans, unplannable = window_plans(array_items, out_rows=views[name].shape[0])
                for i in unplannable if upload else ():  # no byte plan: read on the host
                    self.backend.upload_rows(*array_items[i], views[name])
                jobs += [(plan, reader, views[name]) for plan, reader in plans]
            return jobs

        jobs = planned(upload=True)
        try:
            self.backend.run_plans(jobs)
        except ChunkReadError:
            forgot = [reader.forget_changed_chunks() for _, reader, _ in jobs]  # each store's
            if not any(forgot) and not any(files_changed(plan) for plan, _, _ in jobs):
                raise
            self.backend.run_plans(planned(upload=False))

    def read_generic(
        self,
        ranges: np.ndarray,
        alloc: Callable[[int], Any],
        release: Callable[[Any], None],
    ):
        """Feature selections and mixed stores: host read, then one copy per array into a
        slot from ``alloc`` (given back with ``release`` if the copy fails: it must wait for
        the uploads already queued)."""
        host = window_arrays(self.dataset, self.dataset.read_rows(ranges))
        host_indptr = host[2] if self.dataset.layout == "csr" else None
        slots, nbytes = pack_slot([(str(i), a.shape, a.dtype) for i, a in enumerate(host)])
        lease = alloc(nbytes)
        try:
            arrays = []
            for a, (_, shape, dt, off) in zip(host, slots, strict=True):
                view = self.backend.view(lease.buf, off, shape, dt)
                self.backend.upload(a, view)
                arrays.append(view)
            self.backend.finish()
        except BaseException:
            release(lease)
            raise
        return tuple(arrays), host_indptr, lease

    def _check_indices(self, indices: Any, window: WindowLayout) -> None:
        """Out-of-range column ids would make densify write out of bounds: refuse them,
        naming the store they came from."""
        low, high = self.backend.minmax(indices)
        if low >= 0 and high < self.stored_width:
            return
        bounds = window.host_indptr[window.run_starts]
        for run, a, b in zip(window.runs, bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            if b > a:
                run.store.check_indices(self.backend.to_host(indices[a:b]), run.ranges)
        raise DatasetError(  # not reached: some run holds the bad id
            f"{self.dataset.name}: column index outside [0, {self.stored_width})"
        )

    def _keep_panel_rows(self, views: dict[str, Any], window: WindowLayout) -> np.ndarray:
        """CSR output of a panel: each row's kept entries moved to its start, renumbered
        to the panel (one launch); returns the prefix sum of the kept lengths, from which
        the callback sizes each batch. A bad id fails naming its store and rows."""
        assert self.panel_maps is not None
        row_maps, row_widths = self.panel_maps.of_rows(window.runs, window.run_starts)
        kept, bad = self.backend.keep_panel_rows(
            views["data"], views["indices"], views["indptr"], row_maps, row_widths,
            self._device_maps, self.dataset.n_features,
        )  # fmt: skip
        if bad:  # the run holding the bad row: the last one starting at or before it
            run = int(np.searchsorted(window.run_starts, bad - 1, side="right")) - 1
            self._name_bad_run(views["indices"], window, run)
        return run_offsets(kept)

    def _name_bad_run(self, indices: Any, window: WindowLayout, i: int) -> None:
        """Raise the error of run ``i``, which holds a column id outside its store's width
        (ids mapped or moved before it are below that width, so the bad one shows)."""
        bounds = window.host_indptr[window.run_starts]
        run, a, b = window.runs[i], int(bounds[i]), int(bounds[i + 1])
        run.store.check_indices(self.backend.to_host(indices[a:b]), run.ranges)
        raise DatasetError(  # not reached: check_indices raises
            f"{run.store.name}: column index outside [0, {run.store.n_features})"
        )

    def _map_panels(self, indices: Any, window: WindowLayout) -> None:
        """Each run's column ids to its panel's columns, dropped ones to the panel's width
        (one launch), which also checks them against each store's own width: a bad id
        fails naming its store and rows."""
        assert self.panel_maps is not None
        bounds = window.host_indptr[window.run_starts]
        offsets, widths = self.panel_maps.of_runs(window.runs)
        bad = self.backend.remap_columns(indices, bounds, offsets, widths, self._device_maps)
        if bad:
            self._name_bad_run(indices, window, bad - 1)

    def read_paths(self) -> dict[str, str]:
        if self.stores is None:
            return {
                name: f"gpu: host read ({path}), one copy to the device"
                for name, path in self.dataset.read_paths().items()
            }
        kept = self.dataset.n_features
        if self.cuts_rows:
            how = "ids mapped to the panel, rows cut to it"
        elif self.dataset.layout == "csr":
            how = "ids mapped to the panel, densify skips the rest"
        else:
            how = "each row's panel columns copied out"
        how = f"features kept as each window is read ({how})"
        paths = {}
        for store in self.stores:
            note = "" if self.panel_maps is None else f"; {kept} of {store.n_features} {how}"
            for _, reader in _store_arrays(store):
                paths[reader.name] = self.backend.path(reader) + note
        return paths
