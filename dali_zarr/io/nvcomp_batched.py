"""nvCOMP's low-level batched decode (zstd frames, LZ4 blocks), called through ctypes.

Why not nvCOMP's Python ``Codec.decode``: it parses every frame's header and synchronises
the stream inside the call, holding the GIL all the while. On an H100 (2026-11-22) that was
~25 ms per array of 131 MB decoded, the largest cost of a window, and it kept the reader
threads from overlapping. The C API below takes the decoded sizes instead (the read plan
knows them: a zarr chunk always decodes to ``chunk_nbytes``), only enqueues work on our
stream, and ctypes releases the GIL for the call.

**Status: the default since 2026-11-26.** Written against nvCOMP 5.3's headers
(``nvcomp/zstd.h``, ``nvcomp/lz4.h``); CI loads the library and sizes its temporary memory
(no GPU needed). On an H200 that day every ``gpu`` test passed with it (they compare it with
the CPU decode), and the benchmark's store read 2.3-2.7x faster than with nvCOMP's Python
codecs (``benchmarks/results/h200-2026-11-26/``). ``DALI_ZARR_NVCOMP_BATCHED=0`` goes back to
the Python codecs.

A plan is decoded with one table: the host builds it (source pointers, source sizes,
destination pointers, destination sizes) with NumPy and uploads it once; nvCOMP is called on
consecutive slices of it (:func:`call_slices`, to bound its scratch memory) and writes one
status and one decoded size per chunk, checked after the executor's stream sync.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
from typing import Any

import numpy as np

from ..errors import ConfigError

#: environment switch for :class:`BatchedDecoder` in the GPU executor: unset or ``1`` (the
#: default) uses it, ``0`` nvCOMP's Python codecs
ENV_SWITCH = "DALI_ZARR_NVCOMP_BATCHED"
#: nvCOMP's name of each plan kind it decodes (Python codecs and C symbols alike)
ALGORITHM = {"zstd": "Zstd", "lz4": "LZ4"}
#: ``nvcompStatus_t`` (``nvcomp/shared_types.h``), for error messages; a CI test holds it to
#: the installed header
_STATUS = {
    0: "success",
    10: "invalid value",
    11: "not supported",
    12: "cannot decompress",
    13: "bad checksum",
    14: "cannot verify checksums",
    15: "output buffer too small",
    16: "wrong header length",
    17: "alignment",
    18: "chunk size too large",
    19: "cannot compress",
    20: "wrong input length",
    21: "batch size too large",
    22: "sub-chunk count too large",
    23: "sub-chunk count too small",
    24: "output buffer alignment too small",
    1000: "CUDA error",
    10000: "internal error",
}


#: decoded bytes one decode call covers at most. nvCOMP 5.3's zstd decoder asks for about
#: 3x a call's decoded bytes of scratch (its size query, tested in CI), so this bounds
#: the scratch at ~1.5 GiB per reader thread, whatever the window's size (arrays of larger
#: chunks are decoded on the host: ``gpu.gpu_codec_kind``). Larger calls
#: decode faster: nvCOMP works on a call's chunks side by side, and a window of large
#: chunks cut in two calls keeps too few in flight. On the H200 (2026-11-27, gpu_profile
#: --call-mb 128,1024) a window's decode took 44 instead of 84 ms with 1 MiB inner chunks,
#: 20 instead of 34 ms with 256 KiB ones (the same with 64 KiB ones), once its ~131 MB of
#: each array were one call rather than two.
CALL_NBYTES = 512 << 20


def call_slices(chunk_nbytes: np.ndarray, cap: int | None = None) -> list[slice]:
    """Chunks of decoded sizes ``chunk_nbytes`` (in call order; the plans of a window differ:
    float64 values beside int32 ids) in consecutive calls of at most ``cap`` (default
    :data:`CALL_NBYTES`) decoded bytes each, at least one chunk per call."""
    cap = CALL_NBYTES if cap is None else cap
    ends = np.cumsum(np.asarray(chunk_nbytes, dtype=np.int64))
    calls, start = [], 0
    while start < len(ends):
        before = int(ends[start - 1]) if start else 0
        stop = max(int(np.searchsorted(ends, before + cap, side="right")), start + 1)
        calls.append(slice(start, stop))
        start = stop
    return calls


def use_c_api() -> bool:
    """Whether the GPU executor decodes with this module: asked for (:func:`enabled`) and
    loadable here (:func:`load_error`); else it uses nvCOMP's Python codecs, and
    ``read_paths()`` says why."""
    return enabled() and load_error() is None


@functools.cache
def load_error() -> str | None:
    """Why nvCOMP's C API cannot be called here (``None``: it can): libnvcomp missing or not
    loading, or a batched decoder's symbol absent from it."""
    try:
        for kind in ALGORITHM:
            functions(kind)
    except (ImportError, OSError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def enabled() -> bool:
    """Whether :data:`ENV_SWITCH` asks for this module (unset: yes)."""
    want = os.environ.get(ENV_SWITCH, "").strip()
    if want not in ("", "0", "1"):
        raise ConfigError(
            f"{ENV_SWITCH}={want!r}: use 1 (nvCOMP's C API, the default) or 0 (its Python "
            "codecs), or leave it unset"
        )
    return want != "0"


class DecompressOpts(ctypes.Structure):
    """``nvcompBatched{Zstd,LZ4}DecompressOpts_t``: 64 bytes of 32-bit fields in both headers;
    all zero means the defaults (automatic backend; for LZ4 no bitshuffle)."""

    _fields_ = [("words", ctypes.c_int32 * 16)]


@functools.cache
def library() -> ctypes.CDLL:
    """``libnvcomp.so.5`` from the nvidia-libnvcomp wheel (the one nvidia-nvcomp loads)."""
    lib = importlib.import_module("nvidia.libnvcomp").load_library()
    if lib is None:
        raise OSError("nvidia-libnvcomp is installed but libnvcomp.so.5 did not load")
    return lib


@functools.cache
def functions(kind: str) -> tuple[Any, Any]:
    """``(GetTempSizeAsync, DecompressAsync)`` of ``kind`` ("zstd" or "lz4"), typed."""
    lib = library()
    name = ALGORITHM[kind]
    size_t, ptr = ctypes.c_size_t, ctypes.c_void_p
    temp_size = getattr(lib, f"nvcompBatched{name}DecompressGetTempSizeAsync")
    temp_size.restype = ctypes.c_int
    # (num_chunks, max_uncompressed_chunk_bytes, opts, *temp_bytes, max_total_uncompressed)
    temp_size.argtypes = [size_t, size_t, DecompressOpts, ctypes.POINTER(size_t), size_t]
    decompress = getattr(lib, f"nvcompBatched{name}DecompressAsync")
    decompress.restype = ctypes.c_int
    # (src ptrs, src bytes, dst buffer bytes, *actual dst bytes, num_chunks, temp, temp bytes,
    #  dst ptrs, opts, *statuses, stream) -- every array in device memory
    decompress.argtypes = [ptr, ptr, ptr, ptr, size_t, ptr, size_t, ptr, DecompressOpts, ptr, ptr]
    return temp_size, decompress


class Alignments(ctypes.Structure):
    """``nvcompAlignmentRequirements_t``: minimum byte alignment of each buffer kind."""

    _fields_ = [("input", ctypes.c_size_t), ("output", ctypes.c_size_t), ("temp", ctypes.c_size_t)]


def required_alignments(kind: str) -> tuple[int, int, int]:
    """``(input, output, temp)`` alignment the installed nvCOMP needs to decode ``kind``.

    The read plan packs a run's compressed chunks back to back (any byte offset) and starts
    decoded slots on 256-byte boundaries (``dali_zarr.io.gpu.ALIGN``); nvCOMP 5.3 asks for
    (1, 1, 8) for zstd and (1, 1, 1) for LZ4, which a CI test holds the pinned version to.
    """
    query = getattr(library(), f"nvcompBatched{ALGORITHM[kind]}DecompressGetRequiredAlignments")
    query.restype = ctypes.c_int
    query.argtypes = [DecompressOpts, ctypes.POINTER(Alignments)]
    out = Alignments()
    _raise_for(query(DecompressOpts(), ctypes.byref(out)), f"nvCOMP {kind}: alignment query")
    return int(out.input), int(out.output), int(out.temp)


def temp_nbytes(kind: str, n_chunks: int, max_chunk_nbytes: int, total_nbytes: int) -> int:
    """Device scratch one call needs for ``n_chunks`` chunks decoding to at most
    ``max_chunk_nbytes`` each and ``total_nbytes`` in all."""
    temp_size, _ = functions(kind)
    out = ctypes.c_size_t(0)
    status = temp_size(n_chunks, max_chunk_nbytes, DecompressOpts(), out, total_nbytes)
    _raise_for(status, f"nvCOMP {kind}: temporary-size query")
    return int(out.value)


def calls_temp_nbytes(kind: str, chunk_nbytes: np.ndarray, calls: list[slice]) -> int:
    """The scratch the largest of ``calls`` needs (they share one buffer, in stream order)."""
    sizes = np.asarray(chunk_nbytes, dtype=np.int64)
    return max(
        temp_nbytes(kind, c.stop - c.start, int(sizes[c].max()), int(sizes[c].sum())) for c in calls
    )


def call_table(
    src_base: int, src_offsets: np.ndarray, src_nbytes: np.ndarray, dst_base: int,
    dst_offsets: np.ndarray, chunk_nbytes: np.ndarray | int,
) -> np.ndarray:  # fmt: skip
    """The per-chunk arguments of one call as one ``(6, n)`` uint64 table, uploaded at once:
    source pointers and sizes, destination pointers and sizes (``chunk_nbytes``: each
    chunk's decoded size, or one for all), then room for the decoded sizes and statuses
    nvCOMP writes back."""
    n = len(src_offsets)
    table = np.zeros((6, n), dtype=np.uint64)
    table[0] = np.uint64(src_base) + np.asarray(src_offsets, dtype=np.uint64)
    table[1] = np.asarray(src_nbytes, dtype=np.uint64)
    table[2] = np.uint64(dst_base) + np.asarray(dst_offsets, dtype=np.uint64)
    table[3] = np.asarray(chunk_nbytes, dtype=np.uint64)
    return table


def failed_chunks(table_back: np.ndarray, chunk_nbytes: np.ndarray | int) -> list[tuple[int, str]]:
    """``(chunk index in the call, why)`` for every chunk whose status is not success or
    that decoded to a size other than its ``chunk_nbytes`` (rows 4 and 5 of the table,
    read back after the stream sync; statuses are 32-bit)."""
    n = table_back.shape[1]
    statuses = table_back[5].view(np.int32)[:n]  # nvcompStatus_t is 32-bit: n in a row of 2n
    sizes = table_back[4]
    expected = np.broadcast_to(np.asarray(chunk_nbytes, dtype=np.uint64), (n,))
    bad = np.flatnonzero((statuses != 0) | (sizes != expected))
    out = []
    for i in bad.tolist():  # errors only: a handful at most
        status = int(statuses[i])
        why = (
            f"nvCOMP status {status} ({_STATUS.get(status, 'unknown')})"
            if status
            else f"decoded to {int(sizes[i])} bytes, expected {int(expected[i])}"
        )
        out.append((i, why))
    return out


class BatchedDecoder:
    """One (kind, device stream) pair: grows its scratch and argument buffers, never shrinks."""

    def __init__(self, kind: str, cupy: Any, stream: Any) -> None:
        self.kind = kind
        self.cp = cupy
        self.stream = stream
        self._decompress = functions(kind)[1]
        self._temp = None
        self._table = None
        self._pending: tuple[Any, int, np.ndarray] | None = None  # (device table, n, sizes)

    def _buffer(self, current, nbytes: int):
        if current is None or current.size < nbytes:
            self.stream.synchronize()  # the old buffer may still be in use by queued work
            current = self.cp.empty(max(nbytes, 1), dtype=self.cp.uint8)
        return current

    def enqueue(
        self, staging: Any, src_offsets: np.ndarray, src_nbytes: np.ndarray, decoded: Any,
        dst_offsets: np.ndarray, chunk_nbytes: np.ndarray | int,
    ) -> None:  # fmt: skip
        """Queue the decode of every chunk on the stream, in :func:`call_slices` calls that
        share one scratch buffer (stream order keeps them apart); :meth:`check` after
        syncing the stream. ``chunk_nbytes``: each chunk's decoded size, or one for all
        (the chunks of several plans of a window go in one enqueue)."""
        n = len(src_offsets)
        if n == 0:
            return
        sizes = np.broadcast_to(np.asarray(chunk_nbytes, dtype=np.int64), (n,))
        host = call_table(
            staging.data.ptr, src_offsets, src_nbytes, decoded.data.ptr, dst_offsets, sizes
        )
        self._table = self._buffer(self._table, host.nbytes)
        table = self._table[: host.nbytes].view(self.cp.uint64).reshape(6, n)
        table.set(host, stream=self.stream)
        calls = call_slices(sizes)
        temp = calls_temp_nbytes(self.kind, sizes, calls)
        self._temp = self._buffer(self._temp, temp)
        status_ptr = table[5].data.ptr  # nvcompStatus_t is 32-bit: statuses[i] at 4 * i
        for c in calls:
            k = c.stop - c.start
            status = self._decompress(
                table[0, c].data.ptr, table[1, c].data.ptr, table[3, c].data.ptr,
                table[4, c].data.ptr, k, self._temp.data.ptr, temp, table[2, c].data.ptr,
                DecompressOpts(), status_ptr + 4 * c.start, self.stream.ptr,
            )  # fmt: skip
            _raise_for(status, f"nvCOMP {self.kind}: batched decode of {k} chunks")
        self._pending = (table, n, sizes)

    def forget(self) -> None:
        """Drop the last call's table unread (its plan failed before :meth:`check`)."""
        self._pending = None

    def check(self) -> list[tuple[int, str]]:
        """Failed chunks of the last :meth:`enqueue` (call after the stream was synced)."""
        if self._pending is None:
            return []
        table, _, chunk_nbytes = self._pending
        self._pending = None
        # on our stream: cupy's default (the legacy stream, where torch trains) would make
        # the reader thread wait for the training step queued there
        return failed_chunks(table.get(stream=self.stream), chunk_nbytes)


def _raise_for(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: nvCOMP status {status} ({_STATUS.get(status, '?')})")
