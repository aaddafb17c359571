"""Decode the stored bytes of one zarr chunk into an ndarray.

`ChunkDecoder` is built once per array from a `layout.ChunkCodecs` description and then
decodes chunks on many threads at once (it holds no per-call state). The hot path is
``decode_into(raw, dest)``: ``dest`` is a C-contiguous array of the chunk's full shape and
the reader's (native-endian) dtype, and the last decompressor writes straight into it when
the codec can (zstd, blosc, lz4); a big-endian chunk is then byte-swapped in place.

``decode_prefix_into(raw, dest, rows)`` decodes only rows ``[0, rows)`` (along axis 0) of a
chunk whose last bytes codec is zstd and whose decoded bytes are the chunk in C order: an
axis-0 prefix is then a byte prefix of the decompressed frame, and the `zstandard` package's
streaming decompressor stops once it has produced that many bytes (numcodecs can only decode
whole frames). Without `zstandard` it falls back to the full decode.

Every failure (bad checksum, decompression error, wrong decoded size, truncated input)
raises `DecodeError` saying what went wrong; the reader adds the array name and chunk key
and turns it into a `ChunkReadError`.
"""

from __future__ import annotations

import math
import struct
import threading
from typing import Any

import crc32c as _crc32c
import numcodecs
import numpy as np

from .layout import ChunkCodecs

try:  # optional: decoding a prefix of a zstd frame (numcodecs decodes whole frames only)
    import zstandard as _zstandard
except ImportError:  # pragma: no cover - a dependency, but the full decode still works
    _zstandard = None

__all__ = ["ChunkDecoder", "DecodeError", "verify_crc32c"]

_U1 = np.dtype(np.uint8)
_tls = threading.local()


class DecodeError(Exception):
    """One chunk's bytes could not be decoded; the message says what went wrong."""


def verify_crc32c(buf: np.ndarray, what: str = "chunk") -> np.ndarray:
    """Check the trailing little-endian crc32c of ``buf``; return the payload (a view)."""
    if buf.size < 4:
        raise DecodeError(f"{what} is {buf.size} bytes, too short to hold its crc32c checksum")
    stored = int.from_bytes(buf[-4:].tobytes(), "little")
    payload = buf[:-4]
    computed = _crc32c.crc32c(payload)
    if stored != computed:
        raise DecodeError(
            f"{what} crc32c checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
        )
    return payload


