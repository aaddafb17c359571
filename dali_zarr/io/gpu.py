"""The GPU read backend: a window's rows as a byte-range plan, run on the CPU or on the GPU.

:func:`plan_rows` turns the ``[start, stop)`` row ranges of one window of a
:class:`~dali_zarr.io.DirectReader` array into a :class:`ReadPlan`, without reading chunk
data: which stored bytes to read (file, offset, nbytes; shard indexes are read and
crc32c-checked on the host through the reader), where each chunk's bytes land in a staging
buffer, where each decoded chunk lands in a chunk buffer, which chunks are missing (fill
value), and the copy segments that assemble the window's rows from the decoded chunks.

Two executors run the same plan:

* :func:`execute_plan_cpu` (NumPy, any machine): ``os.preadv`` into one contiguous host
  staging buffer, then decode — the CPU stand-in for exactly what the GPU does, so tests can
  compare it with ``DirectReader.read_rows`` on every codec and layout.
* :class:`GpuPlanExecutor` (needs CUDA; imports kvikio, cupy and nvCOMP lazily): kvikio
  ``CuFile.pread`` of every stored range straight into device memory (GPUDirect Storage where
  the system has it, kvikio's compat mode otherwise), all reads in flight at once; one nvCOMP
  batched decode call for all chunks of the array in the window; chunks nvCOMP cannot decode
  are decoded on the CPU into pinned memory and copied once; then one launch of
  ``cuda_kernels.copy_segments`` assembles the rows.

Per-array decode path (:func:`gpu_codec_kind`): ``"none"`` (only the ``bytes`` codec, native
byte order: disk → GPU with no decode), ``"zstd"`` (zarr v3's default; nvCOMP zstd), ``"lz4"``
(numcodecs' LZ4: a 4-byte little-endian size header before a raw LZ4 block; the plan reads
only the block, and the decoded size is checked instead of the header), and ``"host"`` for
everything else (blosc, gzip, filters, big-endian, per-chunk crc32c, F order...), decoded by
the same :class:`~dali_zarr.io.ChunkDecoder` as the CPU path. Arrays whose chunks do not
span all non-leading axes cannot be planned (rows would not be contiguous in a chunk); the
caller reads those with ``read_rows`` on the host and copies the window once.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numcodecs
import numpy as np

from ..errors import ChunkReadError
from ..planning.partition import split_at_chunks
from . import nvcomp_batched
from .codecs import DecodeError, _zstd_content_size
from .layout import ArrayLayout
from .readers import DirectReader, _check_ranges, _offsets, _pread_into, _run_parallel

__all__ = [
    "GPU_KINDS",
    "ChunkRead",
    "GpuPlanExecutor",
    "GpuSupport",
    "NotPlannable",
    "ReadPlan",
    "execute_plan_cpu",
    "gpu_codec_kind",
    "plan_problem",
    "plan_rows",
    "probe_gpu",
]

#: decode paths that run on the GPU ("host" is the CPU decode + one copy).
GPU_KINDS = ("none", "zstd", "lz4")
ALIGN = 256  # staging and chunk-buffer slots start on 256-byte boundaries (nvCOMP, kvikio)
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
    if ids == ["zstd"]:
        if codecs.bytes_codecs[0].get("checksum"):
            return "host", "zstd frames with content checksums"
        return "zstd", ""
    if ids == ["lz4"]:
        return "lz4", ""
    return "host", "codecs " + "+".join(ids)


# ---------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ChunkRead:
    """One stored chunk (inner chunk when sharded) to read."""

    chunk: int  # chunk index along axis 0
    path: str
    file_offset: int
    nbytes: int
    staging_offset: int  # where the bytes go in the staging buffer; -1: into the chunk buffer
    decoded_offset: int  # byte offset of the decoded chunk in the chunk buffer


@dataclass(frozen=True)
class ReadPlan:
    """Everything needed to read one window of one array, without touching chunk data."""

    name: str
    kind: str  # "none" | "zstd" | "lz4" | "host"
    reason: str  # why "host" ("" otherwise)
    dtype: np.dtype
    out_shape: tuple[int, ...]  # (rows in the window, *trailing shape)
    chunk_shape: tuple[int, ...]
    chunk_nbytes: int  # decoded bytes of one (full) chunk
    slot_nbytes: int  # chunk-buffer stride (chunk_nbytes rounded up to ALIGN)
    chunks: np.ndarray  # chunk indices held by the chunk buffer, in slot order
    reads: tuple[ChunkRead, ...]
    fill_slots: tuple[int, ...]  # slots of chunks that are not stored (fill value)
    fill_value: Any
    staging_nbytes: int
    segments: np.ndarray  # (k, 3) int64, in elements: chunk-buffer start, window start, length

    @property
    def decoded_nbytes(self) -> int:
        return len(self.chunks) * self.slot_nbytes


def plan_problem(reader: Any) -> str:
    """Why ``reader``'s rows cannot be read as planned byte ranges ("" when they can)."""
    if not isinstance(reader, DirectReader):
        return f"not read by the direct path ({reader.path}: {reader.reason})"
    shape, chunk = reader.layout.shape, reader.layout.chunk_shape
    if tuple(chunk[1:]) != tuple(shape[1:]):
        return (
            f"chunks {chunk} do not span the trailing axes {shape[1:]}, so a row is not "
            "contiguous within a chunk"
        )
    return ""


