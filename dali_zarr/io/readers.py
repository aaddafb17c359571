"""Row readers for zarr arrays: the direct path (pread + our decode) and the zarr fallback.

`open_reader(array, name=...)` returns an `ArrayReader`. Which reader serves an array:

* ``DirectReader`` (``path == "direct"``): the array lives in a ``zarr.storage.LocalStore``
  (a directory on the local filesystem) and every part of its layout is handled by
  `layout.parse_layout` / `codecs.ChunkDecoder`:

  - zarr format 2: any fixed-size numeric dtype of either byte order, ``order`` "C" or "F",
    either ``dimension_separator``, a numcodecs ``compressor`` and numcodecs ``filters``;
  - zarr format 3: a regular chunk grid, optional ``numcodecs.{delta, fixedscaleoffset,
    astype, quantize, bitround}`` array→array codecs, the ``bytes`` codec (little or big
    endian), then any of ``zstd``, ``blosc``, ``gzip``, ``crc32c`` and the numcodecs
    bytes→bytes codecs (``numcodecs.lz4``, ``numcodecs.zstd``, ``numcodecs.blosc``,
    ``numcodecs.gzip``, ``numcodecs.zlib``, ``numcodecs.bz2``, ``numcodecs.lzma``,
    ``numcodecs.crc32c`` and the other numcodecs checksums, ``numcodecs.shuffle``);
  - zarr format 3 ``sharding_indexed`` as the only codec, with the inner chunks encoded as
    above and the index encoded with ``bytes`` (+ optional ``crc32c``), at the start or end.

* ``ZarrReader`` (``path == "zarr"``, ``reason`` says why) in every other case:

  - ``force_zarr=True`` was passed;
  - the store is not a ``LocalStore`` (``MemoryStore``, ``ZipStore``, ``FsspecStore``/remote,
    wrapper stores such as ``LoggingStore``);
  - a dtype that is not fixed-size numeric (strings, bytes, objects, structured dtypes) or a
    fill value that cannot be cast to the dtype;
  - a codec the direct path does not decode: ``transpose``, ``vlen-*``, ``numcodecs.pcodec``,
    ``numcodecs.zfpy``, ``numcodecs.packbits``, codecs before/after ``sharding_indexed``,
    nested sharding, index codecs other than ``bytes`` [+ ``crc32c``], any unknown codec,
    or a numcodecs codec that numcodecs cannot build here;
  - storage transformers or a chunk grid other than ``regular``.

Both readers return native-endian data: a big-endian format 2 array (dtype ``>f4``) is read
as ``float32``. A format 3 array whose numcodecs filter sits before a big-endian ``bytes``
codec is not given to ``ZarrReader`` (zarr-python reads its values byte-swapped:
`layout.zarr_misreads`); the direct path decodes it right. A missing chunk file (zarr
does not write chunks equal to the fill value), a missing shard, or an empty inner chunk of
a shard reads as the fill value; a format 2 array whose chunk files use the other
``dimension_separator`` than its ``.zarray`` says (all of them would be "missing") is
refused at open.

The direct reader caches each shard's index (a few KiB) the first time it reads that shard
and checks the shard file's stamp before each use (a shard rewritten in place is indexed
anew); both readers check the array's metadata file before and after each ``read_rows``
(see :class:`_MetadataWatch`), so an array rewritten meanwhile is refused.

Each chunk a ``read_rows`` call touches is read and decoded once. When the call's ranges
need a chunk only up to some row short of its end and the chunk is zstd-compressed in C
order, only that prefix of the zstd frame is decoded (see `ChunkDecoder.decode_prefix_into`;
corruption past the prefix then goes unnoticed, the rows returned are still exact).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import product
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from ..distributed import cpu_share
from ..errors import ChunkReadError, DatasetError
from ..planning.partition import concat_aranges, run_offsets, split_at_chunks
from . import buffers
from .codecs import ChunkDecoder, DecodeError, blosc_header_problem, verify_crc32c
from .layout import (
    ArrayLayout,
    ShardLayout,
    blosc_frames,
    error_chain,
    missing_codec,
    parse_layout,
    zarr_misreads,
)

__all__ = [
    "FILE_STAMP",
    "WRITING",
    "ArrayReader",
    "ChunkLocations",
    "DirectReader",
    "ZarrReader",
    "default_executor",
    "open_reader",
]

_EMPTY = 2**64 - 1  # shard index entry (offset, nbytes) of an inner chunk that is not stored
#: how often a read reads a shard's index again when the shard keeps changing under it
_SHARD_REREADS = 3
_ADVICE = (
    "The store may be truncated or corrupted: re-write the array, or restore this chunk "
    "from an intact copy of the dataset."
)
#: for a file that changed between the look that located a chunk and its read: not damage
WRITING = (
    "Another process is writing the array (its files changed while it was read): read it "
    "again once the writer is done."
)
#: for a read that failed in the storage or network layer, before any byte was decoded
_IO_ADVICE = (
    "Fetching the bytes failed (a storage or network error), not decoding them: the store "
    "may well be intact. Check the connection, credentials and storage service, then go on "
    "from your last checkpoint (loader.state_dict())."
)
#: packages whose errors are a remote store's transport failing (fsspec's HTTP, S3, GCS, Azure)
_NETWORK_PACKAGES = frozenset(
    {"aiohttp", "botocore", "aiobotocore", "urllib3", "requests", "google", "azure"}
)


def _failed_fetching(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is the storage or network layer
    failing: a timeout, a lost connection, a denied access (fsspec's S3 store raises
    PermissionError for a 403), an OSError carrying an errno, or an error of a network
    package. A corrupted chunk fails in its decompressor, with
    errors that carry no errno (gzip's and bz2's OSErrors too)."""
    return any(
        isinstance(e, TimeoutError | ConnectionError | PermissionError)
        or (isinstance(e, OSError) and e.errno is not None)
        or type(e).__module__.split(".")[0] in _NETWORK_PACKAGES
        for e in error_chain(error)
    )


def _past_end(offset: int, nbytes: int, size: int) -> str:
    """The problem with a shard index entry that points past the end of its shard."""
    return (
        f"shard index says bytes [{offset}, {offset + nbytes}) but the shard file is {size} "
        "bytes (truncated shard or corrupted index)"
    )


class ChunkLocations(NamedTuple):
    """Stored bytes of a list of chunks (:meth:`DirectReader.chunk_locations`), as arrays."""

    files: tuple[str, ...]
    file: np.ndarray  # int32 index into ``files``; -1: not stored (reads as the fill value)
    offset: np.ndarray  # int64 byte offset in the file
    nbytes: np.ndarray  # int64 stored bytes
    #: :data:`FILE_STAMP`, one per file: the file as located. Read paths compare it with the
    #: file they read: a grown chunk file cut at its old size is a truncated frame that
    #: nvCOMP does not promise to report, and a shard rewritten at the same size holds its
    #: chunks at other offsets
    file_stamp: np.ndarray


@runtime_checkable
class ArrayReader(Protocol):
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    rows_per_chunk: int
    path: str
    reason: str

    def read_rows(self, ranges: np.ndarray, out: np.ndarray | None = None) -> np.ndarray: ...

    def chunk_where(self, coords: tuple[int, ...]) -> str: ...

    def check_unchanged(self) -> None: ...


# ---------------------------------------------------------------------------- executor

_default_pool: concurrent.futures.ThreadPoolExecutor | None = None
_default_pool_lock = threading.Lock()


def default_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The module-level pool used when a reader gets no executor: ``min(8, 2 * cores)``
    threads, over this process's share of the node's cores (:func:`cpu_share`: the
    ranks on a node split it), twice as many as cores because reads wait on the disk."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            n = min(8, 2 * cpu_share())
            _default_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=n, thread_name_prefix="dali_zarr_io"
            )
        return _default_pool


def _n_workers(executor: concurrent.futures.Executor) -> int:
    return int(getattr(executor, "_max_workers", 0) or 8)


class _WorkQueue:
    """Items run by the calling thread plus up to N pool threads, pulling from one list.

    The caller waits for the *items*, not for the pool tasks, so a read_rows call made from
    a thread of a saturated (or the same) pool still finishes: the caller does all the work
    itself if no pool thread is free. A pool task that starts late finds nothing left.
    """

    def __init__(self, items: Sequence[Any], fn: Callable[[Any], None]) -> None:
        self.items = items
        self.fn = fn
        self.lock = threading.Lock()
        self.next = 0
        self.remaining = len(items)
        self.done = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        items, fn, n = self.items, self.fn, len(self.items)
        while True:
            with self.lock:
                i = self.next
                self.next += 1
            if i >= n:
                return
            try:
                if self.error is None:
                    fn(items[i])
            except BaseException as e:
                with self.lock:
                    if self.error is None:
                        self.error = e
            finally:
                with self.lock:
                    self.remaining -= 1
                    if self.remaining == 0:
                        self.done.set()