def _as_u1(buf: Any) -> np.ndarray:
    """A flat uint8 view of a bytes-like object or ndarray (copies only if not contiguous)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            buf = np.ascontiguousarray(buf)
        return buf.reshape(-1).view(_U1)
    return np.frombuffer(buf, dtype=_U1)


# ---------------------------------------------------------------------------- stages
# Each stage undoes one bytes→bytes codec. ``decode`` returns a new buffer (or a view);
# ``decode_into`` writes exactly ``out.nbytes`` bytes into ``out`` and returns True, or
# returns False when it cannot (the caller then uses ``decode`` and copies).


class _Stage:
    name = "?"

    def decode(self, buf: np.ndarray) -> Any:
        raise NotImplementedError

    def decode_into(self, buf: np.ndarray, out: np.ndarray) -> bool:
        return False


class _Crc32c(_Stage):
    name = "crc32c"

    def __init__(self, location: str = "end") -> None:
        self.location = location

    def decode(self, buf: np.ndarray) -> np.ndarray:
        if self.location == "end":
            return verify_crc32c(buf)
        if buf.size < 4:
            raise DecodeError(f"chunk is {buf.size} bytes, too short to hold its crc32c checksum")
        stored = int.from_bytes(buf[:4].tobytes(), "little")
        computed = _crc32c.crc32c(buf[4:])
        if stored != computed:
            raise DecodeError(
                f"chunk crc32c checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
            )
        return buf[4:]


#: bytes at the start of a stored chunk that the frame checks read: a zstd frame header at
#: its longest (magic 4, descriptor 1, window 1, dictionary id 4, content size 8)
FRAME_HEAD_NBYTES = 18
_ZSTD_MAGIC = 0xFD2FB528
_ZSTD_MIN_FRAME = 9  # magic, descriptor, one 3-byte block header and one byte
_ZSTD_CHECKSUM_FLAG = 0x04  # Content_Checksum_flag of the frame header descriptor
# widths in bytes, by the descriptor's Dictionary_ID_Flag and Frame_Content_Size_Flag
_DICT_ID_WIDTH = (0, 1, 2, 4)
_CONTENT_SIZE_WIDTH = (0, 2, 4, 8)  # flag 0 with Single_Segment_Flag set: 1 byte
_INT64_MAX = int(np.iinfo(np.int64).max)


def _le_u32(heads: np.ndarray) -> np.ndarray:
    """The first 4 bytes of each row of ``heads`` as a little-endian uint32."""
    return np.ascontiguousarray(heads[:, :4]).view("<u4")[:, 0]


def zstd_content_sizes(heads: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse the zstd frame headers in the rows of ``heads`` (``(n, FRAME_HEAD_NBYTES)``
    uint8, a frame's first bytes each; RFC 8878 §3.1.1.1) without Python work per frame.

    Returns ``(is_frame, content_size, header_end)``: the magic number is there and the
    descriptor's reserved bit is clear; Frame_Content_Size (-1 where the frame does not
    record it); the byte where the header ends (a chunk shorter than that is truncated).
    """
    heads = np.asarray(heads, dtype=np.uint8).reshape(-1, FRAME_HEAD_NBYTES)
    fhd = heads[:, 4].astype(np.int64)
    is_frame = (_le_u32(heads) == _ZSTD_MAGIC) & ((fhd >> 3) & 1 == 0)
    single_segment = (fhd >> 5) & 1
    pos = 5 + (1 - single_segment) + np.array(_DICT_ID_WIDTH)[fhd & 3]
    size = np.where(fhd >> 6 == 0, single_segment, np.array(_CONTENT_SIZE_WIDTH)[fhd >> 6])
    byte = np.arange(8)
    at = np.minimum(pos[:, None] + byte, FRAME_HEAD_NBYTES - 1)
    digits = np.take_along_axis(heads, at, axis=1).astype(np.uint64) << (8 * byte).astype(np.uint64)
    value = np.where(byte < size[:, None], digits, 0).sum(axis=1, dtype=np.uint64)
    # sizes past int64 (no real chunk) stay past any expected size
    value = np.minimum(value, np.uint64(_INT64_MAX - 256)).astype(np.int64)
    value += np.where(size == 2, 256, 0)
    return is_frame, np.where(size > 0, value, -1), pos + size


#: decoded bytes a zstd block holds at most (RFC 8878 §3.1.1.2.4)
_ZSTD_BLOCK_MAX = 128 << 10


def zstd_block_walk_limit(chunk_nbytes: int) -> int:
    """Block headers the host walk (:func:`zstd_frame_ends`) reads per frame before it gives
    up on one: blocks of 4 KiB decoded on average, where an encoder that fills them writes
    128 KiB (libzstd 1.5.7 split a 1 MiB frame of random floats into 48 blocks at level 3;
    a frame of more, smaller, blocks is left to a decoder that checks it)."""
    return chunk_nbytes // 4096 + 4


