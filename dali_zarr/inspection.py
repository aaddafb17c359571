"""Describe a store the way the loader will see it: layout, chunking, codecs, read paths.

`inspect_store(path)` returns a `StoreReport` (``to_dict()`` for JSON, `format_report` for
people). For every array the loader reads it names the path it takes:

* ``gpu-decode``: read directly, with chunks nvCOMP decodes on the device (zstd, numcodecs
  lz4, or uncompressed), by the rule of `dali_zarr.io.gpu.gpu_codec_kind`; ``device="cpu"``
  reads the same arrays by the direct CPU path.
* ``cpu-decode``: read directly (``os.preadv``) but decoded on the CPU (blosc, gzip, filters,
  byte swaps, zstd with content checksums…).
* ``zarr-fallback``: read through zarr-python (a remote store, an unsupported codec…); the
  report says why.

It also suggests ``chunk_size`` / ``preload_nchunks`` from the store's own chunking.
"""

from __future__ import annotations

import math
import os
import shlex
import textwrap
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np
import zarr

from dali_zarr.data.dataset import Collection, CsrDataset, Dataset, DenseDataset, open_dataset
from dali_zarr.data.elements import (
    available_elements,
    member_names,
    pick_element,
    zarr_member,
)
from dali_zarr.data.features import FeatureSubset
from dali_zarr.data.obs import describe_beside_x, is_obsm
from dali_zarr.data.subset import Subset
from dali_zarr.errors import ConfigError, DatasetError
from dali_zarr.io import DirectReader, open_reader, parse_layout
from dali_zarr.io.gpu import GPU_KINDS, gpu_codec_kind
from dali_zarr.planning.partition import n_chunks_of, validate_count, window_rows_of

__all__ = [
    "ArrayInfo",
    "ObsInfo",
    "StoreReport",
    "Suggestion",
    "dataset_suggestion",
    "format_report",
    "inspect_store",
    "suggest",
    "suggested_settings",
]

MIN_CHUNK_ROWS = 32
#: CSR loader chunks span at least this many store chunks: see :func:`read_amplification`
CSR_MIN_STORE_CHUNKS = 4
TARGET_PRELOAD = 32
MIN_WINDOW_BATCHES = 4
WINDOW_BYTES_CAP = 2**30

RULE = (
    f"chunk_size = the smallest multiple of the store's rows per chunk that is >= "
    f"{MIN_CHUNK_ROWS} rows (dense: every loader chunk then reads whole store chunks, none "
    f"twice) and, for CSR, >= {CSR_MIN_STORE_CHUNKS} store chunks (rows straddle the chunks "
    "of X/data and X/indices, so a loader chunk also decodes the store chunks at its two ends "
    "in full: reads ~ 1 + store rows per chunk / chunk_size of what it uses), at most "
    "n_obs / world_size rows (every rank needs a chunk of its own); "
    f"preload_nchunks = max({TARGET_PRELOAD}, ceil({MIN_WINDOW_BATCHES} x batch_size / "
    f"chunk_size)), so a window mixes >= {TARGET_PRELOAD} chunks and holds >= "
    f"{MIN_WINDOW_BATCHES} batches, capped at {WINDOW_BYTES_CAP // 2**20} MiB of decoded rows "
    "per window and at the number of chunks in the store (a window that holds the store holds "
    "all of its rows: a second window of the rows left over would read a chunk again)"
)


