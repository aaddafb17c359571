"""Zarr array metadata → a plain description of how its chunks are stored.

`parse_layout` turns a `zarr.Array` (format 2 or 3) into an `ArrayLayout`: the chunk grid,
how to name a chunk's key, the codec chain of one chunk, and the sharding layout if any.
It never reads chunk data. When the direct path (``readers.DirectReader``) cannot decode
the array, the layout says why in ``unsupported`` and the caller takes the zarr fallback.

The description only holds numbers, strings, numpy dtypes and numcodecs-style config
dicts (``{"id": "zstd", ...}``), so `codecs.ChunkDecoder` can build its decoders from it
without touching zarr's codec classes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from ..errors import DatasetError

__all__ = [
    "BYTES_CODEC_IDS",
    "FILTER_CODEC_IDS",
    "ArrayLayout",
    "ChunkCodecs",
    "ShardLayout",
    "error_chain",
    "missing_codec",
    "missing_codec_advice",
    "parse_layout",
    "unknown_codec_id",
    "zarr_misreads",
]

# bytes→bytes codecs the direct path decodes (numcodecs ids). "crc32c" is verified by us.
BYTES_CODEC_IDS = frozenset(
    {
        "zstd",
        "blosc",
        "lz4",
        "gzip",
        "zlib",
        "bz2",
        "lzma",
        "crc32c",
        "crc32",
        "adler32",
        "fletcher32",
        "jenkins_lookup3",
        "shuffle",
    }
)
# array→array numcodecs filters the direct path decodes with numcodecs itself (format 3 names
# "numcodecs.<id>"; format 2 filters may be any numcodecs codec with a fixed-size result).
FILTER_CODEC_IDS = frozenset({"delta", "fixedscaleoffset", "astype", "quantize", "bitround"})

# dtype kinds the direct path can produce: bool, integers, floats, complex, datetimes.
_DIRECT_KINDS = frozenset("biufcmM")


@dataclass(frozen=True)
class ChunkCodecs:
    """How one chunk (an inner chunk for sharded arrays) is encoded.

    Decoding runs ``bytes_codecs`` in reverse, views the bytes as ``stored_dtype`` laid out in
    ``order``, then undoes ``filters`` in reverse.
    """

    bytes_codecs: tuple[dict[str, Any], ...]  # numcodecs configs, in *encode* order
    stored_dtype: np.dtype  # dtype (with byte order) of the serialized array
    order: str = "C"  # memory order of the serialized array ("C" or "F")
    filters: tuple[dict[str, Any], ...] = ()  # numcodecs configs, in *encode* order
    filters_on_bytes: bool = False  # format 2: filters see raw bytes, not a shaped array


@dataclass(frozen=True)
class ShardLayout:
    """`sharding_indexed`: a stored object holds a grid of inner chunks plus an index."""

    chunks_per_shard: tuple[int, ...]
    index_location: str  # "start" or "end"
    index_byteorder: str  # "<" or ">"
    index_crc32c: bool  # index followed by a little-endian crc32c of its bytes

    @property
    def n_inner(self) -> int:
        return math.prod(self.chunks_per_shard)

    @property
    def index_nbytes(self) -> int:
        return 16 * self.n_inner + (4 if self.index_crc32c else 0)


@dataclass(frozen=True)
class ArrayLayout:
    """Everything the direct reader needs to locate and decode an array's chunks."""

    zarr_format: int
    shape: tuple[int, ...]
    dtype: np.dtype  # native-endian dtype the readers return
    fill_value: Any  # scalar of ``dtype``
    grid_chunk_shape: tuple[int, ...]  # shape of one stored object (the shard when sharded)
    chunk_shape: tuple[int, ...]  # shape of one decodable chunk (inner chunk when sharded)
    codecs: ChunkCodecs | None  # None when ``unsupported``
    shard: ShardLayout | None = None
    unsupported: str = ""  # why the direct path cannot decode this array ("" = it can)
    encode_key: Callable[[tuple[int, ...]], str] | None = field(default=None, repr=False)

    @property
    def chunk_grid(self) -> tuple[int, ...]:
        """Number of decodable chunks along each axis."""
        return tuple(-(-s // c) for s, c in zip(self.shape, self.chunk_shape, strict=True))

    def key(self, grid_coords: tuple[int, ...]) -> str:
        """Store key of the object at ``grid_coords`` (shard coords when sharded)."""
        assert self.encode_key is not None
        return self.encode_key(grid_coords)


class _Unsupported(Exception):
    """Internal: the direct path cannot decode this array; the message says why."""


def parse_layout(array: Any) -> ArrayLayout:
    """Describe ``array``'s chunk layout. Never raises for odd codecs: see ``unsupported``.

    Raises DatasetError only for arrays no reader can serve row-wise (0-d arrays).
    """
    shape = tuple(int(s) for s in array.shape)
    if len(shape) == 0:
        raise DatasetError(
            f"zarr array at {_where(array)} is 0-dimensional; dali_zarr reads rows along "
            "axis 0, so store scalars as attributes or as a 1-element array."
        )
    raw_dtype = np.dtype(array.dtype)
    dtype = raw_dtype.newbyteorder("=") if raw_dtype.byteorder not in "=|" else raw_dtype
    fill = array.fill_value
    try:
        fill_value = dtype.type(0) if fill is None else np.asarray(fill).astype(dtype)[()]
    except (TypeError, ValueError):
        fill_value = None
    md = array.metadata
    zarr_format = int(md.zarr_format)
    if zarr_format == 3:
        grid_shape = getattr(md.chunk_grid, "chunk_shape", None)
        # a non-regular grid is reported as unsupported below; zarr still knows its chunks
        chunks = tuple(int(c) for c in (grid_shape or array.chunks))
    else:
        chunks = tuple(int(c) for c in md.chunks)
    _refuse_empty_chunks(_where(array), "chunk", chunks)
    base = dict(
        zarr_format=zarr_format,
        shape=shape,
        dtype=dtype,
        fill_value=fill_value,
        grid_chunk_shape=chunks,
        chunk_shape=chunks,
        encode_key=md.encode_chunk_key,
    )
    try:
        if dtype.kind not in _DIRECT_KINDS or dtype.fields is not None or dtype.subdtype:
            raise _Unsupported(f"dtype {raw_dtype} is not a fixed-size numeric dtype")
        if fill_value is None:
            raise _Unsupported(f"fill value {fill!r} cannot be cast to {dtype}")
        if zarr_format == 2:
            codecs = _parse_v2(md.to_dict(), raw_dtype)
            return ArrayLayout(codecs=codecs, **base)
        if zarr_format == 3:
            return _parse_v3(md, base, where=_where(array))
        raise _Unsupported(f"zarr format {zarr_format} is unknown")
    except _Unsupported as e:
        return ArrayLayout(codecs=None, unsupported=str(e), **base)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        # metadata this module does not understand: zarr itself may still read it
        why = f"zarr metadata not understood by the direct path ({type(e).__name__}: {e})"
        return ArrayLayout(codecs=None, unsupported=why, **base)


def _where(array: Any) -> str:
    return str(getattr(array, "store_path", "?"))


def _refuse_empty_chunks(where: str, what: str, chunk_shape: tuple[int, ...]) -> None:
    """A chunk with a zero-length axis holds no elements: no reader can tile the array with it
    (zarr accepts such metadata and then divides by zero), so say which array and what to do."""
    if all(c > 0 for c in chunk_shape):
        return
    raise DatasetError(
        f"zarr array at {where} has {what} shape {chunk_shape}, with an axis of length "
        "0 or less: such chunks hold no elements, so the array's rows cannot be read. Re-write "
        "the array with chunks of at least 1 along every axis (zarr chooses valid chunks when "
        "they are left to it)."
    )


# ---------------------------------------------------------------------------- zarr format 2


def _parse_v2(d: Mapping[str, Any], raw_dtype: np.dtype) -> ChunkCodecs:
    order = d.get("order", "C")
    if order not in ("C", "F"):
        raise _Unsupported(f"memory order {order!r} is unknown")
    compressor = d.get("compressor")
    filters = tuple(_as_config(f) for f in (d.get("filters") or ()))
    for f in filters:
        if f.get("id") in ("vlen-utf8", "vlen-bytes", "vlen-array", "json2", "msgpack2"):
            raise _Unsupported(f"filter {f.get('id')!r} makes variable-length chunks")
    bytes_codecs: tuple[dict[str, Any], ...] = ()
    if compressor is not None:
        bytes_codecs = (_as_config(compressor),)
    # format 2 filters run on the bytes the compressor produced; decode is validated at the end
    # (decoded size == chunk size × itemsize), so any numcodecs filter that numcodecs can build
    # is acceptable.
    _check_numcodecs(filters + bytes_codecs)
    return ChunkCodecs(
        bytes_codecs=bytes_codecs,
        stored_dtype=raw_dtype,
        order=order,
        filters=filters,
        filters_on_bytes=True,
    )


# ---------------------------------------------------------------------------- zarr format 3


def _parse_v3(md: Any, base: dict[str, Any], *, where: str) -> ArrayLayout:
    transformers = getattr(md, "storage_transformers", ())
    if transformers:
        raise _Unsupported(f"storage transformers {list(transformers)} are not supported")
    d = md.to_dict()
    grid = d.get("chunk_grid", {})
    grid_name = grid.get("name") if isinstance(grid, Mapping) else None
    if grid_name != "regular":
        raise _Unsupported(f"chunk grid {grid_name!r} is not 'regular'")
    codecs = [_named(c) for c in d["codecs"]]
    dtype: np.dtype = base["dtype"]
    outer = base["grid_chunk_shape"]

    if codecs and codecs[0][0] == "sharding_indexed":
        if len(codecs) != 1:
            names = [n for n, _ in codecs]
            raise _Unsupported(f"codecs around sharding_indexed ({names}) are not supported")
        cfg = codecs[0][1]
        inner = tuple(int(c) for c in cfg["chunk_shape"])
        _refuse_empty_chunks(where, "inner chunk", inner)
        if len(inner) != len(outer) or any(o % i for o, i in zip(outer, inner, strict=True)):
            raise _Unsupported(f"inner chunk shape {inner} does not divide shard shape {outer}")
        shard = _shard_layout(cfg, outer, inner)
        inner_codecs = [_named(c) for c in cfg.get("codecs", [])]
        chain = _parse_v3_chain(inner_codecs, dtype)
        base = {**base, "chunk_shape": inner}
        return ArrayLayout(codecs=chain, shard=shard, **base)
    return ArrayLayout(codecs=_parse_v3_chain(codecs, dtype), **base)


class BloscFrames(NamedTuple):
    """Where an array's stored objects are blosc frames (the last codec is blosc): each
    object one frame (``shard`` None), or each inner chunk of a shard one frame."""

    grid: tuple[int, ...]  # stored objects (chunks, or shards) along each axis
    shard: ShardLayout | None


_BLOSC_NAMES = ("blosc", "numcodecs.blosc")


def blosc_frames(array: Any) -> BloscFrames | None:
    """:class:`BloscFrames` of ``array`` read from its metadata alone, whatever codecs come
    before blosc (a transpose the direct path leaves to zarr included); None where blosc is
    not the last codec, or the sharding cannot be described. numcodecs trusts a frame's
    header for its length, so whoever hands zarr such an array checks the frames first."""
    md = array.metadata
    d = md.to_dict()
    shape = tuple(int(s) for s in array.shape)
    if int(md.zarr_format) == 2:
        compressor = d.get("compressor") or {}
        if compressor.get("id") != "blosc":
            return None
        chunks = tuple(int(c) for c in md.chunks)
        return BloscFrames(tuple(-(-s // c) for s, c in zip(shape, chunks, strict=True)), None)
    try:
        codecs = [_named(c) for c in d["codecs"]]
        outer = tuple(int(c) for c in d["chunk_grid"]["configuration"]["chunk_shape"])
        grid = tuple(-(-s // c) for s, c in zip(shape, outer, strict=True))
        if len(codecs) == 1 and codecs[0][0] == "sharding_indexed":
            cfg = codecs[0][1]
            inner_codecs = [_named(c) for c in cfg.get("codecs", [])]
            if not inner_codecs or inner_codecs[-1][0] not in _BLOSC_NAMES:
                return None
            inner = tuple(int(c) for c in cfg["chunk_shape"])
            return BloscFrames(grid, _shard_layout(cfg, outer, inner))
    except (_Unsupported, KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if not codecs or codecs[-1][0] not in _BLOSC_NAMES:
        return None
    return BloscFrames(grid, None)


def _parse_v3_chain(codecs: Sequence[tuple[str, dict[str, Any]]], dtype: np.dtype) -> ChunkCodecs:
    filters: list[dict[str, Any]] = []
    i = 0
    stored = dtype
    # array→array codecs
    while i < len(codecs) and codecs[i][0] not in ("bytes", "sharding_indexed"):
        name, cfg = codecs[i]
        fid = name.removeprefix("numcodecs.")
        if not name.startswith("numcodecs.") or fid not in FILTER_CODEC_IDS:
            raise _Unsupported(f"codec {name!r} is not decoded by the direct path")
        conf = {"id": fid, **cfg}
        filters.append(conf)
        stored = _filter_encoded_dtype(conf, stored)
        i += 1
    if i >= len(codecs) or codecs[i][0] != "bytes":
        got = codecs[i][0] if i < len(codecs) else "nothing"
        if got == "sharding_indexed":  # inside a shard, or after a filter at the top
            raise _Unsupported(
                "sharding_indexed nested in a shard, or after other codecs, is not supported "
                "by the direct path"
            )
        raise _Unsupported(
            f"array→bytes codec {got!r} is not decoded by the direct path (only 'bytes')"
        )
    endian = (codecs[i][1] or {}).get("endian", "little")
    if endian not in ("little", "big"):
        raise _Unsupported(f"bytes codec endian {endian!r} is unknown")
    if stored.itemsize > 1:
        stored = stored.newbyteorder("<" if endian == "little" else ">")
    i += 1
    bytes_codecs: list[dict[str, Any]] = []
    for name, cfg in codecs[i:]:
        if name in ("zstd", "gzip", "crc32c"):
            conf = {"id": name, **cfg}
        elif name == "blosc":
            conf = {"id": "blosc"}  # decode needs no parameters (they are in the blosc header)
        elif name.startswith("numcodecs.") and name.removeprefix("numcodecs.") in BYTES_CODEC_IDS:
            conf = {"id": name.removeprefix("numcodecs."), **cfg}
        else:
            raise _Unsupported(f"codec {name!r} is not decoded by the direct path")
        bytes_codecs.append(conf)
    out = ChunkCodecs(
        bytes_codecs=tuple(bytes_codecs),
        stored_dtype=stored,
        order="C",
        filters=tuple(filters),
        filters_on_bytes=False,
    )
    _check_numcodecs(out.filters + tuple(c for c in out.bytes_codecs if c["id"] != "crc32c"))
    return out


#: array→array codecs that hand the array on as they got it (zarr's own transpose; bitround
#: decodes to its input): a big-endian array passes through them unchanged
_PASS_THROUGH = frozenset({"transpose", "numcodecs.bitround"})


def zarr_misreads(array: Any) -> str:
    """Why zarr-python reads ``array``'s values wrong, or "" where it reads them right.

    A format 3 chain whose ``bytes`` codec is big-endian for multi-byte items, behind a
    numcodecs array→array codec (delta, fixedscaleoffset, astype, quantize): zarr-python
    (3.1) hands that codec the big-endian array, which numcodecs views as native, so every
    value comes back byte-swapped, without an error. The direct path decodes such chunks
    right (:class:`~dali_zarr.io.codecs.ChunkDecoder` makes the array native first); the
    zarr fallback refuses them rather than deliver those numbers.
    """
    md = getattr(array, "metadata", None)
    if md is None or int(getattr(md, "zarr_format", 0)) != 3:
        return ""
    try:
        dtype = np.dtype(array.dtype)
        codecs = [_named(c) for c in md.to_dict()["codecs"]]
        while codecs and codecs[0][0] == "sharding_indexed":  # the inner chunks' chain
            codecs = [_named(c) for c in codecs[0][1].get("codecs", [])]
        filters: list[tuple[str, dict[str, Any]]] = []
        for name, cfg in codecs:
            if name == "bytes":
                break
            filters.append((name, cfg))
        else:
            return ""
        if (cfg or {}).get("endian", "little") != "big":
            return ""
        # the dtype each codec decodes to (its input when decoding is the next one's output)
        dtypes = [dtype]
        for name, cfg in filters:
            fid = name.removeprefix("numcodecs.")
            nxt = _filter_encoded_dtype({"id": fid, **cfg}, dtypes[-1])
            dtypes.append(nxt)
    except (KeyError, TypeError, ValueError, AttributeError):
        return ""  # metadata this check does not understand: as zarr reads it
    for (name, _), encoded in zip(reversed(filters), reversed(dtypes[1:]), strict=True):
        if encoded.itemsize <= 1:
            return ""  # one-byte items have no byte order: what comes next is native
        if name in _PASS_THROUGH:
            continue
        if name.startswith("numcodecs."):
            return (
                f"its {name!r} codec sits before a big-endian 'bytes' codec; zarr-python "
                "hands it the big-endian values and reads them byte-swapped"
            )
        return ""
    return ""


#: what to install for numcodecs codecs that need a package of their own (``imagecodecs_*``
#: come from imagecodecs)
_CODEC_PACKAGES = {"zfpy": "zfpy", "pcodec": "pcodec", "msgpack2": "msgpack"}


def missing_codec_advice(codec_id: str) -> str:
    """What to tell a user whose Python lacks codec ``codec_id``: its chunks are not
    damaged, a package is missing."""
    cid = codec_id.removeprefix("numcodecs.")
    if cid in _CODEC_PACKAGES:
        install = f"run pip install {_CODEC_PACKAGES[cid]}"
    elif cid.startswith("imagecodecs_"):
        install = "run pip install imagecodecs"
    else:
        install = "install the package that registers it with numcodecs or zarr"
    return (
        f"codec {codec_id!r} is not available in this Python, so none of its chunks can be "
        f"decoded (the store itself may be intact): {install} where the loader runs "
        "(on every node), then open the store again"
    )


def unknown_codec_id(error: BaseException) -> str | None:
    """The id of the codec an "unknown codec" error of zarr or numcodecs in ``error``'s
    chain names (zarr raises one at open for a codec no package registers), or None."""
    import numcodecs.errors
    import zarr.errors

    for e in error_chain(error):
        if isinstance(e, numcodecs.errors.UnknownCodecError):
            return str(e.codec_id).strip("'\"")
        if isinstance(e, zarr.errors.UnknownCodecError):
            cause = e.__cause__
            return str(cause.args[0]) if isinstance(cause, KeyError) and cause.args else "?"
    return None


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the errors it was raised from or while handling, once each (a cycle
    in the chain ends it): zarr and fsspec wrap the error that says what happened."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def missing_codec(array: Any) -> str:
    """Why no chunk of ``array`` can be decoded in this Python ("" where they can): a format
    3 ``numcodecs.*`` codec whose package is not installed (``numcodecs.zfpy`` without zfpy,
    ``numcodecs.pcodec`` without pcodec). zarr opens such an array (its metadata is fine)
    and fails on the first chunk it reads, which would be reported as a corrupted chunk at
    the first batch. Format 2 codecs are built when zarr opens the array, and fail there."""
    md = getattr(array, "metadata", None)
    if md is None or int(getattr(md, "zarr_format", 0)) != 3:
        return ""
    import numcodecs
    import numcodecs.errors

    try:
        todo = list(md.to_dict()["codecs"])
    except (KeyError, TypeError, AttributeError):
        return ""
    while todo:
        name, cfg = _named(todo.pop())
        if name == "sharding_indexed":
            todo += list(cfg.get("codecs", [])) + list(cfg.get("index_codecs", []))
        elif name.startswith("numcodecs."):
            try:
                numcodecs.get_codec({"id": name.removeprefix("numcodecs."), **cfg})
            except (numcodecs.errors.UnknownCodecError, ImportError):
                return missing_codec_advice(name)
            except Exception:  # a bad configuration: zarr's read reports it
                continue
    return ""


def _filter_encoded_dtype(conf: Mapping[str, Any], dtype: np.dtype) -> np.dtype:
    fid = conf["id"]
    if fid in ("delta", "fixedscaleoffset") and conf.get("astype"):
        return np.dtype(conf["astype"])
    if fid == "astype":
        return np.dtype(conf["encode_dtype"])
    return dtype


def _shard_layout(
    cfg: Mapping[str, Any], outer: tuple[int, ...], inner: tuple[int, ...]
) -> ShardLayout:
    """The :class:`ShardLayout` of a ``sharding_indexed`` configuration ``cfg`` whose shards
    of shape ``outer`` hold inner chunks of shape ``inner``."""
    return replace(
        _parse_index_codecs(cfg.get("index_codecs", []), cfg.get("index_location", "end")),
        chunks_per_shard=tuple(o // i for o, i in zip(outer, inner, strict=True)),
    )


def _parse_index_codecs(codecs: Sequence[Any], location: str) -> ShardLayout:
    names = [_named(c) for c in codecs]
    if location not in ("start", "end"):
        raise _Unsupported(f"shard index_location {location!r} is unknown")
    if not names or names[0][0] != "bytes":
        raise _Unsupported(f"shard index codecs {[n for n, _ in names]} are not supported")
    endian = (names[0][1] or {}).get("endian", "little")
    rest = [n for n, _ in names[1:]]
    if rest not in ([], ["crc32c"]):
        raise _Unsupported(f"shard index codecs {[n for n, _ in names]} are not supported")
    return ShardLayout(
        chunks_per_shard=(),
        index_location=location,
        index_byteorder="<" if endian == "little" else ">",
        index_crc32c=bool(rest),
    )


# ---------------------------------------------------------------------------- helpers


def _named(c: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(c, Mapping):
        c = c.to_dict()
    return str(c["name"]), dict(c.get("configuration") or {})


def _as_config(c: Any) -> dict[str, Any]:
    if isinstance(c, Mapping):
        return dict(c)
    get_config = getattr(c, "get_config", None)
    if get_config is None:
        raise _Unsupported(f"codec {c!r} has no numcodecs config")
    return dict(get_config())


def _check_numcodecs(configs: Sequence[Mapping[str, Any]]) -> None:
    import numcodecs

    for conf in configs:
        try:
            numcodecs.get_codec(dict(conf))
        except Exception as e:  # unknown id, missing optional dependency, bad config
            raise _Unsupported(f"codec {conf.get('id')!r} cannot be built by numcodecs: {e}") from e