def plan_rows(reader: DirectReader, ranges: Any) -> ReadPlan:
    """The byte plan for ``reader.read_rows(ranges)`` (same rows, same order).

    Raises :class:`NotPlannable` when the array's rows are not contiguous within a chunk, and
    ``ChunkReadError`` for a corrupted shard index.
    """
    problem = plan_problem(reader)
    if problem:
        raise NotPlannable(f"{getattr(reader, 'name', reader)}: {problem}")
    lay = reader.layout
    shape, chunk = lay.shape, lay.chunk_shape
    kind, reason = gpu_codec_kind(lay)
    dtype = np.dtype(lay.dtype)
    n, C = shape[0], int(chunk[0])
    row_elems = math.prod(shape[1:])
    chunk_nbytes = math.prod(chunk) * dtype.itemsize
    slot_nbytes = round_up(max(chunk_nbytes, 1))
    slot_elems = slot_nbytes // dtype.itemsize

    r = _check_ranges(ranges, n, reader.name)
    lens = r[:, 1] - r[:, 0]
    total = int(lens.sum())
    nz = np.flatnonzero(lens)
    starts, stops = r[nz, 0], r[nz, 1]
    outs = _offsets(lens)[nz]
    # one entry per (range, chunk) intersection, in window order
    rep, seg_chunk, lo, hi = split_at_chunks(starts, stops, C)
    chunks, slot_of = np.unique(seg_chunk, return_inverse=True)
    seg = np.stack(
        [
            slot_of * slot_elems + (lo - seg_chunk * C) * row_elems,
            (outs[rep] + lo - starts[rep]) * row_elems,
            (hi - lo) * row_elems,
        ],
        axis=1,
    ).astype(np.int64)
    seg = _merge_segments(seg)

    other = (0,) * (len(shape) - 1)
    locations = reader.chunk_locations([(int(c), *other) for c in chunks])
    reads: list[ChunkRead] = []
    fill: list[int] = []
    staging = 0
    for slot, (c, loc) in enumerate(zip(chunks.tolist(), locations, strict=True)):
        if loc is None:
            fill.append(slot)
            continue
        path, offset, nbytes = loc
        if kind == "none":
            if nbytes != chunk_nbytes:
                raise reader.chunk_error(
                    (c, *other), f"stored {nbytes} bytes, expected {chunk_nbytes} (uncompressed)"
                )
            reads.append(ChunkRead(c, path, offset, nbytes, -1, slot * slot_nbytes))
            continue
        if kind == "lz4":
            if nbytes < _LZ4_HEADER:
                raise reader.chunk_error(
                    (c, *other), f"lz4 chunk is {nbytes} bytes, shorter than its 4-byte header"
                )
            offset, nbytes = offset + _LZ4_HEADER, nbytes - _LZ4_HEADER
        reads.append(ChunkRead(c, path, offset, nbytes, staging, slot * slot_nbytes))
        staging += round_up(max(nbytes, 1))
    return ReadPlan(
        name=reader.name,
        kind=kind,
        reason=reason,
        dtype=dtype,
        out_shape=(total, *shape[1:]),
        chunk_shape=tuple(chunk),
        chunk_nbytes=chunk_nbytes,
        slot_nbytes=slot_nbytes,
        chunks=chunks.astype(np.int64),
        reads=tuple(reads),
        fill_slots=tuple(fill),
        fill_value=lay.fill_value,
        staging_nbytes=staging,
        segments=seg,
    )


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

    def read(rd: ChunkRead) -> None:
        if rd.staging_offset < 0:
            buf = decoded[rd.decoded_offset : rd.decoded_offset + rd.nbytes]
        else:
            buf = staging[rd.staging_offset : rd.staging_offset + rd.nbytes]
        try:
            fd = os.open(rd.path, os.O_RDONLY)
            try:
                got = _pread_into(fd, buf, rd.file_offset)
            finally:
                os.close(fd)
        except OSError as e:
            raise reader.chunk_error(_coords(reader, rd.chunk), f"reading failed ({e})") from e
        if got != rd.nbytes:
            raise reader.chunk_error(
                _coords(reader, rd.chunk), f"read {got} of {rd.nbytes} bytes (file shrank)"
            )

    _run_parallel(reader.executor, plan.reads, read)
    decode = _cpu_decoder(plan, reader)
    _run_parallel(reader.executor, plan.reads, lambda rd: decode(rd, staging, decoded))
    for slot in plan.fill_slots:
        _chunk_view(decoded, plan, slot * plan.slot_nbytes)[...] = plan.fill_value
    return decoded[: plan.decoded_nbytes]


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