def _run_parallel(
    executor: concurrent.futures.Executor, items: Sequence[Any], fn: Callable[[Any], None]
) -> None:
    if not items:
        return
    if len(items) == 1:
        fn(items[0])
        return
    q = _WorkQueue(items, fn)
    for _ in range(min(len(items) - 1, _n_workers(executor))):
        try:
            executor.submit(q.work)
        except RuntimeError:  # executor shut down: the calling thread does the work alone
            break
    q.work()
    q.done.wait()
    if q.error is not None:
        raise q.error


# ---------------------------------------------------------------------------- shared helpers


def check_ranges(ranges: Any, n: int, name: str) -> np.ndarray:
    """``ranges`` as a (k, 2) int64 array of row ranges within ``[0, n]``; anything else is
    refused (a negative start would otherwise index from the end and read other rows)."""
    r = np.asarray(ranges)
    if r.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if r.ndim != 2 or r.shape[1] != 2 or r.dtype.kind not in "iu":
        raise ValueError(f"{name}: ranges must be a (k, 2) integer array, got {r.dtype} {r.shape}")
    r = r.astype(np.int64, copy=False)
    bad = (r[:, 0] < 0) | (r[:, 0] > r[:, 1]) | (r[:, 1] > n)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"{name}: range {i} [{r[i, 0]}, {r[i, 1]}) is not within [0, {n}] with start <= stop"
        )
    return r