@dataclass(frozen=True)
class ArrayInfo:
    """One zarr array: its storage and the read path the loader takes for it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    zarr_format: int
    chunks: tuple[int, ...]  # the decodable chunk (the inner chunk when sharded)
    shards: tuple[int, ...] | None
    codecs: tuple[str, ...]
    path: str  # "gpu-decode" | "cpu-decode" | "zarr-fallback" | "read whole at open"
    why: str
    rows_per_chunk: float | None  # observations per chunk (CSR: on average)


@dataclass(frozen=True)
class ObsInfo:
    name: str
    encoding: str
    batchable: bool  # can ride in a batch (Loader(obs=[...]))
    n_categories: int | None = None


@dataclass(frozen=True)
class Suggestion:
    chunk_size: int
    preload_nchunks: int
    batch_size: int
    rows_per_store_chunk: float
    window_rows: int
    window_mib: float
    read_amplification: float  # store chunk bytes decoded per byte of rows used (about)
    rule: str = RULE
    warning: str = ""


@dataclass(frozen=True)
class StoreReport:
    path: str
    kind: str  # "anndata" | "array"
    element: str | None  # what is loaded: "X", "layers/counts", ... (None: the array itself)
    layout: str  # "csr" | "dense"
    n_obs: int
    feature_shape: tuple[int, ...]
    dtype: str
    nnz: int | None
    arrays: tuple[ArrayInfo, ...]
    obs: tuple[ObsInfo, ...]
    elements: tuple[str, ...]  # every loadable element of an AnnData store (element=...)
    #: obsm entries that ride beside X (obs=["obsm/<key>"]): "obsm/<key> <row shape> <dtype>"
    beside: tuple[str, ...]
    suggestion: Suggestion
    converted: dict[str, Any] | None  # the ``dali_zarr`` attribute `convert` wrote, if any
    #: a store the GPU path decodes on the CPU or, CSR, in slow large chunks: why ("": none),
    #: and the command that rewrites it
    gpu_note: str = ""
    gpu_rewrite: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------- codecs


def _short(name: str, cfg: dict[str, Any]) -> str:
    if name == "bytes":
        return "bytes" if cfg.get("endian", "little") == "little" else f"bytes({cfg['endian']})"
    keep = {k: v for k, v in cfg.items() if k in ("level", "cname", "clevel", "shuffle")}
    if not keep:
        return name
    return f"{name}({', '.join(f'{k}={v}' for k, v in keep.items())})"


def _codec_names(array: zarr.Array) -> tuple[str, ...]:
    md = array.metadata.to_dict()
    if int(md.get("zarr_format", 3)) == 2:
        filters = [f["id"] if isinstance(f, dict) else str(f) for f in (md.get("filters") or [])]
        comp = md.get("compressor")
        names = [_short(f, {}) for f in filters]
        if comp:
            c = dict(comp) if isinstance(comp, dict) else comp.get_config()
            names.append(_short(c.pop("id"), c))
        return tuple(names) or ("none",)
    codecs = list(md.get("codecs", ()))
    if codecs and _name(codecs[0]) == "sharding_indexed":
        codecs = list(_config(codecs[0]).get("codecs", ()))
    return tuple(_short(_name(c), _config(c)) for c in codecs)


def _name(c: Any) -> str:
    return str(c["name"] if isinstance(c, dict) else c.to_dict()["name"])


def _config(c: Any) -> dict[str, Any]:
    d = c if isinstance(c, dict) else c.to_dict()
    return dict(d.get("configuration") or {})


_GPU_WHY = {
    "none": "not compressed: the bytes go to the device as they are",
    "zstd": "nvCOMP decodes zstd",
    "lz4": "nvCOMP decodes lz4 (numcodecs framing: the 4-byte size header is skipped)",
}


#: how a ``cpu-decode`` array's reason ends (``_gpu_note`` names the reason alone)
_ON_CPU = ": read directly, decoded on the CPU"


def _read_path(array: zarr.Array, name: str) -> tuple[str, str]:
    """("gpu-decode" | "cpu-decode" | "zarr-fallback", why), as the readers decide it."""
    reader = open_reader(array, name=name)
    if not isinstance(reader, DirectReader):
        return "zarr-fallback", reader.reason
    kind, why = gpu_codec_kind(reader.layout)  # the GPU backend's own rule, not a copy of it
    if kind in GPU_KINDS:
        return "gpu-decode", _GPU_WHY.get(kind, kind)
    return "cpu-decode", f"{why}{_ON_CPU}"


def _array_info(
    array: zarr.Array, name: str, *, rows_per_element: float | None, whole: bool = False
) -> ArrayInfo:
    layout = parse_layout(array)
    shards = layout.grid_chunk_shape if layout.shard is not None else None
    if layout.shard is None and int(array.metadata.zarr_format) == 3:
        shards = tuple(int(s) for s in array.shards) if array.shards else None
    chunk0 = int(layout.chunk_shape[0])
    if whole:
        path, why = "read whole at open", "row offsets are held in memory"
    else:
        path, why = _read_path(array, name)
    rows = chunk0 if rows_per_element is None else chunk0 * rows_per_element
    return ArrayInfo(
        name=name,
        shape=tuple(int(s) for s in array.shape),
        dtype=str(array.dtype),
        zarr_format=int(array.metadata.zarr_format),
        chunks=tuple(int(c) for c in layout.chunk_shape),
        shards=shards,
        codecs=_codec_names(array),
        path=path,
        why=why,
        rows_per_chunk=None if whole else float(rows),
    )


# ---------------------------------------------------------------------------- obs


def _obs_info(obs: zarr.Group) -> tuple[ObsInfo, ...]:
    index = obs.attrs.get("_index", "_index")
    order = list(obs.attrs.get("column-order", []))
    # zarr lists a group by parsing its members; one it cannot parse is listed from the
    # folder by member_names, and reported below
    names = order + [k for k in member_names(obs) if k not in order and k != index]
    out = []
    for name in names:
        try:
            node = zarr_member(obs, name, where="obs")
        except DatasetError:  # metadata zarr cannot parse: the loader refuses the column
            out.append(ObsInfo(name, "unreadable metadata", False))
            continue
        if node is None:
            continue
        encoding = str(node.attrs.get("encoding-type", "array"))
        n_cat = None
        if encoding == "categorical":
            # the members checked as the loader checks them (a column missing one, or with
            # non-integer codes, is refused there), without reading them
            codes, categories = _column_array(node, "codes"), _column_array(node, "categories")
            n_cat = None if categories is None else int(categories.shape[0])
            batchable = codes is not None and categories is not None and codes.dtype.kind in "iu"
        elif encoding in ("nullable-integer", "nullable-boolean"):
            # the loader refuses missing values (batches cannot carry them)
            mask = _column_array(node, "mask")
            try:
                missing = mask is None or bool(np.asarray(mask[...]).any())
            except MemoryError:
                raise
            except Exception:  # a bad chunk: the loader refuses the column, naming it
                out.append(ObsInfo(name, "unreadable chunks", False))
                continue
            batchable = not missing and _column_array(node, "values") is not None
        else:
            batchable = (  # the loader takes 1-D numeric arrays (one value per row)
                isinstance(node, zarr.Array)
                and encoding == "array"
                and node.ndim == 1
                and np.dtype(node.dtype).kind in "biuf"
            )
        out.append(ObsInfo(name, encoding, batchable, n_cat))
    return tuple(out)


def _column_array(node: zarr.Group | zarr.Array, key: str) -> zarr.Array | None:
    """Array ``key`` of an obs column group, or None where it is missing, not an array or
    its metadata cannot be read: inspect then reports the column not batchable instead of
    failing with zarr's KeyError."""
    if not isinstance(node, zarr.Group):
        return None
    try:
        member = zarr_member(node, key, where="obs")
    except DatasetError:
        return None
    return member if isinstance(member, zarr.Array) else None