def copy_segments_cpu(out: np.ndarray, src: np.ndarray, segments: np.ndarray) -> None:
    """NumPy reference of ``cuda_kernels.copy_segments`` (flat arrays, offsets in elements)."""
    for s, d, k in segments.tolist():
        out[d : d + k] = src[s : s + k]


def _coords(reader: DirectReader, chunk: int) -> tuple[int, ...]:
    return (int(chunk), *(0,) * (len(reader.shape) - 1))


def _chunk_view(decoded: np.ndarray, plan: ReadPlan, offset: int) -> np.ndarray:
    return decoded[offset : offset + plan.chunk_nbytes].view(plan.dtype).reshape(plan.chunk_shape)


def _cpu_decoder(plan: ReadPlan, reader: DirectReader):
    """decode(read, staging, decoded) for the plan's kind, raising ChunkReadError."""
    if plan.kind == "none":
        return lambda rd, staging, decoded: None
    if plan.kind == "zstd":
        codec = numcodecs.Zstd()

        def raw(rd: ChunkRead, src: np.ndarray, dst: np.ndarray) -> None:
            codec.decode(src, out=dst)

    elif plan.kind == "lz4":
        codec = numcodecs.LZ4()
        header = plan.chunk_nbytes.to_bytes(4, "little")

        def raw(rd: ChunkRead, src: np.ndarray, dst: np.ndarray) -> None:
            # the plan read the bare LZ4 block (what nvCOMP gets); numcodecs wants its header
            codec.decode(header + src.tobytes(), out=dst)

    else:
        chunk_decoder = reader.decoder  # the reader's own: same codecs, chunk shape, dtype

        def decode_host(rd: ChunkRead, staging: np.ndarray, decoded: np.ndarray) -> None:
            src = staging[rd.staging_offset : rd.staging_offset + rd.nbytes]
            try:
                chunk_decoder.decode_into(src, _chunk_view(decoded, plan, rd.decoded_offset))
            except DecodeError as e:
                raise reader.chunk_error(_coords(reader, rd.chunk), str(e)) from e

        return decode_host

    def decode(rd: ChunkRead, staging: np.ndarray, decoded: np.ndarray) -> None:
        src = staging[rd.staging_offset : rd.staging_offset + rd.nbytes]
        dst = decoded[rd.decoded_offset : rd.decoded_offset + plan.chunk_nbytes]
        try:
            # numcodecs fills only a zstd frame's content size: check it (the GPU executor
            # checks nvCOMP's decompressed sizes instead)
            if plan.kind == "zstd":
                size = _zstd_content_size(src)
                if size is not None and size != plan.chunk_nbytes:
                    raise DecodeError(f"zstd frame holds {size} bytes, expected {dst.size}")
            raw(rd, src, dst)
        except DecodeError as e:
            raise reader.chunk_error(_coords(reader, rd.chunk), str(e)) from e
        except Exception as e:  # numcodecs raises RuntimeError/ValueError
            raise reader.chunk_error(
                _coords(reader, rd.chunk), f"{plan.kind} decoding failed ({e})"
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


def reads_to_device(plan_kind: str, *, kvikio: bool, nvcomp: bool) -> bool:
    """Whether a plan of ``plan_kind`` is read into device memory (and decoded there):
    kvikio must be there, and nvCOMP too unless the chunks are uncompressed. Otherwise the
    window is read and decoded on the host and copied once."""
    if not kvikio or plan_kind not in GPU_KINDS:
        return False
    return plan_kind == "none" or nvcomp


def describe_path(plan_kind: str, reason: str, support: GpuSupport) -> str:
    """One line for ``read_paths()``: how an array's windows reach the GPU."""
    if not reads_to_device(plan_kind, kvikio=support.kvikio, nvcomp=support.nvcomp):
        if plan_kind not in GPU_KINDS:
            why = reason or plan_kind
        else:
            why = "kvikio unavailable" if not support.kvikio else "nvCOMP unavailable"
        return f"gpu: host read and decode ({why}) into pinned memory, one copy to the device"
    io = "kvikio GDS" if support.gds else "kvikio compat"
    if plan_kind == "none":
        return f"gpu: {io} → device, no decode (uncompressed)"
    api = " (C API, experimental)" if nvcomp_batched.enabled() else ""
    return f"gpu: {io} → device, nvCOMP {plan_kind}{api}"


class GpuPlanExecutor:
    """Runs :class:`ReadPlan`s on one CUDA device (kvikio reads, nvCOMP decode, one copy kernel).

    CI has no GPU: this ran on an H100 (README "GPU path"), one executor per reader thread
    (it is not shared: one plan at a time, reused buffers). Imports kvikio,
    cupy and nvCOMP when constructed; without kvikio it reads with ``os.preadv`` into pinned
    memory and copies; without nvCOMP every chunk takes the host decode path.
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
        self._kvikio = importlib.import_module("kvikio") if self.support.kvikio else None
        self._nvcomp = importlib.import_module("nvidia.nvcomp") if self.support.nvcomp else None
        self._codecs: dict[str, Any] = {}
        # experimental: nvCOMP's C API instead of its Python codecs (see nvcomp_batched)
        self._use_batched = nvcomp_batched.enabled()
        self._batched: dict[str, nvcomp_batched.BatchedDecoder] = {}
        self._files: OrderedDict[str, Any] = OrderedDict()
        self._max_open = max_open_files
        self._buffers: dict[str, Any] = {}
        self._pinned: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()  # one plan at a time (buffers are reused)

    # -- resources ----------------------------------------------------------------------------

    def _device_buffer(self, key: str, nbytes: int):
        buf = self._buffers.get(key)
        if buf is None or buf.size < nbytes:
            self.stream.synchronize()  # the old buffer may still be read by queued work
            buf = self.cp.empty(max(nbytes, 1 << 20, 0 if buf is None else 2 * buf.size), "u1")
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

    def _cufile(self, path: str):
        f = self._files.get(path)
        if f is None:
            f = self._kvikio.CuFile(path, "r")
            self._files[path] = f
        else:
            self._files.move_to_end(path)
        return f

    def _trim_files(self) -> None:
        """Close the least recently used files beyond the cap (no read is in flight)."""
        while len(self._files) > self._max_open:
            self._files.popitem(last=False)[1].close()

    def _codec(self, kind: str):
        codec = self._codecs.get(kind)
        if codec is None:
            nv = self._nvcomp
            codec = nv.Codec(
                algorithm={"zstd": "Zstd", "lz4": "LZ4"}[kind],
                bitstream_kind=nv.BitstreamKind.RAW,
                device_id=self.device_id,
                cuda_stream=self.stream.ptr,
            )
            self._codecs[kind] = codec
        return codec

    def close(self) -> None:
        with self._lock:  # after the plan being run, if any: its reads use these files
            for f in self._files.values():
                f.close()
            self._files.clear()
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
        on_device = reads_to_device(
            plan.kind, kvikio=self.support.kvikio, nvcomp=self.support.nvcomp
        )
        return "device" if on_device else "host"

    def run(self, plan: ReadPlan, reader: DirectReader, out: Any) -> Any:
        """Fill the device array ``out`` (``plan.out_shape``, ``plan.dtype``) with the window.

        Returns ``out`` once every copy into it has completed (the stream is synchronised).
        """
        with self._lock, self.device:
            decoded = self._device_buffer("decoded", plan.decoded_nbytes)
            if self.path_of(plan) == "device":
                staging = self._device_buffer("staging", plan.staging_nbytes)
                self._read_to_device(plan, reader, staging, decoded)
                if plan.kind != "none":
                    self._nvcomp_decode(plan, reader, staging, decoded)
                with self.stream:
                    for slot in plan.fill_slots:
                        off = slot * plan.slot_nbytes
                        chunk = decoded[off : off + plan.chunk_nbytes].view(plan.dtype)
                        chunk.fill(plan.fill_value)
            else:  # host decode: pread into pinned memory, decode + fill there, one copy
                host = decode_plan_cpu(
                    plan,
                    reader,
                    self._pinned_buffer("staging", plan.staging_nbytes),
                    self._pinned_buffer("decoded", plan.decoded_nbytes),
                )
                decoded.set(host, stream=self.stream)
            self.copy_segments(out.reshape(-1), decoded.view(plan.dtype), plan.segments)
            self.stream.synchronize()
            decoder = self._batched.get(plan.kind)
            for i, why in decoder.check() if decoder is not None else ():
                raise reader.chunk_error(_coords(reader, plan.reads[i].chunk), why)
        return out

    def copy_segments(self, out: Any, src: Any, segments: np.ndarray) -> None:
        """One launch of ``cuda_kernels.copy_segments`` on this executor's stream."""
        if not len(segments):
            return
        from numba import cuda

        from dali_zarr.graph import cuda_kernels

        with self.stream:
            seg = self.cp.asarray(np.ascontiguousarray(segments.T))
        kernel = _jit(cuda_kernels.copy_segments)
        blocks = min(len(segments), 4096)
        kernel[blocks, 256, cuda.external_stream(self.stream.ptr)](out, src, seg[0], seg[1], seg[2])

    def _read_to_device(self, plan: ReadPlan, reader: DirectReader, staging, decoded) -> None:
        pending = []
        for rd in plan.reads:  # every read in flight at once (kvikio's thread pool)
            if rd.staging_offset < 0:
                target = decoded[rd.decoded_offset : rd.decoded_offset + rd.nbytes]
            else:
                target = staging[rd.staging_offset : rd.staging_offset + rd.nbytes]
            pending.append((rd, self._cufile(rd.path).pread(target, rd.nbytes, rd.file_offset)))
        for rd, future in pending:
            try:
                got = future.get()
            except Exception as e:
                raise reader.chunk_error(
                    _coords(reader, rd.chunk), f"kvikio read failed ({e})"
                ) from e
            if got != rd.nbytes:
                raise reader.chunk_error(
                    _coords(reader, rd.chunk), f"read {got} of {rd.nbytes} bytes (file shrank)"
                )
        self._trim_files()

    def _nvcomp_decode(self, plan: ReadPlan, reader: DirectReader, staging, decoded) -> None:
        """All chunks of the plan in one batched nvCOMP call (raw zstd frames / LZ4 blocks).

        nvCOMP 5.3 parses every frame's header and synchronises the stream inside ``decode``
        while holding the GIL (its size-built DecompressConfig serves single arrays only).
        On an H100 this was the largest cost of a window: ~25 ms per array of 131 MB decoded.
        """
        if not plan.reads:
            return
        if self._use_batched:
            decoder = self._batched.get(plan.kind)
            if decoder is None:
                decoder = nvcomp_batched.BatchedDecoder(plan.kind, self.cp, self.stream)
                self._batched[plan.kind] = decoder
            n = len(plan.reads)
            decoder.enqueue(
                staging,
                np.fromiter((r.staging_offset for r in plan.reads), np.int64, n),
                np.fromiter((r.nbytes for r in plan.reads), np.int64, n),
                decoded,
                np.fromiter((r.decoded_offset for r in plan.reads), np.int64, n),
                plan.chunk_nbytes,
            )
            return
        nv = self._nvcomp
        srcs = nv.as_arrays(
            [staging[r.staging_offset : r.staging_offset + r.nbytes] for r in plan.reads],
            self.stream.ptr,
        )
        # as nvCOMP arrays: nvCOMP 5.3 segfaults when ``out`` holds cupy arrays directly
        dsts = nv.as_arrays(
            [decoded[r.decoded_offset : r.decoded_offset + plan.chunk_nbytes] for r in plan.reads],
            self.stream.ptr,
        )
        try:
            results = self._codec(plan.kind).decode(srcs, data_type="|u1", out=dsts)
        except Exception as e:
            raise ChunkReadError(
                f"{plan.name}: nvCOMP {plan.kind} decoding of {len(srcs)} chunks failed ({e})"
            ) from e
        for rd, res in zip(plan.reads, results, strict=True):
            size = getattr(res, "buffer_size", plan.chunk_nbytes)
            if size != plan.chunk_nbytes:
                raise reader.chunk_error(
                    _coords(reader, rd.chunk),
                    f"{plan.kind} chunk decoded to {size} bytes, expected {plan.chunk_nbytes}",
                )


_JITTED: dict[Any, Any] = {}


def _jit(fn):
    from numba import cuda

    from dali_zarr.graph.cuda_kernels import numba_cuda_compat

    kernel = _JITTED.get(fn)
    if kernel is None:
        numba_cuda_compat()
        kernel = _JITTED[fn] = cuda.jit(fn)
    return kernel
