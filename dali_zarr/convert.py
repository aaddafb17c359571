"""Streaming converter: ``.h5ad`` / AnnData Zarr / plain Zarr arrays → a store laid out for us.

`convert` reads its inputs in blocks of rows and writes a zarr v3 store whose chunks hold a
chosen number of rows, grouped into shards of a chosen size, compressed with a codec the GPU
path can decode (zstd, lz4 or none). Several inputs are concatenated along the rows. Rows may
be pre-shuffled (see `output_permutation` for exactly how). AnnData inputs give an AnnData
store (``X``, ``obs``, ``var``) that both `dali_zarr.open_dataset` and ``anndata.read_zarr``
read; plain arrays give a plain array.

Memory is bounded: ``X`` is never loaded whole. At any time the converter holds one block of
input rows (twice while shuffling it) and, per output array, a buffer of one shard, because
zarr rewrites a whole shard on every partial write, so each shard is written once, complete.
``obs``/``var`` (one value per row or feature), the dense ``obsm`` entries carried (up to
`OBSM_CARRY_BYTES` each), CSR ``indptr`` and the output→input row map are held in memory.
AnnData inputs need the ``anndata`` package (and ``.h5ad`` files h5py), which reads and
writes ``obs``/``var`` in every encoding anndata knows.

The output is written whole (`dali_zarr.io.publish`): into ``DST.partial``, renamed to
``DST`` only when complete, so an interrupted or killed run never leaves a ``DST`` that looks
complete.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import zarr

from dali_zarr.data.elements import (
    Picked,
    bad_column_error,
    dimension_names,
    first_bad_column,
    indptr_as_int64,
    is_array,
    matrix_layout,
    member_names,
    packing_attributes,
    pick_element,
    refuse_bad_indptr,
    refuse_non_integer,
    shape_attribute,
    var_key,
)
from dali_zarr.data.obs import OBSM_PREFIX, changed_by_join, describe_beside_x
from dali_zarr.errors import ChunkReadError, ConfigError, DaliZarrError, DatasetError
from dali_zarr.io import (
    WRITER_MARKER,
    first_failing_chunk,
    missing_codec_advice,
    read_whole,
    refuse_stale_metadata,
    refuse_unfinished,
    unknown_codec_id,
)
from dali_zarr.io.publish import check_replaceable, dir_bytes, written_whole
from dali_zarr.planning.partition import (
    concat_aranges,
    order_digest,
    ranges_to_rows,
    run_offsets,
)

__all__ = [
    "CODECS",
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CHUNK_ROWS",
    "DEFAULT_CSR_CHUNK_ELEMENTS",
    "DEFAULT_SHARD_BYTES",
    "ConvertResult",
    "convert",
    "output_permutation",
]

Codec = Literal["zstd", "lz4", "none"]
CODECS: tuple[str, ...] = ("zstd", "lz4", "none")
DEFAULT_CHUNK_ROWS = 256
#: the most decoded bytes a default chunk holds: rows of more than 64 KiB get fewer than
#: DEFAULT_CHUNK_ROWS per chunk (a (time, 37, 721, 1440) float32 field's 256 rows are 39 GB,
#: read, held and compressed at once: a kill by the OOM killer, without a word)
DEFAULT_CHUNK_BYTES = 16 * 2**20
#: CSR: the most elements a default data/indices chunk holds (fewer rows than
#: DEFAULT_CHUNK_ROWS where rows are long: 32 rows at 2,000 non-zeros a row). On the H200
#: (2026-11-27) nvCOMP decoded a window of 65,536-element chunks in 20 ms where 262,144-element
#: ones took 44, and the GPU loader gave 636k against 459k rows/s; the CPU path read such a
#: store as fast or faster (benchmarks/results/cpu-2026-11-27b), and a sampler chunk a few
#: times the store's rows per chunk, which bounds the rows decoded and not used, is finer.
DEFAULT_CSR_CHUNK_ELEMENTS = 65_536
DEFAULT_SHARD_BYTES = 256 * 2**20
DEFAULT_BLOCK_BYTES = 64 * 2**20  # decoded X bytes read per block when block_rows is not given
_UNSHARDED_WRITE_BYTES = 32 * 2**20  # write unsharded arrays in runs of whole chunks this big
_INDPTR_CHUNK = 2**20
ORIGINAL_INDEX = "original_index"
ORIGINAL_SOURCE = "original_source"
SHUFFLE_METHOD = (
    "two-level: pieces of piece_rows consecutive input rows in a random order (seed), then the "
    "rows of every window_pieces consecutive pieces permuted uniformly"
)

Progress = Callable[[int, int], None]  # (rows written so far, total rows)


@dataclass(frozen=True)
class ConvertResult:
    """What `convert` wrote (also stored, in part, in the output's ``dali_zarr`` attribute)."""

    path: str
    anndata: bool
    layout: Literal["csr", "dense"]
    n_obs: int
    feature_shape: tuple[int, ...]
    dtype: str
    nnz: int | None  # CSR only
    chunk_rows: int  # dense: exact; CSR: the mean rows per data chunk that was aimed for
    chunk_elements: int | None  # CSR: elements per data/indices chunk
    shard_chunks: int | None  # chunks per shard of X (None: not sharded)
    codec: str
    shuffle: dict[str, int] | None  # {"seed", "piece_rows", "window_pieces"} or None
    block_rows: int
    n_blocks: int  # blocks of input rows read (the unit of memory)
    obs_columns: tuple[str, ...] = ()
    dropped_obs_columns: tuple[str, ...] = ()
    #: obsm entries carried, for obs=["obsm/<key>"]: "obsm/<key> <row shape> <batch dtype>"
    obsm: tuple[str, ...] = ()
    nbytes: int = 0  # bytes on disk
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------- shuffling


def _windows(
    n_obs: int, *, block_rows: int, shuffle: dict[str, int] | None
) -> Iterator[tuple[list[tuple[int, int]], np.ndarray | None]]:
    """Blocks of output rows: (input row ranges read in order, permutation of their rows)."""
    if shuffle is None:
        for start in range(0, n_obs, block_rows):
            yield [(start, min(n_obs, start + block_rows))], None
        return
    seed, piece, per_window = shuffle["seed"], shuffle["piece_rows"], shuffle["window_pieces"]
    n_pieces = -(-n_obs // piece)
    order = np.random.default_rng([seed, 0]).permutation(n_pieces)
    for w, first in enumerate(range(0, n_pieces, per_window)):
        pieces = order[first : first + per_window].tolist()
        ranges = [(p * piece, min(n_obs, (p + 1) * piece)) for p in pieces]
        n_rows = sum(b - a for a, b in ranges)
        yield ranges, np.random.default_rng([seed, 1, w]).permutation(n_rows)


def output_permutation(
    n_obs: int,
    *,
    seed: int,
    piece_rows: int,
    window_pieces: int,
    digest: str | None = None,
    numpy: str | None = None,
) -> np.ndarray:
    """Input row of every output row of a shuffled conversion: ``out[i] = in[perm[i]]``.

    Takes the ``shuffle`` entry of the output's ``dali_zarr`` attribute as keywords; its
    ``digest`` (of the order the store was written in) is checked: NumPy does not promise
    its permutation stream across versions, and another order would map rows wrongly. A
    uniform permutation of n rows needs random access to all of them; to stream with bounded
    memory the converter shuffles in two levels instead: the input (concatenated inputs) is
    cut into pieces of ``piece_rows`` consecutive rows, the pieces are put in a random order,
    then every ``window_pieces`` consecutive pieces are read together and their rows are
    permuted uniformly. Rows of one input piece thus land in one window of output rows.
    """
    shuffle = {"seed": seed, "piece_rows": piece_rows, "window_pieces": window_pieces}
    parts = list(_output_rows(n_obs, shuffle))
    order = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if digest is not None and order_digest(parts) != digest:
        why = (
            f"NumPy {numpy} then, {np.__version__} now: its permutation stream changed"
            if numpy is not None and numpy != np.__version__
            else "the same NumPy: the keywords differ from the store's shuffle entry"
        )
        advice = (
            "Recompute it under the NumPy version that wrote the store."
            if numpy is not None and numpy != np.__version__
            else "Pass the output's dali_zarr attribute's shuffle entry as it is "
            "(output_permutation(n_obs, **attrs['dali_zarr']['shuffle']))."
        )
        raise DatasetError(
            f"the shuffled order recomputed here differs from the one the store was written "
            f"in ({why}), so it would map rows to the wrong input rows. {advice}"
        )
    return order


def _output_rows(n_obs: int, shuffle: dict[str, int]) -> Iterator[np.ndarray]:
    """The input rows of each block of output rows, in order (bounded memory)."""
    block_rows = shuffle["piece_rows"] * shuffle["window_pieces"]
    for ranges, perm in _windows(n_obs, block_rows=block_rows, shuffle=shuffle):
        rows = ranges_to_rows(np.asarray(ranges))
        yield rows if perm is None else rows[perm]


# ---------------------------------------------------------------------------- inputs


@dataclass
class _Input:
    """One opened input: sliceable arrays (zarr or h5py) plus what is needed to read them."""

    path: str
    anndata: bool
    layout: Literal["csr", "dense"]
    n_obs: int
    feature_shape: tuple[int, ...]
    dtype: np.dtype
    root: Any = None  # zarr.Group / h5py.File holding obs and var (AnnData)
    x: Any = None  # dense rows
    data: Any = None  # CSR
    indices: Any = None
    indptr: np.ndarray | None = None
    index_dtype: np.dtype | None = None
    handle: Any = None  # an h5py.File to close
    element: str | None = "X"  # what was read: "X", "layers/counts", a group's array path;
    # None: the input is that array
    var_key: str | None = "var"  # the dataframe describing its features (None: numbered)
    packing: dict[str, Any] = field(default_factory=dict)  # a plain array's CF attributes
    dims: tuple[str, ...] | None = None  # a plain array's dimension names (xarray's)

    @property
    def nnz(self) -> int:
        return int(self.indptr[-1]) if self.indptr is not None else 0

    def read(self, part: Literal["x", "data", "indices"], start: int, stop: int) -> np.ndarray:
        """``[start, stop)`` along axis 0 of one of the input's arrays (rows of a dense X,
        elements of CSR data/indices); a failed read (a corrupted or truncated chunk) is a
        ChunkReadError naming the array and its chunks there, not zarr's or h5py's error."""
        array = getattr(self, part)
        try:
            return np.asarray(array[start:stop])
        except (MemoryError, PermissionError):  # not the chunk's fault: as they are
            raise
        except Exception as exc:
            base = f"{self.path}/{self.element}" if self.anndata and self.element else self.path
            name = base if part == "x" else f"{base}/{part}"
            missing = _codec_missing_error(name, exc)  # v3 codecs load at a chunk's decode
            if missing is not None:
                raise missing from exc
            what = "rows" if part == "x" else "elements"
            where, cause = f"{what} [{start}, {stop})", exc
            found = first_failing_chunk(array, start, stop)  # read again chunk by chunk
            if found is not None:
                c, cause = found
                chunk = int(array.chunks[0])
                where = f"chunk {c} along axis 0 ({what} [{c * chunk}, {(c + 1) * chunk}))"
            raise ChunkReadError(
                f"{name}: reading {where} failed ({type(cause).__name__}: {cause}). It is "
                "corrupted or truncated: restore it from an intact copy, or re-write the input."
            ) from exc

    def check_indices(self, ids: np.ndarray, start: int) -> None:
        """Refuse column ids outside ``[0, n_features)`` (``ids``: elements from ``start``):
        copied as they are, they made a store the loader refuses only when it reads them."""
        n = self.feature_shape[0]
        at = first_bad_column(ids, n)
        if at is None:
            return
        element = start + at
        row = int(np.searchsorted(self.indptr, element, side="right")) - 1
        chunk = int((getattr(self.indices, "chunks", None) or (0,))[0])
        raise bad_column_error(
            f"{self.path}/{self.element}/indices", int(ids[at]), n, element, f"row {row:,}",
            f"chunk {element // chunk} along axis 0" if chunk else "an unchunked array",
        )  # fmt: skip

    def rows_per_chunk(self) -> float | None:
        """Rows in one of the input's own chunks (CSR: on average); None if not chunked."""
        array = self.data if self.layout == "csr" else self.x
        chunks = getattr(array, "chunks", None)
        if not chunks or not self.n_obs:
            return None
        if self.layout == "csr":
            return chunks[0] * self.n_obs / max(1, self.nnz)
        return float(chunks[0])

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def _codec_missing_error(name: str, exc: BaseException) -> DatasetError | None:
    """The error for a sound store whose codec package is missing (zarr's or numcodecs'
    "unknown codec" in ``exc``'s chain), or None: it is no damage to restore."""
    codec = unknown_codec_id(exc)
    if codec is None:
        return None
    return DatasetError(f"{name}: {missing_codec_advice(codec)} ({type(exc).__name__}: {exc}).")


def _open_input(path: str, element: str | None = None) -> _Input:
    if not os.path.exists(path):
        raise DatasetError(
            f"{path}: no such file or directory; pass an .h5ad file, a Zarr store or array."
        )
    if os.path.isfile(path):
        return _open_h5ad(path, element)
    # a killed writer's DST.partial reads its unwritten chunks as zeros, and as the partial
    # of this convert's DST it would be removed as stale while being read
    refuse_unfinished(path)
    try:
        node = zarr.open(path, mode="r")
    except Exception as exc:  # zarr raises several types for "not a store"
        missing = _codec_missing_error(path, exc)
        if missing is not None:
            raise missing from exc
        raise DatasetError(
            f"{path}: is not a Zarr store ({type(exc).__name__}: {exc}); pass an .h5ad file, "
            "or the directory that holds zarr.json (v3) or .zgroup/.zarray (v2)."
        ) from exc
    picked = pick_element(node, element, store=path)
    if not picked.anndata:  # a plain array, or one array of a plain group
        where = path if picked.key is None else os.path.join(path, picked.key)
        refuse_stale_metadata(picked.node, name=where)  # as open_dataset: no garbage values
        inp = _dense_input(where, picked.node, anndata=False, root=None)
        inp.element = picked.key
        inp.packing = packing_attributes(picked.node)  # the copy must stay unpackable
        # and keep its dimension names: open_dataset warns of a (lat, lon, time) copy by them
        inp.dims = dimension_names(picked.node)
        return inp
    return _anndata_input(path, node, picked, handle=None)


def _open_h5ad(path: str, element: str | None) -> _Input:
    try:
        import h5py
    except ImportError as exc:
        raise ConfigError(f"{path}: reading .h5ad files needs h5py (pip install h5py).") from exc
    with contextlib.suppress(ImportError):  # registers the HDF5 filters anndata writes with it
        import hdf5plugin  # noqa: F401
    if not h5py.is_hdf5(path):
        raise DatasetError(
            f"{path}: is a file but not an HDF5 (.h5ad) file; pass an .h5ad file, a Zarr "
            "store or a Zarr array directory."
        )
    try:
        handle = h5py.File(path, "r")
    except OSError as exc:  # h5py's message never names the file
        raise DatasetError(
            f"{path}: the HDF5 file cannot be opened ({exc}); it is truncated, corrupted or "
            "still being written: copy it again, or write it again with anndata."
        ) from exc
    try:
        picked = pick_element(handle, element, store=path, anndata=True)
        for key in (str(picked.key), "obs", var_key(str(picked.key))):
            _refuse_missing_filters(h5py, handle, key, path)
        return _anndata_input(path, handle, picked, handle=handle)
    except BaseException:
        handle.close()
        raise


def _refuse_missing_filters(h5py: Any, handle: Any, key: str | None, path: str) -> None:
    """Refuse datasets under ``key`` compressed with an HDF5 filter h5py has not loaded
    (anndata writes zstd/blosc/lz4 ones with hdf5plugin): their reads failed with h5py's
    "can't open directory (/usr/local/lib/plugin)", reported as a corrupted chunk or a file
    system error. (:func:`_open_h5ad` imports hdf5plugin where installed, registering them.)"""
    node = handle.get(key) if key else None
    found: list[tuple[str, Any]] = [(str(key), node)] if isinstance(node, h5py.Dataset) else []
    if isinstance(node, h5py.Group):
        node.visititems(lambda name, o: found.append((f"{key}/{name}", o)))
    for name, dataset in found:
        if not isinstance(dataset, h5py.Dataset):
            continue
        plist = dataset.id.get_create_plist()
        for i in range(plist.get_nfilters()):
            code, _, _, label = plist.get_filter(i)
            if not h5py.h5z.filter_avail(code):
                what = label.decode(errors="replace").split(";")[0] or "unnamed"
                raise DatasetError(
                    f"{path}/{name}: is compressed with HDF5 filter {code} ({what}), which "
                    "this h5py does not have; install hdf5plugin (pip install hdf5plugin: "
                    "convert loads it) and run again."
                )


def _anndata_input(path: str, root: Any, picked: Picked, *, handle: Any) -> _Input:
    x, key = picked.node, str(picked.key)
    where = f"{path}/{key}"
    if is_array(x) and len(x.shape) > 2:
        # The output is an AnnData store, whose X anndata holds to 2-D.
        raise DatasetError(
            f"{where}: has shape {tuple(x.shape)}; convert writes it as the X of an AnnData "
            "store, which must be 2-D. Read it as it is with dz.open_dataset(..., "
            f"element={key!r}) (N-D rows are batched whole), or reshape it to 2-D first."
        )
    if matrix_layout(x, where=where) == "dense":
        refuse_stale_metadata(x, name=where)
        inp = _dense_input(path, x, anndata=True, root=root)
        inp.handle, inp.element, inp.var_key = handle, key, var_key(key)
        return inp
    for part in ("data", "indices", "indptr"):
        if part not in x or not is_array(x[part]):
            raise DatasetError(f"{where}: csr_matrix group has no array {part!r}; re-write it.")
        # consolidated metadata older than the array (rewritten in place) decodes its chunks
        # as another dtype or shape: refused, as open_dataset does (h5py: nothing to check)
        refuse_stale_metadata(x[part], name=f"{where}/{part}")
    n_obs, n_features = shape_attribute(x, where=where)
    refuse_non_integer(x["indptr"].dtype, f"{where}/indptr", part="indptr")
    indptr = indptr_as_int64(read_whole(x["indptr"], name=f"{where}/indptr"), f"{where}/indptr")
    if indptr.shape != (n_obs + 1,):
        raise DatasetError(
            f"{where}/indptr: must hold {n_obs + 1} offsets, one per row plus one (has "
            f"{len(indptr)}); the store is inconsistent: re-write the matrix."
        )
    refuse_bad_indptr(indptr, f"{where}/indptr")
    data, indices = x["data"], x["indices"]
    refuse_non_integer(indices.dtype, f"{where}/indices", part="indices")  # as open_dataset
    for name, arr in (("data", data), ("indices", indices)):
        if arr.shape[0] < indptr[-1]:
            raise DatasetError(
                f"{where}/{name}: has {arr.shape[0]} elements but indptr ends at "
                f"{int(indptr[-1])}; the store is truncated."
            )
    return _Input(
        path=path,
        anndata=True,
        layout="csr",
        n_obs=n_obs,
        feature_shape=(n_features,),
        dtype=_numeric(path, np.dtype(data.dtype)),
        root=root,
        data=data,
        indices=indices,
        indptr=indptr,
        index_dtype=np.dtype(indices.dtype),
        handle=handle,
        element=key,
        var_key=var_key(key),
    )


def _dense_input(path: str, x: Any, *, anndata: bool, root: Any) -> _Input:
    if len(x.shape) == 0:
        raise DatasetError(f"{path}: is a 0-d array; it holds no rows to convert.")
    return _Input(
        path=path,
        anndata=anndata,
        layout="dense",
        n_obs=int(x.shape[0]),
        feature_shape=tuple(int(s) for s in x.shape[1:]),
        dtype=_numeric(path, np.dtype(x.dtype)),
        root=root,
        x=x,
    )


def _numeric(path: str, dtype: np.dtype) -> np.dtype:
    if dtype.kind not in "biuf":
        raise DatasetError(f"{path}: X has dtype {dtype}; only numeric data can be converted.")
    return dtype.newbyteorder("=") if dtype.byteorder not in "=|" else dtype


def _check_compatible(inputs: Sequence[_Input]) -> None:
    first = inputs[0]
    for inp in inputs[1:]:
        if inp.anndata != first.anndata:
            kinds = {True: "an AnnData store", False: "a plain array"}
            raise DatasetError(
                f"{inp.path} is {kinds[inp.anndata]} but {first.path} is "
                f"{kinds[first.anndata]}; convert AnnData inputs and plain arrays separately."
            )
        if inp.packing != first.packing:  # one set of attributes cannot unpack both
            raise DatasetError(
                f"{inp.path} is packed with {inp.packing or 'no attributes'} but "
                f"{first.path} with {first.packing or 'no attributes'} (CF scale_factor, "
                "add_offset, _FillValue): joined, one of them would be unpacked wrong. "
                "Convert them separately, or write them with one encoding first."
            )
        if inp.layout != first.layout and inp.feature_shape == first.feature_shape:
            fix = (
                "adata.X = adata.X.toarray()"
                if first.layout == "dense"
                else "adata.X = scipy.sparse.csr_matrix(adata.X)"
            )
            raise DatasetError(
                f"{inp.path} has {inp.layout} X but {first.path} has {first.layout} X; "
                "concatenated inputs must store X alike: re-write one of them (e.g. "
                f"{fix}) or convert them separately."
            )
        if (inp.layout, inp.feature_shape) != (first.layout, first.feature_shape):
            raise DatasetError(
                f"{inp.path} has {inp.layout} X with features {inp.feature_shape} but "
                f"{first.path} has {first.layout} X with features {first.feature_shape}; "
                "concatenated inputs must share the feature axis."
            )


# ---------------------------------------------------------------------------- reading


def _split(inputs: Sequence[_Input], offsets: np.ndarray, start: int, stop: int):
    """Global rows [start, stop) → (input, local start, local stop) pieces, in order."""
    while start < stop:
        k = int(np.searchsorted(offsets, start, side="right")) - 1
        end = min(stop, int(offsets[k + 1]))
        yield inputs[k], start - int(offsets[k]), end - int(offsets[k])
        start = end


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _read_dense(inputs, offsets, ranges, dtype: np.dtype) -> np.ndarray:
    parts = [
        inp.read("x", a, b).astype(dtype, copy=False)
        for s, e in _merge(ranges)
        for inp, a, b in _split(inputs, offsets, s, e)
    ]
    return _join(parts)


def _join(parts: list[np.ndarray]) -> np.ndarray:
    """One array of ``parts``, without a copy when there is only one."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _read_csr(inputs, offsets, ranges, dtype: np.dtype, index_dtype: np.dtype):
    data, indices, lengths = [], [], []
    for s, e in _merge(ranges):
        for inp, a, b in _split(inputs, offsets, s, e):
            e0, e1 = int(inp.indptr[a]), int(inp.indptr[b])
            data.append(inp.read("data", e0, e1).astype(dtype, copy=False))
            ids = inp.read("indices", e0, e1)
            inp.check_indices(ids, e0)
            indices.append(ids.astype(index_dtype, copy=False))
            lengths.append(np.diff(inp.indptr[a : b + 1]))
    return _join(data), _join(indices), _join(lengths)


def _permute_csr(data, indices, lengths, perm):
    """Rows of a CSR block in the order ``perm`` (one vectorized gather)."""
    starts = run_offsets(lengths)[:-1]
    new_lengths = lengths[perm]
    gather = concat_aranges(starts[perm], new_lengths)
    return data[gather], indices[gather], new_lengths


# ---------------------------------------------------------------------------- writing


class _Appender:
    """Writes an array front to back in whole write units (one shard, or runs of chunks).

    zarr re-reads and rewrites a shard on every partial write, so values are buffered until
    a unit is complete: every unit is encoded and written exactly once.
    """

    def __init__(self, array: zarr.Array, unit: int) -> None:
        self.array = array
        self.total = int(array.shape[0])
        self.buffer = np.empty((max(1, min(unit, self.total)), *array.shape[1:]), array.dtype)
        self.fill = 0
        self.written = 0

    def append(self, values: np.ndarray) -> None:
        i = 0
        while i < len(values):
            take = min(len(self.buffer) - self.fill, len(values) - i)
            self.buffer[self.fill : self.fill + take] = values[i : i + take]
            self.fill += take
            i += take
            if self.fill == len(self.buffer):
                self._flush()

    def _flush(self) -> None:
        if self.fill:
            self.array[self.written : self.written + self.fill] = self.buffer[: self.fill]
            self.written += self.fill
            self.fill = 0

    def finish(self) -> None:
        self._flush()
        if self.written != self.total:  # an internal bookkeeping error, never user input
            raise RuntimeError(f"wrote {self.written} of {self.total} rows of {self.array.path}")


def _compressors(codec: str) -> Any:
    from zarr.codecs import ZstdCodec

    if codec == "zstd":
        return ZstdCodec()
    if codec == "lz4":
        from zarr.codecs.numcodecs import LZ4

        return LZ4()
    return None


def _layout(length: int, chunk: int, row_bytes: int, shard_bytes: int | None):
    """(chunk length, shard length or None, write unit) for ``length`` rows along axis 0.

    A shard holds as many whole chunks as fit in ``shard_bytes`` (at least 2, or no sharding,
    and never more than the array needs).
    """
    chunk = max(1, min(chunk, length))
    chunk_bytes = max(1, chunk * row_bytes)
    n_chunks = -(-length // chunk) if length else 1
    per_shard = min(shard_bytes // chunk_bytes, n_chunks) if shard_bytes else 0
    if per_shard >= 2:
        return chunk, chunk * per_shard, chunk * per_shard
    return chunk, None, chunk * max(1, _UNSHARDED_WRITE_BYTES // chunk_bytes)


def _create(
    parent: zarr.Group | str,
    name: str | None,
    *,
    shape: tuple[int, ...],
    dtype: np.dtype,
    chunk: int,
    shard: int | None,
    codec: str,
    dims: tuple[str, ...] | None = None,
) -> zarr.Array:
    kwargs: dict[str, Any] = dict(
        dimension_names=dims,
        shape=shape,
        dtype=dtype,
        # an axis of length 0 still gets chunks of 1 (as zarr's own default): a chunk of
        # length 0 has no chunk grid, and readers (ours included) divide by it
        chunks=(chunk, *(max(1, s) for s in shape[1:])),
        shards=None if shard is None else (shard, *shape[1:]),
        compressors=_compressors(codec),
        fill_value=0,
    )
    if isinstance(parent, zarr.Group):
        return parent.create_array(name, **kwargs)
    return zarr.create_array(parent, zarr_format=3, **kwargs)


# ---------------------------------------------------------------------------- obs / var


def _anndata_io():
    try:
        import anndata.io
        import pandas as pd
    except ImportError as exc:
        raise ConfigError(
            "converting AnnData inputs needs the anndata package (pip install anndata)."
        ) from exc
    return anndata.io, pd


def _frame(inp: _Input, key: str | None, n: int):
    """The dataframe at ``key`` (checked to have ``n`` rows), or one numbering ``n`` rows."""
    aio, pd = _anndata_io()
    if inp.root is not None and key is not None and key in inp.root:
        node = inp.root[key]
        if getattr(getattr(node, "dtype", None), "names", None):
            # anndata < 0.7 wrote obs/var as one table (categories in uns): read_elem
            # cannot read it (a bare AttributeError); anndata.read_h5ad can
            raise DatasetError(
                f"{inp.path}/{key}: is a table in the format of anndata before 0.7, which "
                "convert does not read; write the file again in today's format first: "
                "anndata.read_h5ad(path).write_h5ad(new_path)."
            )
        # a column rewritten after the store was consolidated is read (by anndata) with the
        # stale metadata, as another dtype: refused, as the loader refuses it (h5py: no such)
        arrays = _arrays_in(node)
        for name, child in arrays:
            if isinstance(child, zarr.Array):
                refuse_stale_metadata(child, name=f"{inp.path}/{key}/{name}")
        try:
            frame = aio.read_elem(node)
        except (MemoryError, PermissionError, DaliZarrError):
            raise
        except Exception as exc:  # a bad chunk: anndata's (zarr's, h5py's) error names none
            for name, child in arrays:  # the first column that cannot be read, by its chunk
                read_whole(child, name=f"{inp.path}/{key}/{name}")
            raise ChunkReadError(
                f"{inp.path}/{key}: anndata failed to read it ({type(exc).__name__}: {exc}). "
                "Restore the store from an intact copy, or re-write the input."
            ) from exc
        if len(frame) != n:
            raise DatasetError(
                f"{inp.path}/{key}: has {len(frame)} rows for {n}; the store is inconsistent."
            )
        return frame
    return pd.DataFrame(index=pd.Index([str(i) for i in range(n)]))


def _arrays_in(node: Any) -> list[tuple[str, Any]]:
    """``(path, array)`` of every array under a zarr or h5py group, in the group."""
    if hasattr(node, "members"):  # zarr
        return [(name, c) for name, c in node.members(max_depth=None) if is_array(c)]
    found: list[tuple[str, Any]] = []

    def visit(name: str, child: Any) -> None:  # h5py; a value returned would stop the walk
        if is_array(child):
            found.append((name, child))

    node.visititems(visit)
    return found


def _combined_obs(inputs: Sequence[_Input]):
    """The inputs' obs, concatenated (columns common to all; categories merged)."""
    _, pd = _anndata_io()
    frames = [_frame(inp, "obs", inp.n_obs) for inp in inputs]
    if len(frames) == 1:
        return frames[0], ()
    common = [c for c in frames[0].columns if all(c in f.columns for f in frames[1:])]
    dropped = tuple(sorted({str(c) for f in frames for c in f.columns} - set(common)))
    columns = {}
    for c in common:
        # inputs without rows hold no values, and anndata gives their columns any dtype
        # (text: float64): they take no part in the column's type
        held = [(i, f[c]) for i, f in zip(inputs, frames, strict=True) if len(f)]
        sources, parts = zip(*held, strict=True) if held else ((inputs[0],), (frames[0][c],))
        kinds = [_column_kind(p, pd) for p in parts]
        if set(kinds) == {"categorical", "text"}:
            # anndata writes a text column as categorical where values repeat, as text where
            # they do not: merged as categories (concatenated as text, missing values of the
            # categorical parts became the string 'nan')
            parts = [p if k == "categorical" else p.astype("category")
                     for p, k in zip(parts, kinds, strict=True)]  # fmt: skip
        if all(isinstance(p.dtype, pd.CategoricalDtype) for p in parts):
            # one order kept where every input has the same ordered categories
            same = all(p.dtype == parts[0].dtype for p in parts) and parts[0].cat.ordered
            try:
                columns[c] = pd.api.types.union_categoricals(parts, ignore_order=not same)
            except TypeError as e:  # categories of different dtypes (ints here, text there)
                raise DatasetError(
                    f"obs column {c!r}: its categories have different types in "
                    f"{', '.join(i.path for i in inputs)} ({e}); make them the same type "
                    "(e.g. text everywhere) before converting."
                ) from None
            continue
        # kept as pandas arrays: nullable integers and booleans stay nullable
        merged = pd.concat(parts, ignore_index=True).array
        # pandas makes objects of mixed types (written as text: 1 became '1', a missing
        # value 'nan') and nullable floats of Int64 with floats (anndata writes none)
        nullable_float = isinstance(merged.dtype, pd.Float32Dtype | pd.Float64Dtype)
        if (
            nullable_float
            or (pd.api.types.is_object_dtype(merged.dtype) and set(kinds) != {"text"})
            or not _integers_kept(parts, merged)
        ):
            types = ", ".join(f"{i.path} ({p.dtype})" for i, p in zip(sources, parts, strict=True))
            raise DatasetError(
                f"obs column {c!r}: has types no one column keeps exact in the inputs "
                f"({types}); make it the same type in every input (or drop it from some "
                "input) before converting."
            )
        columns[c] = merged
    index = pd.Index(np.concatenate([np.asarray(f.index, dtype=object) for f in frames]))
    # the index's name (e.g. "cell_id"), where every input gives it the same one
    names = {f.index.name for f in frames}
    name = names.pop() if len(names) == 1 else None
    return pd.DataFrame(columns, index=index.astype(str).rename(name)), dropped


def _integers_kept(parts, merged) -> bool:
    """Whether every part of a column is exact in ``merged``: pandas concatenates int64
    with float64 (or uint64 with int64) as float64 (:func:`changed_by_join`)."""
    kind = getattr(merged.dtype, "numpy_dtype", merged.dtype).kind
    if kind != "f":  # nullable integers keep them exact; nullable floats are refused
        return True
    return not changed_by_join([np.asarray(p) for p in parts], np.asarray(merged))


#: the most bytes of one obsm entry convert holds to carry it (it is read whole, like obs)
OBSM_CARRY_BYTES = 2**30


def _listed(root: Any, key: str) -> list[str]:
    """The members of group ``key`` of an input's root (none where it is no group). zarr
    parses every member's metadata to list a group, so one it cannot parse failed the
    listing (and convert with a bare JSONDecodeError): a local store's folder is listed
    then (`member_names`), and ``["?"]`` stands for a listing that cannot be read at all."""
    try:  # for notes only: metadata it cannot parse is no reason to stop the convert
        node = root.get(key)
        return member_names(node) if node is not None and hasattr(node, "keys") else []
    except Exception:
        return ["?"]


def _combined_obsm(inputs: Sequence[_Input]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The inputs' dense obsm entries, concatenated in input row order (the loader serves
    them beside X, ``obs=["obsm/<key>"]``: a convert that dropped spatial coordinates left
    no way to train with them), and the notes on entries left out: sparse or dataframe
    entries, entries not in every input or with other row shapes or dtypes that cannot
    join, entries over `OBSM_CARRY_BYTES` (held whole: convert them with --element) and
    entries whose metadata or chunks cannot be read (X does not need them), each with why."""
    keys: dict[str, None] = {}
    for inp in inputs:
        keys.update(dict.fromkeys(_listed(inp.root, OBSM_PREFIX.rstrip("/"))))
    carried, notes = {}, {}
    for key in keys:
        element = f"{OBSM_PREFIX}{key}"
        if any(inp.element == element for inp in inputs):
            continue  # it is this convert's X
        parts, why = [], ""
        for inp in inputs:
            try:  # metadata zarr cannot parse: X does not need the entry, so a note only
                node = inp.root.get(element)
            except Exception as exc:
                why = f"its metadata cannot be read in {inp.path}: {type(exc).__name__}"
                break
            if node is None:
                why = f"not in {inp.path}"
                break
            if not is_array(node) or len(node.shape) < 2 or node.dtype.kind not in "biuf":
                why = f"not a dense numeric array in {inp.path}"
                break
            if node.shape[0] != inp.n_obs:
                raise DatasetError(
                    f"{inp.path}/{element}: has {node.shape[0]} rows for {inp.n_obs} "
                    "observations; the store is inconsistent."
                )
            if parts and node.shape[1:] != parts[0].shape[1:]:
                why = "rows of other shapes in the inputs"
                break
            if sum(p.nbytes for p in parts) + node.nbytes > OBSM_CARRY_BYTES:
                why = f"over {OBSM_CARRY_BYTES / 2**30:.0f} GiB, held whole to copy it"
                break
            name = f"{inp.path}/{element}"
            try:  # a bad chunk of an entry X does not need: a note, not zarr's bare error
                if isinstance(node, zarr.Array):
                    refuse_stale_metadata(node, name=name)
                    parts.append(read_whole(node, name=name))
                else:
                    parts.append(np.asarray(node[...]))
            except OSError as exc:  # ChunkReadError; h5py's "Can't read data"
                why = f"cannot be read in {inp.path}: {str(exc).removeprefix(name + ': ')}"
                break
        if not why:
            joined = np.concatenate(parts) if len(parts) > 1 else parts[0]
            if changed_by_join(parts, joined):
                why = "dtypes that cannot join without changing values"
        if why:
            notes[element] = why
        else:
            carried[key] = joined
    return carried, notes


def _column_kind(column, pd) -> str:
    """What an obs column holds, for concatenating it with the same column of another
    input: "categorical", "text" or "other" (numbers, booleans, ...)."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        return "categorical"
    return "text" if pd.api.types.is_string_dtype(column.dtype) else "other"


def _not_copied(inputs: Sequence[_Input], told: set[str]) -> str | None:
    """A note naming the inputs' AnnData elements the output leaves out (it holds one
    element as X, obs, var and the dense ``obsm`` entries it carried): the summary said
    nothing of a layer or an obsm entry gone. ``told``: elements another note names."""
    left: set[str] = set()
    for inp in inputs:
        root = inp.root
        if "X" in root and inp.element != "X":
            left.add("X")
        if "raw" in root and "X" in root["raw"] and inp.element != "raw/X":
            left.add("raw")
        for key in ("layers", "obsm", "obsp", "varm", "varp", "uns"):
            names = _listed(root, key)
            left |= {f"{key}/{n}" for n in names if f"{key}/{n}" != inp.element}
    left -= told
    if not left:
        return None
    return (
        f"not copied (the output holds X, obs, var and dense obsm entries): "
        f"{', '.join(sorted(left))}; "
        "--element (element=) converts a layer, raw/X or an obsm/obsp entry as the X of a "
        "store of its own"
    )


def _zarr_names(frame, what: str, path: str):
    """``frame`` with its column and index names' ``/`` made ``_``, and a note naming them:
    anndata writes such a column to an .h5ad (nested, with a FutureWarning) and reads it
    back, but refuses it in a Zarr store, which failed the convert at its end, after the
    whole X (a ValueError traceback). A new name another column already has is refused."""
    names = [str(c) for c in frame.columns]
    renamed = {c: c.replace("/", "_") for c in names if "/" in c}
    index = frame.index.name
    if not renamed and not (isinstance(index, str) and "/" in index):
        return frame, None
    for old, new in renamed.items():
        if new in names or list(renamed.values()).count(new) > 1:
            raise DatasetError(
                f"{path}: {what} column {old!r} holds '/', which anndata does not write to a "
                f"Zarr store, and {new!r}, its name with '_', is taken; rename it (e.g. "
                f"adata.{what}.rename(columns={{{old!r}: ...}})) and write the input again."
            )
    frame = frame.rename(columns=renamed)
    if isinstance(index, str) and "/" in index:
        renamed[index] = index.replace("/", "_")
        frame = frame.rename_axis(renamed[index])
    listed = ", ".join(f"{old!r} as {new!r}" for old, new in renamed.items())
    return frame, f"{what} names with '/', which a Zarr store does not allow, written as: {listed}"


def _same_values(a: Any, b: Any) -> bool:
    """Whether two columns hold the same values, as objects (missing where missing), their
    dtypes and indexes aside."""
    _, pd = _anndata_io()
    return pd.Series(a.to_numpy(dtype=object)).equals(pd.Series(b.to_numpy(dtype=object)))


def _check_var(inputs: Sequence[_Input]):
    """The first input's var (every input's var_names checked to be the same), and a note
    naming its columns that another input holds otherwise (they are the first's only)."""
    var = _frame(inputs[0], inputs[0].var_key, inputs[0].feature_shape[0])
    differ: set[str] = set()
    for inp in inputs[1:]:
        other = _frame(inp, inp.var_key, inp.feature_shape[0])
        # as object arrays: anndata 0.13's text index (pandas' string dtype) never .equals
        # 0.12's object index, whose names are the same
        if not var.index.astype(object).equals(other.index.astype(object)):
            unequal = np.flatnonzero(np.asarray(var.index) != np.asarray(other.index))
            j = int(unequal[0]) if len(unequal) else 0
            raise DatasetError(
                f"{inp.path}: var_names differ from {inputs[0].path} (feature {j}: "
                f"{other.index[j]!r} vs {var.index[j]!r}); align the features of all inputs "
                "before concatenating them."
            )
        # values compared, not dtypes (other unused categories, 0.13's text beside 0.12's),
        # nor the index: Series.equals compares it too, whose dtype differs that way
        differ |= {
            str(c) for c in var.columns if c not in other or not _same_values(var[c], other[c])
        }
    if not differ:
        return var, None
    return var, (
        f"var columns {', '.join(sorted(differ))}: other inputs hold other values (or none); "
        f"the output's are {inputs[0].path}'s"
    )


# ---------------------------------------------------------------------------- convert


def convert(
    sources: str | os.PathLike | Sequence[str | os.PathLike],
    dest: str | os.PathLike,
    *,
    chunk_rows: int | None = None,
    shard_bytes: int | None = DEFAULT_SHARD_BYTES,
    codec: Codec = "zstd",
    element: str | None = None,
    shuffle: bool = False,
    seed: int = 0,
    block_rows: int | None = None,
    piece_rows: int | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ConvertResult:
    """Convert ``sources`` (concatenated along rows) into a dali_zarr-friendly store at ``dest``.

    ``chunk_rows``: rows per chunk (default: :data:`DEFAULT_CHUNK_ROWS`, fewer where that
    many rows would be over :data:`DEFAULT_CHUNK_BYTES` decoded, or, CSR, over
    :data:`DEFAULT_CSR_CHUNK_ELEMENTS` elements on average; at least one). Dense ``X``
    and plain arrays are chunked ``chunk_rows``
    rows × every other axis whole. CSR ``data``/``indices`` are 1-D and a regular zarr grid
    cannot put chunk boundaries at row boundaries (rows have different lengths), so their
    chunk holds ``round(nnz / n_obs * chunk_rows)`` elements: ``chunk_rows`` rows on average.
    ``shard_bytes``: shards hold as many whole chunks as fit (``None``/0: not sharded).
    ``element``: what to read from each input as X (AnnData: ``layers/counts``, ``raw/X``,
    ``obsm/<name>``...; plain Zarr group: an array's path), as for ``open_dataset``; its
    features are named by ``var`` (``raw/var`` for ``raw/X``; numbered for obsm/obsp).
    ``shuffle``: write rows in the order of `output_permutation` (``seed``); the obs column
    ``original_index`` always gives each output row's row number in the concatenated input.
    ``block_rows``: input rows read at once (default: about 64 MiB of decoded X); with
    ``shuffle`` it is rounded down to whole pieces of ``piece_rows`` rows, and up to one
    piece where it is smaller (``piece_rows``: default ``chunk_rows``, or where that is not
    given the rows rule without the CSR cap; only with ``shuffle``). Each piece is one
    read of the input, so pieces much smaller than the input's own chunks decode those
    chunks several times: larger pieces convert faster, smaller pieces mix rows better.
    ``progress(done, total)`` is called before the first block and after each block (it may
    raise to abort: nothing is left at ``dest``).
    """
    t0 = time.perf_counter()
    paths = _paths_of(sources)
    dest = os.path.normpath(os.fspath(dest))
    if not paths:
        raise ConfigError("no input given; pass at least one .h5ad file or Zarr store.")
    if codec not in CODECS:
        raise ConfigError(f"codec {codec!r} is unknown; use one of {', '.join(CODECS)}.")
    for name, value in (
        ("chunk_rows", chunk_rows),
        ("block_rows", block_rows),
        ("piece_rows", piece_rows),
    ):
        if value is not None and (not isinstance(value, int | np.integer) or value < 1):
            raise ConfigError(f"{name}={value!r}: must be a positive number of rows.")
    if shard_bytes is not None and (
        not isinstance(shard_bytes, int | float | np.integer | np.floating)
        or not 0 <= shard_bytes < 2**63
    ):  # a size as the command line takes it ("1GB") raised a bare TypeError
        raise ConfigError(
            f"shard_bytes={shard_bytes!r}: must be a number of bytes >= 0 (e.g. 2**30; "
            "0 or None: no sharding)."
        )
    if not isinstance(seed, int | np.integer) or seed < 0:
        raise ConfigError(f"seed={seed!r}: must be a non-negative integer.")
    if piece_rows is not None and not shuffle:
        raise ConfigError(
            f"piece_rows={piece_rows}: pieces are what shuffle puts in random order; pass "
            "shuffle=True (--shuffle) with it, or leave it out."
        )

    own = os.path.realpath(dest + ".partial")
    for p in paths:
        if os.path.realpath(p) != own:
            continue
        if os.path.isfile(os.path.join(p, WRITER_MARKER)):  # `convert data/* data/all.zarr`
            raise ConfigError(
                f"{p}: is the unfinished output of an earlier convert to {dest} that was "
                "stopped, given as an input (a pattern such as data/* takes it in); leave it "
                "out of the inputs: this convert replaces it."
            )
        raise ConfigError(
            f"{p}: is an input, and the path this convert writes {dest} in while it runs; "
            "rename the input, or choose another destination."
        )
    inputs: list[_Input] = []
    try:
        for p in paths:
            inputs.append(_open_input(p, element))
        _check_compatible(inputs)
        check_replaceable(dest, overwrite)  # fail before reading any obs
        return _convert(
            inputs,
            dest,
            chunk_rows=None if chunk_rows is None else int(chunk_rows),
            shard_bytes=int(shard_bytes or 0),
            codec=codec,
            shuffle=shuffle,
            seed=int(seed),
            block_rows=block_rows,
            piece_rows=piece_rows,
            overwrite=overwrite,
            progress=progress,
            t0=t0,
        )
    finally:
        for inp in inputs:
            inp.close()


def _paths_of(sources: Any) -> list[str]:
    """``sources`` as a list of paths. A zarr node or store is refused by name: iterated as a
    list of paths, an array gave its rows (a bare TypeError naming an ndarray)."""
    one = isinstance(sources, str | os.PathLike) or not isinstance(sources, Sequence)
    paths = []
    for source in [sources] if one else sources:
        try:
            paths.append(os.fspath(source))
        except TypeError:
            raise ConfigError(
                f"convert reads files and folders: {type(source).__name__} {source!r} is not "
                "a path; pass the path of an .h5ad file or a Zarr store (for a zarr node, its "
                "store's folder, with element= the node's path in a group)."
            ) from None
    return paths


@dataclass(frozen=True)
class _Plan:
    """Sizes derived once from the inputs and the options."""

    n_obs: int
    offsets: np.ndarray  # (n_inputs + 1,) global row offsets of the inputs
    layout: Literal["csr", "dense"]
    feature_shape: tuple[int, ...]
    dtype: np.dtype
    index_dtype: np.dtype | None  # CSR
    nnz: int | None  # CSR
    row_bytes: int  # decoded bytes of one row (CSR: on average)
    chunk_rows: int
    block_rows: int
    shuffle: dict[str, int] | None


def _common_dtype(inputs: Sequence[_Input]) -> np.dtype:
    """The dtype every input's values fit in. NumPy promotes int64 with uint64 (or with any
    float) to float64, which rounds integers past 2**53: refused rather than written."""
    dtypes = [np.dtype(inp.dtype) for inp in inputs]
    dtype = np.result_type(*dtypes)
    if dtype.kind == "f":
        mantissa = np.finfo(dtype).nmant + 1
        wide = [(i, d) for i, d in zip(inputs, dtypes, strict=True)
                if d.kind in "iu" and 8 * d.itemsize - (d.kind == "i") > mantissa]  # fmt: skip
        if wide:
            names = ", ".join(f"{i.path} ({d})" for i, d in wide)
            raise DatasetError(
                f"the inputs' values have no common dtype that keeps them exact: {names} "
                f"would become {dtype}, which rounds integers above 2**{mantissa}. Convert "
                "the inputs to one dtype first."
            )
    return dtype


def _plan(
    inputs: Sequence[_Input],
    *,
    chunk_rows: int | None,
    block_rows: int | None,
    shuffle: bool,
    piece_rows: int | None,
    seed: int,
) -> _Plan:
    n_obs = sum(inp.n_obs for inp in inputs)
    if n_obs == 0:
        raise DatasetError(f"{', '.join(i.path for i in inputs)}: no rows; nothing to convert.")
    first = inputs[0]
    dtype = _common_dtype(inputs)
    nnz = index_dtype = None
    if first.layout == "csr":
        nnz = sum(inp.nnz for inp in inputs)
        index_dtype = np.result_type(*[inp.index_dtype for inp in inputs])
        if index_dtype.kind == "f":  # uint64 beside signed ids: checked to be < n_features
            index_dtype = np.dtype(np.int64)
        row_bytes = max(1, round(nnz / n_obs * (dtype.itemsize + index_dtype.itemsize)))
    else:
        row_bytes = max(1, math.prod(first.feature_shape) * dtype.itemsize)
    default_rows = max(1, min(DEFAULT_CHUNK_ROWS, DEFAULT_CHUNK_BYTES // row_bytes))
    # shuffled pieces keep the rows rule: each is a random read of the input, which 8x
    # smaller CSR pieces would make 8x as many
    piece_default = chunk_rows or default_rows
    if chunk_rows is None:
        chunk_rows = default_rows
        if nnz:  # CSR: rows of DEFAULT_CSR_CHUNK_ELEMENTS elements on average, at most
            chunk_rows = max(1, min(chunk_rows, DEFAULT_CSR_CHUNK_ELEMENTS * n_obs // nnz))
    chunk_rows = min(chunk_rows, n_obs)
    if block_rows is None:
        block_rows = max(1, DEFAULT_BLOCK_BYTES // row_bytes)
        if block_rows >= chunk_rows:
            block_rows -= block_rows % chunk_rows
    block_rows = min(int(block_rows), n_obs)
    shuffle_info = None
    if shuffle:
        piece = min(int(piece_rows or piece_default), n_obs)
        shuffle_info = {
            "seed": seed,
            "piece_rows": piece,
            "window_pieces": max(1, block_rows // piece),
        }
        block_rows = piece * shuffle_info["window_pieces"]
    return _Plan(
        n_obs=n_obs,
        offsets=np.cumsum([0] + [inp.n_obs for inp in inputs]).astype(np.int64),
        layout=first.layout,
        feature_shape=first.feature_shape,
        dtype=dtype,
        index_dtype=index_dtype,
        nnz=nnz,
        row_bytes=row_bytes,
        chunk_rows=chunk_rows,
        block_rows=block_rows,
        shuffle=shuffle_info,
    )


_LZ4_MAX_BYTES = 2_113_929_216  # numcodecs' LZ4.max_buffer_size (LZ4_MAX_INPUT_SIZE)


def _refuse_chunks_over_codec_limit(inputs: Sequence[_Input], plan: _Plan, codec: str) -> None:
    """Refuse chunks larger than lz4 encodes: the first write of one failed, after reading a
    chunk of rows, with numcodecs' bare ValueError ("Codec does not support buffers of >
    2113929216 bytes"), naming neither the chunk nor what to change."""
    if codec != "lz4":
        return
    if plan.layout == "csr":
        assert plan.nnz is not None and plan.index_dtype is not None
        itemsize = max(plan.dtype.itemsize, plan.index_dtype.itemsize)
        per_row = plan.nnz / plan.n_obs * itemsize
        elements = min(plan.nnz, max(1, round(plan.nnz / plan.n_obs * plan.chunk_rows)))
        chunk_bytes = elements * itemsize
    else:
        per_row = math.prod(plan.feature_shape) * plan.dtype.itemsize
        chunk_bytes = plan.chunk_rows * per_row
    if chunk_bytes <= _LZ4_MAX_BYTES:
        return
    rows = max(1, int(_LZ4_MAX_BYTES // max(per_row, 1)))
    raise ConfigError(
        f"{inputs[0].path}: a chunk of {plan.chunk_rows:,} rows is {chunk_bytes:,} bytes, "
        f"more than the lz4 codec encodes ({_LZ4_MAX_BYTES:,}); pass chunk_rows={rows:,} or "
        "fewer (--chunk-rows), or codec zstd."
    )


def _shuffle_note(inputs: Sequence[_Input], plan: _Plan) -> str | None:
    """Pieces much smaller than the input's chunks decode each chunk many times: say so."""
    if plan.shuffle is None:
        return None
    piece = plan.shuffle["piece_rows"]
    coarse = max((r for i in inputs if (r := i.rows_per_chunk())), default=0.0)
    if coarse < 4 * piece:
        return None
    return (
        f"shuffle pieces of {piece} rows are much smaller than the input's chunks "
        f"(~{coarse:,.0f} rows), so each input chunk was decoded about {coarse / piece:.0f} "
        "times; larger pieces (piece_rows / --piece-rows) convert faster but mix rows less"
    )


@dataclass
class _Outputs:
    """The output arrays of X, each behind an `_Appender`."""

    writers: dict[str, _Appender]
    x_group: zarr.Group | None  # CSR: the X group (indptr is written at the end)
    chunk_elements: int | None  # CSR
    shard_chunks: int | None


def _create_x(
    root: zarr.Group | None,
    partial: str,
    plan: _Plan,
    shard_bytes: int,
    codec: str,
    dims: tuple[str, ...] | None = None,
):
    if plan.layout == "csr":
        assert root is not None and plan.nnz is not None and plan.index_dtype is not None
        x = root.create_group("X")
        target = max(1, round(plan.nnz / plan.n_obs * plan.chunk_rows))
        writers, chunk_elements, shard_chunks = {}, target, None
        for name, dt in (("data", plan.dtype), ("indices", plan.index_dtype)):
            chunk, shard, unit = _layout(plan.nnz, target, dt.itemsize, shard_bytes)
            array = _create(
                x, name, shape=(plan.nnz,), dtype=dt, chunk=chunk, shard=shard, codec=codec
            )
            writers[name] = _Appender(array, unit)
            if name == "data":
                chunk_elements, shard_chunks = chunk, None if shard is None else shard // chunk
        return _Outputs(writers, x, chunk_elements, shard_chunks)
    if not math.prod(plan.feature_shape):  # zero-width rows: no bytes, and zarr refuses
        shard_bytes = 0  # to shard chunks of zero length
    chunk, shard, unit = _layout(plan.n_obs, plan.chunk_rows, plan.row_bytes, shard_bytes)
    array = _create(
        root if root is not None else partial,
        "X" if root is not None else None,
        shape=(plan.n_obs, *plan.feature_shape),
        dtype=plan.dtype,
        chunk=chunk,
        shard=shard,
        codec=codec,
        dims=dims,
    )
    return _Outputs(
        {"X": _Appender(array, unit)}, None, None, None if shard is None else shard // chunk
    )


def _stream(
    inputs: Sequence[_Input], plan: _Plan, out: _Outputs, progress: Progress | None
) -> tuple[int, np.ndarray | None]:
    """Copy X block by block. Returns (blocks, CSR row lengths)."""
    n_obs = plan.n_obs
    lengths = np.zeros(n_obs, np.int64) if plan.layout == "csr" else None
    n_blocks = done = 0
    if progress is not None:
        progress(0, n_obs)
    for ranges, perm in _windows(n_obs, block_rows=plan.block_rows, shuffle=plan.shuffle):
        if lengths is not None:
            data, indices, lens = _read_csr(
                inputs, plan.offsets, ranges, plan.dtype, plan.index_dtype
            )
            if perm is not None:
                data, indices, lens = _permute_csr(data, indices, lens, perm)
            out.writers["data"].append(data)
            out.writers["indices"].append(indices)
            lengths[done : done + len(lens)] = lens
            n = len(lens)
        else:
            values = _read_dense(inputs, plan.offsets, ranges, plan.dtype)
            out.writers["X"].append(values if perm is None else values[perm])
            n = len(values)
        done += n
        n_blocks += 1
        if progress is not None:
            progress(done, n_obs)
    for writer in out.writers.values():
        writer.finish()
    return n_blocks, lengths


def _convert(
    inputs: list[_Input],
    dest: str,
    *,
    chunk_rows: int | None,
    shard_bytes: int,
    codec: str,
    shuffle: bool,
    seed: int,
    block_rows: int | None,
    piece_rows: int | None,
    overwrite: bool,
    progress: Progress | None,
    t0: float,
) -> ConvertResult:
    first = inputs[0]
    plan = _plan(
        inputs,
        chunk_rows=chunk_rows,
        block_rows=block_rows,
        shuffle=shuffle,
        piece_rows=piece_rows,
        seed=seed,
    )
    _refuse_chunks_over_codec_limit(inputs, plan, codec)
    obs = var = var_note = left_out = None
    dropped: tuple[str, ...] = ()
    obsm: dict[str, np.ndarray] = {}
    obsm_notes: dict[str, str] = {}
    if first.anndata:  # read (and check) before touching the file system
        obs, dropped = _combined_obs(inputs)
        var, var_note = _check_var(inputs)
        obsm, obsm_notes = _combined_obsm(inputs)
        left_out = _not_copied(inputs, {f"obsm/{k}" for k in obsm} | set(obsm_notes))
    notes = [n for n in (_shuffle_note(inputs, plan), var_note, left_out) if n]
    if obsm_notes:
        notes.append(
            "obsm entries not carried: " + ", ".join(f"{k} ({w})" for k, w in obsm_notes.items())
        )
    if obs is not None:
        obs, obs_note = _zarr_names(obs, "obs", ", ".join(i.path for i in inputs))
        var, var_names_note = _zarr_names(var, "var", first.path)
        notes += [n for n in (obs_note, var_names_note) if n]
        # convert writes these columns: an input's own are replaced
        ours = (ORIGINAL_INDEX, ORIGINAL_SOURCE) if len(inputs) > 1 else (ORIGINAL_INDEX,)
        notes += [
            f"the input's obs column {c!r} was replaced by this convert's (its values are not "
            f"in the output; rename it, e.g. adata.obs.rename(columns={{{c!r}: 'earlier_{c}'}}), "
            "before converting to keep them)"
            for c in ours
            if c in obs.columns
        ]
        if obs.index.name in ours:  # anndata refuses to write an index named like a column
            notes.append(
                f"the input's obs index name {obs.index.name!r} was dropped (its values are "
                "kept as obs_names): the output's column of that name is this convert's"
            )
            obs = obs.rename_axis(None)
    obs_columns: tuple[str, ...] = ()
    sources = [i.path for i in inputs]
    with written_whole(dest, sources=sources, overwrite=overwrite) as partial:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Numcodecs codecs are not in the Zarr")
            warnings.filterwarnings("ignore", message=".*zarr v3 autosharding")
            # The root gets its AnnData attributes last: a partial store is not a dataset.
            root = zarr.open_group(partial, mode="a", zarr_format=3) if first.anndata else None
            # the inputs' dimension names where they agree (a plain array's; AnnData: None)
            dims = first.dims if all(i.dims == first.dims for i in inputs) else None
            out = _create_x(root, partial, plan, shard_bytes, codec, dims)
            if shard_bytes and out.shard_chunks is None:
                notes.append("not sharded: a shard of the requested size holds < 2 chunks")
            n_blocks, lengths = _stream(inputs, plan, out, progress)
            info: dict[str, Any] = {
                "version": 1,
                "sources": [os.path.abspath(i.path) for i in inputs],
                "chunk_rows": plan.chunk_rows,
                "chunk_elements": out.chunk_elements,
                "codec": codec,
                "element": first.element,
                "shuffle": plan.shuffle
                and {  # the order written, to check it is recomputed
                    **plan.shuffle,
                    "digest": order_digest(_output_rows(plan.n_obs, plan.shuffle)),
                    "numpy": np.__version__,
                },
                "shuffle_method": SHUFFLE_METHOD if plan.shuffle else None,
            }
            if lengths is not None:
                _write_indptr(out.x_group, lengths, plan, codec)
            if root is not None:
                if plan.layout == "dense":
                    root["X"].attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
                # the input row of every output row, to carry obs along
                original = (
                    output_permutation(plan.n_obs, **plan.shuffle)
                    if plan.shuffle
                    else np.arange(plan.n_obs, dtype=np.int64)
                )
                obs_columns = _write_obs_var(root, inputs, obs, var, original, obsm)
                root.attrs.update(
                    {"encoding-type": "anndata", "encoding-version": "0.1.0", "dali_zarr": info}
                )
            else:
                out.writers["X"].array.attrs.update({**first.packing, "dali_zarr": info})
        nbytes = dir_bytes(partial)
    return ConvertResult(
        path=dest,
        anndata=first.anndata,
        layout=plan.layout,
        n_obs=plan.n_obs,
        feature_shape=plan.feature_shape,
        dtype=str(plan.dtype),
        nnz=plan.nnz,
        chunk_rows=plan.chunk_rows,
        chunk_elements=out.chunk_elements,
        shard_chunks=out.shard_chunks,
        codec=codec,
        shuffle=info["shuffle"],
        block_rows=plan.block_rows,
        n_blocks=n_blocks,
        obs_columns=obs_columns,
        dropped_obs_columns=dropped,
        obsm=tuple(
            describe_beside_x(f"{OBSM_PREFIX}{k}", v.shape, v.dtype) for k, v in obsm.items()
        ),
        nbytes=nbytes,
        seconds=time.perf_counter() - t0,
        notes=tuple(notes),
    )


def _write_indptr(x: zarr.Group, lengths: np.ndarray, plan: _Plan, codec: str) -> None:
    indptr = np.zeros(plan.n_obs + 1, np.int64)
    np.cumsum(lengths, out=indptr[1:])
    array = _create(
        x,
        "indptr",
        shape=indptr.shape,
        dtype=indptr.dtype,
        chunk=min(len(indptr), _INDPTR_CHUNK),
        shard=None,
        codec=codec,
    )
    array[...] = indptr
    x.attrs.update(
        {
            "encoding-type": "csr_matrix",
            "encoding-version": "0.1.0",
            "shape": [plan.n_obs, plan.feature_shape[0]],
        }
    )


def _plain_strings(frame, pd):
    """``frame`` with pandas' string arrays (anndata 0.13 reads and writes text as them, with
    pandas 3) as the object strings every anndata writes and reads; a text column with
    missing values becomes categorical (its missing values stay missing)."""
    frame = frame.copy()
    if isinstance(frame.index.dtype, pd.StringDtype):
        frame.index = frame.index.astype(object)
    for name in frame.columns:
        if isinstance(frame[name].dtype, pd.StringDtype):
            text = frame[name]
            frame[name] = text.astype("category") if text.isna().any() else text.astype(object)
    return frame


def _write_obs_var(
    root, inputs, obs, var, original: np.ndarray, obsm: dict[str, np.ndarray]
) -> tuple[str, ...]:
    """obs (in output row order, plus original_index/original_source), var, the carried
    obsm entries (in output row order), empty groups for the rest."""
    aio, pd = _anndata_io()
    permuted = not np.array_equal(original, np.arange(len(obs)))
    obs = obs.iloc[original] if permuted else obs
    obs = obs.copy()
    obs[ORIGINAL_INDEX] = original
    if len(inputs) > 1:
        names = [i.path for i in inputs]
        if len(set(names)) < len(names):  # the same input twice: categories must be unique
            names = [f"{k}:{p}" for k, p in enumerate(names)]
        which = np.searchsorted(np.cumsum([i.n_obs for i in inputs]), original, side="right")
        obs[ORIGINAL_SOURCE] = pd.Categorical.from_codes(which, categories=names)
    aio.write_elem(root, "obs", _plain_strings(obs, pd))
    aio.write_elem(root, "var", _plain_strings(var, pd))
    aio.write_elem(root, "obsm", {k: v[original] if permuted else v for k, v in obsm.items()})
    for key in ("varm", "obsp", "varp", "layers", "uns"):
        aio.write_elem(root, key, {})
    return tuple(str(c) for c in obs.columns)
