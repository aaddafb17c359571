"""The GPU read backend: a window's rows as a byte-range plan, run on the CPU or on the GPU.

:func:`plan_rows` turns the ``[start, stop)`` row ranges of one window of a
:class:`~dali_zarr.io.DirectReader` array into a :class:`ReadPlan`, without reading chunk
data and without Python work per chunk (NumPy arrays throughout): which stored bytes to read
(file, offset, nbytes; shard indexes are read and crc32c-checked on the host through the
reader), coalesced into *extents* (chunks adjacent in a shard file are one read), where each
chunk's bytes land in a staging buffer, where each decoded chunk lands in a chunk buffer,
which chunks are missing (fill value), and the copy segments that assemble the window's rows
from the decoded chunks.

Two executors run the same plan:

* :func:`execute_plan_cpu` (NumPy, any machine): ``os.preadv`` of every extent into one
  contiguous host staging buffer, then decode — the CPU stand-in for exactly what the GPU
  does, so tests can compare it with ``DirectReader.read_rows`` on every codec and layout.
* :class:`GpuPlanExecutor` (needs CUDA; imports kvikio, cupy and nvCOMP lazily): every extent
  read into device memory, all in flight at once — kvikio ``CuFile.pread`` (GPUDirect
  Storage where the system has it, kvikio's compat mode otherwise), or ``os.preadv`` into
  pinned memory and one copy (:func:`read_method`); each stored chunk's header checked on
  the host (:func:`check_frames`); nvCOMP batched decode calls of up to 512 MiB
  (``nvcomp_batched.CALL_NBYTES``) of the window's chunks (zstd frames that record no
  content size are decoded on the host: :func:`frames_without_size`); arrays nvCOMP cannot
  decode are decoded on the CPU into pinned memory and copied once; then one launch of
  ``cuda_kernels.copy_segments`` per plan assembles the rows. A window's plans (its
  arrays, and stores written differently) run together (:meth:`GpuPlanExecutor.run_many`):
  their reads in flight at once, one decode call per codec kind for all of them.

Per-array decode path (:func:`gpu_codec_kind`): ``"none"`` (only the ``bytes`` codec, native
byte order: disk → GPU with no decode), ``"zstd"`` (zarr v3's default; nvCOMP zstd), ``"lz4"``
(numcodecs' LZ4: a 4-byte little-endian size header before a raw LZ4 block; the plan reads
the header with the block but the decoder gets only the block, and the decoded size is
checked instead of the header), and ``"host"`` for everything else (blosc, gzip, filters,
big-endian, per-chunk crc32c, F order, zstd or lz4 chunks larger than a decode call...),
decoded by the same
:class:`~dali_zarr.io.ChunkDecoder` as the CPU path. Arrays whose chunks do not equal
the non-leading axes cannot be planned (rows would not be contiguous in a chunk, or not back
to back where chunks are wider than the array); the caller
reads those with ``read_rows`` on the host and copies the window once.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numcodecs
import numpy as np

from ..distributed import cpu_share
from ..errors import ChunkReadError, ConfigError
from ..planning.partition import run_offsets, split_at_chunks
from . import nvcomp_batched
from .codecs import (
    DecodeError,
    frame_problems,
    head_index,
    zstd_block_walk_limit,
    zstd_content_sizes,
    zstd_frame_ends,
    zstd_walk_from,
)
from .layout import ArrayLayout
from .readers import (
    FILE_STAMP,
    WRITING,
    DirectReader,
    _file_stamp,
    _pread_into,
    _run_parallel,
    check_ranges,
    stamp_of,
    stored_stamp,
)

__all__ = [
    "GPU_KINDS",
    "GpuPlanExecutor",
    "GpuSupport",
    "NotPlannable",
    "ReadPlan",
    "execute_plan_cpu",
    "files_changed",
    "gpu_codec_kind",
    "place_plan",
    "plan_problem",
    "plan_rows",
    "probe_gpu",
    "window_plans",
]

#: decode paths that run on the GPU ("host" is the CPU decode + one copy).
GPU_KINDS = ("none", "zstd", "lz4")
#: kinds whose stored chunks start with a header the plan executors check before decoding
FRAMED_KINDS = ("zstd", "lz4")
#: where a plan's output goes in a window: ``(starts, lengths)``, its consecutive pieces of
#: ``lengths`` rows to rows ``starts`` (axis-0 units: elements for CSR data and indices)
Pieces = tuple[np.ndarray, np.ndarray]
ALIGN = 256  # staging and chunk-buffer slots start on 256-byte boundaries (nvCOMP, kvikio)
#: a staging read starts on a page of its file and of the buffer: GPUDirect Storage moves
#: whole 4 KiB pages by DMA and takes an unaligned head through a bounce buffer (the cuFile
#: best-practices guide); reading up to a page more per extent costs next to nothing
PAGE = 4096
_LZ4_HEADER = 4


class NotPlannable(ValueError):
    """This array cannot be read through a byte plan (the message says why)."""


def round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def gpu_codec_kind(layout: ArrayLayout) -> tuple[str, str]:
    """``(kind, why)``: which decoder serves this array's chunks in a plan.

    ``kind`` is one of :data:`GPU_KINDS`, or ``"host"`` with ``why`` saying what keeps the
    chunks off the GPU decoder.
    """
    codecs = layout.codecs
    if codecs is None:
        return "host", layout.unsupported or "no direct-path codecs"
    if codecs.filters:
        return "host", "filters " + "+".join(str(f["id"]) for f in codecs.filters)
    stored = np.dtype(codecs.stored_dtype)
    if stored != layout.dtype:
        return "host", f"stored dtype {stored.str} differs from {layout.dtype.str} (byte swap)"
    many_axes = sum(1 for s in layout.chunk_shape if s > 1) > 1
    if codecs.order != "C" and many_axes:
        return "host", f"memory order {codecs.order}"
    ids = [str(c["id"]) for c in codecs.bytes_codecs]
    if not ids:
        return "none", ""
    chunk_nbytes = math.prod(layout.chunk_shape) * layout.dtype.itemsize
    if ids in (["zstd"], ["lz4"]) and chunk_nbytes > nvcomp_batched.CALL_NBYTES:
        # a call holds at least one chunk: its scratch (~3x, ~6.5 GB for a 2 GiB chunk)
        # would pass the call cap's bound, and nvCOMP refuses zstd chunks of 2 GiB or more
        return "host", (
            f"chunks of {chunk_nbytes / 2**20:.0f} MiB decoded, more than a decode call "
            f"takes ({nvcomp_batched.CALL_NBYTES >> 20} MiB; smaller chunks decode on the GPU)"
        )
    if ids == ["zstd"]:
        if codecs.bytes_codecs[0].get("checksum"):
            return "host", "zstd frames with content checksums"
        return "zstd", ""
    if ids == ["lz4"]:
        return "lz4", ""
    return "host", "codecs " + "+".join(ids)


# ---------------------------------------------------------------------------- the plan


#: one entry per stored chunk of a plan, in slot order (:attr:`ReadPlan.reads`)
READ_FIELDS = np.dtype(
    [
        ("chunk", "<i8"),  # chunk index along axis 0
        ("file", "<i4"),  # index into ReadPlan.files
        ("file_offset", "<i8"),  # first stored byte (for lz4: its 4-byte size header)
        ("nbytes", "<i8"),  # stored bytes
        ("staging_offset", "<i8"),  # where they land in the staging buffer; -1: chunk buffer
        ("decoded_offset", "<i8"),  # byte offset of the decoded chunk in the chunk buffer
    ]
)
#: one entry per coalesced read: a run of chunks that follow each other in one file and in
#: the buffer they are read into (:attr:`ReadPlan.extents`)
EXTENT_FIELDS = np.dtype(
    [
        ("file", "<i4"),
        ("file_offset", "<i8"),
        ("nbytes", "<i8"),
        ("dest_offset", "<i8"),  # in the staging buffer (chunk buffer when uncompressed)
        ("lead", "<i8"),  # bytes read before its first chunk, to start on a PAGE boundary
        ("first", "<i8"),  # first read (index into ReadPlan.reads) of the run
        ("count", "<i8"),
    ]
)


def kvikio_pool_size() -> int:
    """kvikio thread pool size the GPU path asks for (unless the user set
    ``KVIKIO_N[UM_]THREADS``): a thread per core of this rank's share of the node
    (:func:`~dali_zarr.distributed.cpu_share`), at most 16."""
    return min(16, cpu_share())


#: a run of adjacent chunks is cut into reads of about this many bytes, so that a window's
#: reads still spread over a thread pool (kvikio splits each read into its own tasks too)
MAX_EXTENT = 16 << 20


@dataclass(frozen=True)
class ReadPlan:
    """Everything needed to read one window of one array, without touching chunk data.

    Per-chunk facts are NumPy arrays (:data:`READ_FIELDS`), not Python objects: a window of
    a Tahoe-like store holds ~250 chunks per array, and per-chunk Python on the reader
    threads competes for the GIL with everything else that feeds the GPU.
    """

    name: str
    kind: str  # "none" | "zstd" | "lz4" | "host"
    reason: str  # why "host" ("" otherwise)
    dtype: np.dtype
    out_shape: tuple[int, ...]  # (rows in the window, *trailing shape)
    chunk_shape: tuple[int, ...]
    chunk_nbytes: int  # decoded bytes of one (full) chunk
    slot_nbytes: int  # chunk-buffer stride (chunk_nbytes, rounded up to ALIGN unless "none")
    chunks: np.ndarray  # chunk indices held by the chunk buffer, in slot order
    files: tuple[str, ...]
    file_stamp: np.ndarray  # FILE_STAMP, each file as planned (read paths compare it)
    reads: np.ndarray  # READ_FIELDS, one per stored chunk, in slot order
    extents: np.ndarray  # EXTENT_FIELDS: the reads as file-contiguous runs, one I/O call each
    header_nbytes: int  # bytes at the start of each stored chunk the decoder skips (lz4: 4)
    fill_slots: tuple[int, ...]  # slots of chunks that are not stored (fill value)
    fill_value: Any
    staging_nbytes: int
    segments: np.ndarray  # (k, 3) int64, in elements: chunk-buffer start, window start, length

    @property
    def decoded_nbytes(self) -> int:
        return len(self.chunks) * self.slot_nbytes

    @property
    def has_frames(self) -> bool:
        """Stored chunks with headers to check before decoding (:func:`check_frames`)."""
        return self.kind in FRAMED_KINDS and len(self.reads) > 0

    @property
    def reads_into_chunk_buffer(self) -> bool:
        """Uncompressed chunks are read straight into their slots (no staging, no decode)."""
        return self.kind == "none"

    def decode_sources(self, staging_at: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``(staging offsets, sizes)`` of what each chunk's decoder gets: the stored bytes
        after the header (numcodecs' LZ4 size header is read but not decoded); offsets from
        ``staging_at``, where the plan's staging starts in a shared buffer."""
        return (
            self.reads["staging_offset"] + (staging_at + self.header_nbytes),
            self.reads["nbytes"] - self.header_nbytes,
        )

    def extent_jobs(self) -> list[tuple[int, int, int, int, int]]:
        """``(extent, file, file_offset, nbytes, dest_offset)`` per extent, as Python ints."""
        rows = self.extents[["file", "file_offset", "nbytes", "dest_offset"]].tolist()
        return [(i, *row) for i, row in enumerate(rows)]

    def chunk_at(self, extent: int, byte: int) -> int:
        """The chunk holding byte ``byte`` of extent ``extent`` (to name it in errors)."""
        e = self.extents[extent]
        run = self.reads["nbytes"][e["first"] : e["first"] + e["count"]]
        byte = max(byte - int(e["lead"]), 0)
        i = min(int(np.searchsorted(np.cumsum(run), byte, side="right")), len(run) - 1)
        return int(self.reads["chunk"][e["first"] + i])