def _prepare_out(
    out: np.ndarray | None, total: int, shape: tuple[int, ...], dtype: np.dtype, name: str
) -> np.ndarray:
    want = (total, *shape[1:])
    if out is None:
        return buffers.empty(want, dtype)  # reused memory inside a window read
    if (
        not isinstance(out, np.ndarray)
        or out.shape != want
        or out.dtype != dtype
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(
            f"{name}: `out` must be a writeable C-contiguous {dtype} array of shape {want}, "
            f"got {got}"
        )
    return out


#: runs of at least this many elements are copied as slices, one NumPy call each; shorter
#: runs are gathered per chunk with one fancy-index copy. A slice copy costs ~1 us of Python,
#: a gathered element a few ns plus its index: fancy indexing long runs (CSR element ranges
#: are 100k+ elements) made a window's copies as slow as its decode.
SLICE_COPY_ELEMENTS = 1024


def _copy_rows(
    out: np.ndarray,
    bufs: dict[int, np.ndarray],
    chunk: np.ndarray,
    src: np.ndarray,
    lens: np.ndarray,
    dst: np.ndarray,
) -> None:
    """``out[dst_i : dst_i + lens_i] = bufs[chunk_i][src_i : src_i + lens_i]`` for every i:
    long runs as slice copies, short ones (scattered subsets: many runs of a few rows in
    few chunks) with one gather per chunk."""
    if len(chunk) == 0:
        return
    row_elems = int(np.prod(out.shape[1:], dtype=np.int64))
    long = lens * row_elems >= SLICE_COPY_ELEMENTS
    runs = zip(*(a[long].tolist() for a in (chunk, src, lens, dst)), strict=True)
    for c, s, k, d in runs:
        out[d : d + k] = bufs[c][s : s + k]
    if long.all():
        return
    short = ~long
    order = np.argsort(chunk[short], kind="stable")
    chunk, src, lens, dst = (a[short][order] for a in (chunk, src, lens, dst))
    heads = np.flatnonzero(np.concatenate([[True], chunk[1:] != chunk[:-1]]))
    src_rows, dst_rows = concat_aranges(src, lens), concat_aranges(dst, lens)
    row_bounds = run_offsets(lens)[np.append(heads, len(lens))].tolist()
    for i, c in enumerate(chunk[heads].tolist()):
        a, b = row_bounds[i], row_bounds[i + 1]
        out[dst_rows[a:b]] = bufs[c][src_rows[a:b]]


# ---------------------------------------------------------------------------- direct reader

_tls = threading.local()


def open_stored(path: str) -> int | None:
    """A read-only descriptor of a chunk or shard file; None where none is stored (it reads
    as the fill value), refused as :func:`_refuse_odd` says. O_NONBLOCK makes the open of a
    pipe return at once; regular files ignore it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return _refuse_odd(path, None)
    try:
        _refuse_odd(path, os.fstat(fd).st_mode)
    except DecodeError:
        os.close(fd)
        raise
    return fd


def stored_stamp(path: str) -> tuple[int, int, int] | None:
    """The :data:`FILE_STAMP` of a chunk file, or None where none is stored; refused as
    :func:`open_stored` refuses, without opening it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return _refuse_odd(path, None)
    _refuse_odd(path, st.st_mode)
    return stamp_of(st)


def _refuse_odd(path: str, mode: int | None) -> None:
    """DecodeError for what is not a stored chunk yet not "none stored" either (``mode``:
    the file's, or None where it was not found): a dangling symbolic link (a store assembled
    from links to a volume that is not mounted would read as zeros), or a named pipe,
    socket or device, which would block or stream forever. A missing file is looked at up to
    its first directory that exists, so a dangling link to a whole folder of chunks (``c/3``
    of a v3 array) is refused too."""
    if mode is None:
        at = path
        while at and not os.path.exists(at):
            if os.path.islink(at):
                where = "it" if at == path else f"its folder {at!r}"
                raise DecodeError(
                    f"{where} is a symbolic link to {os.readlink(at)!r}, which does not exist"
                )
            parent = os.path.dirname(at)
            if parent == at:
                break
            at = parent
        return
    if stat.S_ISDIR(mode):  # a chunk key of another key encoding's depth, or a stray folder
        raise DecodeError("it is a folder, not a chunk file; remove it or re-write the array")
    if not stat.S_ISREG(mode):
        raise DecodeError("it is not a regular file (a named pipe, socket or device?)")


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread reusable uint8 buffer of at least ``nbytes`` (returned sliced to size)."""
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1 << 20, 0 if buf is None else 2 * buf.size), dtype=np.uint8)
        _tls.buf = buf
    return buf[:nbytes]


def _pread_into(fd: int, buf: np.ndarray, offset: int) -> int:
    """Read ``buf.size`` bytes at ``offset``; returns how many were read (less only at EOF)."""
    got = os.preadv(fd, [buf], offset)
    total = got
    while got > 0 and total < buf.size:  # regular files only read short at EOF
        got = os.preadv(fd, [buf[total:]], offset + total)
        total += got
    return total


#: an edge chunk is decoded whole into a buffer of its own up to this size, or 4x its valid
#: part (:meth:`DirectReader._plan`)
EDGE_WHOLE_BYTES = 64 << 20


class _Piece:
    """One stored chunk (or inner chunk) to read, and where its rows go."""

    __slots__ = ("coords", "crop", "dst", "head", "rows")

    def __init__(
        self,
        coords: tuple[int, ...],
        dst: np.ndarray,
        crop: tuple[slice, ...] | None,
        rows: int,
        head: bool = False,
    ):
        self.coords = coords  # chunk coords (inner-chunk coords when sharded)
        self.dst = dst  # where the (cropped) decoded chunk goes
        self.crop = crop  # None: decode straight into dst (full chunk shape, contiguous)
        self.rows = rows  # rows [0, rows) of the chunk (axis 0) are needed
        self.head = head  # dst holds rows [0, rows) only (a place in the output)


class DirectReader:
    """Reads chunk files of a LocalStore with ``os.preadv`` and decodes them itself."""

    path = "direct"
    reason = ""

    def __init__(
        self,
        layout: ArrayLayout,
        directory: str,
        *,
        name: str,
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        if layout.codecs is None:
            raise DatasetError(f"{name}: {layout.unsupported}")
        self.name = name
        self.layout = layout
        self.shape = layout.shape
        self.dtype = layout.dtype
        self.rows_per_chunk = int(layout.chunk_shape[0])
        self.directory = directory
        self._executor = executor
        self._decoder = ChunkDecoder(layout.codecs, layout.chunk_shape, layout.dtype)
        grid = layout.chunk_grid
        self._other_coords = list(product(*(range(g) for g in grid[1:])))
        # shard -> (index, the FILE_STAMP of the file it was read from: its size bounds the
        # index's entries)
        self._shard_index: dict[tuple[int, ...], tuple[np.ndarray, tuple[int, int, int]]] = {}
        self._shard_paths: dict[tuple[int, ...], str] = {}  # shard -> its file (_shard_file)
        # unsharded: each row chunk's file and stamp once seen (its nbytes -1: not seen, or
        # not stored yet; a missing chunk is looked for again, as a missing shard is). One
        # record a chunk, so that a plan copies a chunk's stamp whole while another read
        # thread forgets or finds it
        self._chunk_files = np.full(grid[0], None, dtype=object)
        self._chunk_stamp = np.zeros(grid[0], dtype=FILE_STAMP)
        self._chunk_stamp["nbytes"] = -1
        self.chunks_read = 0  # pieces (chunks / inner chunks) read so far, over all calls
        self.chunks_prefix_decoded = 0  # of those, decoded only up to the last row needed
        self._count_lock = threading.Lock()
        self._watch = _MetadataWatch(directory, name)
        # a chunk spans whole rows of the array (one chunk along every other axis)
        self._whole_rows = all(
            s == c for s, c in zip(self.shape[1:], layout.chunk_shape[1:], strict=True)
        )
        # the first rows of such a chunk can be decoded straight into their place in the
        # output: a zstd prefix in C order
        self._heads_direct = self._decoder.prefix_decodable and self._whole_rows

    def check_unchanged(self) -> None:
        """DatasetError where the array's metadata file changed since this reader was made
        (see :class:`_MetadataWatch`)."""
        self._watch.check()

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (an opened dataset goes to spawned processes: Lightning's
        ``strategy="ddp_spawn"``, multiprocessing): the lock is made anew there; a thread
        pool of the caller's cannot travel, the copy reads with the default pool."""
        state = self.__dict__.copy()
        del state["_count_lock"]
        state["_executor"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._count_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"DirectReader({self.name!r}, shape={self.shape}, dtype={self.dtype})"

    @property
    def executor(self) -> concurrent.futures.Executor:
        return self._executor or default_executor()

    @property
    def decoder(self) -> ChunkDecoder:
        """The array's chunk decoder (thread-safe; planned reads on the host use it too)."""
        return self._decoder

    # -- planning --------------------------------------------------------------------------

    def read_rows(self, ranges: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of the ``(k, 2)`` ranges, end to end. The array's metadata file is checked
        before and after (two stats): an array rewritten meanwhile, even in the middle of
        an epoch, is refused rather than read with what was known at open."""
        n = self.shape[0]
        r = check_ranges(ranges, n, self.name)
        lens = r[:, 1] - r[:, 0]
        total = int(lens.sum())
        out = _prepare_out(out, total, self.shape, self.dtype, self.name)
        if total == 0:
            return out
        with self._watch.around():
            C = self.rows_per_chunk
            nz = np.flatnonzero(lens)
            starts, stops, outs = r[nz, 0], r[nz, 1], run_offsets(lens)[:-1][nz]
            # global rows [lo, hi) of chunk `chunk` go to out[dst : dst + hi - lo]
            pair_range, chunk, lo, hi = split_at_chunks(starts, stops, C)
            dst = outs[pair_range] + lo - starts[pair_range]

            # A chunk wholly inside a range is decoded straight into `out` (the first such range
            # "owns" it); the others get a buffer and their rows are copied out afterwards.
            covering = np.flatnonzero((lo == chunk * C) & (hi == np.minimum((chunk + 1) * C, n)))
            owned, first_cover = np.unique(chunk[covering], return_index=True)
            owner_pairs = covering[first_cover]
            bufs: dict[int, np.ndarray] = {
                c: out[d : d + h - lo_]
                for c, d, lo_, h in zip(
                    owned.tolist(),
                    dst[owner_pairs].tolist(),
                    lo[owner_pairs].tolist(),
                    hi[owner_pairs].tolist(),
                    strict=True,
                )
            }
            needed, which = np.unique(chunk, return_inverse=True)
            # rows [0, rows_needed) of each needed chunk cover every range touching it
            rows_needed = np.zeros(len(needed), dtype=np.int64)
            np.maximum.at(rows_needed, which, hi - chunk * C)
            head_pairs = np.zeros(0, dtype=np.int64)
            if self._heads_direct:
                # A range that starts at a chunk's first row and reaches the last row needed of
                # it, short of its end (the tail of a range): that prefix is decoded straight into
                # the range's place in `out` (no buffer, no copy); other ranges copy from there.
                head_rows = hi - chunk * C
                cand = np.flatnonzero(
                    (lo == chunk * C) & (head_rows == rows_needed[which]) & (head_rows < C)
                )
                head_chunks, first = np.unique(chunk[cand], return_index=True)
                head_pairs = cand[first]
                for c, d, k in zip(
                    head_chunks.tolist(),
                    dst[head_pairs].tolist(),
                    head_rows[head_pairs].tolist(),
                    strict=True,
                ):
                    bufs[c] = out[d : d + k]
            heads = set(chunk[head_pairs].tolist())
            pieces = self._plan(needed, rows_needed, bufs, heads)
            self.chunks_read += len(pieces)
            if self.layout.shard is not None:
                self._load_shard_indexes(p.coords for p in pieces)
            _run_parallel(self.executor, pieces, self._load_piece)

            copies = np.ones(len(chunk), dtype=bool)
            copies[owner_pairs] = False
            copies[head_pairs] = False
            _copy_rows(
                out,
                bufs,
                chunk[copies],
                lo[copies] - chunk[copies] * C,
                hi[copies] - lo[copies],
                dst[copies],
            )
        return out

    def _plan(
        self,
        needed: np.ndarray,
        rows_needed: np.ndarray,
        bufs: dict[int, np.ndarray],
        heads: set[int],
    ) -> list[_Piece]:
        shape, chunk = self.shape, self.layout.chunk_shape
        n, C = shape[0], chunk[0]
        single = len(self._other_coords) == 1
        # chunks without a place in `out` are decoded into buffers carved from one array
        # (one allocation a call, from the window's pool where one is active: a buffer
        # each cost a fresh allocation, and its page faults, per boundary chunk). An edge
        # chunk (short, or narrower than the chunk shape) of a single-chunk-wide array is
        # decoded whole into a chunk-shaped buffer, of which the valid part is used; not
        # where that buffer is far larger than the valid part (a missing chunk of 2**40 rows
        # asked for 42 TiB): such a chunk is cropped from its decode, which allocates the
        # whole chunk only where it is stored (then zarr wrote it whole too).
        itemsize = self.dtype.itemsize
        temp: dict[int, tuple[tuple[int, ...], int, bool]] = {}  # shape, rows, edge
        for c in needed.tolist():
            if c not in bufs and c not in heads:
                rows = min(C, n - c * C)
                valid = (rows, *shape[1:])
                whole = math.prod(chunk) * itemsize
                edge = single and not (rows == C and self._whole_rows)
                edge = edge and whole <= max(4 * math.prod(valid) * itemsize, EDGE_WHOLE_BYTES)
                temp[c] = (tuple(chunk) if edge else valid, rows, edge)
        flat = buffers.empty(sum(math.prod(t[0]) for t in temp.values()), self.dtype)
        at = 0
        pieces: list[_Piece] = []
        for c, hi in zip(needed.tolist(), rows_needed.tolist(), strict=True):
            if c in heads:  # bufs[c]: rows [0, hi) of the chunk, in their place in `out`
                pieces.append(_Piece((c, *self._other_coords[0]), bufs[c], None, hi, head=True))
                continue
            buf = bufs.get(c)
            if buf is None:
                buf_shape, rows, edge = temp[c]
                size = math.prod(buf_shape)
                buf = flat[at : at + size].reshape(buf_shape)
                at += size
                if edge:
                    bufs[c] = buf[(slice(0, rows), *(slice(0, s) for s in shape[1:]))]
                    pieces.append(_Piece((c, *self._other_coords[0]), buf, None, hi))
                    continue
                bufs[c] = buf
            for oc in self._other_coords:
                region = tuple(
                    slice(i * k, min((i + 1) * k, s))
                    for i, k, s in zip(oc, chunk[1:], shape[1:], strict=True)
                )
                dst = buf[(slice(None), *region)] if region else buf
                if dst.shape == chunk and dst.flags.c_contiguous:
                    pieces.append(_Piece((c, *oc), dst, None, hi))
                else:
                    crop = tuple(slice(0, s) for s in dst.shape)
                    pieces.append(_Piece((c, *oc), dst, crop, hi))
        return pieces

    # -- byte locations (public: planned reads such as dali_zarr.io.gpu use them) -----------

    def chunk_locations(self, chunks: np.ndarray) -> ChunkLocations:
        """Where the stored bytes of row chunks ``chunks`` (indices along axis 0, coordinates
        ``(c, 0, ..., 0)``; inner chunks when sharded) are, as arrays: vectorized so that a
        window of hundreds of chunks costs a few NumPy calls per shard (unsharded: per
        window, once each chunk's file size is known), not Python per chunk.

        Shard indexes are read, crc32c-checked and cached exactly as ``read_rows`` does; an
        index entry pointing past the end of its shard raises ``ChunkReadError``. A chunk
        that is not stored (it reads as the fill value) gets ``file == -1``.
        """
        chunks = np.asarray(chunks, dtype=np.int64).reshape(-1)
        lay = self.layout
        zeros = (0,) * (len(self.shape) - 1)
        file = np.full(len(chunks), -1, dtype=np.int32)
        offset = np.zeros(len(chunks), dtype=np.int64)
        if lay.shard is None:  # a file per chunk: its size is its stored bytes
            # the cache as it is now, and the sizes found for the chunks it lacks: another
            # read thread's forget_changed_chunks may clear entries meanwhile, and a chunk
            # read from the cache again then would be "not stored" (read as the fill value)
            stamps = self._chunk_stamp[chunks]
            unseen = np.flatnonzero(stamps["nbytes"] < 0)
            if len(unseen):
                stamps[unseen] = self._stat_chunks(chunks[unseen])
            stored = np.flatnonzero(stamps["nbytes"] >= 0)
            file[stored] = np.arange(len(stored), dtype=np.int32)
            nbytes = np.maximum(stamps["nbytes"], 0)
            files = tuple(self._chunk_files[chunks[stored]])
            return ChunkLocations(files, file, offset, nbytes, stamps[stored])
        nbytes = np.zeros(len(chunks), dtype=np.int64)
        per_shard = lay.shard.chunks_per_shard[0]
        order = np.argsort(chunks, kind="stable")  # shard by shard
        shards, starts = np.unique(chunks[order] // per_shard, return_index=True)
        keys = [(shard, *zeros) for shard in shards.tolist()]
        self._load_shards(keys)
        bounds = [*starts.tolist(), len(chunks)]
        at_parts, entry_parts, files, stamps = [], [], [], []
        for k, key in enumerate(keys):
            cached = self._shard_index.get(key)  # taken once: another thread may drop it
            if cached is None:
                continue  # missing shard: every chunk in it reads as the fill value
            index, stamp = cached
            at = order[bounds[k] : bounds[k + 1]]
            # index is (*chunks_per_shard, 2); trailing inner coordinates are all 0
            entry_parts.append(index.reshape(per_shard, -1, 2)[chunks[at] % per_shard, 0])
            at_parts.append(at)
            files.append(self._shard_file(key))
            stamps.append(stamp)
        # the rest for every chunk at once (a shard's file is its place in ``files``)
        at = np.concatenate(at_parts) if at_parts else np.zeros(0, np.int64)
        entries = np.concatenate(entry_parts) if entry_parts else np.zeros((0, 2), np.uint64)
        shard_file = np.repeat(np.arange(len(files)), [len(a) for a in at_parts])
        stored = ~((entries[:, 0] == _EMPTY) & (entries[:, 1] == _EMPTY))
        at, entries, shard_file = at[stored], entries[stored], shard_file[stored]
        sizes = np.array([stamp[2] for stamp in stamps], dtype=np.uint64)
        start, n_stored, end = entries[:, 0], entries[:, 1], sizes[shard_file]
        # in uint64 without overflow: a corrupted entry can hold any 64-bit value
        past = np.flatnonzero((start > end) | (n_stored > end - np.minimum(start, end)))
        if len(past):
            i = int(past[0])
            where = (int(chunks[at[i]]), *zeros)
            raise self._error(where, _past_end(int(start[i]), int(n_stored[i]), int(end[i])))
        file[at], offset[at], nbytes[at] = shard_file, start, n_stored
        return ChunkLocations(tuple(files), file, offset, nbytes, np.array(stamps, FILE_STAMP))

    def _stat_chunks(self, chunks: np.ndarray) -> np.ndarray:
        """Find the files of row chunks not seen yet and record their stamps (unsharded
        stores): a window's locations are then NumPy lookups, not a stat per chunk. A
        chunk rewritten later fails its read, which compares the file with the one located
        (:attr:`ChunkLocations.file_stamp`). Returns each chunk's :data:`FILE_STAMP` (nbytes
        -1: not stored)."""
        zeros = (0,) * (len(self.shape) - 1)
        unique, where = np.unique(chunks, return_inverse=True)
        stamps = np.zeros(len(unique), dtype=FILE_STAMP)
        stamps["nbytes"] = -1
        for i, c in enumerate(unique.tolist()):
            path = self._file(self.layout.key((c, *zeros)))
            try:
                stamp = stored_stamp(path)
            except DecodeError as e:
                raise self._error((c, *zeros), str(e)) from e
            except OSError as e:
                raise self._error((c, *zeros), f"stat failed ({e})") from e
            if stamp is None:
                continue  # reads as the fill value; looked for again next time
            self._chunk_files[c] = path
            self._chunk_stamp[c] = stamps[i] = stamp
        return stamps[where.reshape(-1)]

    def forget_changed_chunks(self) -> bool:
        """Stat again the chunk files whose stamps :meth:`chunk_locations` has cached
        (unsharded arrays) and forget those that changed or are gone: zarr writes new values
        as a new file, and deletes a chunk set to the fill value, without touching the
        array's metadata. Called after a planned read failed (one stat per cached chunk,
        never on the hot path), so that a new plan reads the chunks as they are now; True
        where any had changed. Shard files are re-stamped every window
        (:meth:`_load_shards`): nothing to do for them."""
        if self.layout.shard is not None:
            return False
        known = np.flatnonzero(self._chunk_stamp["nbytes"] >= 0)
        now = np.array(
            [_file_stamp(self._chunk_files[c]) or (0, 0, -1) for c in known.tolist()],
            dtype=FILE_STAMP,
        )
        changed = known[now != self._chunk_stamp[known]]
        self._chunk_stamp["nbytes"][changed] = -1  # their paths stay: a plan may be reading
        return bool(len(changed))

    def chunk_error(
        self, coords: tuple[int, ...], problem: str, advice: str = _ADVICE
    ) -> ChunkReadError:
        """The error ``read_rows`` raises for a bad chunk (names the array, key and file);
        ``advice`` says what to do (:data:`WRITING` for a file that changed under a read)."""
        return self._error(tuple(coords), problem, advice)

    # -- reading ---------------------------------------------------------------------------

    def _file(self, key: str) -> str:
        return os.path.join(self.directory, key)

    def chunk_where(self, coords: tuple[int, ...]) -> str:
        """Where chunk ``coords`` is stored: its key and file (in a shard: the shard's)."""
        lay = self.layout
        if lay.shard is None:
            key = lay.key(coords)
            return f"chunk {key!r} ({self._file(key)})"
        cps = lay.shard.chunks_per_shard
        shard = tuple(c // k for c, k in zip(coords, cps, strict=True))
        inner = tuple(c % k for c, k in zip(coords, cps, strict=True))
        key = lay.key(shard)
        return f"inner chunk {inner} (array chunk {coords}) of shard {key!r} ({self._file(key)})"

    def _error(
        self, coords: tuple[int, ...], problem: str, advice: str = _ADVICE
    ) -> ChunkReadError:
        return ChunkReadError(f"{self.name}: {self.chunk_where(coords)}: {problem}. {advice}")

    def _load_piece(self, piece: _Piece) -> None:
        dec = self._decoder
        direct = piece.crop is None and not piece.head
        try:
            if self.layout.shard is None:
                raw = self._read_chunk(piece, direct and dec.passthrough)
            else:
                raw = self._read_inner(piece, direct and dec.passthrough)
            if raw is None:
                piece.dst[...] = self.layout.fill_value
            elif piece.head:
                if dec.decode_head_into(raw, piece.dst, piece.rows):
                    with self._count_lock:
                        self.chunks_prefix_decoded += 1
            elif raw is piece.dst:
                pass  # stored bytes were read straight into place
            elif dec.prefix_decodable and piece.rows < self.rows_per_chunk:
                self._decode_prefix(raw, piece)
            elif direct:
                dec.decode_into(raw, piece.dst)
            else:
                piece.dst[...] = dec.decode(raw)[piece.crop]
        except DecodeError as e:
            raise self._error(piece.coords, str(e)) from e
        except ChunkReadError:
            raise
        except OSError as e:
            raise self._error(piece.coords, f"reading failed ({e})") from e

    def _decode_prefix(self, raw: np.ndarray, piece: _Piece) -> None:
        """Decode rows [0, piece.rows) of the chunk into piece.dst (other rows are unused)."""
        rows, crop = piece.rows, piece.crop
        if crop is None:
            prefix = self._decoder.decode_prefix_into(raw, piece.dst, rows)
        else:
            full = np.empty(self.layout.chunk_shape, dtype=self.dtype)
            prefix = self._decoder.decode_prefix_into(raw, full, rows)
            piece.dst[:rows] = full[(slice(0, rows), *crop[1:])]
        if prefix:
            with self._count_lock:
                self.chunks_prefix_decoded += 1

    def _read_chunk(self, piece: _Piece, into_dst: bool) -> np.ndarray | None:
        fd = open_stored(self._file(self.layout.key(piece.coords)))
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            if into_dst:
                want = self._decoder.nbytes
                if size != want:
                    raise DecodeError(f"file is {size} bytes, expected {want} (uncompressed)")
                got = _pread_into(fd, piece.dst.reshape(-1).view(np.uint8), 0)
                buf = piece.dst
            else:
                buf = _scratch(size)
                got = _pread_into(fd, buf, 0)
        finally:
            os.close(fd)
        if got != size:
            raise DecodeError(f"read {got} of {size} bytes (file shrank while reading)")
        return buf

    def _inner_location(self, coords: tuple[int, ...], index: np.ndarray, size: int):
        """``(offset, nbytes)`` of an inner chunk in its shard's ``index`` (the shard file
        ``size`` bytes); None where the index holds none. Raises DecodeError for an entry
        past the end of the shard."""
        cps = self.layout.shard.chunks_per_shard  # type: ignore[union-attr]
        inner = tuple(c % k for c, k in zip(coords, cps, strict=True))
        offset, nbytes = (int(v) for v in index[inner])
        if offset == _EMPTY and nbytes == _EMPTY:
            return None
        if offset + nbytes > size:
            raise DecodeError(_past_end(offset, nbytes, size))
        return offset, nbytes

    def _shard_of(self, coords: tuple[int, ...]) -> tuple[int, ...]:
        shard_layout = self.layout.shard
        assert shard_layout is not None
        return tuple(c // k for c, k in zip(coords, shard_layout.chunks_per_shard, strict=True))

    def _read_inner(self, piece: _Piece, into_dst: bool) -> np.ndarray | None:
        """Read an inner chunk's stored bytes at the offsets its shard's index gives (None:
        not stored, the fill value). A shard rewritten since its index was read (this
        window's look at the file, then another writer) holds its chunks at other offsets,
        or stores a chunk the index left out: the file is compared with the index's stamp
        (the one opened; a stat where the index stores no such chunk), and the index read
        again, at most :data:`_SHARD_REREADS` times."""
        shard = self._shard_of(piece.coords)
        path = self._shard_file(shard)
        for _ in range(_SHARD_REREADS + 1):
            cached = self._shard_index.get(shard)
            if cached is None:
                return None  # missing shard (see _load_shard_indexes)
            index, stamp = cached
            location = self._inner_location(piece.coords, index, stamp[2])
            if location is None:
                if _file_stamp(path) == stamp:
                    return None
                self._load_shard_index(shard)
                continue
            offset, nbytes = location
            if into_dst:
                if nbytes != self._decoder.nbytes:
                    want = self._decoder.nbytes
                    raise DecodeError(f"inner chunk is {nbytes} bytes, expected {want}")
                buf = piece.dst.reshape(-1).view(np.uint8)
                result: np.ndarray = piece.dst
            else:
                buf = result = _scratch(nbytes)
            try:  # a pipe swapped in opens at once, and is refused as another file below
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            except FileNotFoundError:  # deleted since (zarr's shard of fill values only)
                self._load_shard_index(shard)
                continue
            try:
                same = stamp_of(os.fstat(fd)) == stamp
                got = _pread_into(fd, buf, offset) if same else 0
            finally:
                os.close(fd)
            if not same:
                self._load_shard_index(shard)
                continue
            if got != nbytes:
                raise DecodeError(f"read {got} of {nbytes} bytes (shard file shrank while reading)")
            return result
        raise self._error(
            piece.coords,
            f"the shard file was rewritten {_SHARD_REREADS + 1} times while this chunk was read",
            WRITING,
        )

    def _load_shard_indexes(self, chunks: Iterable[Sequence[int]]) -> None:
        """Read (in parallel) and cache the indexes of the shards holding ``chunks``."""
        shard_layout = self.layout.shard
        assert shard_layout is not None
        cps = shard_layout.chunks_per_shard
        self._load_shards(tuple(c // k for c, k in zip(co, cps, strict=True)) for co in chunks)

    def _load_shards(self, shards: Iterable[tuple[int, ...]]) -> None:
        """Read (in parallel) and cache the indexes of ``shards`` (shard coordinates). A
        cached index whose shard file changed since (rewritten in place: zarr rewrites a
        whole shard, with new offsets) is read again: one stat a shard and window, where
        the old offsets would cut the new file's chunks at the wrong bytes."""
        todo = sorted(shard for shard in set(shards) if self._shard_changed(shard))
        _run_parallel(self.executor, todo, self._load_shard_index)

    def _shard_file(self, shard: tuple[int, ...]) -> str:
        """The file of ``shard`` (shard coordinates), its path built once: every window
        looks at each of its shards (:meth:`_shard_changed`) and names its file."""
        path = self._shard_paths.get(shard)
        if path is None:
            path = self._shard_paths[shard] = self._file(self.layout.key(shard))
        return path

    def _shard_changed(self, shard: tuple[int, ...]) -> bool:
        """Whether ``shard``'s index is not cached, or its file is no longer the one it was
        read from. The cached entry is taken once: another read thread drops it where it
        finds the shard deleted (:meth:`_load_shard_index`, also called by a read of a
        shard rewritten since its index was read), and may do so during the stat."""
        cached = self._shard_index.get(shard)
        return cached is None or _file_stamp(self._shard_file(shard)) != cached[1]

    def _load_shard_index(self, shard: tuple[int, ...]) -> None:
        sl = self.layout.shard
        assert sl is not None
        key = self.layout.key(shard)
        path = self._shard_file(shard)

        def fail(problem: str) -> ChunkReadError:
            return ChunkReadError(f"{self.name}: shard {key!r} ({path}): {problem}. {_ADVICE}")

        try:
            fd = open_stored(path)
        except DecodeError as e:
            raise fail(str(e)) from e
        except OSError as e:
            raise fail(f"opening failed ({e})") from e
        if fd is None:
            # every inner chunk reads as the fill value; an index cached before is dropped
            # (zarr deletes a shard rewritten to all fill values, metadata unchanged)
            self._shard_index.pop(shard, None)
            return
        try:
            stamp = stamp_of(os.fstat(fd))
            index = read_shard_index(fd, stamp[2], sl)
        except OSError as e:
            raise fail(f"reading the shard index failed ({e})") from e
        except DecodeError as e:
            raise fail(str(e)) from e
        finally:
            os.close(fd)
        self._shard_index[shard] = (index, stamp)


def read_shard_index(fd: int, size: int, sl: ShardLayout) -> np.ndarray:
    """The ``(*chunks_per_shard, 2)`` uint64 (offset, nbytes) index of the open shard file
    ``fd`` of ``size`` bytes, its crc32c checked where it has one. Raises DecodeError for a
    file shorter than its index or an index that fails its checksum."""
    want = sl.index_nbytes
    if size < want:
        raise DecodeError(f"file is {size} bytes, shorter than its {want}-byte shard index")
    buf = np.empty(want, dtype=np.uint8)
    got = _pread_into(fd, buf, size - want if sl.index_location == "end" else 0)
    if got != want:
        raise DecodeError(f"read {got} of {want} shard index bytes (file shrank while reading)")
    if sl.index_crc32c:
        buf = verify_crc32c(buf, "shard index")
    index = buf.view(np.dtype(sl.index_byteorder + "u8")).astype(np.uint64)
    return index.reshape((*sl.chunks_per_shard, 2))


#: A file as it was seen: what tells a rewritten one. zarr writes a chunk or shard as a new
#: file renamed over the old (another inode); a rewrite in place has another modification
#: time; most rewrites change the size too, but a shard's can keep it with its chunks at
#: other offsets
FILE_STAMP = np.dtype([("inode", "u8"), ("mtime_ns", "i8"), ("nbytes", "i8")])


def stamp_of(st: os.stat_result) -> tuple[int, int, int]:
    """A :data:`FILE_STAMP` from a stat (of a path, or of an open file's descriptor)."""
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _file_stamp(path: str) -> tuple[int, ...]:
    """:func:`stamp_of` the file at ``path``, () where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return stamp_of(st)


#: The files that make a folder a Zarr node (v3; v2 array; v2 group), in that order.
METADATA_FILES = ("zarr.json", ".zarray", ".zgroup")


def metadata_file(directory: str) -> str | None:
    """The Zarr metadata file of the node in ``directory``, or None where it holds none."""
    for name in METADATA_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


WRITER_MARKER = ".dali-zarr-partial"  # in a dali-zarr writer's DST.partial (convert.py)


def refuse_unfinished(path: str) -> None:
    """Refuse ``path`` where it is, or lies in, the ``DST.partial`` of a dali-zarr writer
    (convert, the synthetic stores): its metadata is written first, so a half-written
    array opened and read its missing chunks as fill values."""
    folder = os.path.abspath(path)
    while True:
        if folder.endswith(".partial") and os.path.isfile(os.path.join(folder, WRITER_MARKER)):
            raise DatasetError(
                f"{path}: is the unfinished output of a dali-zarr writer (a convert or a "
                f"synthetic store) that is still running or was stopped ({folder} holds "
                f"{WRITER_MARKER}); open {folder[: -len('.partial')]} once it has finished, or "
                "re-run the convert (a re-run removes this folder)."
            )
        parent = os.path.dirname(folder)
        if parent == folder:
            return
        folder = parent


@contextlib.contextmanager
def checked_around(check: Callable[[], None]) -> Iterator[None]:
    """Run ``check`` (raising where a store changed since it was opened) before and after
    a read; a read that fails with the store changed under it fails with the check's error
    instead (the rewrite is the cause, a bad chunk its symptom), the read's own error
    chained to it. Only ``Exception``s are re-checked: an interrupt passes as it is."""
    check()
    try:
        yield
    except Exception:
        check()
        raise
    check()


class _MetadataWatch:
    """The metadata file of a local array, as it was when the array was opened: a loader
    checks it before each epoch and a reader around each read, since what was read at open
    (shape, dtype, a CSR's row offsets) would describe an array rewritten since and read the
    new one's bytes wrong.
    Any change of the file counts (in zarr v3 an attribute update rewrites it too): the
    error asks for a reopen, never for wrong rows. ``directory`` None: nothing to watch."""

    def __init__(self, directory: str | None, name: str) -> None:
        self.directory, self.name = directory, name
        self.file = (metadata_file(directory) if directory else None) or ""
        self.stamp = _file_stamp(self.file) if self.file else ()

    def around(self) -> contextlib.AbstractContextManager[None]:
        """:func:`checked_around` with this file's check."""
        return checked_around(self.check)

    def check(self) -> None:
        if self.file and _file_stamp(self.file) != self.stamp:
            raise DatasetError(
                f"{self.name}: the array changed since the store was opened (its metadata "
                f"file {self.file} was rewritten: a new array, or its attributes updated); "
                "what was read at open describes the array as it was. Open the store again "
                "(dz.open_dataset) and make a new Loader."
            )


class StoredObjectsWatch:
    """The stored objects (chunk or shard files) of a local 1-D array read whole at open (a
    CSR's row offsets), stamped before that read. Values rewritten in place (same shape,
    same metadata file: ``g["X/indptr"][:] = ...``) left the copy read at open describing
    the old array: beside the new ``data`` and ``indices`` (read anew) every row came out
    cut at the old offsets, with no error. :meth:`around` a window's read stats the objects
    that hold its rows' offsets; :meth:`check` all of them (before an epoch). A remote or
    in-memory array has nothing to watch."""

    def __init__(self, array: Any, *, name: str) -> None:
        self.name = name
        self._paths: list[str] = []
        self._stamps: list[tuple[int, ...]] = []
        self._rows_per_object = 1
        directory, _ = local_directory(array)
        # checked first: a store replaced whole is named as such, not as values rewritten
        self._metadata = _MetadataWatch(directory, name)
        if directory is None or len(array.shape) != 1:
            return
        layout = parse_layout(array)
        if layout.encode_key is None:
            return
        self._rows_per_object = rows = int(layout.grid_chunk_shape[0])
        n_objects = -(-int(array.shape[0]) // rows)
        self._paths = [os.path.join(directory, layout.key((i,))) for i in range(n_objects)]
        self._stamps = [_file_stamp(path) for path in self._paths]  # (): missing (fill)

    def around(self, ranges: np.ndarray) -> contextlib.AbstractContextManager[None]:
        """:func:`checked_around` a read that uses the offsets of rows ``ranges`` (``(k, 2)``
        ``[start, stop)``: offsets ``start .. stop``), the objects holding them found once."""
        objects: Sequence[int] = range(len(self._paths))
        if len(self._paths) > 1:
            ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
            first = ranges[:, 0] // self._rows_per_object
            last = np.minimum(ranges[:, 1] // self._rows_per_object, len(self._paths) - 1)
            objects = np.unique(concat_aranges(first, last - first + 1)).tolist()
        return checked_around(lambda: self.check(objects))

    def check(self, objects: Sequence[int] | None = None) -> None:
        """DatasetError where the metadata file or one of the stored ``objects`` (indices;
        all for None) changed since open."""
        self._metadata.check()
        for i in range(len(self._paths)) if objects is None else objects:
            if _file_stamp(self._paths[i]) != self._stamps[i]:
                raise DatasetError(
                    f"{self.name}: its values were rewritten since the store was opened "
                    f"({self._paths[i]} changed), and they were read then: the new ones "
                    "would be read with the old. Open the store again (dz.open_dataset) and "
                    "make a new Loader."
                )

    def check_unchanged(self) -> None:
        self.check()


# ---------------------------------------------------------------------------- zarr fallback


class ZarrReader:
    """Reads rows with zarr-python itself (``array[a:b]``): any store, any codec."""

    path = "zarr"

    def __init__(
        self,
        array: Any,
        *,
        name: str,
        reason: str,
        executor: concurrent.futures.Executor | None = None,
        directory: str | None = None,
        layout: ArrayLayout | None = None,
    ) -> None:
        self.name = name
        self.reason = reason
        self._watch = _MetadataWatch(directory, name)  # a local array's (None: remote)
        # a local array's stored objects are looked at before zarr reads them (see
        # _check_stored); a remote store's are zarr's business
        self._directory = directory
        self._layout = layout if directory is not None else None
        self.array = array
        self.shape = tuple(int(s) for s in array.shape)
        if not self.shape:
            raise DatasetError(f"{name}: a 0-dimensional array has no rows to read")
        dtype = np.dtype(array.dtype)
        self.dtype = dtype.newbyteorder("=") if dtype.byteorder not in "=|" else dtype
        self.rows_per_chunk = int(array.chunks[0])
        self._executor = executor
        self.chunks_read = 0  # approximate: chunk rows spanned by the zarr reads, over all calls

    def __repr__(self) -> str:
        return f"ZarrReader({self.name!r}, shape={self.shape}, reason={self.reason!r})"

    def chunk_where(self, coords: tuple[int, ...]) -> str:
        """Chunk ``coords`` as zarr numbers it (the store's keys are zarr's business)."""
        return f"chunk {tuple(coords)} of {self.name}"

    def check_unchanged(self) -> None:
        """As :meth:`DirectReader.check_unchanged` for a local array; a remote or in-memory
        store's array is not watched."""
        self._watch.check()

    @property
    def executor(self) -> concurrent.futures.Executor:
        return self._executor or default_executor()

    def _check_stored(self, start: int, stop: int) -> None:
        """ChunkReadError for a stored object (chunk or shard file) of rows [start, stop)
        that is no file, as :func:`_refuse_odd` says: zarr reads a dangling link as the
        fill value (zeros, silently) and blocks forever on a named pipe. One stat an
        object: this path reads with zarr-python, which costs far more per object."""
        layout = self._layout
        if layout is None:
            return
        grid = layout.grid_chunk_shape
        other = product(*(range(-(-s // g)) for s, g in zip(self.shape[1:], grid[1:], strict=True)))
        for coords in product(range(start // grid[0], (stop - 1) // grid[0] + 1), other):
            key = layout.key((coords[0], *coords[1]))
            path = os.path.join(self._directory, key)  # type: ignore[arg-type]
            try:
                stored_stamp(path)
            except DecodeError as e:
                raise ChunkReadError(
                    f"{self.name}: stored object {key!r} ({path}): {e}. {_ADVICE}"
                ) from e

    def read_rows(self, ranges: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """As :meth:`DirectReader.read_rows` (the metadata file checked around the read)."""
        r = check_ranges(ranges, self.shape[0], self.name)
        lens = r[:, 1] - r[:, 0]
        total = int(lens.sum())
        out = _prepare_out(out, total, self.shape, self.dtype, self.name)
        if total == 0:
            return out
        with self._watch.around():
            offs = run_offsets(lens)[:-1]
            nz = np.flatnonzero(lens)
            C = self.rows_per_chunk
            # Merge ranges into spans so that no chunk is read by two zarr calls.
            order = nz[np.argsort(r[nz, 0], kind="stable")]
            spans: list[list[int]] = []
            for j in order.tolist():
                s, e = int(r[j, 0]), int(r[j, 1])
                if spans and (s <= spans[-1][1] or s // C <= (spans[-1][1] - 1) // C):
                    spans[-1][1] = max(spans[-1][1], e)
                else:
                    spans.append([s, e])
            self.chunks_read += sum((e - 1) // C - s // C + 1 for s, e in spans)
            data: list[np.ndarray | None] = [None] * len(spans)

            def read(i: int) -> None:
                a, b = spans[i]
                self._check_stored(a, b)
                try:
                    data[i] = np.asarray(self.array[a:b])
                except Exception as e:
                    raise _zarr_read_failed(self.name, a, b, C, e) from e

            _run_parallel(self.executor, range(len(spans)), read)
            span_starts = np.array([s for s, _ in spans], dtype=np.int64)
            which = np.searchsorted(span_starts, r[nz, 0], side="right") - 1
            for j, i in zip(nz.tolist(), which.tolist(), strict=True):
                s, e, o = int(r[j, 0]), int(r[j, 1]), int(offs[j])
                a = spans[i][0]
                out[o : o + e - s] = data[i][s - a : e - a]  # type: ignore[index]
        return out


# ---------------------------------------------------------------------------- factory


def local_directory(array: Any) -> tuple[str | None, str]:
    """(directory of the array in a LocalStore, "") or (None, why not)."""
    from zarr.storage import LocalStore

    store = getattr(array, "store", None)
    if not isinstance(store, LocalStore):
        kind = type(store).__name__
        return None, f"store is {kind}, not a local-filesystem LocalStore"
    prefix = str(array.store_path.path or "")
    # Absolute now: a relative root would follow a later os.chdir (Hydra moves jobs into
    # their run directory) and every chunk would be "missing", i.e. read as fill values.
    root = os.path.abspath(str(store.root))
    return (os.path.join(root, *prefix.split("/")) if prefix else root), ""


def _metadata_without_attributes(array: Any) -> dict[str, Any]:
    import json

    meta = dict(array.metadata.to_dict())
    meta.pop("attributes", None)
    return json.loads(json.dumps(meta, sort_keys=True, default=str))  # NaN fills compare equal


def _is_group_file(path: str) -> bool:
    """Whether the metadata file ``path`` (of :func:`metadata_file`) is a group's; one that
    cannot be parsed is not called a group (it is named where it is read)."""
    import json

    if os.path.basename(path) != "zarr.json":
        return os.path.basename(path) == ".zgroup"
    try:
        with open(path, "rb") as f:
            return json.load(f).get("node_type") == "group"
    except (OSError, ValueError, AttributeError):
        return False


def _refuse_stale_metadata(array: Any, directory: str, name: str) -> None:
    """DatasetError where the metadata ``array`` was opened with (a store's consolidated
    copy, as anndata and ``zarr.open`` read it) differs from the array's own file. zarr does
    not update the consolidated copy when an array is rewritten, and which of the two
    matches the chunks depends on how they were written, so neither is guessed at."""
    import zarr

    own_file = metadata_file(directory)
    if own_file is None or _is_group_file(own_file):
        # opened from the consolidated copy alone: the array was deleted or replaced by a
        # group since (a numeric obs column made categorical, a dense X made sparse), and
        # zarr reads its chunks, now missing, as fill values
        held = "no metadata file of its own" if own_file is None else "a group, not an array"
        raise DatasetError(
            f"{name}: the store's consolidated metadata lists this array, but on disk "
            f"{directory} holds {held}: it was deleted or replaced after the store was "
            "consolidated (e.g. obs or X rewritten with anndata.io.write_elem), and zarr "
            "would read it as fill values. Run zarr.consolidate_metadata on the store so it "
            "lists what is on disk."
        )
    try:
        own = zarr.open_array(directory, mode="r")
    except Exception:  # its own file is unreadable: nothing to compare (zarr reads on)
        return
    theirs, mine = _metadata_without_attributes(array), _metadata_without_attributes(own)
    if theirs == mine:
        return
    differ = ", ".join(
        f"{key} {theirs.get(key)} vs {mine.get(key)}"
        for key in sorted(set(theirs) | set(mine))
        if theirs.get(key) != mine.get(key)
    )
    raise DatasetError(
        f"{name}: the store's consolidated metadata and the array's own metadata file in "
        f"{directory} disagree ({differ}): the array was changed after the store was "
        "consolidated, and zarr does not update that copy. If the array's own file is right "
        "(it was rewritten through zarr.open_array, or a group opened with "
        "use_consolidated=False), run zarr.consolidate_metadata on the store; otherwise "
        "re-write the array."
    )


def open_reader(
    array: Any,
    *,
    name: str,
    executor: concurrent.futures.Executor | None = None,
    force_zarr: bool = False,
) -> ArrayReader:
    """The fastest reader that can serve ``array`` (see the module docstring)."""
    layout = parse_layout(array)  # raises DatasetError for 0-d arrays
    _refuse_missing_codec(array, name)
    directory, why = local_directory(array)
    if directory is None:
        _refuse_zarr_misreads(
            array, name, why, "Copy the store to a local disk, where dali_zarr decodes them itself"
        )
        return ZarrReader(array, name=name, reason=why, executor=executor)
    _refuse_stale_metadata(array, directory, name)
    _refuse_other_separator(layout, directory, name)
    if force_zarr or layout.unsupported:
        _refuse_truncated_blosc(array, directory, name)  # zarr decodes them
        reason = "force_zarr=True" if force_zarr else layout.unsupported
        _refuse_zarr_misreads(
            array,
            name,
            reason,
            "Open it without force_zarr, where dali_zarr decodes them itself"
            if force_zarr and not layout.unsupported
            else "",
        )
        return ZarrReader(
            array, name=name, reason=reason, executor=executor, directory=directory, layout=layout
        )
    return DirectReader(layout, directory, name=name, executor=executor)


def _refuse_other_separator(layout: ArrayLayout, directory: str, name: str) -> None:
    """DatasetError for an array whose chunks are stored under the other separator than
    its metadata names: v2-style keys (``0.0`` or ``0/0``: format 2, or format 3 with the
    ``v2`` chunk key encoding that ``zarr migrate v3`` writes; zarr-python < 2.8's
    NestedDirectoryStore wrote ``0/0`` folders without recording ``"/"``), or v3's
    default keys (``c/0/0`` against ``c.0.0``, a hand-edited or re-written zarr.json).
    Such an array reads as fill values throughout, by zarr too, without an error. One stat
    at open where the first chunk is stored: an array holds no folders of its own, so a
    folder ``0`` (``c``) means nested keys, and a file ``0.0`` beside no such folder flat
    ones. Where it is not (never written, or all fill values), the first chunk entry the
    folder lists tells."""
    zeros = (0,) * len(layout.shape)
    key, flat_zero = layout.key(zeros), ".".join(map(str, zeros))
    if key.startswith("c"):  # v3's default keys, "c/0/0" or "c.0.0" (one axis too)
        if os.path.isdir(os.path.join(directory, "c")):
            nested, found = True, "c/..."
        else:
            entry = _first_chunk_entry(directory, prefix="c.")
            if entry is None:
                return
            nested, found = False, entry[0]
    elif len(zeros) < 2:  # v2-style keys of one axis: "0" either way
        return
    elif os.path.isdir(os.path.join(directory, "0")):
        nested, found = True, "0/..."
    elif os.path.isfile(os.path.join(directory, flat_zero)):
        nested, found = False, flat_zero
    else:
        entry = _first_chunk_entry(directory)
        if entry is None:
            return
        nested, found = entry[1], entry[0] + ("/..." if entry[1] else "")
    if nested == ("/" in key):
        return
    want = "/" if nested else "."
    if layout.zarr_format == 2:
        meta, fix = ".zarray", f'Add "dimension_separator": "{want}" to'
    else:
        meta, fix = "zarr.json", f'Set the chunk_key_encoding\'s "separator" to "{want}" in'
    why = (
        "its zarr.json was written apart from its chunks"
        if key.startswith("c")
        else "zarr-python < 2.8's NestedDirectoryStore did not record it"
    )
    raise DatasetError(
        f"{name}: its {meta} says chunk keys look like {key!r}, but {directory} holds "
        f"{found!r}: the chunks were written with separator {want!r} ({why}), so every "
        f"chunk would read as the fill value. {fix} {os.path.join(directory, meta)} (and in "
        "the store's consolidated metadata, if it has any)."
    )


def _first_chunk_entry(directory: str, prefix: str = "") -> tuple[str, bool] | None:
    """``(name, is a folder)`` of the first entry of an array's folder named like a chunk
    key: ``prefix`` then a chunk index (v2-style keys: no prefix; v3's flat ones: ``c.``),
    None where there is none. ``os.scandir`` lists a folder in batches, so a folder of a
    million chunks costs one batch."""
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                name = entry.name
                if name.startswith(prefix) and name[len(prefix) :].split(".")[0].isdigit():
                    return entry.name, entry.is_dir()
    except OSError:
        return None
    return None


def _refuse_missing_codec(array: Any, name: str) -> None:
    """DatasetError at open where this Python lacks a codec of ``array``
    (:func:`~dali_zarr.io.layout.missing_codec`): zarr's read of every chunk would fail,
    at the first batch, as if the store were corrupted."""
    problem = missing_codec(array)
    if problem:
        raise DatasetError(f"{name}: {problem}.")


def _refuse_zarr_misreads(array: Any, name: str, why_zarr: str, direct: str) -> None:
    """DatasetError where zarr-python, which would read ``array`` (``why_zarr``), reads its
    values wrong (:func:`~dali_zarr.io.layout.zarr_misreads`); ``direct``: how to get the
    direct path instead ("" where it cannot decode the array either)."""
    problem = zarr_misreads(array)
    if problem:
        fix = f"{direct}, or re-write" if direct else "Re-write"
        raise DatasetError(
            f"{name}: zarr-python would read this array ({why_zarr}), but {problem}, so "
            f"every chunk would arrive as other numbers. {fix} the array with "
            "BytesCodec(endian='little')."
        )


def _zarr_read_failed(
    name: str, start: int, stop: int, rows: int, error: Exception, by: str = "zarr-python"
):
    """The ChunkReadError for zarr-python (or ``by``, h5py) failing to read rows ``[start,
    stop)`` of array ``name`` (chunks of ``rows`` rows on axis 0): zarr's own error ("error
    during blosc decompression: -1") names no store, array or chunk."""
    first, last = start // rows, (stop - 1) // rows
    chunks = f"chunk {first}" if first == last else f"chunks {first} to {last}"
    return ChunkReadError(
        f"{name}: {by} failed to read rows [{start}, {stop}) ({chunks} along axis 0, "
        f"{rows} rows each; {type(error).__name__}: {error}). "
        f"{_IO_ADVICE if _failed_fetching(error) else _ADVICE}"
    )


def first_failing_chunk(array: Any, start: int, stop: int) -> tuple[int, Exception] | None:
    """The first chunk along axis 0 of ``array`` (a zarr or h5py array) within rows
    ``[start, stop)`` whose read fails, with its error, or None: after a read of many
    chunks failed, to name the bad one (zarr's and h5py's errors name none)."""
    rows = int((getattr(array, "chunks", None) or (0,))[0]) if array.ndim else 0
    for c in range(start // rows, (stop - 1) // rows + 1) if rows and stop > start else ():
        try:
            array[max(start, c * rows) : min(stop, (c + 1) * rows)]
        except Exception as e:
            return c, e
    return None


def read_whole(array: Any, *, name: str) -> np.ndarray:
    """``array`` read whole with zarr-python or h5py (obs columns, obsm entries beside X, a
    CSR's row offsets), a failed read named (:func:`_zarr_read_failed`): one bad chunk of an obs
    column stopped the Loader without a clue. On failure the chunks along axis 0 are read
    one by one to name the first bad one."""
    try:
        return np.asarray(array[...])
    except MemoryError:  # too large to hold, not a bad store
        raise
    except Exception as e:
        n = int(array.shape[0]) if array.ndim else 0
        # h5py: an unchunked dataset's chunks are None
        rows = int((getattr(array, "chunks", None) or (0,))[0]) if array.ndim else 0
        by = "h5py" if type(array).__module__.startswith("h5py") else "zarr-python"
        found = first_failing_chunk(array, 0, n)
        if found is not None:
            c, chunk_error = found
            stop = min((c + 1) * rows, n)
            raise _zarr_read_failed(name, c * rows, stop, rows, chunk_error, by) from e
        raise _zarr_read_failed(name, 0, max(n, 1), max(n, rows, 1), e, by) from e


def _blosc_frames_problem(fd: int, size: int, shard: ShardLayout | None) -> str:
    """What is wrong with the blosc frames of one stored object (``shard``: how a shard
    holds them; None: the object is one frame), or ""."""
    if shard is None:
        return blosc_header_problem(os.pread(fd, 16, 0), size)
    index = read_shard_index(fd, size, shard).reshape(-1, 2)
    for inner, (offset, nbytes) in enumerate(index.tolist()):
        if offset == _EMPTY and nbytes == _EMPTY:
            continue
        if offset + nbytes > size:
            return f"inner chunk {inner} (in C order): {_past_end(offset, nbytes, size)}"
        problem = blosc_header_problem(os.pread(fd, 16, offset), nbytes)
        if problem:
            return f"inner chunk {inner} (in C order): {problem}"
    return ""


def refuse_stale_metadata(array: Any, *, name: str) -> None:
    """:func:`_refuse_stale_metadata` for an array read whole at open (obs columns, a CSR's
    row offsets), where it is in a local store; and, since zarr-python reads such arrays,
    :func:`_refuse_zarr_misreads` (a delta-filtered ``indptr`` read byte-swapped would
    cut every row at other offsets), :func:`_refuse_missing_codec` and
    :func:`_refuse_truncated_blosc`."""
    _refuse_missing_codec(array, name)
    _refuse_zarr_misreads(array, name, "it is read whole at open", "")
    directory, _ = local_directory(array)
    if directory is not None:
        _refuse_stale_metadata(array, directory, name)
        with contextlib.suppress(DatasetError):  # 0-d: refused by whoever reads it
            _refuse_truncated_blosc(array, directory, name)


def _refuse_truncated_blosc(array: Any, directory: str, name: str) -> None:
    """ChunkReadError for a stored blosc frame (a chunk, or an inner chunk of a shard, of an
    array compressed last by blosc) whose size is not the one its blosc header gives
    (:func:`~dali_zarr.io.codecs.blosc_header_problem`), for arrays zarr-python reads (obs
    columns, the ``convert`` input, the zarr fallback): numcodecs decoded a truncated frame
    past its end into other memory's bytes, delivered as values without an error, and
    zarr-python never compares a shard index's lengths with the file. One 16-byte read per
    stored frame (plus each shard's index)."""
    frames = blosc_frames(array)
    if frames is None:  # e.g. a crc32c after blosc checks the frame itself
        return
    for coords in product(*(range(n) for n in frames.grid)):
        key = array.metadata.encode_chunk_key(coords)
        try:
            fd = open_stored(os.path.join(directory, key))
            if fd is None:  # never written: the fill value
                continue
            try:
                problem = _blosc_frames_problem(fd, os.fstat(fd).st_size, frames.shard)
            finally:
                os.close(fd)
        except DecodeError as exc:
            problem = str(exc)
        if problem:
            what = "chunk" if frames.shard is None else "shard"
            raise ChunkReadError(
                f"{name}: {what} {key!r}: {problem}; zarr would decode it into wrong values "
                f"without an error: restore this {what} from an intact copy, or re-write the "
                "array."
            )