# ---------------------------------------------------------------------------- suggestion


def read_amplification(chunk_size: int, rows_per_chunk: float, *, aligned: bool) -> float:
    """About how many bytes of store chunks a loader chunk of ``chunk_size`` rows decodes per
    byte of its rows. ``aligned``: loader chunks start on store chunk boundaries (dense arrays
    with ``chunk_size`` a multiple of the store's rows per chunk): 1. Otherwise (CSR: a row's
    values start anywhere in a chunk of ``X/data``) the rows meet one store chunk more than
    they fill, on average, and those are decoded whole (measured on 2026-11-22, 100k cells,
    98 rows per store chunk: chunk_size 98 decoded 1.9x, 392 1.2x, 784 1.1x; the CPU path
    ran at 34k, 47k and 56k rows/s)."""
    return 1.0 if aligned else 1.0 + rows_per_chunk / max(1, chunk_size)


def suggest(
    *,
    n_obs: int,
    rows_per_chunk: float,
    row_bytes: float,
    batch_size: int = 256,
    aligned: bool = True,
    world_size: int = 1,
) -> Suggestion:
    """``chunk_size`` / ``preload_nchunks`` for a store (the rule is in ``RULE``).

    ``aligned=False`` for CSR stores, whose rows do not start on store chunk boundaries.
    ``world_size``: ranks sharing the store; the planner refuses fewer chunks than ranks, so
    a store of few, large store chunks gets smaller loader chunks under DDP.
    """
    r = max(1, round(rows_per_chunk))
    min_rows = MIN_CHUNK_ROWS if aligned else max(MIN_CHUNK_ROWS, CSR_MIN_STORE_CHUNKS * r)
    chunk_size = min(r * max(1, math.ceil(min_rows / r)), max(1, n_obs // max(1, world_size)))
    preload = max(TARGET_PRELOAD, math.ceil(MIN_WINDOW_BATCHES * batch_size / chunk_size))
    # no more chunks than the store has, but always a window of a batch: a store (or split)
    # of fewer rows than one batch still gets one batch, as it does from the planner
    n_chunks = max(n_chunks_of(n_obs, chunk_size), math.ceil(batch_size / chunk_size))
    by_memory = max(1, int(WINDOW_BYTES_CAP // max(1.0, chunk_size * row_bytes)))
    if n_obs * row_bytes <= WINDOW_BYTES_CAP:  # a window reads at most the store's rows, so
        by_memory = n_chunks  # the cap cannot bind (it refused batches larger than the store)
    preload = max(1, min(preload, by_memory, n_chunks))
    if preload * chunk_size >= n_obs > window_rows_of(chunk_size, preload, batch_size):
        # the window is meant to hold the store, but whole batches of it stop short: the
        # rows left over would be a second window reading (and decoding) a chunk again
        # (a store of one chunk: twice per epoch); one more chunk's room holds them all
        preload = math.ceil(math.ceil(n_obs / batch_size) * batch_size / chunk_size)
    window = window_rows_of(chunk_size, preload, batch_size)  # what the loader will use
    warning = ""
    if n_obs == 0:  # the loader refuses it; a suggestion would read as if it could load
        warning = "the store has no observations: there is nothing to load"
    elif window == 0:  # rows too large for a window of a batch within WINDOW_BYTES_CAP
        warning = (
            f"a window of {preload * chunk_size} rows holds no batch of {batch_size}: rows of "
            f"{row_bytes:,.0f} bytes cap the window at {WINDOW_BYTES_CAP / 2**20:,.0f} MiB; "
            "lower batch_size or raise preload_nchunks"
        )
    elif min(window, n_obs) * row_bytes > WINDOW_BYTES_CAP < n_obs * row_bytes:
        # the cap cannot bind below one loader chunk: a store chunked whole along axis 0
        # (a time series chunked by space) got a window of the whole store without a word
        warning = _oversized_window(chunk_size, r, row_bytes, min(window, n_obs) * row_bytes)
    return Suggestion(
        chunk_size=chunk_size,
        preload_nchunks=preload,
        batch_size=batch_size,
        rows_per_store_chunk=float(rows_per_chunk),
        window_rows=window,
        # a window reads no more rows than the store has (one of a batch larger than the
        # store is the whole store): its decoded size is that of the rows it can hold
        window_mib=round(min(window, n_obs) * row_bytes / 2**20, 2),
        # one loader chunk of the whole store decodes each store chunk once, whole
        read_amplification=round(
            read_amplification(chunk_size, r, aligned=aligned or chunk_size >= n_obs), 3
        ),
        warning=warning,
    )


def _oversized_window(chunk_size: int, r: int, row_bytes: float, window_bytes: float) -> str:
    """Why a window is over ``WINDOW_BYTES_CAP``, and what to change."""
    cap = WINDOW_BYTES_CAP / 2**20
    if r * row_bytes > WINDOW_BYTES_CAP:  # one store chunk is larger: only a rewrite helps
        fits = max(1, int(WINDOW_BYTES_CAP // (TARGET_PRELOAD * row_bytes)))
        cause = (
            f"a store chunk holds {r:,} rows, {r * row_bytes / 2**20:,.0f} MiB decoded, and "
            "every read decodes whole store chunks; rewrite the array with fewer rows per "
            f"chunk on axis 0 (dali-zarr convert SRC DST --chunk-rows N, N <= {fits:,} for "
            f"{TARGET_PRELOAD} chunks per window)"
        )
    else:
        cause = f"lower chunk_size (a multiple of the store's {r:,} rows per chunk)"
    return (
        f"a window of chunk_size={chunk_size:,} rows is {window_bytes / 2**20:,.0f} MiB "
        f"decoded, more than the {cap:,.0f} MiB cap, and the loader holds a few windows at "
        f"once: {cause}"
    )


class _Chunking(NamedTuple):
    """What the suggestion needs to know of a dataset's storage."""

    rows_per_chunk: float  # observations per store chunk (CSR: on average; the coarsest array)
    row_bytes: float  # decoded bytes of one observation (CSR: values and indices)
    aligned: bool  # loader chunks of a multiple of rows_per_chunk start on store chunks


def _chunking(ds: Dataset) -> _Chunking:
    if isinstance(ds, DenseDataset):
        return _Chunking(
            float(ds.values_reader.rows_per_chunk),
            float(ds.n_features * np.dtype(ds.dtype).itemsize),
            True,
        )
    if isinstance(ds, CsrDataset):
        elements = max(ds.data_reader.rows_per_chunk, ds.indices_reader.rows_per_chunk)
        nnz_per_row = float(ds.indptr[-1]) / max(1, ds.n_obs)
        return _Chunking(
            elements * _rows_per_element(ds),
            nnz_per_row * (np.dtype(ds.dtype).itemsize + np.dtype(ds.index_dtype).itemsize),
            False,
        )
    if isinstance(ds, Collection):
        parts = [_chunking(p) for p in ds.parts]
        rows = max(c.rows_per_chunk for c in parts)
        sizes = np.array([p.n_obs for p in ds.parts], dtype=np.float64)
        row_bytes = float(np.dot(sizes, [c.row_bytes for c in parts]) / max(1.0, sizes.sum()))
        # loader chunks (multiples of the coarsest grid) stay on every store's chunk grid only
        # if each grid divides the coarsest and every store starts on the coarsest grid
        unit = max(1, round(rows))
        aligned = all(
            c.aligned and unit % max(1, round(c.rows_per_chunk)) == 0 for c in parts
        ) and all(int(o) % unit == 0 for o in ds.offsets[1:-1])
        return _Chunking(rows, row_bytes, aligned)
    if isinstance(ds, FeatureSubset):
        return _chunking(ds.parent)  # the parent's rows are read (and decoded) in full
    if isinstance(ds, Subset):
        # a loader chunk of the subset's rows spans n_parent / n_subset as many stored rows
        # (about, for a split spread over the store), and rarely starts on a store chunk
        parent = _chunking(ds.parent)
        if ds.n_obs == ds.parent.n_obs:
            return parent
        share = ds.n_obs / max(1, ds.parent.n_obs)
        return _Chunking(parent.rows_per_chunk * share, parent.row_bytes, False)
    raise ConfigError(
        f"{ds.name}: no chunk_size suggestion for a {type(ds).__name__}; pass chunk_size and "
        "preload_nchunks."
    )


def _rows_per_element(ds: CsrDataset) -> float:
    """Rows per stored non-zero (how X/data's chunking maps to rows); an empty X counts as
    all rows in any chunk."""
    nnz = int(ds.indptr[-1])
    return ds.n_obs / nnz if nnz > 0 else float(ds.n_obs)


def dataset_suggestion(ds: Dataset, *, batch_size: int = 256, world_size: int = 1) -> Suggestion:
    """The :func:`suggest` rule applied to an opened dataset (a store, a collection of
    stores or a subset of either), from its arrays' chunking."""
    c = _chunking(ds)
    return suggest(
        n_obs=ds.n_obs,
        rows_per_chunk=c.rows_per_chunk,
        row_bytes=c.row_bytes,
        batch_size=batch_size,
        aligned=c.aligned,
        world_size=world_size,
    )


def suggested_settings(
    source: str | os.PathLike | Dataset,
    *,
    batch_size: int,
    chunk_size: int | None = None,
    preload_nchunks: int | None = None,
    world_size: int = 1,
) -> tuple[int, int]:
    """``(chunk_size, preload_nchunks)``: the given values, and where one is None, the
    suggestion for ``source`` (a store path, or a dataset already opened) read by
    ``world_size`` ranks. A given ``chunk_size`` keeps the suggested window size in rows.
    Deterministic in the stores' metadata, so every rank gets the same."""
    validate_count("batch_size", batch_size)
    validate_count("world_size", world_size)
    for name, value in (("chunk_size", chunk_size), ("preload_nchunks", preload_nchunks)):
        if value is not None:  # else a division by zero further down
            validate_count(name, value)
    if chunk_size is not None and preload_nchunks is not None:
        return chunk_size, preload_nchunks
    ds = source if isinstance(source, Dataset) else open_dataset(source)
    s = dataset_suggestion(ds, batch_size=batch_size, world_size=world_size)
    if chunk_size is None:
        chunk_size = s.chunk_size
    if preload_nchunks is None:
        preload_nchunks = max(1, math.ceil(s.preload_nchunks * s.chunk_size / chunk_size))
    return chunk_size, preload_nchunks


# ---------------------------------------------------------------------------- inspect


def inspect_store(
    path: str | os.PathLike, *, element: str | None = None, batch_size: int = 256
) -> StoreReport:
    """Open ``path`` as the loader would and describe it (raises DatasetError like the loader).

    ``element``: as for :func:`~dali_zarr.open_dataset` (an AnnData layer, ``obsm`` entry, ...).
    """
    path = os.fspath(path)
    if os.path.isfile(path) and not zipfile.is_zipfile(path):  # a zip: open_dataset says
        # quoted, so that the command runs as printed for a path with spaces too
        command = shlex.join(["dali-zarr", "convert", path, os.path.splitext(path)[0] + ".zarr"])
        raise DatasetError(
            f"{path}: is a file, not a Zarr store; if it is an .h5ad file, convert it first: "
            f"{command}"
        )
    ds = open_dataset(path, element=element)
    node = zarr.open(path, mode="r")
    picked = pick_element(node, element, store=path)  # what ds read, as zarr nodes
    x, key = picked.node, picked.key
    arrays: list[ArrayInfo] = []
    obs: tuple[ObsInfo, ...] = ()
    elements: tuple[str, ...] = ()
    beside: tuple[str, ...] = ()
    nnz = None
    # convert records its settings on the root group, or on the array it wrote
    converted = node.attrs.get("dali_zarr") or x.attrs.get("dali_zarr")
    if not picked.anndata:
        kind = "array"
        arrays.append(_array_info(x, key or ds.name, rows_per_element=None))
    else:
        kind = "anndata"
        elements = tuple(available_elements(node))
        beside = tuple(_beside_x(node, elements))
        if isinstance(ds, CsrDataset):
            nnz = int(ds.indptr[-1])
            per_element = _rows_per_element(ds)
            for part in ("data", "indices"):
                arrays.append(_array_info(x[part], f"{key}/{part}", rows_per_element=per_element))
            indptr = _array_info(x["indptr"], f"{key}/indptr", rows_per_element=None, whole=True)
            arrays.append(indptr)
        else:
            arrays.append(_array_info(x, key, rows_per_element=None))
        if "obs" in node and isinstance(node["obs"], zarr.Group):
            obs = _obs_info(node["obs"])
    return StoreReport(
        path=path,
        kind=kind,
        element=key,
        layout=ds.layout,
        n_obs=ds.n_obs,
        feature_shape=ds.feature_shape,
        dtype=str(ds.dtype),
        nnz=nnz,
        arrays=tuple(arrays),
        obs=obs,
        elements=elements,
        beside=beside,
        suggestion=dataset_suggestion(ds, batch_size=batch_size),
        converted=dict(converted) if isinstance(converted, dict) else None,
        **_gpu_note(path, arrays, layout=ds.layout, element=element),
    )


def _gpu_note(
    path: str, arrays: Sequence[ArrayInfo], *, layout: str, element: str | None
) -> dict[str, str]:
    """Advice for a store the GPU path reads slower than it could, with the ``convert``
    command that rewrites it (``element`` as the user gave it). Arrays it decodes on the CPU
    (blosc, which anndata writes by default, gzip, filters, ...) come first: their chunks
    are decoded on the host and copied, the work the device decode takes off the CPU. Then
    CSR ``data`` decoded on the device (zstd, lz4) in chunks of over twice ``convert``'s
    default: nvCOMP works on a window's chunks side by side, so fewer, larger chunks decode
    slower (measured on an H200, 2026-11-27)."""
    from dali_zarr.convert import DEFAULT_CSR_CHUNK_ELEMENTS

    on_cpu = [a for a in arrays if a.path == "cpu-decode"]
    data = next((a for a in arrays if a.name.endswith("/data")), None)
    if on_cpu:
        names = " and ".join(a.name for a in on_cpu)
        reasons = sorted({a.why.removesuffix(_ON_CPU) for a in on_cpu})
        note = (
            f'with device="gpu", {names} {"is" if len(on_cpu) == 1 else "are"} decoded on the '
            f"CPU ({'; '.join(reasons)}) and copied to the device. This rewrites the store "
            "in zstd, which nvCOMP decodes on the GPU:"
        )
        suffix = "_zstd"
    elif (
        layout == "csr"
        and data is not None
        and data.path == "gpu-decode"
        and any(c.split("(")[0] in ("zstd", "lz4") for c in data.codecs)  # not read as stored
        and data.chunks[0] > 2 * DEFAULT_CSR_CHUNK_ELEMENTS
    ):
        note = (
            f"{data.name} is stored in chunks of {data.chunks[0]:,} elements; the GPU path "
            f"decodes smaller ones faster (an H200 decoded a window of 65,536-element chunks "
            f"in 19.5 ms, of 262,144-element ones in 43.7 ms). This writes chunks of at most "
            f"{DEFAULT_CSR_CHUNK_ELEMENTS:,} elements:"
        )
        suffix = "_rechunked"
    else:
        return {}
    stem = os.path.splitext(path.rstrip("/"))[0]
    chosen = ["--element", element] if element else []
    command = ["dali-zarr", "convert", *chosen, path, f"{stem}{suffix}.zarr"]
    return {"gpu_note": note, "gpu_rewrite": shlex.join(command)}


def _beside_x(root: zarr.Group, elements: Sequence[str]) -> Iterator[str]:
    """The loadable obsm entries that can ride beside X too (dense numeric arrays), each
    with its row shape and the dtype it has in batches, for obs=["obsm/<key>"]."""
    for element in elements:
        if is_obsm(element):
            node = root[element]
            if isinstance(node, zarr.Array) and node.dtype.kind in "biuf":
                yield describe_beside_x(element, node.shape, node.dtype)


def _shape(shape: tuple[int, ...] | None) -> str:
    if shape is None:
        return "-"
    return "×".join(str(s) for s in shape)


def format_report(report: StoreReport) -> str:
    """The report as text: a header, a table of arrays, obs columns and the suggestion."""
    r = report
    features = "×".join(str(s) for s in r.feature_shape) or "scalar"
    matrix = "csr_matrix" if r.layout == "csr" else "dense"
    what = (
        f"AnnData store, {r.element} {matrix}"
        if r.kind == "anndata"
        else f"plain Zarr array{'' if r.element is None else f' {r.element}'}"
    )
    lines = [f"{r.path}: {what}", f"  {r.n_obs:,} observations × {features} features, {r.dtype}"]
    if r.nnz is not None:
        lines.append(f"  nnz {r.nnz:,} ({r.nnz / max(1, r.n_obs):.1f} per row)")
    if r.converted:
        c = r.converted
        # the attribute is plain JSON anyone can write: a shuffle that is not convert's dict
        # (or lacks its seed) is reported as such, not a TypeError traceback
        shuffle = c.get("shuffle")
        seed = shuffle.get("seed", "?") if isinstance(shuffle, dict) else "?"
        shuffled = f", shuffled (seed {seed})" if shuffle else ""
        lines.append(
            f"  written by dali-zarr convert: chunk_rows {c.get('chunk_rows')}, "
            f"codec {c.get('codec')}{shuffled}"
        )
    lines.append("")
    header = ("array", "fmt", "shape", "dtype", "chunk", "shard", "rows/chunk", "codecs", "path")
    rows = [
        (
            a.name,
            f"v{a.zarr_format}",
            _shape(a.shape),
            a.dtype,
            _shape(a.chunks),
            _shape(a.shards),
            "-" if a.rows_per_chunk is None else f"{a.rows_per_chunk:,.1f}",
            ", ".join(a.codecs),
            a.path,
        )
        for a in r.arrays
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for row in (header, *rows):
        cells = "  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True))
        lines.append(("  " + cells).rstrip())
    lines.append("")
    for a in r.arrays:
        lines.append(f"  {a.name}: {a.path}: {a.why}")
    if any(a.path == "gpu-decode" for a in r.arrays):
        lines.append(
            "  (gpu-decode: what device='gpu' decodes with nvCOMP; device='cpu' reads the same"
            " arrays by the direct path)"
        )
    if r.gpu_note:
        lines.append(textwrap.fill(f"note: {r.gpu_note}", width=96, initial_indent="  ",
                                   subsequent_indent="    "))  # fmt: skip
        lines.append(f"    {r.gpu_rewrite}")  # on a line of its own: it pastes as printed
    if r.kind == "anndata":
        lines.append("")
        lines.append("  loadable elements (element=...): " + ", ".join(r.elements))
        if r.beside:
            lines.append('  beside X (obs=["obsm/<key>"]): ' + ", ".join(r.beside))
        if r.obs:
            parts = []
            for o in r.obs:
                desc = o.encoding if o.n_categories is None else f"{o.n_categories} categories"
                parts.append(f"{o.name} ({desc}{'' if o.batchable else ', not batchable'})")
            lines.append("  obs columns: " + ", ".join(parts))
        else:
            lines.append("  obs columns: none")
    s = r.suggestion
    if r.n_obs == 0:  # the loader refuses it: settings beside the warning read as loadable
        return "\n".join([*lines, "", f"  warning: {s.warning}; no settings to suggest"])
    # a window that holds no batch is not "0 rows" beside the warning that says why
    window = (
        f"a window is {s.window_rows:,} rows, ~{s.window_mib:,.1f} MiB decoded"
        + (f"; the store's {r.n_obs:,} fit in one" if 0 < r.n_obs < s.window_rows else "")
        if s.window_rows
        else f"a window of {s.chunk_size * s.preload_nchunks:,} rows holds no batch: see the "
        "warning"
    )
    lines += [
        "",
        f"  suggested: chunk_size={s.chunk_size}, preload_nchunks={s.preload_nchunks} "
        f"(batch_size={s.batch_size}: {window})",
        f"  store rows per chunk: {s.rows_per_store_chunk:,.1f}; store chunk bytes decoded "
        f"per byte of rows used: ~{s.read_amplification:.2f}",
        *([f"  warning: {s.warning}"] if s.warning else []),
        textwrap.fill(f"rule: {s.rule}", width=96, initial_indent="  ", subsequent_indent="    "),
    ]
    return "\n".join(lines)