def plan_problem(reader: Any) -> str:
    """Why ``reader``'s rows cannot be read as planned byte ranges ("" when they can)."""
    if not isinstance(reader, DirectReader):
        return f"not read by the direct path ({reader.path}: {reader.reason})"
    shape, chunk = reader.layout.shape, reader.layout.chunk_shape
    if tuple(chunk[1:]) == tuple(shape[1:]):
        return ""
    fit = f"chunks=(N, {', '.join(map(str, shape[1:]))})"
    if all(c >= s for c, s in zip(chunk[1:], shape[1:], strict=True)):
        # a row is whole in its chunk, but padded: "do not span" sent users the wrong way
        return (
            f"chunks {chunk} are wider than the array's trailing axes {shape[1:]}, so each "
            f"row is padded within its chunk and rows are not back to back; re-write with "
            f"{fit} for byte plans"
        )
    return (
        f"chunks {chunk} do not span the trailing axes {shape[1:]}, so a row is not "
        f"contiguous within a chunk; re-write with {fit} for byte plans"
    )


@dataclass(frozen=True)
class _ChunkFormat:
    """What a plan needs to know of an array's chunks, from its metadata alone; arrays with
    equal formats can share one plan (one chunk buffer stride, one decoder)."""

    kind: str
    reason: str
    dtype: np.dtype
    chunk_shape: tuple[int, ...]
    trailing: tuple[int, ...]  # the array's shape after axis 0
    chunk_nbytes: int
    slot_nbytes: int
    header_nbytes: int
    fill: bytes  # the fill value's bytes (NaN fills compare equal)


def _chunk_format(reader: DirectReader) -> _ChunkFormat:
    """Raises :class:`NotPlannable` when the array's rows are not contiguous in a chunk."""
    problem = plan_problem(reader)
    if problem:
        raise NotPlannable(f"{getattr(reader, 'name', reader)}: {problem}")
    lay = reader.layout
    kind, reason = gpu_codec_kind(lay)
    dtype = np.dtype(lay.dtype)
    chunk_nbytes = math.prod(lay.chunk_shape) * dtype.itemsize
    # decoded chunks start on ALIGN boundaries (nvCOMP writes faster there); uncompressed
    # ones are read straight into their slots, back to back, so that adjacent chunks of a
    # file are one read (the copy kernel needs only the dtype's alignment)
    slot_nbytes = max(chunk_nbytes, dtype.itemsize)
    if kind != "none":
        slot_nbytes = round_up(slot_nbytes)
    return _ChunkFormat(
        kind=kind,
        reason=reason,
        dtype=dtype,
        chunk_shape=tuple(lay.chunk_shape),
        trailing=tuple(lay.shape[1:]),
        chunk_nbytes=chunk_nbytes,
        slot_nbytes=slot_nbytes,
        header_nbytes=_LZ4_HEADER if kind == "lz4" else 0,
        fill=np.asarray(lay.fill_value, dtype=dtype).tobytes(),
    )


def plan_rows(reader: DirectReader, ranges: Any) -> ReadPlan:
    """The byte plan for ``reader.read_rows(ranges)`` (same rows, same order).

    Raises :class:`NotPlannable` when the array's rows are not contiguous within a chunk, and
    ``ChunkReadError`` for a corrupted shard index.
    """
    return _plan_stores(_chunk_format(reader), [reader], [ranges], reader)


def _plan_stores(
    fmt: _ChunkFormat, readers: Sequence[DirectReader], ranges: Sequence[Any], named_by: Any
) -> ReadPlan:
    """One plan for rows ``ranges[i]`` of ``readers[i]`` (arrays of format ``fmt``), their
    outputs end to end in that order, in one pass of NumPy over all of them: chunk ``c`` of
    the ``i``-th reader is chunk ``bases[i] + c`` of the plan (``named_by``, a
    :class:`StoreReaders` or the one reader, names chunks in errors)."""
    C = fmt.chunk_shape[0]
    row_elems = math.prod(fmt.trailing)
    slot_elems = fmt.slot_nbytes // fmt.dtype.itemsize
    # one reader: its chunk numbers as they are (every chunk below the second base)
    bases = getattr(named_by, "bases", np.array([0, np.iinfo(np.int64).max]))
    checked = [
        check_ranges(r, reader.shape[0], reader.name)
        for reader, r in zip(readers, ranges, strict=True)
    ]
    r = np.concatenate(checked) if len(checked) > 1 else checked[0]
    store = np.repeat(np.arange(len(checked)), [len(c) for c in checked])
    lens = r[:, 1] - r[:, 0]
    total = int(lens.sum())
    nz = np.flatnonzero(lens)
    starts, stops = r[nz, 0], r[nz, 1]
    outs = run_offsets(lens)[:-1][nz]
    # one entry per (range, chunk) intersection, in window order
    rep, seg_chunk, lo, hi = split_at_chunks(starts, stops, C)
    chunks, slot_of = np.unique(seg_chunk + bases[store[nz][rep]], return_inverse=True)
    seg = np.stack(
        [
            slot_of * slot_elems + (lo - seg_chunk * C) * row_elems,
            (outs[rep] + lo - starts[rep]) * row_elems,
            (hi - lo) * row_elems,
        ],
        axis=1,
    ).astype(np.int64)
    seg = _merge_segments(seg)

    # where each chunk is stored: one lookup per store over its (sorted) chunks
    cuts = np.searchsorted(chunks, bases).tolist()
    files: list[str] = []
    file, offset, nbytes, file_stamp = [], [], [], []
    for i, reader in enumerate(readers):
        mine = chunks[cuts[i] : cuts[i + 1]]
        if len(mine):
            loc = reader.chunk_locations(mine - bases[i])
            file.append(np.where(loc.file >= 0, loc.file + len(files), -1))
            offset.append(loc.offset)
            nbytes.append(loc.nbytes)
            file_stamp.append(loc.file_stamp)
            files += loc.files
    file = np.concatenate(file) if file else np.zeros(0, np.int32)
    slots = np.flatnonzero(file >= 0)
    nbytes = np.concatenate(nbytes)[slots] if len(slots) else np.zeros(0, np.int64)
    if fmt.kind == "none":
        _refuse_chunks(
            named_by, chunks[slots], nbytes, nbytes != fmt.chunk_nbytes,
            lambda n: f"stored {n} bytes, expected {fmt.chunk_nbytes} (uncompressed)",
        )  # fmt: skip
    if fmt.kind == "lz4":
        _refuse_chunks(
            named_by, chunks[slots], nbytes, nbytes < _LZ4_HEADER,
            lambda n: f"lz4 chunk is {n} bytes, shorter than its 4-byte header",
        )  # fmt: skip
    reads = np.empty(len(slots), dtype=READ_FIELDS)
    reads["chunk"] = chunks[slots]
    reads["file"] = file[slots]
    reads["file_offset"] = np.concatenate(offset)[slots] if len(slots) else 0
    reads["nbytes"] = nbytes
    reads["decoded_offset"] = slots * fmt.slot_nbytes
    extents, staging_nbytes = _coalesce(reads, into_chunk_buffer=fmt.kind == "none")
    return ReadPlan(
        name=named_by.name,
        kind=fmt.kind,
        reason=fmt.reason,
        dtype=fmt.dtype,
        out_shape=(total, *fmt.trailing),
        chunk_shape=fmt.chunk_shape,
        chunk_nbytes=fmt.chunk_nbytes,
        slot_nbytes=fmt.slot_nbytes,
        chunks=chunks.astype(np.int64),
        files=tuple(files),
        file_stamp=np.concatenate(file_stamp) if file_stamp else np.zeros(0, FILE_STAMP),
        reads=reads,
        extents=extents,
        header_nbytes=fmt.header_nbytes,
        fill_slots=tuple(np.flatnonzero(file < 0).tolist()),
        fill_value=readers[0].layout.fill_value,
        staging_nbytes=staging_nbytes,
        segments=seg,
    )