def zstd_walk_from(heads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(first block header, checksum bytes)`` of each zstd frame whose first bytes are a
    row of ``heads``: where a walk of its blocks starts, and the 4 bytes a frame with a
    content checksum holds after its last block (int64 each)."""
    heads = np.asarray(heads, dtype=np.uint8).reshape(-1, FRAME_HEAD_NBYTES)
    checksum = np.where(heads[:, 4] & _ZSTD_CHECKSUM_FLAG, 4, 0).astype(np.int64)
    return zstd_content_sizes(heads)[2].astype(np.int64), checksum


def zstd_frame_ends(
    staging: np.ndarray, starts: np.ndarray, nbytes: np.ndarray, first_block: np.ndarray,
    checksum: np.ndarray, max_blocks: int,
) -> np.ndarray:  # fmt: skip
    """Where each zstd frame ends by its block headers (RFC 8878 §3.1.1.2), in bytes from its
    start, for frames stored at ``starts`` of the host buffer ``staging`` (``nbytes`` stored
    bytes each; ``first_block`` and ``checksum`` from :func:`zstd_walk_from` of their
    headers, already checked by :func:`frame_problems`): NumPy over every frame, one step a
    block. Device memory is walked by its twin ``cuda_kernels.zstd_frame_ends``, which
    takes the same arguments, one thread a frame.

    -1 where the stored bytes end before the frame does (a truncated chunk), or a block
    header is of the reserved type; -2 where the frame holds more than ``max_blocks``
    blocks (not walked to its end). A frame's header says how many bytes it decodes to but
    not how many it is stored in: nvCOMP's batched zstd decoder decoded a frame cut short
    to garbage without an error (H200, 2026-11-27), so the GPU executor checks this first.
    """
    starts = np.asarray(starts, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.int64)
    pos = np.array(first_block, dtype=np.int64)  # advanced in place
    checksum = np.asarray(checksum, dtype=np.int64)
    end = np.full(len(starts), -1, dtype=np.int64)
    active = np.flatnonzero(pos + 3 <= nbytes)
    for _ in range(max_blocks):
        if not len(active):
            return end
        at = starts[active, None] + pos[active, None] + np.arange(3)
        b = staging[at].astype(np.int64)
        header = b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16
        kind = (header >> 1) & 3  # 0 raw, 1 RLE (one byte stored), 2 compressed, 3 reserved
        pos[active] += 3 + np.where(kind == 1, 1, header >> 3)
        last = (header & 1 == 1) & (kind != 3)
        end[active[last]] = pos[active[last]] + checksum[active[last]]
        going = ~last & (kind != 3)
        active = active[going & (pos[active] + 3 <= nbytes[active])]
    end[active] = -2
    return end


def _zstd_header(head: bytes) -> tuple[bool, int, int]:
    """:func:`zstd_content_sizes` for one frame in plain Python: the reader path checks
    every chunk it decodes, and the NumPy version costs ~30x as much for one frame (a test
    holds the two to the same answers)."""
    head = head[:FRAME_HEAD_NBYTES].ljust(FRAME_HEAD_NBYTES, b"\0")
    fhd = head[4]
    is_frame = int.from_bytes(head[:4], "little") == _ZSTD_MAGIC and not (fhd >> 3) & 1
    single_segment = (fhd >> 5) & 1
    pos = 5 + (1 - single_segment) + _DICT_ID_WIDTH[fhd & 3]
    size = single_segment if fhd >> 6 == 0 else _CONTENT_SIZE_WIDTH[fhd >> 6]
    if size == 0:
        return is_frame, -1, pos
    value = int.from_bytes(head[pos : pos + size], "little")
    value = min(value, _INT64_MAX - 256) + (256 if size == 2 else 0)
    return is_frame, value, pos + size


def _zstd_content_size(buf: np.ndarray) -> int | None:
    """Frame_Content_Size of the zstd frame ``buf`` starts with; None if it records none or
    ``buf`` does not start with a whole zstd frame header."""
    is_frame, size, end = _zstd_header(buf[:FRAME_HEAD_NBYTES].tobytes())
    if not is_frame or buf.size < end or size < 0:
        return None
    return size


def frame_problems(
    kind: str, heads: np.ndarray, nbytes: np.ndarray, expected: int
) -> list[tuple[int, str]]:
    """``(index, why)`` for every stored chunk whose first bytes show it cannot decode to
    ``expected`` bytes: ``kind`` "zstd" (not a frame, a truncated header, a content size
    other than ``expected``) or "lz4" (numcodecs' 4-byte size header is not ``expected``).

    Skippable frames (which zarr and numcodecs never write) count as "not a zstd frame".
    Both executors run it on every chunk before decoding. On the GPU it keeps data that is
    not what the array's metadata says away from nvCOMP, whose batched decoders do not
    promise to report such input as an error.
    """
    heads = np.asarray(heads, dtype=np.uint8).reshape(-1, FRAME_HEAD_NBYTES)
    nbytes = np.asarray(nbytes, dtype=np.int64)
    if kind == "lz4":
        size = _le_u32(heads)
        bad = np.flatnonzero(size != expected)
        return [(int(i), f"lz4 header says {int(size[i])} bytes, expected {expected}") for i in bad]
    is_frame, size, end = zstd_content_sizes(heads)
    short = nbytes < np.maximum(end, _ZSTD_MIN_FRAME)
    bad = np.flatnonzero(~is_frame | short | ((size >= 0) & (size != expected)))
    out = []
    for i in bad.tolist():  # errors only: a handful at most
        if not is_frame[i]:
            first = " ".join(f"{b:02x}" for b in heads[i, : min(4, max(nbytes[i], 0))])
            why = f"not a zstd frame (starts with [{first}], a zstd frame with 28 b5 2f fd)"
        elif short[i]:
            why = f"stored {int(nbytes[i])} bytes, too short for a zstd frame"
        else:
            why = f"zstd frame holds {int(size[i])} bytes, expected {expected}"
        out.append((i, why))
    return out


def head_index(offsets: np.ndarray, buffer_nbytes: int) -> np.ndarray:
    """Gather index of the first :data:`FRAME_HEAD_NBYTES` bytes at each of ``offsets`` in a
    buffer of ``buffer_nbytes`` (clipped to it: bytes past a chunk's end are ignored)."""
    idx = np.asarray(offsets, dtype=np.int64)[:, None] + np.arange(FRAME_HEAD_NBYTES)
    return np.minimum(idx, max(buffer_nbytes - 1, 0))


class _Zstd(_Stage):
    name = "zstd"

    def __init__(self) -> None:
        self.codec = numcodecs.Zstd()

    def decode(self, buf: np.ndarray) -> Any:
        return self.codec.decode(buf)

    def decode_into(self, buf: np.ndarray, out: np.ndarray) -> bool:
        # numcodecs fills only the frame's content size into a bigger `out`: check it first.
        if _zstd_content_size(buf) != out.nbytes:
            return False
        self.codec.decode(buf, out=out)
        return True


_BLOSC_HEADER = struct.Struct("<BBBBIII")


def blosc_header_problem(head: bytes, nbytes: int) -> str:
    """What is wrong with a stored blosc chunk of ``nbytes`` bytes that starts with
    ``head`` (its first 16 bytes or fewer), or "" where its header's compressed size is the
    chunk's. numcodecs trusts that size, so a truncated chunk would be decoded past its end:
    our decoder and the arrays zarr-python reads (``readers._refuse_truncated_blosc``) look
    first."""
    if nbytes < 16 or len(head) < 16:
        return f"blosc chunk is {nbytes} bytes, shorter than its 16-byte header"
    cbytes = _BLOSC_HEADER.unpack(head[:16])[6]
    if cbytes != nbytes:
        return (
            f"blosc header says {cbytes} compressed bytes but the chunk holds {nbytes} "
            "(truncated or corrupted)"
        )
    return ""


def _zstd_prefix_into(buf: np.ndarray, target: np.ndarray) -> int:
    """Decompress the first ``target.size`` bytes of the zstd frame in ``buf`` into ``target``.

    Returns how many bytes were written: less than ``target.size`` only when the (first)
    frame ends before that. Decoding stops after the block that fills ``target``.
    """
    dctx = getattr(_tls, "zstd", None)
    if dctx is None:  # a ZstdDecompressor must not be used by two threads at once
        dctx = _tls.zstd = _zstandard.ZstdDecompressor()
    reader = dctx.stream_reader(buf, read_across_frames=False)
    view = memoryview(target)
    got = 0
    while got < target.size:
        n = reader.readinto(view[got:])
        if n <= 0:
            break
        got += n
    return got


class _Blosc(_Stage):
    name = "blosc"

    def __init__(self) -> None:
        self.codec = numcodecs.Blosc()

    def _check(self, buf: np.ndarray) -> int:
        head = buf[:16].tobytes()
        problem = blosc_header_problem(head, buf.size)
        if problem:
            raise DecodeError(problem)
        return _BLOSC_HEADER.unpack(head)[4]  # the decoded size

    def decode(self, buf: np.ndarray) -> Any:
        self._check(buf)
        return self.codec.decode(buf)

    def decode_into(self, buf: np.ndarray, out: np.ndarray) -> bool:
        nbytes = self._check(buf)
        if nbytes != out.nbytes:
            raise DecodeError(f"blosc chunk decodes to {nbytes} bytes, expected {out.nbytes}")
        self.codec.decode(buf, out=out)
        return True


class _Lz4(_Stage):
    name = "lz4"

    def __init__(self, config: dict[str, Any]) -> None:
        self.codec = numcodecs.get_codec(config)

    def decode(self, buf: np.ndarray) -> Any:
        return self.codec.decode(buf)

    def decode_into(self, buf: np.ndarray, out: np.ndarray) -> bool:
        if buf.size < 4:
            raise DecodeError(f"lz4 chunk is {buf.size} bytes, shorter than its 4-byte header")
        nbytes = int.from_bytes(buf[:4].tobytes(), "little")
        if nbytes != out.nbytes:
            raise DecodeError(f"lz4 chunk decodes to {nbytes} bytes, expected {out.nbytes}")
        self.codec.decode(buf, out=out)
        return True


class _Numcodec(_Stage):
    """Any other numcodecs bytes→bytes codec (gzip, zlib, bz2, lzma, other checksums)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.codec = numcodecs.get_codec(config)
        self.name = str(config["id"])

    def decode(self, buf: np.ndarray) -> Any:
        return self.codec.decode(buf)


def _make_stage(config: dict[str, Any]) -> _Stage:
    cid = config["id"]
    if cid == "crc32c":
        return _Crc32c(config.get("location", "end"))
    if cid == "zstd":
        return _Zstd()
    if cid == "blosc":
        return _Blosc()
    if cid == "lz4":
        return _Lz4(config)
    return _Numcodec(config)


# ---------------------------------------------------------------------------- decoder


class ChunkDecoder:
    """Decodes one chunk (inner chunk of a shard) of an array; thread-safe, stateless."""

    def __init__(self, codecs: ChunkCodecs, chunk_shape: tuple[int, ...], dtype: np.dtype):
        self.codecs = codecs
        self.chunk_shape = tuple(chunk_shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = math.prod(self.chunk_shape) * self.dtype.itemsize
        self.stages = [_make_stage(dict(c)) for c in reversed(codecs.bytes_codecs)]
        self.filters = [numcodecs.get_codec(dict(f)) for f in reversed(codecs.filters)]
        stored = np.dtype(codecs.stored_dtype)
        same_values = stored == self.dtype
        swapped = not same_values and stored.newbyteorder("=") == self.dtype
        many_axes = sum(1 for s in self.chunk_shape if s > 1) > 1
        # "simple": the decompressed bytes are the chunk in C order, maybe byte-swapped.
        self._simple = (
            not self.filters and (same_values or swapped) and (codecs.order == "C" or not many_axes)
        )
        self._swap = self._simple and swapped
        self.passthrough = self._simple and not self._swap and not self.stages
        """True when the stored bytes are the chunk itself: read them straight into place."""
        self.prefix_decodable = (
            _zstandard is not None
            and self._simple
            and bool(self.stages)
            and isinstance(self.stages[-1], _Zstd)
        )
        """True when `decode_prefix_into` can stop early (zstd last, chunk in C order)."""

    def decode_into(self, raw: np.ndarray, dest: np.ndarray) -> None:
        """Decode ``raw`` (flat uint8) into ``dest`` (C-contiguous, chunk shape, dtype)."""
        try:
            if self._simple:
                self._decode_simple(raw, dest)
            else:
                dest[...] = self._decode_general(raw)
        except DecodeError:
            raise
        except Exception as e:  # numcodecs raises RuntimeError/ValueError/zlib.error/...
            raise self._failed(e) from e

    def decode_prefix_into(self, raw: np.ndarray, dest: np.ndarray, rows: int) -> bool:
        """Decode at least rows ``[0, rows)`` (axis 0) of ``raw`` into ``dest`` (as in
        `decode_into`); the other rows of ``dest`` may be left unwritten.

        Returns True when only that prefix was decoded (`prefix_decodable`, ``rows`` short of
        the chunk, one zstd frame holding the rows), False after a full `decode_into`.
        A prefix decode checks the frame only as far as it decodes: corruption past that
        point goes unnoticed, but the rows returned are exactly those a full decode gives.
        Frames that only a full decode can check are decoded whole: those with a content
        checksum (it covers every byte, the prefix's too) and those that do not record their
        content size (they may hold the wrong number of bytes).
        """
        if self._prefix_into(raw, dest, rows):
            return True
        self.decode_into(raw, dest)  # frame too short or not the chunk's size: full decode
        return False

    def decode_head_into(self, raw: np.ndarray, head: np.ndarray, rows: int) -> bool:
        """Rows ``[0, rows)`` of ``raw`` into ``head``, a C-contiguous array of just those rows
        (``(rows, *chunk_shape[1:])``): a reader decodes the first rows of a chunk straight
        into its output this way. As `decode_prefix_into` (True: only the prefix was
        decoded), but where the prefix cannot be decoded alone the whole chunk is decoded
        into a temporary array and its first rows copied."""
        if self._prefix_into(raw, head, rows):
            return True
        full = np.empty(self.chunk_shape, dtype=self.dtype)
        self.decode_into(raw, full)
        head[...] = full[:rows]
        return False

    def _prefix_into(self, raw: np.ndarray, dest: np.ndarray, rows: int) -> bool:
        """Rows ``[0, rows)`` of ``raw`` into the first rows of ``dest`` (C-contiguous, at
        least ``rows`` rows of the chunk's row shape) where a prefix decode can; False (and
        ``dest`` in any state) where it cannot."""
        if not self.prefix_decodable or rows >= self.chunk_shape[0]:
            return False
        try:
            buf: Any = raw
            for stage in self.stages[:-1]:
                buf = _as_u1(stage.decode(buf))
            if buf.size > 4 and buf[4] & _ZSTD_CHECKSUM_FLAG:
                return False  # its checksum covers the whole frame: decode all to check it
            # a frame without its content size (zarr always writes it) may hold the wrong
            # number of bytes, which only the full decode finds: decoded whole
            if _zstd_content_size(buf) == self.nbytes:  # else the full decode reports it
                nbytes = rows * (self.nbytes // self.chunk_shape[0])
                target = dest.reshape(-1).view(_U1)[:nbytes]
                if _zstd_prefix_into(buf, target) == nbytes:
                    if self._swap:
                        dest[:rows].byteswap(inplace=True)
                    return True
        except DecodeError:
            raise
        except Exception as e:  # zstandard.ZstdError for a corrupted frame
            raise self._failed(e) from e
        return False

    def _failed(self, e: Exception) -> DecodeError:
        names = "+".join(s.name for s in reversed(self.stages)) or "bytes"
        return DecodeError(f"{names} decoding failed ({type(e).__name__}: {e})")

    def decode(self, raw: np.ndarray) -> np.ndarray:
        """Decode ``raw`` into a new array of the chunk's shape and dtype."""
        out = np.empty(self.chunk_shape, dtype=self.dtype)
        self.decode_into(raw, out)
        return out

    def _decode_simple(self, raw: np.ndarray, dest: np.ndarray) -> None:
        target = dest.reshape(-1).view(_U1)
        buf: Any = raw
        stages = self.stages
        for stage in stages[:-1]:
            buf = _as_u1(stage.decode(buf))
        if not (stages and stages[-1].decode_into(buf, target)):
            if stages:
                buf = stages[-1].decode(buf)
            buf = _as_u1(buf)
            if buf.size != target.size:
                raise DecodeError(self._size_message(buf.size))
            target[:] = buf
        if self._swap:
            dest.byteswap(inplace=True)

    def _decode_general(self, raw: np.ndarray) -> np.ndarray:
        buf: Any = raw
        for stage in self.stages:
            buf = _as_u1(stage.decode(buf))
        codecs = self.codecs
        stored = np.dtype(codecs.stored_dtype)
        if codecs.filters_on_bytes:  # zarr format 2: filters undo on the decompressed bytes
            for f in self.filters:
                buf = f.decode(buf)
            flat = _as_u1(buf)
            if flat.size != math.prod(self.chunk_shape) * stored.itemsize:
                raise DecodeError(self._size_message(flat.size))
            return flat.view(stored).reshape(self.chunk_shape, order=codecs.order)
        flat = _as_u1(buf)
        if flat.size != math.prod(self.chunk_shape) * stored.itemsize:
            raise DecodeError(self._size_message(flat.size, stored.itemsize))
        arr = flat.view(stored).reshape(self.chunk_shape, order=codecs.order)
        if not stored.isnative:
            # numcodecs filters view their input as their own native dtype, so a big-endian
            # array (the bytes codec's endian "big") would be read byte-swapped
            arr = arr.astype(stored.newbyteorder("="))
        for f in self.filters:
            arr = np.asarray(f.decode(arr))
        if arr.size != math.prod(self.chunk_shape):
            raise DecodeError(f"filters decoded {arr.size} values, expected {self.chunk_shape}")
        return arr.reshape(self.chunk_shape)

    def _size_message(self, got: int, itemsize: int | None = None) -> str:
        itemsize = itemsize or self.dtype.itemsize
        want = math.prod(self.chunk_shape) * itemsize
        return (
            f"decoded to {got} bytes, expected {want} (chunk shape {self.chunk_shape} × "
            f"{itemsize}-byte items)"
        )