def place_plan(
    plan: ReadPlan, *, starts: np.ndarray, lengths: np.ndarray, out_rows: int
) -> ReadPlan:
    """``plan`` writing into a larger output: its output's consecutive pieces of
    ``lengths`` rows go to rows ``starts`` of an ``out_rows``-row output (pure NumPy).

    A window of a collection (or of a subset of one) takes runs of rows from several
    stores, interleaved. Their plan (:func:`window_plans`) writes each store's runs back to
    back; placing only moves its copy segments, so the rows go straight to their places in
    the window, with no extra copy.
    Rows are the array's axis-0 units (elements for CSR ``data``/``indices``).
    """
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if int(lengths.sum()) != plan.out_shape[0]:
        raise ValueError(f"pieces of {int(lengths.sum())} rows for a plan of {plan.out_shape[0]}")
    row = math.prod(plan.out_shape[1:])
    keep = lengths > 0
    src = (run_offsets(lengths)[:-1][keep]) * row  # piece starts in the plan's own output
    dst, n = starts[keep] * row, lengths[keep] * row
    if np.any(dst < 0) or np.any(dst + n > out_rows * row):
        raise ValueError(f"pieces placed outside an output of {out_rows} rows")
    seg = plan.segments
    if len(seg):
        # cut the segments wherever a piece starts, then shift each part to its piece's place
        cuts = np.union1d(seg[:, 1], src)
        which = np.searchsorted(seg[:, 1], cuts, side="right") - 1
        piece = np.searchsorted(src, cuts, side="right") - 1
        ends = np.append(cuts[1:], seg[-1, 1] + seg[-1, 2])
        seg = np.stack(
            [seg[which, 0] + cuts - seg[which, 1], dst[piece] + cuts - src[piece], ends - cuts],
            axis=1,
        ).astype(np.int64)
        seg = _merge_segments(seg)
    return replace(plan, out_shape=(int(out_rows), *plan.out_shape[1:]), segments=seg)


class StoreReaders:
    """Stands in for the reader of a plan of several stores' arrays (:func:`window_plans`):
    the executors ask a plan's reader only for chunk errors and a thread pool (the window
    reader also asks it to forget chunk files that changed), and a chunk error must name
    the store, array and chunk it came from.

    The plan numbers chunks ``bases[i] + chunk`` for the ``i``-th reader's chunks.
    """

    def __init__(self, readers: Sequence[DirectReader]) -> None:
        self.readers = tuple(readers)
        counts = [-(-r.layout.shape[0] // r.layout.chunk_shape[0]) for r in self.readers]
        self.bases = run_offsets(np.array(counts, dtype=np.int64))
        self.name = " + ".join(r.name for r in self.readers)
        self.shape = self.readers[0].shape  # chunk coordinates have this many axes
        self.executor = self.readers[0].executor

    def chunk_error(self, coords: tuple[int, ...], problem: str, *advice: str) -> ChunkReadError:
        i = int(np.searchsorted(self.bases, coords[0], side="right")) - 1
        local = (int(coords[0] - self.bases[i]), *coords[1:])
        return self.readers[i].chunk_error(local, problem, *advice)

    def forget_changed_chunks(self) -> bool:
        """Every store's :meth:`DirectReader.forget_changed_chunks` (each asked, none
        skipped): a failed joint plan is planned again where any store's chunks changed."""
        return any([reader.forget_changed_chunks() for reader in self.readers])


def window_plans(
    items: Sequence[tuple[DirectReader, Any, Pieces | None]], *, out_rows: int
) -> tuple[list[tuple[ReadPlan, Any]], list[int]]:
    """The plans that write one array of a window, each with the reader to run it with, and
    the items that cannot be planned (their indices: read them on the host).

    ``items`` holds, per store the window touches, the array's reader, its row ranges (all
    of the store's runs in the window) and where those rows go in the window
    (``(starts, lengths)`` pieces, or None: they are the whole window).

    A window of a collection touches many stores; planned and run one by one, each store
    costs its own reads, checks, decode call, copy launch and stream syncs, and its own
    host planning. Stores whose arrays share a chunk format (decode kind, dtype, chunk
    shape, fill value) are planned together in one NumPy pass instead (their chunk buffers
    end to end, chunk errors still naming each store through a :class:`StoreReaders`),
    and the plan is placed once (:func:`place_plan`). Host-decoded arrays keep a plan each:
    their decode uses each store's own decoder.
    """
    groups: dict[Any, list[int]] = {}
    formats: dict[int, _ChunkFormat] = {}
    unplannable: list[int] = []
    for i, (reader, _, _) in enumerate(items):
        try:
            formats[i] = _chunk_format(reader)
        except NotPlannable:
            unplannable.append(i)
            continue
        key = formats[i] if formats[i].kind in GPU_KINDS else ("alone", i)
        groups.setdefault(key, []).append(i)
    plans: list[tuple[ReadPlan, Any]] = []
    for members in groups.values():
        readers = [items[i][0] for i in members]
        named_by = readers[0] if len(readers) == 1 else StoreReaders(readers)
        plan = _plan_stores(formats[members[0]], readers, [items[i][1] for i in members], named_by)
        pieces = [items[i][2] for i in members]
        if pieces[0] is not None:
            plan = place_plan(
                plan,
                starts=np.concatenate([p[0] for p in pieces]),
                lengths=np.concatenate([p[1] for p in pieces]),
                out_rows=out_rows,
            )
        elif plan.out_shape[0] != out_rows:
            raise ValueError(f"a plan of {plan.out_shape[0]} rows for a window of {out_rows}")
        plans.append((plan, named_by))
    return plans, unplannable


def _refuse_chunks(
    reader: DirectReader, chunks: np.ndarray, nbytes: np.ndarray, bad: np.ndarray, why
) -> None:
    """Raise the reader's chunk error for the first chunk flagged in ``bad``."""
    hits = np.flatnonzero(bad)
    if len(hits):
        i = hits[0]
        raise reader.chunk_error(_coords(reader, chunks[i]), why(int(nbytes[i])))


def _coalesce(reads: np.ndarray, *, into_chunk_buffer: bool) -> tuple[np.ndarray, int]:
    """Group ``reads`` into extents (runs adjacent in their file and in the buffer they land
    in, cut near :data:`MAX_EXTENT`); fills ``reads["staging_offset"]``. Returns the extents
    and the staging bytes. A staging extent starts on a :data:`PAGE` of its file and of the
    staging buffer (its ``lead`` bytes before the first chunk are read and ignored); the
    chunks inside one follow each other unpadded (nvCOMP's zstd and LZ4 decoders take inputs
    at any byte: :func:`nvcomp_batched.required_alignments`, held to that by a CI test)."""
    nb = reads["nbytes"]
    n = len(nb)
    before = run_offsets(nb)  # where each read would start with all of them end to end
    new = np.ones(n, dtype=bool)
    if n > 1:
        follows = (reads["file"][1:] == reads["file"][:-1]) & (
            reads["file_offset"][1:] == reads["file_offset"][:-1] + nb[:-1]
        )
        if into_chunk_buffer:
            dst = reads["decoded_offset"]
            follows &= dst[1:] == dst[:-1] + nb[:-1]
        new[1:] = ~follows
        run_start = before[:-1][new][np.cumsum(new) - 1]
        piece = (before[:-1] - run_start) // MAX_EXTENT
        new[1:] |= piece[1:] != piece[:-1]
    heads = np.flatnonzero(new)
    bounds = np.append(heads, n)
    of = np.cumsum(new) - 1  # extent of each read
    ext = np.empty(len(heads), dtype=EXTENT_FIELDS)
    ext["file"] = reads["file"][heads]
    ext["file_offset"] = reads["file_offset"][heads]
    ext["nbytes"] = np.diff(before[bounds])
    ext["first"] = heads
    ext["count"] = np.diff(bounds)
    if into_chunk_buffer:  # straight into the slots: no room for a lead
        ext["lead"] = 0
        ext["dest_offset"] = reads["decoded_offset"][heads]
        reads["staging_offset"] = -1
        return ext, 0
    lead = ext["file_offset"] % PAGE
    ext["lead"] = lead
    ext["file_offset"] -= lead
    ext["nbytes"] += lead
    starts = run_offsets(round_up(np.maximum(ext["nbytes"], 1), PAGE))
    ext["dest_offset"] = starts[:-1]
    reads["staging_offset"] = (starts[:-1] + lead)[of] + before[:-1] - before[heads][of]
    return ext, int(starts[-1])


def _merge_segments(seg: np.ndarray) -> np.ndarray:
    """Join consecutive segments that continue each other in both buffers."""
    if len(seg) < 2:
        return seg
    cont = (seg[1:, 0] == seg[:-1, 0] + seg[:-1, 2]) & (seg[1:, 1] == seg[:-1, 1] + seg[:-1, 2])
    heads = np.flatnonzero(np.concatenate([[True], ~cont]))
    out = seg[heads].copy()
    out[:, 2] = np.add.reduceat(seg[:, 2], heads)
    return out


# ---------------------------------------------------------------------------- CPU executor


def decode_plan_cpu(
    plan: ReadPlan,
    reader: DirectReader,
    staging: np.ndarray | None = None,
    decoded: np.ndarray | None = None,
) -> np.ndarray:
    """Reads, decode and fill of ``plan`` on the host; returns the chunk buffer (uint8).

    ``staging``/``decoded`` may be given (pinned memory on the GPU path), at least
    ``plan.staging_nbytes``/``plan.decoded_nbytes`` long.
    """
    staging = np.empty(plan.staging_nbytes, np.uint8) if staging is None else staging
    decoded = np.empty(plan.decoded_nbytes, np.uint8) if decoded is None else decoded
    read_extents_cpu(plan, reader, decoded if plan.reads_into_chunk_buffer else staging)
    if plan.has_frames:
        check_frames(plan, reader, frame_heads_host(plan, staging))
    if not plan.reads_into_chunk_buffer:  # uncompressed chunks were read into their slots
        decode = _cpu_decoder(plan, reader)
        jobs = plan.reads[["chunk", "staging_offset", "nbytes", "decoded_offset"]].tolist()
        _run_parallel(reader.executor, jobs, lambda job: decode(*job, staging, decoded))
    for slot in plan.fill_slots:
        _chunk_view(decoded, plan, slot * plan.slot_nbytes)[...] = plan.fill_value
    return decoded[: plan.decoded_nbytes]


def frame_heads_host(plan: ReadPlan, staging: np.ndarray) -> np.ndarray:
    """The first bytes of every stored chunk of ``plan`` in host ``staging`` (for
    :func:`check_frames`)."""
    return staging[head_index(plan.reads["staging_offset"], plan.staging_nbytes)]


def check_frames(plan: ReadPlan, reader: DirectReader, heads: np.ndarray) -> None:
    """Raise the reader's chunk error, naming the chunk, for the first stored chunk of a
    ``plan`` with :attr:`~ReadPlan.has_frames` whose first bytes (``heads``, one row per
    read) show it cannot decode to a chunk (:func:`~dali_zarr.io.codecs.frame_problems`)."""
    for i, why in frame_problems(plan.kind, heads, plan.reads["nbytes"], plan.chunk_nbytes)[:1]:
        raise reader.chunk_error(_coords(reader, plan.reads["chunk"][i]), why)


def frames_without_size(heads: np.ndarray) -> np.ndarray:
    """Indices (into a zstd plan's reads) of the frames whose header records no content size
    (streaming writers leave it out; zarr and numcodecs never do). The GPU executor decodes
    them on the host, where numcodecs checks the size they decode to: nvCOMP cannot check
    them against the chunk's size, and on the H200 (2026-11-27) a corrupted frame without
    one made it read out of bounds (``cudaErrorIllegalAddress``, which ends every later use
    of the device by the process)."""
    return np.flatnonzero(zstd_content_sizes(heads)[1] < 0)


def check_frame_ends(plan: ReadPlan, reader: DirectReader, ends: np.ndarray) -> np.ndarray:
    """Raise the reader's chunk error for the first zstd frame of ``plan`` whose blocks do
    not end within its stored bytes (a truncated chunk; ``ends`` per read, from
    :func:`~dali_zarr.io.codecs.zstd_frame_ends` or its device twin), and return the
    indices into ``plan.reads`` of the frames of too many blocks to walk (-2, host walk
    only): the GPU executor decodes those on the host, as it does
    :func:`frames_without_size`."""
    nbytes = plan.reads["nbytes"]
    cut = np.flatnonzero((ends == -1) | (ends > nbytes))
    if len(cut):
        i = int(cut[0])
        why = f"zstd frame cut short: its {int(nbytes[i])} stored bytes end inside it (truncated)"
        raise reader.chunk_error(_coords(reader, plan.reads["chunk"][i]), why)
    return np.flatnonzero(ends == -2)


def read_extents_cpu(plan: ReadPlan, reader: DirectReader, target: np.ndarray) -> None:
    """``os.preadv`` of every extent of ``plan`` into ``target`` (staging, or the chunk buffer
    when uncompressed) on the reader's thread pool. Each read opens its file (a window of an
    unsharded array can touch more chunk files than a process may hold open)."""
    read_extents_cpu_many([(plan, reader, target)])


def read_extents_cpu_many(work: Sequence[tuple[ReadPlan, DirectReader, np.ndarray]]) -> None:
    """:func:`read_extents_cpu` of several plans at once: their extents share the first
    reader's thread pool, so a window's plans (a few extents of up to :data:`MAX_EXTENT`
    each) keep more reads in flight than one plan after the other."""

    def reader_of(plan: ReadPlan, reader: DirectReader, target: np.ndarray):
        def read(job: tuple[int, int, int, int, int]) -> None:
            i, f, offset, nbytes, dest = job
            try:
                # a pipe swapped in opens at once (and is refused below as another file)
                fd = os.open(plan.files[f], os.O_RDONLY | os.O_NONBLOCK)
                try:
                    stamp = stamp_of(os.fstat(fd))
                    unchanged = stamp == plan.file_stamp[f].item()  # else refused below
                    got = _pread_into(fd, target[dest : dest + nbytes], offset) if unchanged else 0
                finally:
                    os.close(fd)
            except OSError as e:
                raise _extent_error(reader, plan, i, 0, f"reading failed ({e})") from e
            _refuse_changed_file(plan, reader, i, stamp)
            if got != nbytes:
                why = f"read {got} of {nbytes} bytes (file shrank)"
                raise _extent_error(reader, plan, i, got, why)

        return read

    if not work:
        return
    reads = [reader_of(*w) for w in work]
    jobs = [(k, job) for k, (plan, _, _) in enumerate(work) for job in plan.extent_jobs()]
    _run_parallel(work[0][1].executor, jobs, lambda kjob: reads[kjob[0]](kjob[1]))


def _bytes_left(plan: ReadPlan, extent: int) -> int:
    """Where in ``extent`` its file ends, to name the chunk there when a read raised instead
    of reading short; 0 (its first chunk) where the file holds all of it, so the read
    failed for another reason."""
    e = plan.extents[extent]
    try:
        size = os.path.getsize(plan.files[int(e["file"])])
    except OSError:
        return 0
    left = max(size - int(e["file_offset"]), 0)
    return left if left < int(e["nbytes"]) else 0


def _extent_error(
    reader: DirectReader, plan: ReadPlan, extent: int, byte: int, why: str, *advice: str
):
    """The reader's chunk error for a failed read, naming the chunk at ``byte`` of it."""
    return reader.chunk_error(_coords(reader, plan.chunk_at(extent, byte)), why, *advice)


def _refuse_changed_file(
    plan: ReadPlan, reader: DirectReader, extent: int, stamp: tuple[int, ...]
) -> None:
    """Raise the chunk error for extent ``extent`` where its file (``stamp``, of the file as
    opened) is no longer the one planned: rewritten since (zarr writes new values as a new
    file). Read at the planned size, a grown zstd frame is cut short, and nvCOMP decoded
    such a frame on the H200 (2026-11-27) to garbage without an error; a shard rewritten at
    the same size holds its chunks at other offsets. The window reader plans again on this
    error where files changed (:func:`files_changed`)."""
    e = plan.extents[extent]
    planned = plan.file_stamp[int(e["file"])].item()
    if stamp == planned:
        return
    size, was = stamp[2], planned[2]
    if size != was:
        left = size - int(e["file_offset"])  # a shrunken file: name the chunk where it ends
        at = left if 0 <= left < int(e["nbytes"]) else 0
        why = f"its file is {size} bytes, {was} when its reads were planned (rewritten since)"
    else:
        at = 0
        why = (
            f"its file was replaced or rewritten since its reads were planned (the same {size}"
            " bytes, another inode or modification time)"
        )
    raise _extent_error(reader, plan, extent, at, why, WRITING)


def files_changed(plan: ReadPlan) -> bool:
    """Whether a file ``plan`` reads is no longer the one planned (its inode, modification
    time or size), or is gone: rewritten since (zarr writes new values as a new file, and
    deletes a chunk or shard set to the fill value). Its reads refuse such a file
    (:func:`_refuse_changed_file`); the window reader then plans again. Asked of the files
    themselves, one stat each, after a failed read only: a shard's index is stamped as it
    is planned, and another window may have forgotten and located a changed chunk anew
    before this plan ran (``DirectReader.forget_changed_chunks`` then finds nothing)."""
    planned = plan.file_stamp.tolist()  # a tuple a file, as _file_stamp gives
    return any(_file_stamp(path) != p for path, p in zip(plan.files, planned, strict=True))


def _kvikio_read_failed(reader: DirectReader, plan: ReadPlan, extent: int, e: Exception):
    """The chunk error for a kvikio read that raised (at end of file, where a shrunken file
    ends, rather than reading short)."""
    why = f"kvikio read failed ({e})"
    return _extent_error(reader, plan, extent, _bytes_left(plan, extent), why)


def execute_plan_cpu(
    plan: ReadPlan, reader: DirectReader, out: np.ndarray | None = None
) -> np.ndarray:
    """Run ``plan`` on the host: the window's rows as ``reader.read_rows`` returns them.

    Mirrors the GPU executor step by step: read every range into one staging buffer (or,
    uncompressed, straight into the chunk buffer), decode (zstd/lz4 as nvCOMP would: raw
    stream in, fixed-size chunk out; other codecs with the ChunkDecoder), fill missing
    chunks, then the segment copies.
    """
    decoded = decode_plan_cpu(plan, reader)
    if out is None:
        out = np.empty(plan.out_shape, dtype=plan.dtype)
    copy_segments_cpu(out.reshape(-1), decoded.view(plan.dtype), plan.segments)
    return out


#: the most elements of one segment a block of ``cuda_kernels.copy_segments`` copies
COPY_PIECE_ELEMENTS = 1 << 14


def split_segments(segments: np.ndarray, piece: int | None = None) -> np.ndarray:
    """``segments`` (rows ``src, dst, length``) with every one longer than ``piece`` cut into
    pieces of at most ``piece`` elements, in order.

    The copy kernel gives a segment one block, and merged segments can be few and long: an
    unshuffled window of uncompressed chunks is a single segment, which one SM would copy
    alone. Pieces spread it over the whole GPU. ``piece``: ``COPY_PIECE_ELEMENTS``.
    """
    piece = piece or COPY_PIECE_ELEMENTS
    lengths = segments[:, 2]
    counts = np.maximum(1, -(-lengths // piece))
    if len(segments) == 0 or counts.max() == 1:
        return segments
    which = np.repeat(np.arange(len(segments)), counts)
    step = (np.arange(len(which)) - np.repeat(run_offsets(counts)[:-1], counts)) * piece
    out = segments[which].copy()
    out[:, 0] += step
    out[:, 1] += step
    out[:, 2] = np.minimum(piece, lengths[which] - step)
    return out


def launch(fn: Any, blocks: int, threads: int, stream: Any, *args: Any) -> None:
    """The kernel ``fn`` (compiled once) on the cupy ``stream``.

    Device arrays reach numba with ``sync=False``. Numba's own conversion synchronises the
    stream an array reports, and cupy reports its current stream: outside ``with stream``
    that is the legacy default stream, on which torch trains, so each launch would wait on
    the host for the training step. The launch is ordered on ``stream``, where its inputs
    were made.
    """
    from numba import cuda

    args = tuple(
        cuda.as_cuda_array(a, sync=False) if hasattr(a, "__cuda_array_interface__") else a
        for a in args
    )
    cuda_jit(fn)[blocks, threads, cuda.external_stream(stream.ptr)](*args)


def copy_segments_cpu(out: np.ndarray, src: np.ndarray, segments: np.ndarray) -> None:
    """NumPy reference of ``cuda_kernels.copy_segments`` (flat arrays, offsets in elements)."""
    for s, d, k in segments.tolist():
        out[d : d + k] = src[s : s + k]


def _coords(reader: DirectReader, chunk: int) -> tuple[int, ...]:
    return (int(chunk), *(0,) * (len(reader.shape) - 1))


def _chunk_view(decoded: np.ndarray, plan: ReadPlan, offset: int) -> np.ndarray:
    return decoded[offset : offset + plan.chunk_nbytes].view(plan.dtype).reshape(plan.chunk_shape)


def _cpu_decoder(plan: ReadPlan, reader: DirectReader):
    """``decode(chunk, staging_offset, nbytes, decoded_offset, staging, decoded)``: one
    chunk's stored bytes into its slot, for a plan of a compressed kind, raising
    ChunkReadError that names the chunk."""
    n_out = plan.chunk_nbytes
    if plan.kind in ("zstd", "lz4"):
        # check_frames has checked each frame's content size (zstd) or size header (lz4).
        # nvCOMP gets the bare LZ4 block; numcodecs wants the 4-byte size header in front
        # of it, which the plan read too
        codec = numcodecs.Zstd() if plan.kind == "zstd" else numcodecs.LZ4()

        def raw(stored: np.ndarray, dst: np.ndarray) -> None:
            codec.decode(stored, out=dst)

    else:  # "host": the reader's own decoder (same codecs, chunk shape, dtype)
        chunk_decoder = reader.decoder

        def raw(stored: np.ndarray, dst: np.ndarray) -> None:
            chunk_decoder.decode_into(stored, dst.view(plan.dtype).reshape(plan.chunk_shape))

    def decode(chunk, offset, nbytes, dst_offset, staging, decoded) -> None:
        try:
            raw(staging[offset : offset + nbytes], decoded[dst_offset : dst_offset + n_out])
        except DecodeError as e:  # the ChunkDecoder's own errors say what failed
            raise reader.chunk_error(_coords(reader, chunk), str(e)) from e
        except Exception as e:  # numcodecs raises RuntimeError/ValueError
            raise reader.chunk_error(
                _coords(reader, chunk), f"{plan.kind} decoding failed ({e})"
            ) from e

    return decode


# ---------------------------------------------------------------------------- GPU executor


@dataclass(frozen=True)
class GpuSupport:
    """What this process can use for the GPU path (:func:`probe_gpu`)."""

    cuda: bool
    dali_gpu: bool  # DALI's GPU backend and cupy (our device buffers) see a device
    kvikio: bool
    gds: bool  # kvikio reads with GPUDirect Storage (False: compat mode, POSIX + copies)
    nvcomp: bool
    reason: str  # why the GPU path is unusable ("" when it is usable)

    @property
    def usable(self) -> bool:
        return self.cuda and self.dali_gpu


def probe_gpu() -> GpuSupport:
    """Probe CUDA, DALI's GPU backend, kvikio (and GDS) and nvCOMP; never raises."""
    why = []
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
    except Exception:  # torch missing or broken CUDA init
        cuda = False
    if not cuda:
        why.append("torch sees no CUDA device")
    try:
        from nvidia.dali import backend

        dali_gpu = cuda and backend.GetCUDADeviceCount() > 0
    except Exception:
        dali_gpu = False
    if cuda and not dali_gpu:
        why.append("DALI's GPU backend sees no device")
    try:
        import cupy

        has_cupy = cuda and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        has_cupy = False
    if cuda and not has_cupy:
        why.append("cupy (device buffers of the GPU path) is missing or sees no device")
    kvikio = gds = False
    try:
        import kvikio as _kvikio  # noqa: F401
        import kvikio.defaults as kd

        kvikio = True
        compat = getattr(kd, "is_compat_mode_preferred", None) or getattr(kd, "compat_mode", None)
        gds = bool(cuda and compat is not None and not compat())
    except Exception:
        pass
    nvcomp = False
    try:
        import nvidia.nvcomp  # noqa: F401

        nvcomp = cuda
    except Exception:
        pass
    return GpuSupport(cuda, dali_gpu and has_cupy, kvikio, gds, nvcomp, "; ".join(why))


#: environment switch: how chunk bytes reach device memory (:func:`read_method`)
READS_ENV = "DALI_ZARR_GPU_READS"


def decodes_on_device(plan_kind: str, *, nvcomp: bool) -> bool:
    """Whether a plan of ``plan_kind`` is read into device memory and decoded there: its
    chunks are uncompressed, or nvCOMP decodes them. Otherwise the window is read and decoded
    on the host and copied once."""
    return plan_kind in GPU_KINDS and (plan_kind == "none" or nvcomp)


def read_method(support: GpuSupport) -> str:
    """How chunk bytes reach device memory: ``"kvikio"`` (``CuFile.pread``: GPUDirect Storage
    where the system has it, compat mode otherwise) when kvikio is installed, else
    ``"pinned"`` (``os.preadv`` of the plan's extents on the reader's threads into pinned
    memory, then one copy). ``DALI_ZARR_GPU_READS=pinned`` (or ``kvikio``) chooses."""
    want = os.environ.get(READS_ENV, "").strip().lower()
    if want not in ("", "kvikio", "pinned"):
        raise ConfigError(f"{READS_ENV}={want!r}: use 'kvikio' or 'pinned', or leave it unset")
    if want == "kvikio" and not support.kvikio:
        raise ConfigError(
            f"{READS_ENV}=kvikio, but kvikio is not installed (pip install kvikio-cu12)"
        )
    return "pinned" if want == "pinned" or not support.kvikio else "kvikio"


def describe_path(plan_kind: str, reason: str, support: GpuSupport) -> str:
    """One line for ``read_paths()``: how an array's windows reach the GPU."""
    if not decodes_on_device(plan_kind, nvcomp=support.nvcomp):
        if plan_kind in GPU_KINDS:
            return (
                "gpu: host read and decode (nvCOMP unavailable) into pinned memory, one copy to "
                "the device"
            )
        return (
            f"gpu: host read and decode ({reason or plan_kind}) into pinned memory, one copy to "
            "the device (`dali-zarr inspect STORE` prints the `dali-zarr convert` command that "
            "rewrites it in zstd, decoded on the device)"
        )
    if read_method(support) == "pinned":
        io = "pread into pinned memory, one copy"
        if not support.kvikio:
            io += " (kvikio unavailable)"
    else:
        io = "kvikio GDS" if support.gds else "kvikio compat"
        threads = kvikio_threads()
        io += f", {threads} threads" if threads else ""
    if plan_kind == "none":
        return f"gpu: {io} → device, no decode (uncompressed)"
    if nvcomp_batched.use_c_api():
        api = "C API"
    elif nvcomp_batched.enabled():
        api = f"Python API: the C API did not load ({nvcomp_batched.load_error()})"
    else:
        api = f"Python API, {nvcomp_batched.ENV_SWITCH}=0"
    return f"gpu: {io} → device, nvCOMP {plan_kind} ({api})"


_KVIKIO_POOL_LOCK = threading.Lock()
#: how often a kvikio file is opened again where its path was renamed over between the opens
_CUFILE_OPENS = 3


#: the soft limit of open files :func:`room_for_open_files` asks for (at most the hard one)
OPEN_FILES_WANTED = 1 << 16


@functools.cache
def room_for_open_files() -> int:
    """Raise this process's soft limit of open files towards :data:`OPEN_FILES_WANTED` (never
    past the hard limit, which any process may do); returns the soft limit now.

    Every reader thread's executor keeps up to 256 kvikio files open, and a window of an
    unsharded store has all of its chunk files in flight at once; a kvikio file may hold two
    descriptors (with and without O_DIRECT). 4 threads on such a store pass the usual soft
    limit of 1,024, and the reads would fail with "Too many open files".
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(OPEN_FILES_WANTED, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def kvikio_threads(want: int | None = None) -> int:
    """kvikio's thread pool size (0 when unknown), first raised to ``want`` threads if it is
    smaller and the user did not set ``KVIKIO_NTHREADS`` (or ``KVIKIO_NUM_THREADS``).

    kvikio serves every ``CuFile.pread`` of the process from one pool of 1 thread by default,
    so the reads of all reader threads queued behind each other (compat mode on the H100:
    ~6 GB/s, a third of a window's time).
    """
    try:
        import kvikio.defaults as kd

        with _KVIKIO_POOL_LOCK:  # reader threads build their executors concurrently
            have = int(kd.get("num_threads"))
            user_set = any(k in os.environ for k in ("KVIKIO_NTHREADS", "KVIKIO_NUM_THREADS"))
            if want is not None and want > have and not user_set:
                kd.set("num_threads", want)
                have = int(kd.get("num_threads"))
        return have
    except Exception:  # no kvikio, or one without defaults.get/set (before 25.x)
        return 0


class GpuPlanExecutor:
    """Runs :class:`ReadPlan`s on one CUDA device (kvikio reads, nvCOMP decode, one copy kernel).

    CI has no GPU: this ran on an H100 (README "GPU path"), one executor per reader thread
    (it is not shared: one plan at a time, reused buffers). Imports kvikio, cupy and nvCOMP
    when constructed; without kvikio (or with ``DALI_ZARR_GPU_READS=pinned``) it reads with
    ``os.preadv`` into pinned memory and copies; without nvCOMP, compressed chunks take the
    host decode path.
    """

    def __init__(
        self, device_id: int = 0, *, max_open_files: int = 256, support: GpuSupport | None = None
    ) -> None:
        import cupy

        self.cp = cupy
        self.device_id = int(device_id)
        self.device = cupy.cuda.Device(self.device_id)
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
        # one probe decides both what runs and what read_paths() reports: the caller's
        # (CudaBackend shares its own with every reader thread's executor), else a new one
        self.support = support if support is not None else probe_gpu()
        #: "kvikio" or "pinned" (:func:`read_method`)
        self.reads = read_method(self.support)
        self._kvikio = importlib.import_module("kvikio") if self.reads == "kvikio" else None
        if self._kvikio is not None:
            kvikio_threads(kvikio_pool_size())
            room_for_open_files()
        self._nvcomp = importlib.import_module("nvidia.nvcomp") if self.support.nvcomp else None
        self._codecs: dict[str, Any] = {}
        # nvCOMP's C API unless DALI_ZARR_NVCOMP_BATCHED=0 (its Python codecs; see nvcomp_batched)
        self._use_batched = nvcomp_batched.use_c_api()
        self._batched: dict[str, nvcomp_batched.BatchedDecoder] = {}
        #: path -> (the file's (inode, mtime, size) when opened, its kvikio CuFile)
        self._files: OrderedDict[str, tuple[tuple[int, ...], Any]] = OrderedDict()
        self._replaced: list[Any] = []  # handles of files rewritten since, closed when idle
        self._max_open = max_open_files
        self._buffers: dict[str, Any] = {}
        self._pinned: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()  # one plan at a time (buffers are reused)
        self._closed = False

    # -- resources ----------------------------------------------------------------------------

    def _device_buffer(self, key: str, nbytes: int):
        """A reused device buffer of at least ``nbytes`` that starts on a :data:`PAGE` (cupy's
        pool aligns to 512 bytes only; the staging extents are laid out in pages)."""
        buf = self._buffers.get(key)
        if buf is None or buf.size < nbytes:
            self.stream.synchronize()  # the old buffer may still be read by queued work
            size = max(nbytes, 1 << 20, 0 if buf is None else 2 * buf.size)
            raw = self.cp.empty(size + PAGE, "u1")
            skip = -raw.__cuda_array_interface__["data"][0] % PAGE
            buf = raw[skip : skip + size]
            self._buffers[key] = buf
        return buf[:nbytes]

    def _pinned_buffer(self, key: str, nbytes: int) -> np.ndarray:
        buf = self._pinned.get(key)
        if buf is None or buf.size < nbytes:
            size = max(nbytes, 1 << 20, 0 if buf is None else 2 * buf.size)
            mem = self.cp.cuda.alloc_pinned_memory(size)
            buf = np.frombuffer(mem, dtype=np.uint8, count=size)
            self._pinned[key] = buf
        return buf[:nbytes]

    def _cufile(self, path: str) -> tuple[Any, tuple[int, ...]]:
        """An open kvikio file of ``path``, reused while the file at ``path`` is the one it
        opened, and the :data:`FILE_STAMP` of the file it reads.

        zarr rewrites a chunk or shard by writing a new file and renaming it over the old
        one: a handle kept by path would go on reading the old file, at offsets the reader
        planned from the new shard index (the CPU path opens each file per read, and the
        reader re-reads an index whose file changed). So the path's stamp is compared with
        the handle's, one stat per file and plan. A new handle is stamped through its own
        descriptor: a stat of the path before the open would describe the old file where a
        new one was renamed over it in between. kvikio opens the path twice, so the path is
        looked at once more after the opens (at most :data:`_CUFILE_OPENS` tries)."""
        held = self._files.get(path)
        if held is not None and held[0] == _file_stamp(path):
            self._files.move_to_end(path)
            return held[1], held[0]
        if held is not None:  # rewritten: a read of this plan may still use the old handle
            del self._files[path]
            self._replaced.append(held[1])
        for _ in range(_CUFILE_OPENS):
            # kvikio's open waits on a named pipe (for a writer): refuse what is not a
            # regular file before it (a pipe swapped in after this stat still would block)
            if stored_stamp(path) is None:
                raise FileNotFoundError(f"no file at {path}")
            f = self._kvikio.CuFile(path, "r")
            try:
                stamp = stamp_of(os.fstat(f.fileno()))
                # kvikio opens the path twice and reads with GDS through the second, O_DIRECT
                # descriptor, which fileno() does not give: the path still holding the file
                # stamped (kept open, so its inode is not reused) shows both opened that one
                same = _file_stamp(path) == stamp
            except BaseException:
                f.close()
                raise
            if same:
                self._files[path] = (stamp, f)
                return f, stamp
            f.close()  # renamed over between its opens: open it again
        raise OSError(f"the file was replaced {_CUFILE_OPENS} times as it was opened")

    def _trim_files(self) -> None:
        """Close the least recently used files beyond the cap, and the handles of files
        rewritten since they were opened (no read is in flight)."""
        while self._replaced:
            self._replaced.pop().close()
        while len(self._files) > self._max_open:
            self._files.popitem(last=False)[1][1].close()

    def _codec(self, kind: str):
        codec = self._codecs.get(kind)
        if codec is None:
            nv = self._nvcomp
            codec = nv.Codec(
                algorithm=nvcomp_batched.ALGORITHM[kind],
                bitstream_kind=nv.BitstreamKind.RAW,
                device_id=self.device_id,
                cuda_stream=self.stream.ptr,
            )
            self._codecs[kind] = codec
        return codec

    def close(self) -> None:
        """Close the files and codecs, after the plan being run, if any (its reads use
        them); a plan run later is refused (see :meth:`run`)."""
        with self._lock:
            self._closed = True
            for _, f in self._files.values():
                f.close()
            self._files.clear()
            while self._replaced:
                self._replaced.pop().close()
            self._drop_codecs()

    def _drop_codecs(self) -> None:
        """Destroy the nvCOMP codecs while their stream still exists: a codec outliving its
        stream crashed the process (seen on an H100 when the garbage collector freed the
        stream first)."""
        if self._codecs:
            self.stream.synchronize()
            self._codecs.clear()

    def __del__(self) -> None:
        # runs before the collector clears this object's attributes (PEP 442)
        with contextlib.suppress(Exception):
            self._drop_codecs()

    # -- running a plan -------------------------------------------------------------------------

    def path_of(self, plan: ReadPlan) -> str:
        """How this executor serves ``plan``'s array: "device" or "host" decode."""
        return "device" if decodes_on_device(plan.kind, nvcomp=self.support.nvcomp) else "host"

    def run(self, plan: ReadPlan, reader: DirectReader, out: Any) -> Any:
        """Fill the device array ``out`` (``plan.out_shape``, ``plan.dtype``) with the window.

        Returns ``out`` once every copy into it has completed (the stream is synchronised).
        """
        self.run_many([(plan, reader, out)])
        return out

    def run_many(self, jobs: Sequence[tuple[ReadPlan, DirectReader, Any]]) -> None:
        """Fill each job's device array ``out`` with its plan's window, all plans together:
        every read in flight at once, one look at the frames, one nvCOMP call per codec kind
        (of at most :data:`nvcomp_batched.CALL_NBYTES`), one stream sync at the end.

        Why together: a window of a CSR store is two plans (``data``, ``indices``). Run one
        after the other, each waited for its reads and then for its decode call, and on the
        H200 (2026-11-27) a call of ~220 large zstd chunks took ~20 ms however many chunks
        it held: the window paid two. Each plan has its own region of the executor's
        buffers (:func:`place_jobs`). Returns once every copy has completed.
        """
        if not jobs:
            return
        with self._lock, self.device, self._in_flight_finished():
            if self._closed:  # a reader thread outliving its loader's close(): it would
                # open files and codecs again that nothing closes
                raise RuntimeError(f"{jobs[0][1].name}: this GPU executor was closed")
            placed, staging_nbytes, decoded_nbytes = place_jobs(jobs)
            on_device = [p for p in placed if self.path_of(p.plan) == "device"]
            on_host = [p for p in placed if self.path_of(p.plan) == "host"]
            if on_host or self.reads == "pinned":  # each job's regions, as on the device
                self._pinned_buffer("staging", staging_nbytes)
                self._pinned_buffer("decoded", decoded_nbytes)
            decoded = self._device_buffer("decoded", decoded_nbytes)
            staged = any(not p.plan.reads_into_chunk_buffer for p in on_device)
            staging = self._device_buffer("staging", staging_nbytes) if staged else None
            self._read_to_device(on_device, staging, decoded)
            decodes = self._checked_frames(on_device, staging)
            owners = self._nvcomp_decode(
                [(p, on_gpu) for p, on_gpu, _ in decodes], staging, decoded
            )
            for p, _, on_cpu in decodes:
                self._decode_on_host(p, staging, decoded, on_cpu)
            for p in on_host:  # decoded here while the device decodes what was queued
                host = decode_plan_cpu(
                    p.plan,
                    p.reader,
                    _staging_region(self._pinned["staging"], p),
                    _decoded_region(self._pinned["decoded"], p),
                )
                _decoded_region(decoded, p).set(host, stream=self.stream)
            with self.stream:
                for p in on_device:
                    for slot in p.plan.fill_slots:
                        off = p.decoded_at + slot * p.plan.slot_nbytes
                        chunk = decoded[off : off + p.plan.chunk_nbytes].view(p.plan.dtype)
                        chunk.fill(p.plan.fill_value)
            for p in placed:
                src = _decoded_region(decoded, p).view(p.plan.dtype)
                self.copy_segments(p.out.reshape(-1), src, p.plan.segments)
            self.stream.synchronize()
            for kind, (group, job_of, read_of) in owners.items():
                for i, why in self._batched[kind].check():
                    p = group[int(job_of[i])]
                    chunk = p.plan.reads["chunk"][read_of[i]]
                    raise p.reader.chunk_error(_coords(p.reader, chunk), why)

    def _checked_frames(
        self, jobs: list[_Placed], staging
    ) -> list[tuple[_Placed, np.ndarray, np.ndarray]]:
        """Check the frames of every compressed job (the reads have completed) and say which
        of its chunks nvCOMP decodes and which the host: ``(job, on_gpu, on_cpu)``, indices
        into its plan's reads. The host takes the zstd frames nvCOMP cannot be trusted with
        (:func:`frames_without_size`, and frames of too many blocks for the host walk)."""
        framed = [p for p in jobs if p.plan.has_frames]
        heads = dict(
            zip((p.index for p in framed), self._frame_heads(framed, staging), strict=True)
        )
        for p in framed:
            check_frames(p.plan, p.reader, heads[p.index])
        walked = [p for p in framed if p.plan.kind == "zstd"]
        walks = self._frame_ends(walked, [heads[p.index] for p in walked], staging)
        ends = dict(zip((p.index for p in walked), walks, strict=True))
        out = []
        for p in jobs:
            if p.plan.kind == "none":
                continue
            on_cpu = np.zeros(0, np.int64)
            if p.index in ends:
                unwalked = check_frame_ends(p.plan, p.reader, ends[p.index])
                on_cpu = np.union1d(frames_without_size(heads[p.index]), unwalked)
            out.append((p, np.setdiff1d(np.arange(len(p.plan.reads)), on_cpu), on_cpu))
        return out

    @contextlib.contextmanager
    def _in_flight_finished(self):
        """On an error, wait for the work already queued on the stream (reads, decodes,
        copies into the caller's slot) before the buffers are reused or handed back, and
        forget the failed decode's status table."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # a sticky CUDA error: report the first
                self.stream.synchronize()
            for decoder in self._batched.values():
                decoder.forget()
            raise

    def copy_segments(self, out: Any, src: Any, segments: np.ndarray) -> None:
        """One launch of ``cuda_kernels.copy_segments`` on this executor's stream, long
        segments cut into pieces (a block each)."""
        if not len(segments):
            return
        from dali_zarr.graph import cuda_kernels

        pieces = split_segments(segments)
        with self.stream:
            seg = self.cp.asarray(np.ascontiguousarray(pieces.T))
        blocks = min(len(pieces), 1 << 16)
        launch(cuda_kernels.copy_segments, blocks, 256, self.stream, out, src, *seg)

    def _read_to_device(self, jobs: list[_Placed], staging, decoded) -> None:
        """Every extent of every job into its :func:`_read_region`, all in flight at once:
        kvikio ``CuFile.pread`` (its thread pool), or with ``reads="pinned"`` ``os.preadv``
        on the readers' threads into pinned memory and one copy a job."""
        if self.reads == "pinned":  # the pinned regions the host decode path reads into
            pinned = self._pinned["staging"], self._pinned["decoded"]
            hosts = [_read_region(p, *pinned) for p in jobs]
            work = [(p.plan, p.reader, host) for p, host in zip(jobs, hosts, strict=True)]
            read_extents_cpu_many(work)
            for p, host in zip(jobs, hosts, strict=True):
                _read_region(p, staging, decoded).set(host, stream=self.stream)
            return
        pending: list[tuple[_Placed, int, int, Any]] = []
        error = None
        try:
            for p in jobs:
                error = self._submit_reads(p, _read_region(p, staging, decoded), pending)
                if error is not None:
                    break
        finally:
            # every read must be over before we raise: kvikio's pool would otherwise go on
            # writing into buffers the next plan reuses (or cupy hands to another owner).
            # An extent in flight comes before one that raised at once: it names the error.
            failed_at_once, error = error, None
            for p, i, size, future in pending:
                try:
                    got = future.get()
                except Exception as e:  # kvikio raises at end of file rather than read short
                    error = error or _kvikio_read_failed(p.reader, p.plan, i, e)
                    continue
                if got != size and error is None:
                    error = _extent_error(
                        p.reader, p.plan, i, got, f"read {got} of {size} bytes (file shrank)"
                    )
        error = error or failed_at_once
        if error is not None:
            raise error
        self._trim_files()

    def _submit_reads(self, job: _Placed, target, pending: list) -> Exception | None:
        """Start a kvikio read of each extent of ``job`` into ``target``, appending
        ``(job, extent, nbytes, future)`` to ``pending``; returns the error of a read that
        raised at once (the reads before it are in flight), None otherwise."""
        plan, reader = job.plan, job.reader
        handles: dict[int, Any] = {}  # one look at each file per plan
        for i, f, offset, size, dest in plan.extent_jobs():
            file = handles.get(f)
            if file is None:
                try:
                    file, stamp = self._cufile(plan.files[f])
                except Exception as e:  # gone since planned (a chunk set to fill)
                    raise _extent_error(reader, plan, i, 0, f"opening failed ({e})") from e
                _refuse_changed_file(plan, reader, i, stamp)
                handles[f] = file
            try:
                future = file.pread(target[dest : dest + size], size, offset)
            except Exception as e:  # kvikio 26.10 reads a small extent at once, raising here
                return _kvikio_read_failed(reader, plan, i, e)
            pending.append((job, i, size, future))
        return None

    def _frame_ends(
        self, jobs: list[_Placed], heads: list[np.ndarray], staging
    ) -> list[np.ndarray]:
        """Where each zstd frame of each job ends by its block headers (the reads have
        completed; ``heads``: each job's :meth:`_frame_heads`): walked on the host in the
        pinned buffer the reads went through (frames of more blocks than
        :func:`~dali_zarr.io.codecs.zstd_block_walk_limit` give -2), or by
        ``cuda_kernels.zstd_frame_ends`` in device memory, one launch for all jobs and 8
        bytes a frame copied back."""
        if not jobs:
            return []
        rows = []  # per job: frame starts in the buffer, sizes, first block, checksum bytes
        for p, head in zip(jobs, heads, strict=True):
            first_block, checksum = zstd_walk_from(head)
            starts = p.plan.reads["staging_offset"] + p.staging_at
            rows.append(np.stack([starts, p.plan.reads["nbytes"], first_block, checksum]))
        if self.reads == "pinned":
            staged = self._pinned["staging"]
            limits = [zstd_block_walk_limit(p.plan.chunk_nbytes) for p in jobs]
            return [zstd_frame_ends(staged, *row, n) for row, n in zip(rows, limits, strict=True)]
        from dali_zarr.graph import cuda_kernels

        table = np.concatenate(rows, axis=1).astype(np.int64)
        with self.stream:  # one copy up, its rows the kernel's four arrays (as copy_segments)
            args = self.cp.asarray(table)
            ends = self.cp.empty(table.shape[1], dtype=np.int64)
        blocks = max(1, min(-(-table.shape[1] // 128), 1 << 16))
        launch(cuda_kernels.zstd_frame_ends, blocks, 128, self.stream, ends, staging, *args)
        host = self.cp.asnumpy(ends, stream=self.stream)
        self.stream.synchronize()
        return np.split(host, np.cumsum([row.shape[1] for row in rows])[:-1])

    def _frame_heads(self, jobs: list[_Placed], staging) -> list[np.ndarray]:
        """The first bytes of every stored chunk of each job, on the host
        (:func:`check_frames`): from the pinned buffer the reads went through, or gathered
        on the device in one gather and one copy back (18 bytes a chunk; the kvikio reads
        have completed)."""
        if not jobs:
            return []
        index = [
            head_index(p.plan.reads["staging_offset"], p.plan.staging_nbytes) + p.staging_at
            for p in jobs
        ]
        flat = np.concatenate(index)
        if self.reads == "pinned":
            host = self._pinned["staging"][flat]
        else:
            with self.stream:
                heads = staging[self.cp.asarray(flat)]
            host = self.cp.asnumpy(heads, stream=self.stream)
            self.stream.synchronize()
        return np.split(host, np.cumsum([len(i) for i in index])[:-1])

    def _decode_on_host(self, job: _Placed, staging, decoded, reads: np.ndarray) -> None:
        """Decode the stored chunks ``reads`` (indices into ``job``'s plan's reads) on the
        host and put them in their slots: frames kept from nvCOMP (:func:`frames_without_size`,
        or too many blocks for the host walk). Each one's stored bytes (with any header, as
        :func:`decode_plan_cpu` gives them to the same decoder) are copied back, decoded
        with numcodecs (which checks the decoded size) and copied up: few chunks, if any."""
        if not len(reads):
            return
        plan = job.plan
        decode = _cpu_decoder(plan, job.reader)
        jobs = plan.reads[["chunk", "staging_offset", "nbytes", "decoded_offset"]][reads]
        chunk = np.empty(plan.chunk_nbytes, np.uint8)
        for c, start, n, dst in jobs.tolist():
            start, dst = start + job.staging_at, dst + job.decoded_at
            stored = self.cp.asnumpy(staging[start : start + n], stream=self.stream)
            self.stream.synchronize()
            decode(c, 0, n, 0, stored, chunk)
            decoded[dst : dst + len(chunk)].set(chunk, stream=self.stream)
            self.stream.synchronize()  # ``chunk`` is pageable memory, written again next

    def _nvcomp_decode(
        self, jobs: list[tuple[_Placed, np.ndarray]], staging, decoded
    ) -> dict[str, tuple[list[_Placed], np.ndarray, np.ndarray]]:
        """Each job's chunks ``reads`` (raw zstd frames / LZ4 blocks; indices into its plan's
        reads) decoded by nvCOMP: by default through its C API (:mod:`nvcomp_batched`), the
        chunks of every job of a kind in one enqueue (calls of up to
        :data:`nvcomp_batched.CALL_NBYTES` decoded bytes). Returns, per kind enqueued, who
        owns each chunk of it: ``(jobs, job of each chunk, read of each chunk)``, to name a
        chunk the decoder's check after the stream sync finds failed.

        The C API takes the decoded sizes (the plans know them), so nothing parses
        headers, and the call only enqueues work on our stream with the GIL released.
        nvCOMP's Python ``decode`` (``DALI_ZARR_NVCOMP_BATCHED=0``, or where the C API does
        not load) parses every frame's header and synchronises inside the call, holding the
        GIL: on the H200 (2026-11-26) the loader was 2.3-2.7x slower with it.
        """
        jobs = [(p, reads) for p, reads in jobs if len(reads)]
        if not self._use_batched:
            for p, reads in jobs:
                self._nvcomp_decode_python(p, reads, staging, decoded)
            return {}
        owners = {}
        for kind in dict.fromkeys(p.plan.kind for p, _ in jobs):
            group = [(p, reads) for p, reads in jobs if p.plan.kind == kind]
            table: list[list[np.ndarray]] = [[], [], [], []]  # stored at, stored n, decoded at, n
            for p, reads in group:
                src_off, src_nbytes = p.plan.decode_sources(p.staging_at)
                table[0].append(src_off[reads])
                table[1].append(src_nbytes[reads])
                table[2].append(p.plan.reads["decoded_offset"][reads] + p.decoded_at)
                table[3].append(np.full(len(reads), p.plan.chunk_nbytes))
            src_off, src_nbytes, dst_off, sizes = (np.concatenate(column) for column in table)
            decoder = self._batched.get(kind)
            if decoder is None:
                decoder = nvcomp_batched.BatchedDecoder(kind, self.cp, self.stream)
                self._batched[kind] = decoder
            decoder.enqueue(staging, src_off, src_nbytes, decoded, dst_off, sizes)
            job_of = np.repeat(np.arange(len(group)), [len(r) for _, r in group])
            owners[kind] = ([p for p, _ in group], job_of, np.concatenate([r for _, r in group]))
        return owners

    def _nvcomp_decode_python(self, job: _Placed, reads: np.ndarray, staging, decoded) -> None:
        """``job``'s chunks ``reads`` through nvCOMP's Python codec (see :meth:`_nvcomp_decode`)."""
        plan, nv, n_out = job.plan, self._nvcomp, job.plan.chunk_nbytes
        src_off, src_nbytes = (a[reads] for a in plan.decode_sources(job.staging_at))
        dst_off = plan.reads["decoded_offset"][reads] + job.decoded_at
        pairs = list(zip(src_off.tolist(), src_nbytes.tolist(), dst_off.tolist(), strict=True))
        results, stream = [], self.stream.ptr
        for call in nvcomp_batched.call_slices(np.full(len(pairs), n_out)):
            srcs = nv.as_arrays([staging[s : s + n] for s, n, _ in pairs[call]], stream)
            # as nvCOMP arrays: nvCOMP 5.3 segfaults when ``out`` holds cupy arrays directly
            dsts = nv.as_arrays([decoded[d : d + n_out] for _, _, d in pairs[call]], stream)
            try:
                results += self._codec(plan.kind).decode(srcs, data_type="|u1", out=dsts)
            except Exception as e:
                raise ChunkReadError(
                    f"{plan.name}: nvCOMP {plan.kind} decoding of {len(srcs)} chunks failed ({e})"
                ) from e
        for chunk, res in zip(plan.reads["chunk"][reads].tolist(), results, strict=True):
            size = getattr(res, "buffer_size", n_out)
            if size != n_out:
                raise job.reader.chunk_error(
                    _coords(job.reader, chunk),
                    f"{plan.kind} chunk decoded to {size} bytes, expected {n_out}",
                )


class _Placed(NamedTuple):
    """A job of :meth:`GpuPlanExecutor.run_many` and where its bytes go: its staging and its
    chunk buffer start ``staging_at`` and ``decoded_at`` bytes into the executor's buffers
    (device, and pinned where used). ``index``: its place among the call's jobs."""

    index: int
    plan: ReadPlan
    reader: DirectReader
    out: Any
    staging_at: int
    decoded_at: int


def place_jobs(
    jobs: Sequence[tuple[ReadPlan, DirectReader, Any]],
) -> tuple[list[_Placed], int, int]:
    """Each job's regions in one staging and one chunk buffer, back to back, each starting on
    a :data:`PAGE` (a plan lays out its own reads from a page boundary: O_DIRECT and GDS
    reads need it); returns the placed jobs and the two buffers' sizes."""
    placed, staging_at, decoded_at = [], 0, 0
    for index, (plan, reader, out) in enumerate(jobs):
        placed.append(_Placed(index, plan, reader, out, staging_at, decoded_at))
        staging_at += round_up(plan.staging_nbytes, PAGE)
        decoded_at += round_up(plan.decoded_nbytes, PAGE)
    return placed, staging_at, decoded_at


def _decoded_region(buf: Any, job: _Placed) -> Any:
    """``job``'s chunk buffer: its region of ``buf`` (device or pinned)."""
    return buf[job.decoded_at : job.decoded_at + job.plan.decoded_nbytes]


def _staging_region(buf: Any, job: _Placed) -> Any:
    """``job``'s staging: its region of ``buf`` (device or pinned)."""
    return buf[job.staging_at : job.staging_at + job.plan.staging_nbytes]


def _read_region(job: _Placed, staging: Any, decoded: Any) -> Any:
    """Where ``job``'s extents are read: its staging region, or its chunk buffer region when
    uncompressed (of the device buffers, or of the pinned ones)."""
    if job.plan.reads_into_chunk_buffer:
        return _decoded_region(decoded, job)
    return _staging_region(staging, job)


_JITTED: dict[Any, Any] = {}


def cuda_jit(fn):
    """``fn`` compiled with ``numba.cuda.jit`` once per process (after the toolkit mends of
    :func:`~dali_zarr.graph.cuda_kernels.numba_cuda_compat`)."""
    from numba import cuda

    from dali_zarr.graph.cuda_kernels import numba_cuda_compat

    kernel = _JITTED.get(fn)
    if kernel is None:
        numba_cuda_compat()
        kernel = _JITTED[fn] = cuda.jit(fn)
    return kernel
